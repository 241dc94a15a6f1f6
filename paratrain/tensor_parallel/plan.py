"""Apply tensor parallelism to a model from outside, by a plan that maps module names to styles.

    layout = apply_tensor_parallel(model, plan, tp_group, sequence_parallel=True)   # plan: a recipe's tp_plan

A plan key names modules by suffix ("attn.qkv" matches "blocks.3.attn.qkv") or by a glob
("blocks.*.mlp.up"). Styles:

    column            nn.Linear, weight split on the output dim; output stays split (feeds a "row")
    column_gather     nn.Linear split the same way, output all-gathered (a replicated result)
    row               nn.Linear, weight split on the input dim, input already split, output summed
    embedding         nn.Embedding split along the vocabulary (rows)
    vocab_output      paratrain.models.VocabOutput -> VocabParallelOutput (loss on split logits)
    heads_dropout     KeyedDropout over [B, H, ...] whose heads dim 1 is split (attention probabilities)
    sequence_dropout  KeyedDropout over [B, S, ...] between blocks: split along S under sequence
                      parallelism, replicated (the same mask on every tp rank) otherwise
    head_partial      a module kept whole that runs on this rank's heads only (Qwen3's per-head q / k
                      norms): its parameters' gradients are partial per tp rank and summed over tp as
                      autograd produces them (without this, each rank would train its own copy apart)
    partial_linear    nn.Linear kept whole whose output feeds this rank's heads only and a part shared by all of
                      them (DeepSeek's MLA down-projections: the compressed q / kv, the rotary key k_pe): its
                      output's gradient is partial per rank, so its input's gradient is summed over tp
                      (copy_to_tp_region) and its parameters' as head_partial's
    column_partial    "column" after a partial_linear (and its head_partial norm): its input's gradient stays
                      partial, for the partial_linear to sum once
    conv1d_column     GPT-2's Conv1D (weight [in, out]) split on the output dim, as "column"
    conv1d_qkv        the same for a fused q | k | v Conv1D: each third split alike (whole heads of each)
    conv1d_row        Conv1D split on the input dim, as "row"
    norm              a norm over the width (RMSNorm, LayerNorm): replicated here (under sequence parallelism its
                      gradient summed over tp as any replicated parameter's); tp_mode 2d splits it
                      (paratrain.tensor_parallel.grid_plan)

Every split parameter is a slice of the full, layout-free one, so tp = 1 and tp = N start from the
same numbers; a weight shared by two modules (a tied embedding and head) stays one parameter when
both split it the same way, and a plan that splits one end and not the other (or splits them
differently) is refused before anything runs: training would silently untie them. Everything not
named stays replicated on every tp rank.

Sequence parallelism (Korthikanti et al. 2022): the split layers all-gather their input along the
sequence and reduce-scatter their output, so whatever runs between them (norms, dropout, residual
adds) holds 1/tp of the tokens. A replicated parameter used there (a norm's weight) then gets only
its slice's share of the gradient on each rank: a hook sums that share over tp as soon as autograd
produces it, before it accumulates, so every gradient strategy downstream sees the full gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from paratrain.comm.collectives import all_reduce
from paratrain.comm.placement import Placements
from paratrain.nn.dropout import KeyedDropout
from paratrain.nn.loss import VocabOutput
from paratrain.nn.ties import tied_parameters
from paratrain.names import name_matches
from paratrain.tensor_parallel.layers import (ColumnParallelConv1D, ColumnParallelLinear, PartialLinear,
                                              RowParallelConv1D, RowParallelLinear, VocabParallelEmbedding)
from paratrain.tensor_parallel.loss import VocabParallelOutput
from paratrain.state_layout import DimCuts
from paratrain.topology.mesh import AxisGroup, Mesh

STYLES = ("column", "column_gather", "row", "embedding", "vocab_output", "heads_dropout", "sequence_dropout",
          "head_partial", "partial_linear", "column_partial", "conv1d_column", "conv1d_qkv", "conv1d_row", "norm",
          "head_vector")
_BLOCKS = {"conv1d_qkv": 3}
"""Styles that split each of several equal blocks of a dim alike (paratrain.state_layout.DimCuts.blocks)."""

@dataclass
class TensorParallelLayout(DimCuts):
    """What apply_tensor_parallel did: which parameters are split, along which dim, over which group."""

    sequence_parallel: bool = False
    partial_names: frozenset[str] = frozenset()
    """Parameters of head_partial modules: whole, their gradients summed over tp (also without SP)."""

    def place(self, placements: Placements, mesh: Mesh) -> None:
        """Split parameters: reduced as the replicated ones, their norm's squares added over tp."""
        placements.add(placements.default.split_over(self.group), self.split_ids)

    def is_split(self, param: torch.Tensor) -> bool:
        return id(param) in self.split_ids

    def register_grad_hooks(self, model: nn.Module, *,
                            split: frozenset[int] = frozenset()) -> list[RemovableHandle]:
        """Under sequence parallelism, sum each replicated parameter's gradient over tp as autograd
        produces it. apply_tensor_parallel does this itself, unless the model is on the meta device or
        told not to (parallelize hooks once every layout is applied): then call it once the parameters
        are materialised (a hook does not survive materialisation). split: id() of parameters other
        layouts cut over tp (expert tensor parallelism): their gradients are whole, not summed.
        Returns the hooks' handles (Engine.close removes them)."""
        handles = []
        for name, param in model.named_parameters():
            replicated = param.requires_grad and id(param) not in self.split_ids and id(param) not in split
            if replicated and (self.sequence_parallel or name in self.partial_names):
                handles.append(param.register_hook(_sum_over_tp(self.group)))
        return handles

def resolve_plan(model: nn.Module, plan: Mapping[str, str], *, allow_missing: bool = False) -> dict[str, str]:
    """Module name -> style, every plan key matched to at least one module (unless allow_missing: a
    pipeline stage holds only some of the model's modules), no module matched twice."""
    bad = {k: s for k, s in plan.items() if s not in STYLES}
    if bad:
        raise ValueError(f"unknown tensor-parallel style(s) {bad}: styles are {', '.join(STYLES)}")
    resolved: dict[str, str] = {}
    names = [n for n, _ in model.named_modules() if n]
    for key, style in plan.items():
        hits = [n for n in names if name_matches(key, n)]
        if not hits and not allow_missing:
            raise ValueError(f"tensor-parallel plan entry {key!r} matches no module of the model "
                             f"(its modules include {names[:8]}); fix the name or drop the entry")
        for name in hits:
            if name in resolved:
                raise ValueError(f"module {name!r} is matched by two plan entries ({resolved[name]!r} and "
                                 f"{style!r}): make the keys specific enough to pick one")
            resolved[name] = style
    return resolved


def _expect(module: nn.Module, kind: type | tuple[type, ...], name: str, style: str) -> None:
    if not isinstance(module, kind):
        wanted = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise TypeError(f"tensor-parallel style {style!r} applies to {wanted}, but {name!r} is a "
                        f"{type(module).__name__}: change the plan entry for it")


def apply_tensor_parallel(model: nn.Module, plan: Mapping[str, str], group: AxisGroup, *,
                          sequence_parallel: bool = False, allow_missing: bool = False,
                          hooks: bool = True) -> TensorParallelLayout:
    """Replace the planned modules of `model` in place by their tensor-parallel versions. hooks: register
    sequence parallelism's gradient hooks now (TensorParallelLayout.register_grad_hooks)."""
    check_ties(model, plan, allow_missing=allow_missing)  # so every end of a tie is split alike below
    resolved = resolve_plan(model, plan, allow_missing=allow_missing)
    split: dict[int, int] = {}  # id(new parameter) -> split dim
    blocked: dict[int, int] = {}  # id(new parameter) -> blocks of its split dim (fused q | k | v)
    sliced: dict[int, nn.Parameter] = {}  # id(full parameter) -> its slice here (ties stay ties)
    partial: set[str] = set()
    for name, style in resolved.items():
        module = model.get_submodule(name)
        if style == "norm":
            continue
        if style in ("head_partial", "partial_linear"):
            partial.update(f"{name}.{p}" for p, _ in module.named_parameters())
            if style == "head_partial":
                continue
        if style == "head_vector":  # the module's own per-head vectors (gpt-oss's attention sinks), cut with the heads
            for attr in _SPLIT_DIMS[style]:
                full = getattr(module, attr, None)
                if not isinstance(full, nn.Parameter) or full.dim() != 1 or full.shape[0] % group.size:
                    raise ValueError(f"{name}: style 'head_vector' cuts its per-head vector {attr!r} over tp = "
                                     f"{group.size}: it must be a 1-d Parameter whose heads tp divides")
                new = sliced.get(id(full))  # another end of a tied vector: the one slice serves both
                if new is None:
                    part = full.shape[0] // group.size
                    new = nn.Parameter(full.detach().narrow(0, group.index * part, part).clone(),
                                       requires_grad=full.requires_grad)
                    sliced[id(full)], split[id(new)] = new, 0
                setattr(module, attr, new)
            continue
        if style in ("heads_dropout", "sequence_dropout"):
            _expect(module, KeyedDropout, name, style)
            assert isinstance(module, KeyedDropout)
            if style == "heads_dropout" or sequence_parallel:
                module.split_along(1, group.index, group.size)
            continue
        replacement, dims = _build(module, name, style, group, sequence_parallel)
        for attr, dim in dims.items():
            full, new = getattr(module, attr), getattr(replacement, attr)
            if new is None:
                continue
            shared = sliced.get(id(full))
            if shared is not None:  # another end of a tied weight: the one slice serves both
                setattr(replacement, attr, shared)
                continue
            sliced[id(full)] = new
            if dim >= 0:
                split[id(new)] = dim
                if style in _BLOCKS:
                    blocked[id(new)] = _BLOCKS[style]
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, replacement)
    layout = TensorParallelLayout(group, sequence_parallel=sequence_parallel, partial_names=frozenset(partial))
    for pname, param in model.named_parameters():
        if id(param) in split:
            layout.split_dims[pname] = split[id(param)]
            if id(param) in blocked:
                layout.blocks[pname] = blocked[id(param)]
    layout.split_ids = frozenset(split)
    if hooks and not any(p.is_meta for p in model.parameters()):
        layout.register_grad_hooks(model)
    return layout


_SPLIT_DIMS = {"column": {"weight": 0, "bias": 0}, "column_gather": {"weight": 0, "bias": 0},
               "row": {"weight": 1, "bias": -1}, "embedding": {"weight": 0}, "conv1d_column": {"weight": 1, "bias": 0},
               "conv1d_qkv": {"weight": 1, "bias": 0}, "conv1d_row": {"weight": 0, "bias": -1}, "head_vector": {"sinks": 0}}
"""The dim of each parameter a style splits (-1: replicated); parameters of unplanned modules are replicated."""


def _split_dim(resolved: Mapping[str, str], name: str) -> int:
    module_name, _, attr = name.rpartition(".")
    return _SPLIT_DIMS.get(resolved.get(module_name, ""), {}).get(attr, -1)


def check_ties(model: nn.Module, plan: Mapping[str, str], *, allow_missing: bool = False) -> None:
    """Refuse a plan that would split the ends of a tied parameter differently (one end split, the other
    not, or along other dims). Call it on the whole model: once a pipeline has cut it, each stage may hold
    one end only, and the tie is no longer visible there."""
    ties = tied_parameters(model)
    if not ties:
        return
    resolved = resolve_plan(model, plan, allow_missing=allow_missing)
    for group in ties:
        if len({_split_dim(resolved, name) for name in group}) > 1:
            raise ValueError(_untie_message(model, resolved, ties, group[0]))


def _untie_message(model: nn.Module, resolved: Mapping[str, str], ties: list[tuple[str, ...]], name: str) -> str:
    """Why a plan would untie the weight `name` is one end of, and the plan entries that keep it tied."""
    group = next(g for g in ties if name in g)
    ends = []
    for end in group:
        module_name = end.rpartition(".")[0]
        style = resolved.get(module_name)
        ends.append(f"{module_name} ({'not in the plan' if style is None else repr(style)}"
                    f"{'' if style is None else f', dim {_split_dim(resolved, end)}'})")
    dims = {_split_dim(resolved, end) for end in group} - {-1}
    dim = dims.pop() if len(dims) == 1 else None
    fixes = []
    for end in group:
        module_name = end.rpartition(".")[0]
        if module_name not in resolved and dim is not None:
            module = model.get_submodule(module_name) if module_name else model
            style = {(True, 0): "embedding", (False, 0): "column", (False, 1): "row"}.get(
                (isinstance(module, nn.Embedding), dim))
            if style is not None:
                fixes.append(f"{module_name!r}: {style!r}")
    fix = (f"add {{{', '.join(fixes)}}} to the plan (it splits the same dim of the weight), " if fixes
           else "give every end a style that splits the same dim of the weight, ")
    return (f"{' and '.join(group)} are one tied parameter, and the tensor-parallel plan would split its ends "
            f"differently: {'; '.join(ends)}. Training would silently untie them (each end then learns apart): "
            f"{fix}drop the ends from the plan to keep the weight replicated, or untie the weights in the model")


def _build(module: nn.Module, name: str, style: str, group: AxisGroup,
           sequence_parallel: bool) -> tuple[nn.Module, dict[str, int]]:
    """The replacement and, per parameter attribute, the dim it splits (-1: replicated)."""
    if style in ("column", "column_gather", "column_partial"):
        _expect(module, nn.Linear, name, style)
        assert isinstance(module, nn.Linear)
        if style == "column_partial" and sequence_parallel:
            raise ValueError(f"{name}: the partial styles (DeepSeek's MLA) do not support sequence parallelism; "
                             "set it off")
        return (ColumnParallelLinear(module, group, gather_output=style == "column_gather",
                                     sequence_parallel=sequence_parallel, reduce_input=style != "column_partial"),
                {"weight": 0, "bias": 0})
    if style == "partial_linear":
        _expect(module, nn.Linear, name, style)
        assert isinstance(module, nn.Linear)
        return PartialLinear(module, group), {"weight": -1, "bias": -1}
    if style == "row":
        _expect(module, nn.Linear, name, style)
        assert isinstance(module, nn.Linear)
        return RowParallelLinear(module, group, sequence_parallel=sequence_parallel), {"weight": 1, "bias": -1}
    if style.startswith("conv1d_"):
        if type(module).__name__ != "Conv1D" or getattr(module, "weight", None) is None or module.weight.dim() != 2:
            raise TypeError(f"tensor-parallel style {style!r} applies to a Conv1D (weight [in, out], GPT-2's), but "
                            f"{name!r} is a {type(module).__name__}: change the plan entry for it")
        if sequence_parallel:
            raise ValueError(f"{name}: the Conv1D styles do not support sequence parallelism; set it off")
        if style == "conv1d_row":
            return RowParallelConv1D(module, group), {"weight": 0, "bias": -1}
        return ColumnParallelConv1D(module, group, blocks=_BLOCKS.get(style, 1)), {"weight": 1, "bias": 0}
    if style == "embedding":
        _expect(module, nn.Embedding, name, style)
        assert isinstance(module, nn.Embedding)
        scaled = isinstance(getattr(module, "embed_scale", None), torch.Tensor)
        if type(module) is not nn.Embedding and not scaled:
            raise ValueError(f"{name} is a {type(module).__name__}, a subclass of nn.Embedding whose forward may "
                             "compute more than a lookup: the vocab-parallel embedding would silently drop it; drop "
                             "the entry to keep it replicated (a scaled embedding with an embed_scale buffer splits)")
        if module.max_norm is not None:
            raise ValueError(f"{name}: vocab-parallel embedding does not support max_norm (it renormalises rows "
                             "that other tp ranks hold); drop the entry to keep the embedding replicated")
        return VocabParallelEmbedding(module, group, sequence_parallel=sequence_parallel), {"weight": 0}
    _expect(module, VocabOutput, name, style)
    assert isinstance(module, VocabOutput)
    return VocabParallelOutput(module.vocab_size, group), {}


def _sum_over_tp(group: AxisGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        summed = grad.contiguous().clone()
        all_reduce(summed, group)
        return summed

    return hook
