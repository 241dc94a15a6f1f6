"""A model family's recipe: what the parallel strategies need to know about it, kept with the model.

Strategies know no model class. Each receives from the recipe the one thing it needs:

    tp_plan          tensor parallelism: module name -> style (paratrain.tensor_parallel.STYLES)
    blocks           the repeated blocks, a regex of module names: what recompute 'full' recomputes,
                     ZeRO-3's units, what compile compiles and offload offloads
    attention_cores  recompute 'selective': the attention cores (softmax(q k^T) v) inside the blocks
    layers           pipeline parallelism: the model as an ordered list of Layers to cut into stages
    stage_loss       the last pipeline stage's loss, (stage model, its output, targets) -> (sum, count)
    hidden_size      the width of the activation between pipeline stages ([rows, seq, hidden]), for a
                     dry run on the meta device, where no activation is computed
    split_sequence   context parallelism: route the model's attention and positions through a
                     SequenceShard (the model's own method: it knows where its attention and rotary are)
    tp_local         tensor parallelism: the model's own width settings made its slices' (GPT-2's)
    expert_banks     expert parallelism: the model's MoE layers as ExpertBanks (stacked expert weights, and how to
                     route a layer's rows through an ep runner); paratrain's own MoE layer needs none

A model exposes its recipe as a `recipe()` method (paratrain.models.GPT does); a model that has
none (any user's nn.Module) passes the pieces to parallelize by keyword, or a Recipe (the Hugging
Face ones are in paratrain.models.hf). Every field is optional: a strategy that needs a missing one
says so before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

Run = Callable[..., torch.Tensor]
"""run(stage_model, x) -> y; a layer that reads packed documents' positions also run(stage_model, x, positions)."""
PipelineLoss = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, Any]]
"""(the last stage's output, targets) -> (sum of losses, count): a loss that needs no module."""
StageLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, Any]]
"""(the last stage's model, its output, targets) -> (sum of losses, count)."""


@dataclass
class Layer:
    """One layer of a model cut for pipeline parallelism: a few modules under their names in the whole
    model, the function that runs them, and its cost for balancing the stages."""

    name: str
    modules: dict[str, nn.Module]
    """Dotted names in the whole model -> modules this layer runs."""
    run: Run
    """run(stage_model, x) -> y: the layer's forward, reading its modules from the stage model."""
    cost: float
    """Relative cost (forward FLOPs per token, or parameters), for balancing."""
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    """Tensors of the whole model the layer reads (the GPT's rotary tables), registered on every stage
    that holds it as non-persistent buffers under these names (so they move with the stage's .to())."""
    positions: bool = False
    """Whether run takes a third argument, positions[B, S] of packed documents (paratrain.nn.documents): a
    micro-batch (inputs, targets, positions) gives every stage its positions, each from its own copy of the
    micro-batch (every pipeline rank reads the same rows), so they travel with the activations at no cost."""
    tokens: bool = False
    """Whether run takes the micro-batch's input token ids as keyword `tokens` (the GPT's multi-token prediction on
    the last stage embeds the tokens ahead of each position): every pipeline rank holds the micro-batch already."""


ExpertRunner = Callable[[torch.Tensor, torch.Tensor, Callable[[torch.Tensor, list[int]], torch.Tensor]], torch.Tensor]
"""run(rows[N, D], expert_ids[N], experts) -> outputs[N, D], experts(rows grouped by local expert, counts) running
the rows: where the experts run (paratrain.expert_parallel.AllToAllExperts: on the ep ranks that hold them)."""


@dataclass(frozen=True)
class ExpertBank:
    """One MoE layer's experts as expert parallelism cuts them: weights stacked along dim 0 by expert, and how the
    layer's rows go through a runner instead of its own loop."""

    owner: str
    """The module holding the stacked weights."""
    weights: tuple[str, ...]
    """Its attributes stacked by expert (each rank keeps its experts' rows of dim 0, the Parameter kept)."""
    n_experts: int
    route: Callable[[ExpertRunner], None]
    """route(runner): make the layer run its (local) experts through `runner`."""


@dataclass(frozen=True)
class Recipe:
    tp_plan: Mapping[str, str] | None = None
    blocks: str | None = None
    attention_cores: str | None = None
    layers: Callable[[nn.Module], list[Layer]] | None = None
    stage_loss: StageLoss | None = None
    hidden_size: Callable[[nn.Module], int] | None = None
    split_sequence: Callable[[nn.Module, Any], None] | None = None
    """Context parallelism: split_sequence(model, shard) makes the model's attention attend through
    shard.attend and index its positions by shard.positions (paratrain.context_parallel.SequenceShard)."""
    tp_local: Callable[[nn.Module, int], None] | None = None
    """Tensor parallelism: once tp_plan is applied, tp_local(model, tp) makes the model's own width settings
    those of its slices (GPT-2's attention splits its fused q | k | v output by a width it keeps)."""
    expert_banks: Callable[[nn.Module], list[ExpertBank]] | None = None
    """Expert parallelism of a model whose MoE layers are its own (Hugging Face's): its ExpertBanks."""

    def with_overrides(self, **given: Any) -> Recipe:
        """This recipe with the fields given (not None) replaced: parallelize's keywords win."""
        return replace(self, **{k: v for k, v in given.items() if v is not None})


def stage_loss(loss: PipelineLoss) -> StageLoss:
    """A loss of (output, targets) as a stage loss (it reads no module of the stage)."""

    def on_stage(stage: nn.Module, output: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        total, count = loss(output, targets)
        return total, torch.as_tensor(count)

    return on_stage


def recipe_of(model: nn.Module) -> Recipe:
    """The model's own recipe (its `recipe()` method), or an empty one."""
    own = getattr(model, "recipe", None)
    return own() if callable(own) else Recipe()


def recipe_for(model: nn.Module, recipe: Recipe | None = None, *, tp_plan: Mapping[str, str] | None = None,
               layers: Callable[[nn.Module], list[Layer]] | None = None,
               pipeline_loss: PipelineLoss | None = None) -> Recipe:
    """The recipe a run of `model` uses: `recipe` (else the model's own), with the pieces given one by one
    replacing its fields (parallelize's and paratrain.Trainer's keywords)."""
    return (recipe or recipe_of(model)).with_overrides(
        tp_plan=tp_plan, layers=layers, stage_loss=None if pipeline_loss is None else stage_loss(pipeline_loss))
