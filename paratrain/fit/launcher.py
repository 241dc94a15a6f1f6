"""A launching Trainer's processes: start the workers, relaunch them, and receive their result.

Run as a plain script with devices x num_nodes > 1, fit launches that many worker processes that
run the same program again (torch's elastic launcher, as torchrun). Each worker learns from the
environment that it was launched by a Trainer (HANDOFF_ENV) and which relaunch it is (ATTEMPT_ENV);
when done, rank 0 of each node leaves the trained weights and the FitResult in the handoff folder,
and the launching process loads them.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from torch import nn

from paratrain.config.run import LaunchSection
from paratrain.fit.result import FitResult
from paratrain.hybrid import Engine

HANDOFF_ENV = "PARATRAIN_FIT_HANDOFF"
"""Set by a launching Trainer for its workers: the folder where rank 0 of each node leaves the result
and the trained weights."""

ATTEMPT_ENV = "PARATRAIN_FIT_ATTEMPT"
"""Set by a launching Trainer for its workers: 0, or how many times it relaunched the job (max_restarts):
above 0 they resume from the newest checkpoint under save= that verifies."""


def launched_by_trainer() -> bool:
    """Whether this process is a worker of a launching Trainer (it hands its result over at the end)."""
    return bool(os.environ.get(HANDOFF_ENV))


def relaunch_attempt() -> int:
    """0, or how many times the launching Trainer relaunched this job."""
    return int(os.environ.get(ATTEMPT_ENV, "0"))


def launch_workers(model: nn.Module | None, launch: LaunchSection, *, max_restarts: int,
                   save: str | None) -> FitResult:
    """Run this program in launch.nproc x launch.nnodes workers, relaunching a failed job up to
    max_restarts times (the workers resume from the newest checkpoint under `save`); then load the
    trained weights into `model` (None: a Trainer(hf=...) model, which save_pretrained exports from the
    checkpoints) and return rank 0's FitResult."""
    from paratrain.launch import JobFailed, launch_script

    command = this_program(launch)
    handoff = tempfile.mkdtemp(prefix="paratrain-fit-")
    os.environ[HANDOFF_ENV] = handoff
    try:
        for attempt in range(max_restarts + 1):
            os.environ[ATTEMPT_ENV] = str(attempt)
            try:
                launch_script(launch, command, attempt=attempt)
                break
            except JobFailed as error:
                if attempt == max_restarts:
                    raise
                print(f"paratrain.Trainer: {error}\nrelaunching (restart {attempt + 1} of {max_restarts}) "
                      f"from the newest checkpoint under {save}", file=sys.stderr, flush=True)
        result = load_handoff(Path(handoff), model)
    finally:
        os.environ.pop(HANDOFF_ENV, None)
        os.environ.pop(ATTEMPT_ENV, None)
        for part in Path(handoff).glob("*"):
            part.unlink()
        Path(handoff).rmdir()
    return result


def load_handoff(folder: Path, model: nn.Module | None) -> FitResult:
    """The FitResult rank 0 left in `folder`, and the trained weights loaded into `model` (None: not gathered)."""
    from safetensors.torch import load_model

    result = FitResult(**_int_keys(json.loads((folder / "result.json").read_text())))
    # Tied weights were written once, under their first name: safetensors' load_model restores every
    # alias of a shared tensor, and still refuses a missing or unexpected name.
    if model is not None:
        load_model(model, str(folder / "model.safetensors"))
    return result


def this_program(launch: LaunchSection) -> list[str]:
    """The arguments after `python` that run this program again (_this_program), or the error that there is none."""
    command = _this_program()
    if command is None:
        raise RuntimeError(
            f"paratrain.Trainer(devices={launch.nproc}, num_nodes={launch.nnodes}) starts its workers by running "
            f"this program again, and there is no script to run (an interactive session or python -c): put the "
            f"code in a script and run `python script.py`, or launch it with "
            f"`torchrun --nproc-per-node {launch.nproc} script.py`")
    return command


def hand_over(engine: Engine, result: FitResult, *, weights: bool = True) -> None:
    """In a worker of a launching Trainer: leave the trained weights (unless `weights` is False: a Trainer(hf=)
    model, which save_pretrained exports from the checkpoints, is never gathered whole) and the result in the
    handoff folder (rank 0 of each node), and exit, so that the code after fit runs in the launching process only."""
    from safetensors.torch import save_file

    from paratrain.launch import leave

    folder = Path(os.environ[HANDOFF_ENV])
    model = engine.state_dict()["model"] if weights else None  # collective: every rank gathers the whole model
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        if model is not None:
            save_file({name: tensor.detach().cpu().clone().contiguous() for name, tensor in model.items()},
                      str(folder / "model.safetensors"))
        (folder / "result.json").write_text(json.dumps(asdict(result)))
    leave()


def _this_program() -> list[str] | None:
    """The arguments after `python` that run this program again: `-m package.module ARGS` when it was
    started with -m (as Lightning does), `SCRIPT ARGS` otherwise; None without a script."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        module = spec.name[: -len(".__main__")] if spec.name.endswith(".__main__") else spec.name
        return ["-m", module, *sys.argv[1:]]
    script = sys.argv[0] if sys.argv else ""
    if not script or not Path(script).is_file():
        return None
    return [script, *sys.argv[1:]]


def _int_keys(result: dict[str, Any]) -> dict[str, Any]:
    """JSON turned the step numbers into strings; turn them back."""
    return {key: {int(k): v for k, v in value.items()} if isinstance(value, dict) else value
            for key, value in result.items()}
