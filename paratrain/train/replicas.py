"""Silent-corruption checks (train.check_replicas, `--check-replicas N`): replicas that must agree, compared.

Data-parallel replicas hold the same parameters after every step: their gradients are summed over the same ranks
and every rank applies the same update. A device that corrupts a result (a flipped bit in a gradient, a bad
reduction) leaves one replica different, and nothing in the loss says so until it diverges. Every N steps each
rank takes a fingerprint of every parameter it holds, the sum of its bits read as integers (exact and order-free:
any single flipped bit changes it), and the ranks holding the same parameters compare them: the dense parameters
over the data group (dp, or dp x cp), the experts over the ranks holding the same experts (edp, times cp). A
tensor on which the ranks disagree stops the run on every rank, naming the rank that differs from the majority (with
two replicas, both), the tensor, the step, and how to replay it (paratrain.train.replay).

Costs one pass over the parameters and one small all-gather per group every N steps (measured in
tests/e2e/test_cli.py::test_a_flipped_bit_is_named_by_the_replica_check: 2.8 ms a check on steps of about 25 ms of
the tiny GPT under dp 2, 1.1 % of the run at N = 10). The parameters are compared after the step, so a corrupted
gradient is found through the update it made (a gradient the optimizer ignores, or a flip below the update's
rounding, is not); the gradients themselves are not fingerprinted.
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

    def on_step_start(self, loop: TrainLoop) -> None:
        if loop.step and loop.step % self.every == 0:
            self.check(loop, loop.step)

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
        mesh = loop.ctx.mesh
        named = list(loop.engine.model.named_parameters())
        for group, kind in ((mesh.data_group(), "dense"), (mesh.expert_data_group(), "experts")):
            names = [n for n, _ in named if (".experts." in n) == (kind == "experts")]
            if group is None or not names:
                continue
            tensors = dict(named)
            mine = torch.tensor([fingerprint(tensors[n]) for n in names], dtype=torch.int64, device=loop.ctx.device)
            everyone = torch.empty(group.size, len(names), dtype=torch.int64, device=loop.ctx.device)
            all_gather_async(everyone.view(-1), mine, group).wait()
            self._compare(everyone, names, group, step)
        self.checks += 1
        self.seconds += time.perf_counter() - started

    @staticmethod
    def _compare(everyone: torch.Tensor, names: list[str], group: AxisGroup, step: int) -> None:
        for column, name in enumerate(names):
            values = everyone[:, column].tolist()
            if len(set(values)) == 1:
                continue
            common, count = Counter(values).most_common(1)[0]
            odd = [group.ranks[i] for i, v in enumerate(values) if v != common] if count > len(values) / 2 else \
                list(group.ranks)
            who = (f"rank {odd[0]} holds a different {name!r} than its {group.size - 1} replicas"
                   if len(odd) == 1 else f"ranks {odd} disagree on {name!r} (no majority among {group.size} replicas)")
            raise ReplicaMismatch(
                f"replica check after step {step}: {who} on {group.describe()} (fingerprints {values}): a device or "
                f"a link corrupted a result silently. Stop using that rank's device; replay the steps since the last "
                f"check on one process against the logged losses with `paratrain replay SAVE --step S`, and resume "
                f"from a checkpoint taken before the corruption")
