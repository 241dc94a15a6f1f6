"""A user's script for paratrain.Trainer, as a Lightning user would write one: the tests run it with
`python fit_script.py DEVICES STRATEGY OUT.json [KEY=VALUE ...]` (the Trainer launches its own workers)
and call build() in-process."""

from __future__ import annotations

import json
import sys

import torch
from torch import nn

import paratrain

TP_PLAN = {"0": "column", "2": "row"}


def build() -> tuple[nn.Module, torch.utils.data.Dataset, torch.utils.data.Dataset]:
    """A small float64 classifier and its data (float64: layouts agree to the last bits)."""
    torch.manual_seed(0)
    x = torch.randn(96, 8, dtype=torch.float64)
    y = (x @ torch.randn(8, 4, dtype=torch.float64)).argmax(1)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).double()
    return model, torch.utils.data.TensorDataset(x[:64], y[:64]), torch.utils.data.TensorDataset(x[64:], y[64:])


class Stream(torch.utils.data.IterableDataset):
    """The training set as a stream, in its own (fixed) order: what an IterableDataset user brings."""

    def __init__(self, data: torch.utils.data.TensorDataset) -> None:
        self.data = data

    def __iter__(self):
        return (self.data[i] for i in range(len(self.data)))


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


class FailOnce(paratrain.fit.Callback):
    """Rank 1 raises after step `step` in the first launch only (a relaunch runs clean): a worker that fails."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, trainer: paratrain.Trainer, record: dict) -> None:
        import os

        from paratrain.fit.launcher import ATTEMPT_ENV

        first = os.environ.get(ATTEMPT_ENV, "0") == "0"
        if first and record["step"] == self.step and trainer.ctx is not None and trainer.ctx.rank == 1:
            raise RuntimeError(f"injected failure after step {self.step}")


class KillOnce(paratrain.fit.Callback):
    """Rank `rank` of replica group `group` SIGKILLs itself after step `step` (a group lost; the job goes on)."""

    def __init__(self, group: int, rank: int, step: int) -> None:
        self.group, self.rank, self.step = group, rank, step

    def on_train_step_end(self, trainer: paratrain.Trainer, record: dict) -> None:
        import os
        import signal

        ctx = trainer.ctx
        if record["step"] == self.step and ctx is not None and ctx.replicas is not None \
                and (ctx.replicas.group, ctx.rank) == (self.group, self.rank):
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    devices, strategy, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    options = {key: json.loads(value) for key, value in (arg.split("=", 1) for arg in sys.argv[4:])}
    if "fail_once_after" in options:
        options["callbacks"] = [FailOnce(options.pop("fail_once_after"))]
    if "kill_group_rank_after" in options:
        options["callbacks"] = [KillOnce(*options.pop("kill_group_rank_after"))]
    model, train, val = build()
    if options.pop("stream", False):
        train = Stream(train)
    trainer = paratrain.Trainer(devices=devices, strategy=strategy, max_steps=6, global_batch=16, micro_batch=4,
                                lr=0.05, val_every=3, tp_plan=TP_PLAN if strategy == "tp" else None, **options)
    result = trainer.fit(model, loss_fn, train, val)
    # after fit, in the launching process only: the trained weights are in `model`
    with open(out, "a") as file:
        file.write(json.dumps({"losses": result.losses, "val_losses": result.val_losses,
                               "model": {k: v.tolist() for k, v in model.state_dict().items()}}) + "\n")


if __name__ == "__main__":
    main()
