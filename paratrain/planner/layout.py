"""A candidate layout, and the parameters one rank of it holds, derived from the model's shapes alone.

The planner predicts what paratrain will do, so it reads paratrain's own rules where they are pure
functions (the pipeline's balanced split, the gradient buckets' plan) rather than re-deriving them;
what it cannot call without processes (which module tensor parallelism splits, which parameters a
ZeRO-3 unit owns) it states here for the reference GPT, next to the rule it mirrors.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import torch

from paratrain.config.model import ModelConfig
from paratrain.pipeline.stages import balanced_split

@dataclass(frozen=True)
class Layout:
    """One way to lay a run out: the degrees and the memory savers (the planner's search space)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    virtual_stages: int = 1
    zero: int = 0
    shard_group: int | None = None
    """ZeRO over groups of this many dp ranks (MiCS / HSDP); None: all of dp."""
    micro_batch: int = 1
    recompute: str = "none"
    """none, selective (the attention core) or full (each block)."""
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    offload: bool = False
    """ZeRO's optimizer state and fp32 masters in CPU memory."""
    ep: int = 1
    """Expert parallelism: each MoE layer's experts divided among ep consecutive dp ranks."""

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def shards(self) -> int:
        """Ranks one copy of ZeRO's state is split over."""
        return (self.shard_group or self.dp) if self.zero else 1

    @property
    def expert_shards(self) -> int:
        """Ranks ZeRO splits the experts' state over: the dp / ep ranks holding the same experts (edp)."""
        return self.dp // self.ep if self.zero else 1

    def to_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in _LAYOUT_FIELDS}  # flat, no deep copy: the search calls it often


_LAYOUT_FIELDS = tuple(f.name for f in fields(Layout))


@dataclass(frozen=True)
class RankParam:
    """One parameter as a rank holds it."""

    name: str
    shape: tuple[int, ...]
    """This rank's shape (a tensor-parallel slice of the full one, or the full one)."""
    tp_split: bool
    tied: bool = False
    """This rank's end of a weight tied across pipeline stages."""
    norm_skip: bool = False
    """Counted in the norm by another rank (the last stage's tied copy)."""
    expert: bool = False
    """Stacked expert weights of a MoE layer (this rank's E / ep experts), reduced and sharded over edp."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def unit(self) -> str:
        """The ZeRO-3 unit holding it (paratrain.sharding.zero wraps "blocks.N"; the rest is the root "")."""
        parts = self.name.split(".")
        return ".".join(parts[:2]) if parts[0] == "blocks" else ""


def layer_costs(model: ModelConfig) -> list[float]:
    """The pipeline's balancing costs per GPT layer (paratrain.pipeline.stages.gpt_layers): the
    embedding, the blocks, the head."""
    d, f, v, s = model.d_model, model.ff_dim, model.padded_vocab, model.seq_len
    block = 2 * (4 * d * d + 2 * d * f) + 4 * s * d
    return [2.0 * d] + [float(block)] * model.n_layer + [2.0 * d * v]


def chunk_layers(model: ModelConfig, layout: Layout, pp_split: tuple[int, ...] = ()) -> list[tuple[int, int]]:
    """[start, end) GPT layers of each of the pp x v chunks, as the engine cuts them."""
    return list(_chunk_layers(model, layout.pp * layout.virtual_stages, tuple(pp_split)))


@functools.lru_cache(maxsize=4096)
def _chunk_layers(model: ModelConfig, parts: int, pp_split: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    starts = [0, *pp_split] if pp_split else balanced_split(layer_costs(model), parts)
    return tuple(zip(starts, [*starts[1:], model.n_layer + 2]))


def rank_params(model: ModelConfig, layout: Layout, stage: int, pp_split: tuple[int, ...] = ()) -> list[RankParam]:
    """The parameters pipeline rank `stage` holds, in the engine's order (the model's registration
    order), with tensor parallelism's slices (GPT_PLAN: qkv, up and head split by rows, out and down
    by columns, the embedding by vocabulary rows; norms and MoE layers replicated) and expert
    parallelism's (each rank E / ep experts of every MoE layer)."""
    return list(_rank_params(model, layout.tp, layout.pp, layout.virtual_stages, stage, tuple(pp_split), layout.ep))


@functools.lru_cache(maxsize=4096)
def _rank_params(model: ModelConfig, t: int, pp: int, v_stages: int, stage: int,
                 pp_split: tuple[int, ...], ep: int = 1) -> tuple[RankParam, ...]:
    d, f, v = model.d_model, model.ff_dim, model.padded_vocab
    ranges = _chunk_layers(model, pp * v_stages, pp_split)
    mine = [c for c in range(len(ranges)) if c % pp == stage]
    layers = {i for c in mine for i in range(*ranges[c])}
    first, last = 0 in mine, len(ranges) - 1 in mine
    split = t > 1
    params: list[RankParam] = []
    if 0 in layers:
        params.append(RankParam("tok_emb.weight", (v // t, d), split, tied=model.tie_embeddings and not last))
    for i in range(model.n_layer):
        if i + 1 in layers:
            b = f"blocks.{i}"
            params += [RankParam(f"{b}.attn_norm.weight", (d,), False),
                       RankParam(f"{b}.attn.qkv.weight", (3 * d // t, d), split),
                       RankParam(f"{b}.attn.out.weight", (d, d // t), split),
                       RankParam(f"{b}.mlp_norm.weight", (d,), False)]
            if not model.is_moe(i):
                params += [RankParam(f"{b}.mlp.up.weight", (f // t, d), split),
                           RankParam(f"{b}.mlp.down.weight", (d, f // t), split)]
                continue
            # a MoE layer (paratrain.nn.moe): replicated over tp, its experts sliced over ep
            e, fe = model.n_experts // ep, model.expert_dim
            params += [RankParam(f"{b}.moe.router.weight", (model.n_experts, d), False),
                       RankParam(f"{b}.moe.experts.up", (e, fe, d), False, expert=True),
                       RankParam(f"{b}.moe.experts.down", (e, d, fe), False, expert=True)]
            if model.shared_expert:
                params += [RankParam(f"{b}.moe.shared.up.weight", (f, d), False),
                           RankParam(f"{b}.moe.shared.down.weight", (d, f), False)]
    if model.n_layer + 1 in layers:
        params.append(RankParam("norm.weight", (d,), False))
        if not model.tie_embeddings:
            params.append(RankParam("head.weight", (v // t, d), split))
        elif not first:  # the head's own copy of the tied weight, on the last stage
            params.append(RankParam("head.weight", (v // t, d), split, tied=True, norm_skip=True))
    return tuple(params)


def meta_tensors(params: list[RankParam], dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """Shape-only stand-ins (the meta device allocates nothing), for paratrain's own planning rules."""
    return [torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta")) for p in params]
