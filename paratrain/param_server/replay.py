"""An asynchronous parameter-server run replayed in one process, from what its servers and trainers recorded.

With staleness > 0 the result depends on timing: which version of each server's slices a trainer computed
a step on, and in which order a server summed a clock's pushes. Both are recorded (each server's pushes as
(clock, trainer, version) in arrival order: ShardServer.serve; each trainer's pulls as (clock, the version
received from each server): ServerClient.record). Given the same model, optimizer, data and learning
rates, `replay` computes every trainer's gradient on the parameters it had, sums each server's pushes in
the order they arrived and updates as the servers do, clock by clock: the weights it returns equal the
run's bit for bit (the test of that claim: tests/distributed/test_param_server.py). The norm sums the
servers' squares in server order, as gloo's all-reduce does for two servers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from paratrain.comm.flat import optimizer_groups, point_optimizer_at
from paratrain.comm.norms import divide_and_clip_
from paratrain.param_server.layout import served_groups

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[nn.Module, Any], tuple[torch.Tensor, Any]]


@dataclass(frozen=True)
class Record:
    pushes: Mapping[int, Sequence[tuple[int, int, int]]]
    """Server -> its pushes in arrival order: (clock, trainer, version computed on)."""
    pulls: Mapping[int, Sequence[tuple[int, tuple[int, ...]]]]
    """Trainer -> its pulls: (the clock it pulled for, the version received from each server)."""

    @property
    def servers(self) -> int:
        return len(self.pushes)

    @property
    def trainers(self) -> int:
        """Every trainer pushes to every server at every clock."""
        return 1 + max(trainer for log in self.pushes.values() for _, trainer, _ in log)

    @property
    def clocks(self) -> int:
        return 1 + max(clock for log in self.pushes.values() for clock, _, _ in log)


@torch.no_grad()
def _set(groups: list, flats: list[torch.Tensor], history: list[list[list[torch.Tensor]]],
         versions: Sequence[int]) -> None:
    """The compute model's parameters: server j's slices at version versions[j]."""
    for j, version in enumerate(versions):
        for g, flat, value in zip(groups, flats, history[version][j]):
            flat[j * g.shard_numel: (j + 1) * g.shard_numel].copy_(value)


def replay(record: Record, *, model: nn.Module, optimizer: OptimizerFactory, loss_fn: LossFn,
           batches: Callable[[int, int], list[Any]], lrs: Callable[[int], tuple[float, ...]], bucket_bytes: int,
           grad_clip: float = 0.0) -> dict[str, torch.Tensor]:
    """The final weights of the recorded run, by name (its servers, trainers and clocks: the record's). batches(trainer,
    clock): that trainer's micro-batches of that step; lrs(clock): every optimizer group's learning rate then. `model`
    holds the initial values."""
    servers, trainers, clocks = record.servers, record.trainers, record.clocks
    compute = copy.deepcopy(model)
    params = [p for p in compute.parameters() if p.requires_grad]
    names = {id(p): n for n, p in compute.named_parameters()}
    group_of = optimizer_groups(params, optimizer(params), names)
    groups = served_groups(params, group_of, servers=servers, shard=0, whole=True, bucket_bytes=bucket_bytes,
                           device=torch.device("cpu"))
    flats = [g.param_flat for g in groups]
    grads = [torch.zeros_like(f) for f in flats]
    for g, flat in zip(groups, grads):
        for param, view in zip(g.params, g.views(flat)):
            param.grad = view
    owners = []  # each server's slices (FlatGroups over a copy of the model) and its optimizer
    for j in range(servers):
        copy_j = copy.deepcopy(model)
        ps = [p for p in copy_j.parameters() if p.requires_grad]
        opt = optimizer(ps)
        gj = served_groups(ps, optimizer_groups(ps, opt, {id(p): n for n, p in copy_j.named_parameters()}),
                           servers=servers, shard=j, whole=False, bucket_bytes=bucket_bytes, device=torch.device("cpu"))
        point_optimizer_at(opt, gj)
        owners.append((gj, opt))
    history = [[[g.master.detach().clone() for g in gj] for gj, _ in owners]]  # version -> server -> slices
    pulled = {i: {clock: versions for clock, versions in record.pulls.get(i, ())} for i in range(trainers)}
    for clock in range(clocks):
        pushed: dict[int, list[torch.Tensor]] = {}
        totals: dict[int, tuple[float, float]] = {}
        for i in range(trainers):
            versions = pulled[i].get(clock, (0,) * servers) if clock else (0,) * servers
            _set(groups, flats, history, versions)
            for grad in grads:
                grad.zero_()
            loss, tokens = 0.0, 0.0
            with torch.enable_grad():
                for micro in batches(i, clock):
                    loss_sum, count = loss_fn(compute, micro)
                    loss_sum.backward()
                    loss += float(loss_sum.detach().double())
                    tokens += float(count)
            pushed[i] = [g.clone() for g in grads]
            totals[i] = (loss, tokens)
        sums, squares = [], []
        for j, (gj, _) in enumerate(owners):
            order = [t for c, t, _ in record.pushes[j] if c == clock]
            if sorted(order) != list(range(trainers)):
                raise ValueError(f"server {j}'s record has pushes {order} for clock {clock}: every trainer once")
            total = None
            for t in order:
                parts = [pushed[t][b][j * g.shard_numel: (j + 1) * g.shard_numel] for b, g in enumerate(gj)]
                total = [p.clone() for p in parts] if total is None else [a.add_(p) for a, p in zip(total, parts)]
            assert total is not None
            wide = torch.promote_types(total[0].dtype, torch.float32)
            squares.append(torch.stack(torch._foreach_norm(total, dtype=wide)).pow(2).sum())
            sums.append(total)
        tokens = sum(totals[t][1] for t in range(trainers))
        divisor = torch.tensor(max(tokens, 1.0), dtype=torch.float64)
        norm = sum(squares[1:], squares[0]).sqrt() / divisor
        for (gj, opt), total in zip(owners, sums):
            divide_and_clip_(total, divisor, norm, grad_clip)
            for group, lr in zip(opt.param_groups, lrs(clock)):
                group["lr"] = lr
            for g, grad in zip(gj, total):
                g.master.grad = grad
            opt.step()
            for g in gj:
                g.master.grad = None
        history.append([[g.master.detach().clone() for g in gj] for gj, _ in owners])
    _set(groups, flats, history, (clocks,) * servers)
    return {n: p.detach().clone() for n, p in compute.named_parameters()}
