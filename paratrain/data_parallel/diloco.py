"""DiLoCo's outer step (Douillard et al. 2023, "DiLoCo: Distributed Low-Communication Training of Language Models").

Under dp_mode 'diloco' the dp ranks are cut into replica groups (the mesh's dp_replicate groups); each group trains
alone, its gradients summed over its own ranks (Mesh.data_group), on its own rows of every global batch. Every
`inner_steps` steps the groups meet once:

    delta   = outer - inner                      on every tensor this rank's optimizer steps
    delta   = mean of delta over the replica group (one all-reduce, by buckets)
    outer  -= outer_lr x Nesterov(delta)         torch.optim.SGD(momentum, nesterov=True)'s arithmetic
    inner   = outer                              every group goes on from the same weights

The tensors are those the inner optimizer steps, wherever the layout keeps them: the parameters under plain data
parallelism, tensor slices and pipeline stages as they are, ZeRO's shards (or their float32 masters), so the outer
state is this rank's share and no layout needs a case. The inner optimizer's state stays each group's own, as in
the paper. The outer copy and the momentum cost two float32 copies of what the optimizer steps (what
OuterStep.state_bytes says); the all-reduce moves them once per `inner_steps` steps over the replica group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from paratrain.comm import all_reduce
from paratrain.topology.mesh import AxisGroup


REPLICA_PREFIX = "replica-"
"""Before a replica group's keys in a checkpoint ("replica-1/blocks.0.attn.qkv.weight"); the first group's have none."""

OUTER, MOMENTUM = "diloco_outer", "diloco_momentum"
"""The outer state's keys in a checkpoint, per element beside the optimizer's ("NAME::diloco_outer")."""


@dataclass(frozen=True)
class OuterSettings:
    """DiLoCo's outer optimizer (ParallelConfig's inner_steps, outer_lr, outer_momentum)."""

    inner_steps: int
    lr: float
    momentum: float


class OuterStep:
    """The outer state of this rank's share of the model and the step that moves it (LocalUpdate calls begin()
    before each inner step and after_step(n) after step n, taken or skipped, before the gradient strategy pushes
    what the optimizer stepped back into the parameters)."""

    def __init__(self, tensors: Callable[[], list[torch.Tensor]], group: AxisGroup | None, settings: OuterSettings,
                 *, bucket_elements: int) -> None:
        """tensors: what the inner optimizer steps (read at the first step: a meta model is materialised by then);
        group: the replica group (None: a single group, whose outer step is the Nesterov step alone)."""
        self.tensors, self.group, self.settings = tensors, group, settings
        self.bucket_elements = bucket_elements
        self.inner: list[torch.Tensor] = []
        self.outer: list[torch.Tensor] = []
        self.momentum: list[torch.Tensor | None] = []
        self.rounds = 0
        """Outer steps taken."""

    def begin(self) -> None:
        """Before an inner step: the outer copy is taken once, from the weights the first round starts at."""
        if not self.inner:
            self.inner = list(self.tensors())
            self.outer = [t.detach().clone() for t in self.inner]
            self.momentum = [None] * len(self.inner)

    @torch.no_grad()
    def after_step(self, step: int) -> bool:
        """After step `step` (counted from 1): every inner_steps steps, the outer step; True when it ran."""
        if step % self.settings.inner_steps or not self.inner:
            return False
        for bucket in self._buckets():
            flat = torch.cat([(self.outer[i] - self.inner[i]).reshape(-1) for i in bucket])
            if self.group is not None:
                all_reduce(flat, self.group)
                flat.div_(self.group.size)
            offset = 0
            for i in bucket:
                n = self.inner[i].numel()
                self._nesterov(i, flat[offset: offset + n].view_as(self.inner[i]))
                offset += n
        self.rounds += 1
        return True

    def _nesterov(self, i: int, delta: torch.Tensor) -> None:
        """torch.optim.SGD's single-tensor step (dampening 0, nesterov) on the outer copy, with the averaged
        pseudo-gradient as its gradient; the inner tensor takes the result."""
        momentum, grad = self.settings.momentum, delta
        if momentum:
            buf = self.momentum[i]
            if buf is None:
                buf = self.momentum[i] = delta.clone()
            else:
                buf.mul_(momentum).add_(delta)
            grad = delta.add(buf, alpha=momentum)
        self.outer[i].add_(grad, alpha=-self.settings.lr)
        self.inner[i].copy_(self.outer[i])

    def _buckets(self) -> list[list[int]]:
        """Indices of the tensors in all-reduce buckets of one dtype and at most bucket_elements elements (a larger
        tensor alone), in the optimizer's order: the same on every rank of a replica group."""
        buckets: list[list[int]] = []
        size, dtype = 0, None
        for i, t in enumerate(self.inner):
            if not buckets or t.dtype != dtype or size + t.numel() > self.bucket_elements:
                buckets.append([])
                size, dtype = 0, t.dtype
            buckets[-1].append(i)
            size += t.numel()
        return [b for b in buckets if b]

    @property
    def groups(self) -> int:
        """The replica groups (paratrain.hybrid.view.Replicas)."""
        return self.group.size if self.group is not None else 1

    @property
    def prefix(self) -> str:
        """Before this group's keys in a checkpoint: none for the first group (its state is the checkpoint's plain
        one: `paratrain export` and a look at the weights read it), "replica-G/" for group G."""
        index = self.group.index if self.group is not None else 0
        return f"{REPLICA_PREFIX}{index}/" if index else ""

    def state(self) -> dict[int, dict[str, torch.Tensor]]:
        """What a checkpoint keeps beside the optimizer's state: the outer copy and the Nesterov buffer of every
        tensor the optimizer steps (by id()), per element, so they are saved and resharded as its moments are."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for inner, outer, buf in zip(self.inner, self.outer, self.momentum):
            out[id(inner)] = {OUTER: outer, **({MOMENTUM: buf} if buf is not None else {})}
        return out

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """State was loaded into the optimizer's state (the checkpoint's OUTER / MOMENTUM entries land there): take
        them back as the outer state, leaving the optimizer its own."""
        tensors = list(self.tensors())
        outer, momentum = [], []
        for t in tensors:
            held = optimizer.state.get(t, {})
            if OUTER not in held:
                raise ValueError("the loaded state holds no DiLoCo outer copy (a checkpoint of a dp_mode sync run, or a "
                                 "whole state dict): resume a DiLoCo run from its own checkpoint")
            outer.append(held.pop(OUTER))
            momentum.append(held.pop(MOMENTUM, None))
        self.inner, self.outer, self.momentum = tensors, outer, momentum

    def state_bytes(self) -> int:
        """Bytes of the outer state: the outer copy and (momentum > 0) the Nesterov buffer, once both exist."""
        held = [t for t in self.outer] + [b for b in self.momentum if b is not None]
        return sum(t.numel() * t.element_size() for t in held)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Callable[[], list[torch.Tensor]]:
    """What `optimizer` steps, in its order (after a ZeRO strategy re-pointed it at its shards)."""
    return lambda: [p for group in optimizer.param_groups for p in group["params"]]
