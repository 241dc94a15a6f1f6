"""Buffers a model changes in forward (a sample counter, running statistics), kept equal over dp.

Parameters stay equal on every dp rank because their gradients are summed; a buffer that forward
changes (in place, or by assigning a new tensor) changes on each rank from that rank's samples only,
so replicas would drift apart, and a checkpoint would keep rank 0's. Each such buffer gets a rule,
applied over the dp ranks after every step:

    rank0   dp rank 0's value on every rank (DDP's broadcast_buffers; the default)
    sum     the value before the step plus the sum over ranks of each rank's change: a counter of
            samples then counts the whole global batch, as one process would
    mean    the mean over ranks of their values (floating buffers only)

Which buffers change is found in the first step (every rank says which of its buffers changed, one
small all-reduce, once); from then on those are synchronised every step, with no read from the
device. A buffer that changes later for the first time is named in a warning: it is not synchronised.
A buffer that changes under the default rule is named in a warning once, with how to choose another.
Only persistent buffers are kept (non-persistent ones are caches, outside checkpoints); BatchNorm's,
synchronised by their statistics (paratrain.data_parallel.batch_norm), are left to it.
"""

from __future__ import annotations

import fnmatch
import warnings
from typing import Mapping

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.collectives import all_reduce, broadcast
from paratrain.config.errors import ConfigError
from paratrain.topology.mesh import AxisGroup

BUFFER_RULES = ("rank0", "sum", "mean")


class BufferSync:
    def __init__(self, model: nn.Module, group: AxisGroup, rules: Mapping[str, str], *, device: torch.device,
                 synced_batch_norms: tuple[str, ...] = ()) -> None:
        """rules: buffer name or glob -> rule (the first matching key wins; unmatched: 'rank0');
        device: where the group's collectives run; synced_batch_norms: the SyncedBatchNorm modules,
        whose buffers their statistics keep equal, and whose statistics need one micro-batch per step."""
        self.model, self.group, self.device = model, group, device
        self.synced_batch_norms = synced_batch_norms
        managed = tuple(f"{m}." for m in synced_batch_norms)
        self.rules = {n: r for n, r in buffer_rules(model, rules).items() if not n.startswith(managed)}
        """Each persistent buffer that may need keeping equal, in the model's order, and its rule."""
        self.names = list(self.rules)
        self.tracked: list[str] | None = None if self.names else []
        """The buffers found changing in the first step (None until it has run)."""
        self._versions: dict[str, tuple[int, int]] = {}
        self._before: dict[str, torch.Tensor] = {}
        self._warned: set[str] = set()

    def _buffer(self, name: str) -> torch.Tensor:
        return self.model.get_buffer(name)

    def _version(self, name: str) -> tuple[int, int]:
        tensor = self._buffer(name)
        return id(tensor), tensor._version  # in-place changes bump _version; assignment changes the tensor

    def check_micro_batches(self, count: int, rows: int) -> None:
        """Refuse a step whose statistics no single process would take: synced BatchNorm over dp ranks
        that each cut their rows into several micro-batches (paratrain.data_parallel.batch_norm)."""
        if self.synced_batch_norms and count > 1:
            raise ConfigError(
                f"BatchNorm ({', '.join(self.synced_batch_norms[:3])}{', ...' if len(self.synced_batch_norms) > 3 else ''}) "
                f"normalises over the samples of one forward: with dp = {self.group.size} and {count} micro-batches of "
                f"{rows // count} rows per rank, the ranks' k-th micro-batches together are no micro-batch of a "
                f"single process (each rank holds a contiguous slice of the global batch), so the loss would depend "
                f"on the layout. Use one micro-batch per step (micro_batch = global_batch / dp = {rows}), or "
                "batch_norm='local' for per-rank statistics (DDP's default: not layout-free)")

    def begin_step(self) -> None:
        """Before the step's forwards: note each buffer's version (and the values 'sum' adds to)."""
        self._versions = {n: self._version(n) for n in self.names}
        self._before = {n: self._buffer(n).detach().clone() for n in (self.tracked or self.names)
                        if self.rules[n] == "sum"}

    def end_step(self) -> None:
        """After the step's forwards (every dp rank, collective): apply each changing buffer's rule."""
        changed = [n for n in self.names if self._version(n) != self._versions[n]]
        if self.tracked is None:  # the first step: which buffers change on any rank
            flags = torch.tensor([float(n in changed) for n in self.names], device=self.device)
            all_reduce(flags, self.group, op=dist.ReduceOp.MAX)
            self.tracked = [n for n, f in zip(self.names, flags.tolist()) if f > 0]
            default = [n for n in self.tracked if self.rules[n] == "rank0"]
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
        for name in self.tracked:
            buffer, rule = self._buffer(name), self.rules[name]
            with torch.no_grad():
                if rule == "rank0":
                    broadcast(buffer, self.group)
                elif rule == "sum":
                    change = buffer - self._before[name]
                    all_reduce(change, self.group)
                    buffer.copy_(self._before[name] + change)
                else:
                    total = buffer.clone()
                    all_reduce(total, self.group)
                    buffer.copy_(total / self.group.size)


def buffer_rules(model: nn.Module, rules: Mapping[str, str]) -> dict[str, str]:
    """Every persistent buffer of `model` -> its rule: the first key of `rules` (a name, a suffix after
    a dot, or a glob) that matches it, else 'rank0'. Refuses unknown rules, keys that match no
    persistent buffer, and 'mean' on a buffer that is not floating point."""
    bad = {k: r for k, r in rules.items() if r not in BUFFER_RULES}
    if bad:
        raise ValueError(f"unknown buffer rule(s) {bad}: rules are {', '.join(BUFFER_RULES)}")
    persistent = set(model.state_dict(keep_vars=True))
    buffers = {n: b for n, b in model.named_buffers() if n in persistent}
    unmatched = [key for key in rules if not any(_matches(key, n) for n in buffers)]
    if unmatched:
        raise ValueError(f"buffer rule key(s) {unmatched} match no persistent buffer of the model (its buffers: "
                         f"{list(buffers)[:8]}); fix the names or drop the keys")
    chosen = {n: next((r for k, r in rules.items() if _matches(k, n)), "rank0") for n in buffers}
    for name, rule in chosen.items():
        if rule == "mean" and not buffers[name].is_floating_point():
            raise ValueError(f"buffer {name!r} holds {buffers[name].dtype}: 'mean' needs a floating buffer; use 'sum' "
                             "or 'rank0'")
    return chosen


def _matches(key: str, name: str) -> bool:
    return fnmatch.fnmatchcase(name, key) if any(c in key for c in "*?[") else name == key or name.endswith("." + key)
