"""What each launched process runs: join the job, train, leave cleanly."""

from __future__ import annotations

import os
import signal
import sys
import traceback
from datetime import timedelta
from types import FrameType

import torch
import torch.distributed as dist

from paratrain.config import RunPlan
from paratrain.topology import join, lay_out
from paratrain.topology.quorum import Quorum, reach
from paratrain.topology.recorder import FlightRecorder
from paratrain.planner.check import predicted_memory
from paratrain.train import Trainer, TrainResult
from paratrain.train.memory_snapshot import MemorySnapshot
from paratrain.train.serve import serve_plan


def threads_per_rank(local_world_size: int) -> int:
    """Split this machine's cores evenly between the ranks on it (at least one each)."""
    return max(1, (os.cpu_count() or 1) // max(1, local_world_size))


def train_on_this_rank(plan: RunPlan) -> TrainResult:
    """Join the job's process group (if launched), train, print the summary on rank 0."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(threads_per_rank(local_world))
    timeout = timedelta(seconds=plan.config.launch.timeout_s)  # the plan is resolved: laid out, not resolved again
    member = join(plan.config.launch.device, timeout=timeout)
    ctx = lay_out(member, plan.parallel, timeout=timeout, replicas=replica_quorum(plan, member.rank, member.world_size))
    folder, recorder = plan.config.launch.flight_dir, ctx.mesh.recorder
    if folder and recorder is not None:
        _leave_a_record_when_stopped(recorder, folder)
    try:
        if ctx.is_server:  # a dedicated parameter server: it serves the trainers until they stop
            serve_plan(plan, ctx)
            return TrainResult()
        result = Trainer(plan, ctx, hooks=memory_hooks(plan)).fit()
    except BaseException:
        if folder and recorder is not None:
            recorder.dump(folder, stack=traceback.format_exc())
        raise
    if ctx.is_main:
        print_summary(result)
    return result


def replica_quorum(plan: RunPlan, rank: int, world: int) -> Quorum | None:
    """Under fault tolerance: this rank's view of the replica groups, through the lighthouse (None otherwise)."""
    if plan.parallel.fault_tolerance != "replica":
        return None
    launch = plan.config.launch
    return reach(launch.lighthouse, plan.parallel, group=launch.replica_group, rank=rank, world=world,
                 timeout_s=launch.timeout_s, device=launch.device)


def memory_hooks(plan: RunPlan) -> list[MemorySnapshot]:
    """train.memory_snapshot's hook, with the planner's prediction for the run's busiest rank (none for a --hf model:
    its check dry-runs the model instead)."""
    train = plan.config.train
    if not train.memory_snapshot:
        return []
    predicted = None if plan.config.model.hf else predicted_memory(plan, device=plan.config.launch.device)
    return [MemorySnapshot(train.memory_snapshot, train.profile_dir, predicted)]


def _leave_a_record_when_stopped(recorder: FlightRecorder, folder: str) -> None:
    """On the launcher's SIGTERM (another rank failed), write this rank's flight record and where it
    was, then die of SIGTERM as it would have: the launcher's hang report reads both."""

    def stopped(signum: int, frame: FrameType | None) -> None:
        recorder.dump(folder, stack="".join(traceback.format_stack(frame)) if frame is not None else "")
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, stopped)


def print_summary(result: TrainResult) -> None:
    if result.val_losses:
        steps = sorted(result.val_losses)
        first, last = result.val_losses[steps[0]], result.val_losses[steps[-1]]
        print(f"validation loss: {first:.4f} at step {steps[0]} -> {last:.4f} at step {steps[-1]}")
    if result.tokens_per_s:
        utilisation = f", MFU {result.mfu:.1%}" if result.mfu is not None else ""
        print(f"throughput: {result.tokens_per_s:,.0f} tokens/s{utilisation} (the steps after the first)")
    if result.sample:
        print("sample:\n" + result.sample)
    sys.stdout.flush()


def leave() -> None:
    """Tear down the process group and exit at once.

    With several gloo processes, a normal interpreter exit ends about one run in eight with
    SIGABRT from a gloo thread after the work is done (pytorch issue 190489); destroying the
    group and leaving with os._exit avoids it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    if dist.is_initialized():
        dist.destroy_process_group()
    os._exit(0)
