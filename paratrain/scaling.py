"""paratrain scaling: what happens to accuracy when the same training runs on more processes.

A widely read Lightning walkthrough trained a model on 1 to 8 GPUs and saw accuracy fall by 11 % at 8:
the batch per device was fixed, so the global batch grew with the device count and a fixed number of
epochs made fewer, larger steps with the same learning rate. This experiment repeats it on a small
convolutional net and the handwritten digits scikit-learn ships (8 x 8 images, 1,797 samples; nothing
downloaded), for 1, 2, 4, 8 processes, three ways:

- fixed-device-batch: `batch` samples per process, the global batch grows (the walkthrough's way);
- fixed-global-batch: `batch` samples per step whatever the process count (paratrain's way): the
  loss curve is the 1-process curve up to float rounding, so the accuracy is too;
- scaled-lr: `batch` per process, the learning rate scaled by the process count and warmed up over
  the first epochs (Goyal et al. 2017, "Accurate, Large Minibatch SGD").

Each run trains for the same number of epochs with SGD (momentum 0.9), in float64 (Recipe.dtype says
why), through paratrain.Trainer, in a
process of its own that launches the run's workers; the launching process measures the test accuracy
of the trained weights it gets back. `paratrain scaling --procs 1,2,4,8 --json PATH --plot DIR`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from paratrain.config.errors import ConfigError

MODES = ("fixed-device-batch", "fixed-global-batch", "scaled-lr")


@dataclass(frozen=True)
class Recipe:
    batch: int = 32
    """Samples per process (fixed-device-batch, scaled-lr), or per step (fixed-global-batch)."""
    lr: float = 0.05
    """SGD's learning rate at one process (scaled-lr multiplies it by the process count)."""
    epochs: int = 10
    warmup_epochs: float = 2.0
    """scaled-lr: linear warmup to the scaled rate over this many epochs."""
    seed: int = 0
    test_fraction: float = 0.2
    dtype: str = "float64"
    """float64 by default: 440 steps of SGD at lr 0.05 to a near-zero loss amplify float32 rounding
    (the fixed-global-batch curves of 1 and 2 processes parted by 1e-7 at step 1, 1e-5 by step 200 and
    by 40 % at step 320: the layouts' sums round differently, then the dynamics magnify it); in float64
    the same growth stays far below anything the accuracy can show. "float32" to see that."""


def digits(recipe: Recipe) -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    """scikit-learn's digits as [N, 1, 8, 8] images in [0, 1] and labels; a seeded train / test split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError("paratrain scaling reads the digits scikit-learn ships: pip install "
                          "'paratrain[scaling]' (or scikit-learn)") from None
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=getattr(torch, recipe.dtype)).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(recipe.seed))
    cut = len(y) - int(len(y) * recipe.test_fraction)
    train, test = order[:cut], order[cut:]
    return torch.utils.data.TensorDataset(x[train], y[train]), torch.utils.data.TensorDataset(x[test], y[test])


def build_model(seed: int, dtype: str = "float64") -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10),
    ).to(getattr(torch, dtype))


def loss_fn(model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def settings(mode: str, procs: int, recipe: Recipe, train_samples: int) -> dict[str, Any]:
    """The global batch, learning rate, warmup and steps of one run."""
    if mode not in MODES:
        raise ConfigError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    global_batch = recipe.batch if mode == "fixed-global-batch" else recipe.batch * procs
    if global_batch % procs or global_batch > train_samples:
        raise ConfigError(f"{mode} on {procs} processes: a global batch of {global_batch} samples must split evenly "
                          f"over the processes and fit the {train_samples} training samples: change --batch or --procs")
    steps_per_epoch = train_samples // global_batch
    scaled = mode == "scaled-lr"
    return {"global_batch": global_batch, "lr": recipe.lr * (procs if scaled else 1),
            "warmup_steps": round(recipe.warmup_epochs * steps_per_epoch) if scaled else 0,
            "steps": recipe.epochs * steps_per_epoch}


def run_one(mode: str, procs: int, recipe: Recipe) -> dict[str, Any]:
    """Train one configuration (launching `procs` workers) and measure the trained model here."""
    from paratrain.fit import Trainer

    train, test = digits(recipe)
    plan = settings(mode, procs, recipe, len(train))
    model = build_model(recipe.seed, recipe.dtype)
    lr = plan["lr"]
    trainer = Trainer(
        devices=procs, strategy="ddp", max_steps=plan["steps"], global_batch=plan["global_batch"], lr=lr,
        warmup_steps=plan["warmup_steps"], seed=recipe.seed, accelerator="cpu",
        optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9))
    result = trainer.fit(model, loss_fn, train)
    model.eval()
    with torch.no_grad():
        x, y = test.tensors
        logits = model(x)
        accuracy = float((logits.argmax(1) == y).double().mean())
        test_loss = float(nn.functional.cross_entropy(logits, y))
    return {"mode": mode, "procs": procs, "global_batch": plan["global_batch"], "lr": lr, "steps": plan["steps"],
            "wall_s": result.wall_s, "accuracy": accuracy, "test_loss": test_loss,
            "final_loss": result.losses[plan["steps"]], "losses": [result.losses[s] for s in sorted(result.losses)]}


def experiment(procs: Sequence[int], modes: Sequence[str], recipe: Recipe, *, log: Any = sys.stderr,
               single_here: bool = False) -> list[dict[str, Any]]:
    """Every (mode, procs) run, each in a process of its own that launches its workers (a Trainer
    relaunches the program it runs in, so each run is a program of its own), all timed alike.
    single_here: run the one-process ones in this process instead (quicker to start, for tests)."""
    runs: list[dict[str, Any]] = []
    for mode in modes:
        for count in procs:
            if count == 1 and mode == "fixed-global-batch" and "fixed-device-batch" in modes:
                same = next(r for r in runs if r["mode"] == "fixed-device-batch" and r["procs"] == 1)
                runs.append({**same, "mode": mode})  # one process: the two are the same run
                continue
            if count == 1 and single_here:  # no workers to launch
                runs.append(run_one(mode, 1, recipe))
                _report(runs[-1], log)
                continue
            with tempfile.TemporaryDirectory(prefix="paratrain-scaling-") as folder:
                out = Path(folder) / "run.json"
                command = [sys.executable, "-m", "paratrain.scaling", "--one", mode, "--procs", str(count),
                           "--out", str(out), "--recipe", json.dumps(asdict(recipe))]
                done = subprocess.run(command, capture_output=True, text=True, env={**os.environ})
                if done.returncode != 0:
                    raise RuntimeError(f"the {mode} run on {count} processes failed:\n{done.stderr[-4000:]}")
                run = json.loads(out.read_text())
            runs.append(run)
            _report(run, log)
    return runs


def _report(run: dict[str, Any], log: Any) -> None:
    print(f"{run['mode']:>19} x{run['procs']}: global batch {run['global_batch']:>4}, {run['steps']:>4} steps, "
          f"{run['wall_s']:6.1f} s, accuracy {100 * run['accuracy']:.1f} %, final loss {run['final_loss']:.4f}",
          file=log, flush=True)


def table(runs: Sequence[dict[str, Any]]) -> str:
    """Markdown: one row per run."""
    lines = ["| mode | processes | global batch | lr | steps | wall s | accuracy | final loss |",
             "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['mode']} | {r['procs']} | {r['global_batch']} | {r['lr']:g} | {r['steps']} | "
                     f"{r['wall_s']:.1f} | {100 * r['accuracy']:.1f} % | {r['final_loss']:.4f} |")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--procs", default="1,2,4,8", help="process counts, comma-separated (default 1,2,4,8)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated among {', '.join(MODES)}")
    parser.add_argument("--epochs", type=int, default=Recipe.epochs, help=f"epochs of every run (default {Recipe.epochs})")
    parser.add_argument("--batch", type=int, default=Recipe.batch,
                        help=f"samples per process, or per step in fixed-global-batch (default {Recipe.batch})")
    parser.add_argument("--lr", type=float, default=Recipe.lr, help=f"SGD learning rate at 1 process (default {Recipe.lr})")
    parser.add_argument("--dtype", choices=("float64", "float32"), default=Recipe.dtype,
                        help="the model's and data's dtype (default float64: see paratrain.scaling.Recipe.dtype)")
    parser.add_argument("--json", metavar="PATH", help="write {'runs': [...]} here")
    parser.add_argument("--plot", metavar="DIR", help="write scaling.png and loss curves there (matplotlib)")


def run(args: argparse.Namespace) -> int:
    """`paratrain scaling`: every run, the table, and the JSON and plots asked for."""
    try:
        procs = [int(p) for p in args.procs.split(",") if p.strip()]
    except ValueError:
        raise ConfigError(f"--procs takes process counts separated by commas, got {args.procs!r}") from None
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not procs or min(procs) < 1:
        raise ConfigError(f"--procs takes counts >= 1, got {args.procs!r}")
    recipe = Recipe(batch=args.batch, lr=args.lr, epochs=args.epochs, dtype=args.dtype)
    train, _ = digits(recipe)
    for mode in modes:  # every rule before the first run
        for count in procs:
            settings(mode, count, recipe, len(train))
    runs = experiment(procs, modes, recipe)
    print(table(runs))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"recipe": asdict(recipe), "runs": runs}, indent=1))
    if args.plot:
        from paratrain.plot import plot_curves, plot_scaling

        print(f"wrote {plot_scaling(runs, Path(args.plot) / 'scaling.png', title='digits, ' + str(recipe.epochs) + ' epochs')}")
        for mode in modes:  # the loss curves of each mode, one line per process count
            curves = {f"{r['procs']} processes": (list(enumerate(r["losses"], 1)), [])
                      for r in runs if r["mode"] == mode}
            print(f"wrote {plot_curves(curves, Path(args.plot) / f'loss-{mode}.png', log_y=True, title=mode)}")
    return 0


def _one() -> None:
    """A run's own process: `python -m paratrain.scaling --one MODE --procs N --out PATH --recipe JSON`."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--one", required=True, choices=MODES)
    parser.add_argument("--procs", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--recipe", required=True)
    args = parser.parse_args()
    result = run_one(args.one, args.procs, Recipe(**json.loads(args.recipe)))
    Path(args.out).write_text(json.dumps(result))  # the launching process only: the workers left in fit


if __name__ == "__main__":
    _one()
