"""Buffers a model changes in forward (a sample counter, an EMA), kept equal over the dp ranks.

Parameters stay equal on every dp rank because their gradients are summed; a buffer that forward
changes (in place, through .data, or by assigning a new tensor) changes on each rank from that
rank's samples only, so replicas would drift apart and a checkpoint would keep rank 0's. Each such
buffer gets a rule, applied over the dp ranks after every step:

    rank0   dp rank 0's value on every rank (DDP's broadcast_buffers; the default)
    sum     the value before the step plus the sum over ranks of each rank's change: a counter of
            samples then counts the whole global batch, as one process would
    mean    the mean over ranks of their values (floating buffers only)

Which buffers change is found in the first step: each rank compares its buffers with a copy taken
before it (values and identity, once), and the ranks agree in one small all-reduce. From then on
those buffers are synchronised every step, one collective per rule and dtype, with no read from the
device. A buffer that starts changing later (seen by identity or its version counter) is named in a
warning: it is not synchronised. A buffer that changes under the default rule is named in a warning
once, with how to choose another. Only persistent buffers are kept (non-persistent ones are caches,
outside checkpoints); a SyncedBatchNorm's are equal by construction and left to it.
"""

from __future__ import annotations

import warnings
from typing import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from paratrain.comm.collectives import all_reduce, broadcast
from paratrain.config.errors import ConfigError
from paratrain.data_parallel.batch_norm import check_accumulation
from paratrain.names import name_matches
from paratrain.topology.mesh import AxisGroup

BUFFER_RULES = ("rank0", "sum", "mean")


def buffer_rules(model: nn.Module, rules: Mapping[str, str], *, allow_missing: bool = False) -> dict[str, str]:
    """Every persistent buffer of `model` -> its rule: the first key of `rules` (a name, a suffix after a
    dot, or a glob) that matches it, else 'rank0'. Refuses unknown rules, keys that match no persistent
    buffer (unless allow_missing: a pipeline stage holds some of the model's buffers), and 'mean' on a
    buffer that is not floating point."""
    bad = {k: r for k, r in rules.items() if r not in BUFFER_RULES}
    if bad:
        raise ConfigError(f"unknown buffer rule(s) {bad}: rules are {', '.join(BUFFER_RULES)}")
    persistent = set(model.state_dict(keep_vars=True))
    buffers = {n: b for n, b in model.named_buffers() if n in persistent}
    unmatched = [key for key in rules if not any(name_matches(key, n) for n in buffers)]
    if unmatched and not allow_missing:
        raise ConfigError(f"buffer rule key(s) {unmatched} match no persistent buffer of the model (its buffers: "
                          f"{list(buffers)[:8]}); fix the names or drop the keys")
    chosen = {n: next((r for k, r in rules.items() if name_matches(k, n)), "rank0") for n in buffers}
    for name, rule in chosen.items():
        if rule == "mean" and not buffers[name].is_floating_point():
            raise ConfigError(f"buffer {name!r} holds {buffers[name].dtype}: 'mean' needs a floating buffer; use "
                              "'sum' or 'rank0'")
    return chosen


class BufferSync:
    def __init__(self, model: nn.Module, group: AxisGroup, rules: Mapping[str, str], *, device: torch.device,
                 synced_batch_norms: Sequence[str] = (), local_batch_norms: Sequence[str] = ()) -> None:
        """rules: as buffer_rules' (keys another pipeline stage's buffers match are let be); device: where
        the group's collectives run; synced_batch_norms: SyncedBatchNorm modules, whose buffers their
        statistics keep equal and whose statistics need one micro-batch per step; local_batch_norms:
        BatchNorms with per-rank statistics (batch_norm='local'), whose buffers keep rank 0's as DDP's
        do, without a warning of their own."""
        self.model, self.group, self.device = model, group, device
        self.synced_batch_norms = tuple(synced_batch_norms)
        managed = tuple(f"{m}." for m in synced_batch_norms)
        self.rules = {n: r for n, r in buffer_rules(model, rules, allow_missing=True).items()
                      if not n.startswith(managed)}
        """Each persistent buffer that may need keeping equal, in the model's order, and its rule."""
        self.quiet = tuple(f"{m}." for m in local_batch_norms)
        self.tracked: list[str] | None = None if self.rules else []
        """The buffers found changing in the first step (None until it has run)."""
        self._seen: dict[str, tuple[torch.Tensor, int]] = {}
        self._first: dict[str, torch.Tensor] = {}
        self._before: dict[str, torch.Tensor] = {}
        self._warned: set[str] = set()

    def check_micro_batches(self, count: int, rows: int) -> None:
        """Refuse a step whose batch statistics no single process would take (check_accumulation)."""
        if self.synced_batch_norms:
            check_accumulation(self.synced_batch_norms, dp=self.group.size, accumulation=count,
                               micro_batch=rows // count)

    def begin_step(self) -> None:
        """Before the step's forwards: each buffer as it is (and the values 'sum' adds to)."""
        buffers = {n: self.model.get_buffer(n) for n in self.rules}
        self._seen = {n: (b, b._version) for n, b in buffers.items()}
        if self.tracked is None:  # the first step compares values: .data changes bump no version
            self._first = {n: b.detach().clone() for n, b in buffers.items()}
        self._before = {n: buffers[n].detach().clone() for n in (self.tracked or self.rules)
                        if self.rules[n] == "sum"}

    def end_step(self) -> None:
        """After the step's forwards (every dp rank; collective): apply each changing buffer's rule."""
        if self.device.type == "meta":  # the planner's dry run: no values to compare or reduce
            return
        changed = [n for n, (b, version) in self._seen.items()
                   if self.model.get_buffer(n) is not b or b._version != version]
        if self.tracked is None:
            changed += [n for n, b in self._first.items() if n not in changed and not torch.equal(
                self.model.get_buffer(n), b)]
            self._first = {}
            names = list(self.rules)
            flags = torch.tensor([float(n in changed) for n in names], device=self.device)
            all_reduce(flags, self.group, op=dist.ReduceOp.MAX)
            self.tracked = [n for n, f in zip(names, flags.tolist()) if f > 0]
            default = [n for n in self.tracked if self.rules[n] == "rank0" and not n.startswith(self.quiet)]
            if default and self.group.index == 0:
                warnings.warn(f"buffer(s) {default} change in forward under data parallelism (dp = {self.group.size}): "
                              "each rank changes them from its own samples, and paratrain keeps dp rank 0's value on "
                              "every rank after each step (DDP's broadcast_buffers). If they count or average over "
                              "samples, name a rule: buffers={'NAME': 'sum'} (the changes of every rank added up, as "
                              "one process would count) or 'mean'", stacklevel=3)
        late = sorted(set(changed) - set(self.tracked) - self._warned)
        if late:
            self._warned.update(late)
            warnings.warn(f"buffer(s) {late} changed in forward on dp rank {self.group.index}, but not in the first "
                          "step, when paratrain found which buffers change: they are not kept equal over the dp "
                          "ranks (each rank keeps its own); change them in every step, or keep them out of forward",
                          stacklevel=3)
        self._synchronise()

    @torch.no_grad()
    def _synchronise(self) -> None:
        """One collective per rule and dtype over the tracked buffers, flattened (GradSync's buckets' habit)."""
        assert self.tracked is not None
        kinds: dict[tuple[str, torch.dtype], list[str]] = {}
        for name in self.tracked:
            kinds.setdefault((self.rules[name], self.model.get_buffer(name).dtype), []).append(name)
        for (rule, _), names in kinds.items():
            buffers = [self.model.get_buffer(n) for n in names]
            if rule == "sum":  # what each rank added, summed
                flat = _flatten_dense_tensors([b - self._before[n] for n, b in zip(names, buffers)])
            else:
                flat = _flatten_dense_tensors(buffers)
            if rule == "rank0":
                broadcast(flat, self.group)
            else:
                all_reduce(flat, self.group)
            for name, buffer, value in zip(names, buffers, _unflatten_dense_tensors(flat, buffers)):
                if rule == "sum":
                    buffer.copy_(self._before[name] + value)
                elif rule == "mean":
                    buffer.copy_(value / self.group.size)
                else:
                    buffer.copy_(value)
