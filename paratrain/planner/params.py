"""The parameters one rank holds, as the engine holds them: name, this rank's shape (tensor parallelism's slices, a
grid's blocks, expert parallelism's experts) and the flat-group role each takes (tied, a norm's copy, an expert). The
planner's model states, traffic and optimizer counts are built on these lists (paratrain.planner.memory, comm,
optimizer, param_server)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from paratrain.config.model import ModelConfig
from paratrain.pipeline.schedules import Schedule
from paratrain.planner.layout import layer_ranges, stage_chunks
from paratrain.topology.dims import ParallelDims


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
    grid_vector: bool = False
    """A norm's weight cut along a grid's width (tp_mode 2d, 2.5d, 3d): its own placement, so its own flat groups."""

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def block_linear(self) -> bool:
        """A weight of one of the blocks' linear layers (a matrix in a ZeRO-3 unit, not the router's, not an expert
        bank): what precision fp8 multiplies in float8."""
        return bool(self.unit) and len(self.shape) == 2 and not self.expert and not self.name.endswith("router.weight")

    @property
    def unit(self) -> str:
        """The ZeRO-3 unit holding it (paratrain.sharding.zero wraps "blocks.N" and "mtp.depths.K.block"; the rest is
        the root "")."""
        parts = self.name.split(".")
        if parts[0] == "mtp" and parts[3:4] == ["block"]:  # an MTP depth's block (GPT_BLOCKS)
            return ".".join(parts[:4])
        return ".".join(parts[:2]) if parts[0] == "blocks" else ""


def rank_params(model: ModelConfig, dims: ParallelDims, stage: int, pp_split: tuple[int, ...] = (), *,
                expert_tp: bool = False, pipeline: Schedule | None = None) -> list[RankParam]:
    """The parameters pipeline rank `stage` holds, in the engine's order (the model's registration
    order), with tensor parallelism's slices (GPT_PLAN: qkv, up and head split by rows, out and down
    by columns, the embedding by vocabulary rows; norms and MoE layers replicated, the experts cut along
    their width with expert_tp) and expert parallelism's (each rank E / ep experts of every MoE layer)."""
    if dims.tp_grid:
        return list(_grid_params(model, dims.tp_cube, dims.grid_side, dims.pp * dims.virtual_stages,
                                 stage_chunks(dims, stage, pipeline), tuple(pp_split)))
    return list(_rank_params(model, dims.tp, dims.pp * dims.virtual_stages, stage_chunks(dims, stage, pipeline),
                             tuple(pp_split), dims.experts_of(model.n_experts), dims.experts_split,
                             expert_tp and dims.tp > 1))


@functools.lru_cache(maxsize=4096)
def _grid_params(model: ModelConfig, cube: bool, q: int, parts: int, mine: tuple[int, ...],
                 pp_split: tuple[int, ...]) -> tuple[RankParam, ...]:
    """rank_params under a grid mode (paratrain.tensor_parallel.grid_plan): every matrix W[out, in] a block of
    [out / q, in / q] (2d, 2.5d: the same blocks on every grid of the stack) or [out / q^2, in / q] (3d), the
    embedding and the head as a [V, d] matrix, norms [d / q]. The GPT's MoE layers are refused there."""
    d, f, v = model.d_model, model.ff_dim, model.padded_vocab
    rows = q * q if cube else q

    def matrix(name: str, out: int, inp: int, **kw: bool) -> RankParam:
        return RankParam(name, (out // rows, inp // q), True, **kw)

    def vector(name: str) -> RankParam:
        return RankParam(name, (d // q,), False, grid_vector=True)

    ranges = layer_ranges(model, parts, pp_split)
    layers = {i for c in mine for i in range(*ranges[c])}
    first, last = 0 in mine, len(ranges) - 1 in mine
    params: list[RankParam] = []
    if 0 in layers:
        params.append(matrix("tok_emb.weight", v, d, tied=model.tie_embeddings and not last))
    for i in range(model.n_layer):
        if i + 1 in layers:
            b = f"blocks.{i}"
            params += [vector(f"{b}.attn_norm.weight"), matrix(f"{b}.attn.qkv.weight", 3 * d, d),
                       matrix(f"{b}.attn.out.weight", d, d), vector(f"{b}.mlp_norm.weight"),
                       matrix(f"{b}.mlp.up.weight", f, d), matrix(f"{b}.mlp.down.weight", d, f)]
    if model.n_layer + 1 in layers:
        params.append(vector("norm.weight"))
        if not model.tie_embeddings:
            params.append(matrix("head.weight", v, d))
        elif not first:
            params.append(matrix("head.weight", v, d, tied=True, norm_skip=True))
    return tuple(params)


@functools.lru_cache(maxsize=4096)
def _rank_params(model: ModelConfig, t: int, parts: int, mine: tuple[int, ...],
                 pp_split: tuple[int, ...], experts: int = 0, experts_apart: bool = False,
                 expert_tp: bool = False) -> tuple[RankParam, ...]:
    """rank_params under 1d: experts, this rank's of each MoE layer; experts_apart, whether ep splits them."""
    d, f, v = model.d_model, model.ff_dim, model.padded_vocab
    ranges = layer_ranges(model, parts, pp_split)
    layers = {i for c in mine for i in range(*ranges[c])}
    first, last = 0 in mine, len(ranges) - 1 in mine
    split = t > 1
    params: list[RankParam] = []
    embedding_on_last = model.tie_embeddings or model.mtp_depth > 0  # the head's or the MTP depths' copy
    if 0 in layers:
        params.append(RankParam("tok_emb.weight", (v // t, d), split, tied=embedding_on_last and not last))

    def dense(b: str) -> list[RankParam]:
        return [RankParam(f"{b}.attn_norm.weight", (d,), False), RankParam(f"{b}.attn.qkv.weight", (3 * d // t, d), split),
                RankParam(f"{b}.attn.out.weight", (d, d // t), split), RankParam(f"{b}.mlp_norm.weight", (d,), False),
                RankParam(f"{b}.mlp.up.weight", (f // t, d), split), RankParam(f"{b}.mlp.down.weight", (d, f // t), split)]

    for i in range(model.n_layer):
        if i + 1 in layers:
            b = f"blocks.{i}"
            if not model.is_moe(i):
                params += dense(b)
                continue
            params += dense(b)[:4]
            # a MoE layer (paratrain.nn.moe): replicated over tp, its experts sliced over ep (and over tp)
            fe = model.expert_dim // (t if expert_tp else 1)
            params += [RankParam(f"{b}.moe.router.weight", (model.n_experts, d), False),
                       RankParam(f"{b}.moe.experts.up", (experts, fe, d), expert_tp, expert=experts_apart),
                       RankParam(f"{b}.moe.experts.down", (experts, d, fe), expert_tp, expert=experts_apart)]
            if model.shared_expert:
                params += [RankParam(f"{b}.moe.shared.up.weight", (f, d), False),
                           RankParam(f"{b}.moe.shared.down.weight", (d, f), False)]
    if model.n_layer + 1 in layers:
        params.append(RankParam("norm.weight", (d,), False))
        if not model.tie_embeddings:
            params.append(RankParam("head.weight", (v // t, d), split))
        elif not first:  # the head's own copy of the tied weight, on the last stage
            params.append(RankParam("head.weight", (v // t, d), split, tied=True, norm_skip=True))
        if model.mtp_depth and not model.tie_embeddings and not first:  # the MTP depths' copy of the embedding
            params.append(RankParam("mtp.tok_emb.weight", (v // t, d), split, tied=True, norm_skip=True))
        for k in range(model.mtp_depth):  # paratrain.models.gpt_mtp: the projection replicated over tp
            m = f"mtp.depths.{k}"
            params += [RankParam(f"{m}.hidden_norm.weight", (d,), False), RankParam(f"{m}.embed_norm.weight", (d,), False),
                       RankParam(f"{m}.proj.weight", (d, 2 * d), False), *dense(f"{m}.block"),
                       RankParam(f"{m}.norm.weight", (d,), False)]
    return tuple(params)


def meta_tensors(params: list[RankParam], dtype: torch.dtype) -> list[torch.nn.Parameter]:
    """Shape-only stand-ins (the meta device allocates nothing), for paratrain's own planning rules."""
    return [torch.nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta")) for p in params]
