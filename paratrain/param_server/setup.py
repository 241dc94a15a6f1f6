"""Setting the parameter server up: a trainer's client (`connect`, from parallelize) and a dedicated server
(`build_server`, then `serve`), both cutting the model's trainable parameters into the same flat buckets."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.flat import optimizer_groups, point_optimizer_at
from paratrain.param_server.client import ServerClient
from paratrain.param_server.layout import served_groups
from paratrain.param_server.protocol import Peers
from paratrain.param_server.server import Exchange, ShardServer
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


def trainable(model: nn.Module) -> tuple[list[nn.Parameter], dict[int, str]]:
    params = [p for p in model.parameters() if p.requires_grad]
    return params, {id(p): n for n, p in model.named_parameters()}


def connect(model: nn.Module, ctx: Context, optimizer: torch.optim.Optimizer, *, grad_clip: float,
            on_non_finite: str) -> ServerClient:
    """A trainer's client over its model's trainable parameters (materialised: they are flattened into the
    buckets here). Colocated, its own slices' server too: the optimizer is re-pointed at them."""
    config = ctx.config
    link = exchange(ctx)
    params, names = trainable(model)
    group_of = optimizer_groups(params, optimizer, names)
    colocated = not link.peers.dedicated
    groups = served_groups(params, group_of, servers=link.peers.servers, shard=ctx.rank if colocated else 0,
                           whole=True, bucket_bytes=int(config.bucket_mb * 2**20), device=ctx.device)
    local = None
    if colocated:
        point_optimizer_at(optimizer, groups)
        local = ShardServer(ctx.rank, groups, optimizer, link, clip=grad_clip, on_non_finite=on_non_finite, ready=True)
    return ServerClient(groups, link, ctx.rank, len(optimizer.param_groups), mode=config.ps_mode,
                        staleness=config.staleness, local=local)


def build_server(model: nn.Module, ctx: Context, optimizer: OptimizerFactory, *, grad_clip: float = 0.0,
                 on_non_finite: str = "raise") -> ShardServer:
    """A dedicated server's slices of `model` (built on the meta device, or whole: nothing of it runs here),
    their masters and the optimizer over them (`optimizer` as parallelize takes it)."""
    if not ctx.is_server:
        raise ValueError(f"rank {ctx.rank} trains (the grid's ranks 0 .. {ctx.dims.grid_size - 1}); the parameter "
                         "servers are the ranks after them: call parallelize on this rank")
    link = exchange(ctx)
    params, names = trainable(model)
    opt = optimizer(params)
    group_of = optimizer_groups(params, opt, names)
    index = ctx.rank - ctx.dims.grid_size
    groups = served_groups(params, group_of, servers=link.peers.servers, shard=index, whole=False,
                           bucket_bytes=int(ctx.config.bucket_mb * 2**20), device=torch.device("cpu"))
    point_optimizer_at(opt, groups)
    return ShardServer(index, groups, opt, link, clip=grad_clip, on_non_finite=on_non_finite)
