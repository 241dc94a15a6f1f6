"""Silent-corruption checks (train.check_replicas, `--check-replicas N`): replicas that must agree, compared.

Data-parallel replicas hold the same parameters after every step: their gradients are summed over the same ranks
and every rank applies the same update. A device that corrupts a result (a flipped bit in a gradient, a bad
reduction) leaves one replica different, and nothing in the loss says so until it diverges. Every N steps each
rank takes a fingerprint of every parameter it holds, and without ZeRO of every reduced gradient before the update
(an optimizer step pre-hook: element-wise optimizers; a matrix optimizer's exchange runs no hooks), the sum of its
bits read as integers (exact and order-free: any single flipped bit changes it), and the ranks holding the same
tensors compare them: the dense parameters
over the data group (dp, or dp x cp), the experts over the ranks holding the same experts (edp, times cp). A
tensor on which the ranks disagree stops the run on every rank, naming the rank that differs from the majority (with
two replicas, both), the tensor, the step, and how to replay it (paratrain.train.replay).

Costs one pass over the parameters and one small all-gather per group every N steps (measured in
tests/e2e/test_cli.py::test_a_flipped_bit_is_named_by_the_replica_check: 2.8 ms a check on steps of about 25 ms of
the tiny GPT under dp 2, 1.1 % of the run at N = 10). Under ZeRO the gradients and the update are sharded: each shard is reduced to, and
updated on, one rank of the replicas, then gathered to all, so a corrupted shard reaches every replica alike and no
comparison can see it; there the check sees only what stays on one rank (its copy of the parameters).
ZeRO-3 keeps no replicas (each rank its own shard) and is refused before launch, as is the parameter server.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import torch

from paratrain.comm.collectives import all_gather_async
from paratrain.topology.mesh import AxisGroup
from paratrain.train.loop import Hook, TrainLoop

_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class ReplicaMismatch(RuntimeError):
    """Replicas that must hold the same parameters do not."""


def fingerprint(tensor: torch.Tensor) -> int:
    """The sum of a tensor's elements read as integers of their width (int64, wrapping): exact, order-free, and
    changed by any single flipped bit."""
    data = tensor.detach().contiguous().view(-1)
    return int(data.view(_INTEGER[data.element_size()]).to(torch.int64).sum())


class ReplicaCheck(Hook):
    """Every `every` steps (and after the last): the parameters' fingerprints compared over their replicas."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.checks, self.seconds = 0, 0.0
        self._checked = -1
        self._coming = 0

    def on_start(self, loop: TrainLoop) -> None:
        self._coming = loop.step + 1
        if not loop.engine.flat_groups:  # without ZeRO every replica holds the whole reduced gradient
            loop.engine.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: self._gradients(loop))

    def on_step_start(self, loop: TrainLoop) -> None:
        self._coming = loop.step + 1
        if loop.step and loop.step % self.every == 0:
            self.check(loop, loop.step)

    def _gradients(self, loop: TrainLoop) -> None:
        """Before the update of a checked step: the reduced gradients compared as the parameters are."""
        if self._coming % self.every == 0:
            started = time.perf_counter()
            self._compare_over_replicas(loop, self._coming, {n: p.grad for n, p in loop.engine.model.named_parameters()
                                                             if p.grad is not None}, what="reduced gradient of")
            self.seconds += time.perf_counter() - started

    def on_end(self, loop: TrainLoop, result: Any) -> None:
        self.check(loop, loop.step)
        if loop.ctx.is_main and self.checks and result.wall_s:
            share = self.seconds / self.checks / (result.wall_s / max(len(result.losses), 1))
            loop.log.info("replica checks: %d, %.2f ms each, %.2f %% of a step (one every %d steps: %.3f %%)",
                          self.checks, 1e3 * self.seconds / self.checks, 100 * share, self.every,
                          100 * share / self.every)

    def check(self, loop: TrainLoop, step: int) -> None:
        """Compare the parameters as they are after `step` (collective over the replica groups)."""
        if step == self._checked:
            return
        self._checked = step
        started = time.perf_counter()
        self._compare_over_replicas(loop, step, dict(loop.engine.model.named_parameters()), what="")
        self.checks += 1
        self.seconds += time.perf_counter() - started

    @staticmethod
    def _compare_over_replicas(loop: TrainLoop, step: int, tensors: dict[str, torch.Tensor], *, what: str) -> None:
        """The tensors' fingerprints compared over the ranks that hold the same ones (collective over them)."""
        mesh = loop.ctx.mesh
        for group, kind in ((mesh.data_group(), "dense"), (mesh.expert_data_group(), "experts")):
            names = [n for n in tensors if (".experts." in n) == (kind == "experts")]
            if group is None or not names:
                continue
            mine = torch.tensor([fingerprint(tensors[n]) for n in names], dtype=torch.int64, device=loop.ctx.device)
            everyone = torch.empty(group.size, len(names), dtype=torch.int64, device=loop.ctx.device)
            all_gather_async(everyone.view(-1), mine, group).wait()
            ReplicaCheck._compare(everyone, names, group, step, what)

    @staticmethod
    def _compare(everyone: torch.Tensor, names: list[str], group: AxisGroup, step: int, what: str) -> None:
        for column, name in enumerate(names):
            values = everyone[:, column].tolist()
            if len(set(values)) == 1:
                continue
            common, count = Counter(values).most_common(1)[0]
            odd = [group.ranks[i] for i, v in enumerate(values) if v != common] if count > len(values) / 2 else \
                list(group.ranks)
            tensor = f"{what} {name!r}".strip()
            when = f"at step {step}, before its update" if what else f"after step {step}"
            who = (f"rank {odd[0]} holds a different {tensor} than its {group.size - 1} replicas"
                   if len(odd) == 1 else f"ranks {odd} disagree on {tensor} (no majority among {group.size} replicas)")
            raise ReplicaMismatch(
                f"replica check {when}: {who} on {group.describe()} (fingerprints {values}): a device or "
                f"a link corrupted a result silently. Stop using that rank's device; replay the steps since the last "
                f"check on one process against the logged losses with `paratrain replay SAVE --step S`, and resume "
                f"from a checkpoint taken before the corruption")
