"""Load a local Hugging Face checkpoint folder under any layout, each rank reading only what it keeps.

A folder as `save_pretrained` writes it: config.json, and model.safetensors or shards
model-0000i-of-0000N.safetensors with model.safetensors.index.json (tokenizer files beside them are not
read here). `from_pretrained(folder)`:

1. builds the model from config.json on the meta device (transformers' AutoModelForCausalLM.from_config:
   shapes only, nothing allocated), in `dtype` (default: the files' own);
2. checks the files' tensor names against the model's, both ways, and refuses a difference by name
   (transformers would re-initialise what it cannot find, silently); a weight tied to another (a tied
   lm_head) is one tensor of the model and may be absent from the files;
3. returns an HFCheckpoint (paratrain.hf.files), a paratrain.hybrid.materialize Source: parallelize(init=...)
   asks it for each tensor of the whole model, and each rank reads from the files only the rows its pieces need
   (a tensor-parallel slice, a ZeRO shard, a pipeline stage's layers, an ep rank's experts; safetensors' lazy
   slices; a MoE family's experts from their per-expert files), converting to the model's dtype. Buffers the files do not hold (non-persistent ones: rotary frequencies) come from
   their module built again on the CPU from the config.

pad_vocab_to=N pads a vocabulary N does not divide (GPT-2's 50,257) to the next multiple of N: the
embedding's and lm_head's extra rows are zeros, never looked up, and the losses (Pretrained.loss, the
recipe's stage loss) read only the real vocabulary's logits, so the padding changes no number; export
trims it (paratrain.hf.export). `--hf` and Trainer(hf=) pad to vocab_multiple(tp): the same rows for every tp
that divides 128, so their checkpoints resume under any of those layouts.

The model families: the recipe of each (paratrain.models.hf: Llama, Mistral, Qwen2, Qwen3, Gemma, Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3; paratrain.models.hf_gpt2: GPT-2) says how the strategies split it; a family without one is refused with what is
missing.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from paratrain.config.errors import ConfigError
from paratrain.config.model import ModelConfig
from paratrain.config.parallel import ParallelConfig
from paratrain.config.run import RunConfig
from paratrain.config.validate import preset_shape
from paratrain.context_parallel.families import check_hf_family
from paratrain.hf.files import MOE_TYPES, HFCheckpoint, files_dtype, files_layout, weight_files
from paratrain.nn.recipe import Recipe

def _recipes() -> dict[str, Recipe]:
    from paratrain.models.hf import (DEEPSEEK_RECIPE, GPT_OSS_RECIPE, LLAMA_RECIPE, MOE_RECIPE, QWEN3_MOE_RECIPE,
                                     QWEN3_RECIPE)
    from paratrain.models.hf_gpt2 import GPT2_RECIPE

    return {"llama": LLAMA_RECIPE, "mistral": LLAMA_RECIPE, "qwen2": LLAMA_RECIPE, "qwen3": QWEN3_RECIPE,
            "gemma": LLAMA_RECIPE, "gemma2": LLAMA_RECIPE, "gemma3_text": QWEN3_RECIPE, "gpt2": GPT2_RECIPE,
            "mixtral": MOE_RECIPE, "qwen2_moe": MOE_RECIPE, "qwen3_moe": QWEN3_MOE_RECIPE, "deepseek_v3": DEEPSEEK_RECIPE,
            "gpt_oss": GPT_OSS_RECIPE}


def check_tp(config: Any, tp: int, *, sequence_parallel: bool = False, pad_vocab: bool = False) -> None:
    """The family's tensor-parallel rules (paratrain.models.hf.check_llama_tp, hf_gpt2.check_gpt2_tp)."""
    from paratrain.models.hf import check_llama_tp
    from paratrain.models.hf_gpt2 import check_gpt2_tp

    if config.model_type == "deepseek_v3" and tp > 1 and not (config.q_lora_rank and config.first_k_dense_replace):
        raise ConfigError(f"tp {tp} with this DeepSeek-V3 config: its tensor-parallel plan (DEEPSEEK_TP_PLAN) splits "
                          "the compressed queries (q_lora_rank set, as DeepSeek-V3 and R1 have; here "
                          f"{config.q_lora_rank}) and the dense first layers' MLP (first_k_dense_replace > 0; here "
                          f"{config.first_k_dense_replace}); train this one with dp, ZeRO, pp, cp or ep (tp 1)")
    check = check_gpt2_tp if config.model_type == "gpt2" else check_llama_tp
    check(config, tp, sequence_parallel=sequence_parallel, pad_vocab=pad_vocab)


@dataclass
class Pretrained:
    """What from_pretrained gives: the meta model, where its values come from, and how to split it."""

    model: nn.Module
    init: HFCheckpoint
    recipe: Recipe
    config: Any
    folder: Path
    vocab_size: int
    """The real vocabulary (config.vocab_size is the padded one under pad_vocab_to)."""
    loss: Callable[[nn.Module, Any], tuple[torch.Tensor, torch.Tensor]]
    """The engine's loss_fn: llama_loss over the real vocabulary."""


def vocab_multiple(tp: int) -> int:
    """What `--hf` and Trainer(hf=) pad a vocabulary to a multiple of: 128 (as Megatron's default), or its least
    common multiple with tp: a vocabulary already divisible stays as it is, and the padded size is the same for
    every tp dividing 128 (checkpoints move between those layouts)."""
    return math.lcm(128, tp)


def pretrained_for_training(folder: str | Path, tp: int) -> Pretrained:
    """The folder's model as `--hf`, Trainer(hf=) and the planner's dry run train it: float32 on the meta device (each
    rank reads the pieces it keeps), the vocabulary padded to vocab_multiple(tp) with rows the loss never reads
    (export trims them), alike for every tp dividing 128."""
    return from_pretrained(folder, dtype=torch.float32, pad_vocab_to=vocab_multiple(tp))


def from_pretrained(folder: str | Path, *, dtype: torch.dtype | None = None, pad_vocab_to: int = 1) -> Pretrained:
    """The model of a local Hugging Face folder on the meta device, and the Source of its values (module docstring)."""
    from paratrain.models.hf import llama_loss, llama_pipeline_loss
    from paratrain.nn.recipe import stage_loss

    folder = Path(folder)
    config = _config(folder)
    vocab = config.vocab_size
    config.vocab_size = -(-vocab // pad_vocab_to) * pad_vocab_to
    recipe = _recipes().get(config.model_type)
    if recipe is None:
        raise ConfigError(f"{folder} holds a {config.model_type!r} model, and paratrain has a recipe (how tensor, "
                          f"pipeline and ZeRO-3 split it) for {sorted(_recipes())} only")
    files = weight_files(folder)
    model = _meta_model(config, dtype or files_dtype(folder, files))
    stored = _stored_names(model)
    state = model.state_dict(keep_vars=True)
    parts = files_layout(config.model_type, {name: tuple(state[name].shape) for name in stored}, set(files))
    tied = {name for name in stored if name not in files and _is_tied(model, name)}
    missing = sorted({p.key for name in stored if name not in tied for p in parts[name]} - set(files))
    unexpected = sorted(set(files) - {p.key for name in stored for p in parts[name]})
    mtp = f"model.layers.{config.num_hidden_layers}."
    if config.model_type == "deepseek_v3" and any(name.startswith(mtp) for name in unexpected):
        raise ConfigError(f"{folder} holds DeepSeek's multi-token-prediction layers ({mtp}*, num_nextn_predict_layers "
                          f"{getattr(config, 'num_nextn_predict_layers', '?')}), which transformers' DeepseekV3ForCausalLM "
                          "does not build and paratrain does not train: they would be lost on export; remove them from "
                          "the files (and model.safetensors.index.json) to train the model without them")
    if missing or unexpected:
        raise ConfigError(f"the files in {folder} and the {type(model).__name__} config.json builds differ: missing "
                          f"from the files {missing[:6]}{' ...' if len(missing) > 6 else ''}, in the files but not "
                          f"the model {unexpected[:6]}{' ...' if len(unexpected) > 6 else ''} (transformers would "
                          "initialise the missing ones at random): use the config.json saved with these weights")
    buffers = _rebuilt_buffers(model, config, set(files))
    padded = (vocab, config.vocab_size) if config.vocab_size != vocab else None
    if padded:  # the losses read the real vocabulary's logits only
        recipe = dataclasses.replace(recipe, stage_loss=stage_loss(functools.partial(llama_pipeline_loss, vocab=vocab)))
    return Pretrained(model, HFCheckpoint(folder, buffers, padded, parts), recipe, config, folder, vocab,
                      functools.partial(llama_loss, vocab=vocab))


def run_model_shape(config: RunConfig, parallel: ParallelConfig) -> ModelConfig:
    """check_run's model_shape for any run: with model.hf the folder's (stand_in, after its family's tensor-parallel
    rules), else the GPT preset's."""
    if not config.model.hf:
        return preset_shape(config, parallel)
    if config.model.overrides:
        given = ", ".join(f"{key}={value!r}" for key, value in sorted(config.model.overrides.items()))
        raise ConfigError(f"--hf {config.model.hf} takes the model's shape from its config.json, and the run also sets "
                          f"model settings of paratrain's GPT ({given}): drop them, or edit the folder's config.json")
    if parallel.expert_tp:
        raise ConfigError("--expert-tp with --hf: cutting each Hugging Face expert over tp is not built (ep splits "
                          "the experts whole); drop --expert-tp, or shard them with --ep / --zero")
    shape = stand_in(config.model.hf, tp=parallel.tp_split, sequence_parallel=parallel.sequence_parallel)
    check_hf_family(_config(Path(config.model.hf)), parallel)  # the families context parallelism does not run
    if parallel.ep > 1 and not shape.n_experts:
        raise ConfigError(f"--ep {parallel.ep}: expert parallelism splits a Mixture-of-Experts model's experts, and "
                          f"{config.model.hf} holds a dense {_config(Path(config.model.hf)).model_type!r} model; drop "
                          f"--ep (its ranks then train as data-parallel ones)")
    return shape


def stand_in(folder: str | Path, *, tp: int = 1, sequence_parallel: bool = False) -> ModelConfig:
    """The folder's model as the run's checks read a model (the GPT's ModelConfig: widths, heads, layers,
    vocabulary, the longest sequence), after its family's own tensor-parallel rules (check_llama_tp)."""
    config = _config(Path(folder))
    if config.model_type not in _recipes():
        raise ConfigError(f"{folder} holds a {config.model_type!r} model, and paratrain has a recipe for "
                          f"{sorted(_recipes())} only")
    check_tp(config, tp, sequence_parallel=sequence_parallel, pad_vocab=True)
    ffn = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * config.hidden_size
    moe = {}
    if config.model_type in MOE_TYPES:  # every layer a MoE layer (Qwen's decoder_sparse_step 1, no mlp_only_layers)
        experts = (getattr(config, "num_local_experts", None) or getattr(config, "n_routed_experts", None)
                   or config.num_experts)
        moe = dict(n_experts=experts, top_k=config.num_experts_per_tok, moe_every=getattr(config, "decoder_sparse_step", 1),
                   d_expert=getattr(config, "moe_intermediate_size", None) or ffn,
                   shared_expert=bool(getattr(config, "shared_expert_intermediate_size", 0)))
    return ModelConfig(vocab_size=config.vocab_size, seq_len=config.max_position_embeddings,
                       n_layer=config.num_hidden_layers, n_head=config.num_attention_heads, d_model=config.hidden_size,
                       d_ff=ffn, tie_embeddings=bool(config.tie_word_embeddings), **moe)


def _config(folder: Path) -> Any:
    from transformers import AutoConfig

    if not (folder / "config.json").is_file():
        raise ConfigError(f"{folder} has no config.json: give a folder save_pretrained wrote")
    config = AutoConfig.from_pretrained(folder)
    config.use_cache = False
    if getattr(config, "use_bidirectional_attention", False):
        raise ConfigError(f"{folder}: a {config.model_type} model with use_bidirectional_attention: paratrain trains "
                          "causal language models; set it false")
    if config.model_type in MOE_TYPES:
        _check_moe(folder, config)
    if getattr(config, "use_sliding_window", False):
        raise ConfigError(f"{folder}: a {config.model_type} model with use_sliding_window: paratrain's pipeline and "
                          "context-parallel runners build full causal masks for it; set use_sliding_window false")
    return config


def _check_moe(folder: Path, config: Any) -> None:
    """What paratrain's loss and layouts do not reproduce of HF's MoE training, refused by name."""
    if getattr(config, "output_router_logits", False):
        raise ConfigError(f"{folder}: output_router_logits is true, so transformers would add router_aux_loss_coef "
                          f"({getattr(config, 'router_aux_loss_coef', '?')}) x its load-balancing loss, computed per "
                          "forward (per micro-batch: a number that changes with the layout), which paratrain's HF loss "
                          "does not add; set output_router_logits false in config.json to train without it")
    if getattr(config, "router_jitter_noise", 0.0):
        raise ConfigError(f"{folder}: router_jitter_noise {config.router_jitter_noise} multiplies the router's input "
                          "by noise from torch's global generator, which no two layouts draw alike; set it 0")


def _meta_model(config: Any, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    # torch's grouped_mm (transformers' default for stacked experts) takes no float64: the loop over experts does
    grouped = config.model_type not in MOE_TYPES or dtype != torch.float64
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype, **({} if grouped else
                                                                       {"experts_implementation": "eager"}))


def expected_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """The tensors a checkpoint of the model `folder`/config.json builds holds (a tied one once), by name."""
    model = _meta_model(_config(Path(folder)), torch.float32)
    state = model.state_dict()
    return {name: tuple(state[name].shape) for name in _stored_names(model)}


def _stored_names(model: nn.Module) -> list[str]:
    """The names parallelize materialises: each parameter once (a tied one under its first name), persistent
    buffers."""
    seen, names = set(), []
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            names.append(name)
    persistent = set(model.state_dict(keep_vars=True))
    return [n for n in names if n in persistent]


def _is_tied(model: nn.Module, name: str) -> bool:
    target = dict(model.named_parameters(remove_duplicate=False)).get(name)
    return target is not None and sum(p is target for _, p in model.named_parameters(remove_duplicate=False)) > 1


def _rebuilt_buffers(model: nn.Module, config: Any, in_files: set[str]) -> dict[str, torch.Tensor]:
    """Every buffer the files do not hold (non-persistent ones: rotary frequencies, an embedding's scale), from
    the model built again with its parameters on the meta device and its buffers computed on the CPU."""
    names = [name for name, _ in model.named_buffers() if name not in in_files]
    if not names:
        return {}
    from transformers import AutoModelForCausalLM

    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, None if param is None else nn.Parameter(param.to("meta"), param.requires_grad))

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        buffers = dict(AutoModelForCausalLM.from_config(config, dtype=next(model.parameters()).dtype).named_buffers())
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]
    return {name: buffers[name].detach().cpu() for name in names}
