"""Setting the parameter server up: a trainer's client (`connect`, from parallelize) and a dedicated server
(`build_server`, then `serve`), both cutting the model's trainable parameters into the same flat buckets."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.flat import FlatGroup, FlatStorage, optimizer_groups, point_optimizer_at
from paratrain.config.errors import ConfigError
from paratrain.config.parallel import PS_ON_CPU
from paratrain.param_server.client import ServerClient
from paratrain.param_server.layout import served_groups
from paratrain.param_server.protocol import Peers
from paratrain.param_server.server import Exchange, ShardServer
from paratrain.param_server.sparse import TouchedRows, check_sparse_optimizer, table_module
from paratrain.topology import Context

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def exchange(ctx: Context) -> Exchange:
    """The ranks of the exchange and the groups it uses. Collective (every rank calls it at the same point):
    under NCCL the messages go over a gloo group of every rank made here (point-to-point from any source,
    which the asynchronous servers need, is gloo's)."""
    dims = ctx.dims
    dedicated = dims.servers > 0
    peers = Peers(trainers=dims.grid_size, servers=dims.servers if dedicated else dims.grid_size, dedicated=dedicated)
    pg = None if ctx.backend in ("gloo", "none") else dist.new_group(backend="gloo")
    servers = ctx.mesh.groups.get("servers") if dedicated else ctx.mesh.data_group()
    return Exchange(peers, pg, servers)  # type: ignore[arg-type]


def trainable(model: nn.Module, sparse: tuple[str, ...] = ()) -> tuple[list[nn.Parameter], dict[int, str],
                                                                     list[tuple[str, nn.Embedding]]]:
    """(the dense trainable parameters, every parameter's name by id, the sparse tables' (name, module))."""
    tables = [(name, table_module(model, name)) for name in sparse]
    left_out = {id(module.weight) for _, module in tables}
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in left_out]
    return params, {id(p): n for n, p in model.named_parameters()}, tables


def table_groups(tables: list[tuple[str, nn.Embedding]], group_of: dict[int, int], *, servers: int, shard: int,
                 whole: bool, first: int, device: torch.device) -> list[FlatGroup]:
    """Each sparse table as a flat group of its own, cut into `servers` row ranges (V divisible by them)."""
    groups = []
    for k, (name, module) in enumerate(tables):
        rows, width = module.weight.shape
        if rows % servers:
            raise ConfigError(f"ps_sparse table {name!r} has {rows} rows, which the {servers} servers cannot split into "
                              f"whole equal row ranges: pad it to a multiple of {servers} rows (e.g. "
                              f"ModelConfig.vocab_multiple) or use {[s for s in range(1, servers + 1) if rows % s == 0]} "
                              "servers")
        # the master has storage of its own (at offset 0) when the group is whole (colocated): torch
        # 2.13's dense.add_(sparse) on a view at a storage offset ignores the offset and writes out of
        # bounds (the sparse optimizers' update); ShardServer.apply copies it back (push_master)
        groups.append(FlatGroup(first + k, [module.weight], shards=servers, shard_index=shard,
                                optimizer_group=group_of[id(module.weight)],
                                storage=FlatStorage(persistent=whole, device=device,
                                                    master_device=device if whole else None)))
    return groups


def connect(model: nn.Module, ctx: Context, optimizer: torch.optim.Optimizer, *, grad_clip: float,
            on_non_finite: str) -> ServerClient:
    """A trainer's client over its model's trainable parameters (materialised: they are flattened into the
    buckets here). Colocated, its own slices' server too: the optimizer is re-pointed at them."""
    config = ctx.config
    if ctx.device.type != "cpu":
        raise ConfigError(PS_ON_CPU)
    link = exchange(ctx)
    params, names, tables = trainable(model, config.ps_sparse)
    group_of = optimizer_groups(params + [module.weight for _, module in tables], optimizer, names)
    colocated = not link.peers.dedicated
    shard = ctx.rank if colocated else 0
    groups = served_groups(params, group_of, servers=link.peers.servers, shard=shard, whole=True,
                           bucket_bytes=int(config.bucket_mb * 2**20), device=ctx.device)
    sparse = table_groups(tables, group_of, servers=link.peers.servers, shard=shard, whole=True, first=len(groups),
                          device=ctx.device)
    touched = []
    for (name, module), group in zip(tables, sparse):
        rows = TouchedRows(name, group, torch.zeros_like(group.param_flat), module.embedding_dim)
        module.register_forward_pre_hook(rows.record)
        touched.append(rows)
    local = None
    if colocated:
        check_sparse_optimizer(optimizer, list(config.ps_sparse))
        point_optimizer_at(optimizer, groups + sparse)
        local = ShardServer(ctx.rank, groups, optimizer, link, clip=grad_clip, on_non_finite=on_non_finite, ready=True,
                            tables=sparse, widths=[t.width for t in touched])
    return ServerClient(groups, link, ctx.rank, len(optimizer.param_groups), mode=config.ps_mode,
                        staleness=config.staleness, local=local, tables=touched, keep_grads=config.keep_grads)


def build_server(model: nn.Module, ctx: Context, optimizer: OptimizerFactory, *, grad_clip: float = 0.0,
                 on_non_finite: str = "raise", before_step: Callable[[int], None] | None = None) -> ShardServer:
    """A dedicated server's slices of `model` (built on the meta device, or whole: nothing of it runs here),
    their masters and the optimizer over them (`optimizer` as parallelize takes it). before_step: called with
    each (1-based) step whose update is about to be applied (fault injection)."""
    if not ctx.is_server:
        raise ValueError(f"rank {ctx.rank} trains (the grid's ranks 0 .. {ctx.dims.grid_size - 1}); the parameter "
                         "servers are the ranks after them: call parallelize on this rank")
    link = exchange(ctx)
    params, names, tables = trainable(model, ctx.config.ps_sparse)
    weights = [module.weight for _, module in tables]
    opt = optimizer(params + weights)
    check_sparse_optimizer(opt, list(ctx.config.ps_sparse))
    group_of = optimizer_groups(params + weights, opt, names)
    index = ctx.rank - ctx.dims.grid_size
    cpu = torch.device("cpu")
    groups = served_groups(params, group_of, servers=link.peers.servers, shard=index, whole=False,
                           bucket_bytes=int(ctx.config.bucket_mb * 2**20), device=cpu)
    sparse = table_groups(tables, group_of, servers=link.peers.servers, shard=index, whole=False, first=len(groups),
                          device=cpu)
    point_optimizer_at(opt, groups + sparse)
    return ShardServer(index, groups, opt, link, clip=grad_clip, on_non_finite=on_non_finite, tables=sparse,
                       widths=[module.embedding_dim for _, module in tables], before_step=before_step)
