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
from typing import Any, Callable, Sequence

import torch

from paratrain.comm import all_reduce
from paratrain.topology.mesh import AxisGroup
from paratrain.topology.quorum import Quorum, ReplicaLost


REPLICA_PREFIX = "replica-"
"""Before a replica group's keys in a checkpoint ("replica-1/blocks.0.attn.qkv.weight"); the first group's have none."""

OUTER, MOMENTUM = "diloco_outer", "diloco_momentum"
"""The outer state's keys in a checkpoint, per element beside the optimizer's ("NAME::diloco_outer")."""


@dataclass(frozen=True)
class OuterSettings:
    """DiLoCo's outer optimizer (ParallelConfig's inner_steps, outer_lr, outer_momentum, outer_fragments)."""

    inner_steps: int
    lr: float
    momentum: float
    fragments: int = 1
    """Streaming DiLoCo (Douillard et al. 2025): the model's parameters cut into this many fragments of consecutive
    whole-model parameters (fragment_of), fragment f meeting every inner_steps steps at the steps
    (f + 1) x inner_steps / fragments past a multiple of inner_steps: the same bytes per round, in smaller bursts."""

    def due(self, step: int) -> list[int]:
        """The fragments whose outer step follows step `step` (counted from 1)."""
        every = self.inner_steps // self.fragments
        return [f for f in range(self.fragments) if (step - (f + 1) * every) % self.inner_steps == 0]


Span = tuple[int, int, int, int]
"""(index of a tensor the optimizer steps, first element, elements, fragment)."""


def fragment_of(sizes: Sequence[tuple[str, int]], fragments: int) -> dict[str, int]:
    """Whole-model parameter name -> its fragment: the parameters in model order, cut into `fragments` runs of about
    equal elements (a run ends once it reaches its share of the total), so every layout cuts alike."""
    total = sum(n for _, n in sizes)
    out, seen, fragment = {}, 0, 0
    for name, n in sizes:
        out[name] = fragment
        seen += n
        while fragment < fragments - 1 and seen >= (fragment + 1) * total / fragments:
            fragment += 1
    return out


class OuterStep:
    """The outer state of this rank's share of the model and the step that moves it (LocalUpdate calls begin()
    before each inner step and after_step(n) after step n, taken or skipped, before the gradient strategy pushes
    what the optimizer stepped back into the parameters)."""

    def __init__(self, tensors: Callable[[], list[torch.Tensor]], group: AxisGroup | None, settings: OuterSettings,
                 *, bucket_elements: int, spans: Callable[[list[torch.Tensor]], list[Span]] | None = None,
                 quorum: Quorum | None = None) -> None:
        """tensors: what the inner optimizer steps (read at the first step: a meta model is materialised by then);
        group: the replica group (None: a single group, whose outer step is the Nesterov step alone); spans: which
        elements of those tensors belong to which fragment (each element to one; None: whole tensors, fragment 0);
        quorum: under fault_tolerance 'replica', the replica groups are worlds of their own that meet here instead
        (group None): the pseudo-gradient averaged over the quorum's live members, a lost group's round skipped."""
        self.tensors, self.group, self.settings, self.quorum = tensors, group, settings, quorum
        self.lost_rounds: list[dict[str, Any]] = []
        """Under a quorum: each outer round a replica group was lost in (the step, the groups lost, the members that
        averaged it)."""
        self.bucket_elements = bucket_elements
        self.spans_of = spans or (lambda ts: [(i, 0, t.numel(), 0) for i, t in enumerate(ts)])
        self.inner: list[torch.Tensor] = []
        self.outer: list[torch.Tensor] = []
        self.momentum: list[torch.Tensor | None] = []
        self.spans: list[Span] = []

    def begin(self) -> None:
        """Before an inner step: the outer copy is taken once, from the weights the first round starts at; the
        Nesterov buffer starts at zero (its first step then is torch's clone of the pseudo-gradient, exactly)."""
        if not self.inner:
            self._hold(list(self.tensors()), None, None)

    def _hold(self, inner: list[torch.Tensor], outer: list[torch.Tensor] | None,
              momentum: list[torch.Tensor | None] | None) -> None:
        self.inner = inner
        self.outer = outer if outer is not None else [t.detach().clone() for t in inner]
        keep = self.settings.momentum > 0
        self.momentum = [m if m is not None else (torch.zeros_like(t) if keep else None)
                         for m, t in zip(momentum or [None] * len(inner), inner)]
        self.spans = self.spans_of(inner)

    @torch.no_grad()
    def after_step(self, step: int) -> bool:
        """After step `step` (counted from 1): the outer step of the fragments due; True when one ran."""
        due = set(self.settings.due(step)) if self.inner else set()
        if due and self.quorum is not None:
            self._over_the_quorum(step)
            return True
        for fragment in sorted(due):
            for bucket in self._buckets([s for s in self.spans if s[3] == fragment]):
                flat = torch.cat([(self.outer[i] - self.inner[i]).view(-1)[o: o + n] for i, o, n, _ in bucket])
                if self.group is not None:
                    all_reduce(flat, self.group)
                    flat.div_(self.group.size)
                at = 0
                for i, o, n, _ in bucket:
                    self._nesterov(i, o, n, flat[at: at + n])
                    at += n
        return bool(due)

    def _over_the_quorum(self, step: int) -> None:
        """The outer step over the replica groups of the quorum (one fragment: validated): every bucket's
        pseudo-gradient summed first, then applied, so a group lost in any bucket's sum leaves nothing applied; the
        survivors agree on the members (Quorum.recover) and sum again without it, its round's work left out."""
        assert self.quorum is not None
        buckets = self._buckets(self.spans)
        while True:
            flats = [torch.cat([(self.outer[i] - self.inner[i]).view(-1)[o: o + n] for i, o, n, _ in bucket])
                     for bucket in buckets]
            before = list(self.quorum.epoch.members)
            try:
                self.quorum.reduce(flats)
                break
            except ReplicaLost:
                members = list(self.quorum.recover(step).members)
                self.lost_rounds.append({"step": step, "lost": sorted(set(before) - set(members)),
                                         "members": members})
        count = len(self.quorum.epoch.members)
        for bucket, flat in zip(buckets, flats):
            flat.div_(count)
            at = 0
            for i, o, n, _ in bucket:
                self._nesterov(i, o, n, flat[at: at + n])
                at += n

    def _nesterov(self, i: int, first: int, n: int, delta: torch.Tensor) -> None:
        """torch.optim.SGD's single-tensor step (dampening 0, nesterov) on elements [first, first + n) of the outer
        copy, with the averaged pseudo-gradient as its gradient; the inner tensor takes the result."""
        outer = self.outer[i].view(-1)[first: first + n]
        grad = delta
        buf = self.momentum[i]
        if buf is not None:
            part = buf.view(-1)[first: first + n]
            part.mul_(self.settings.momentum).add_(delta)
            grad = delta.add(part, alpha=self.settings.momentum)
        outer.add_(grad, alpha=-self.settings.lr)
        self.inner[i].view(-1)[first: first + n].copy_(outer)

    def _buckets(self, spans: list[Span]) -> list[list[Span]]:
        """The spans in all-reduce buckets of one dtype and at most bucket_elements elements (a larger span alone), in
        the optimizer's order: the same on every rank of a replica group."""
        buckets: list[list[Span]] = []
        size, dtype = 0, None
        for span in spans:
            t = self.inner[span[0]]
            if not buckets or t.dtype != dtype or size + span[2] > self.bucket_elements:
                buckets.append([])
                size, dtype = 0, t.dtype
            buckets[-1].append(span)
            size += span[2]
        return buckets

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
        self._hold(tensors, outer, momentum)

    def state_bytes(self) -> int:
        """Bytes of the outer state: the outer copy and (momentum > 0) the Nesterov buffer, once both exist."""
        held = [t for t in self.outer] + [b for b in self.momentum if b is not None]
        return sum(t.numel() * t.element_size() for t in held)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> Callable[[], list[torch.Tensor]]:
    """What `optimizer` steps, in its order (after a ZeRO strategy re-pointed it at its shards)."""
    return lambda: [p for group in optimizer.param_groups for p in group["params"]]
