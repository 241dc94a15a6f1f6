"""Fit a GPU profile's per-operation rates to measured steps (issue 28's calibration from runs).

A row is a measured training step: a GPT preset or shape, its layout, eager or compiled, and the seconds
it took. `fit` searches the four rates paratrain.planner.ops prices a step with (the best matmul
efficiency, from which the shape table follows by the roofline; the attention kernel's efficiency; the
achieved memory bandwidth; the time lost per kernel launch) for the least squared log error over the
rows, coarse to fine on a grid inside physical bounds. The shipped GPU profiles carry what it found:
`h100-80gb` from the repo's one-H100 runs (bench/results/h100-*.json, `python -m paratrain.planner.fit
bench/results/h100-gpt2-*.json bench/results/h100-gpt3xl-*.json`), `a100-80gb` from the published Megatron runs
(paratrain.planner.published; `python -m paratrain.planner.fit --published`), and every GPU profile's overlap loss
from Narayanan et al. 2021's ZeRO-3 runs (`--overlap`: the share of a collective's overlap with compute still
paid; those runs' steps hang on it). The fitted rates stand for the
model's terms as a whole (its byte and kernel counts are estimates), so they differ from what the primitives
measure alone (paratrain.planner.calibrate_device).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from paratrain.config.model import ModelConfig, preset
from paratrain.planner.hardware import DATASHEET_MEMORY_BW, DATASHEETS, PROFILES, Hardware, with_rates
from paratrain.planner.layout import Layout
from paratrain.planner.settings import PRICED
from paratrain.planner.timing import step_time

if TYPE_CHECKING:
    from paratrain.planner.published import PublishedRun


@dataclass(frozen=True)
class Row:
    """One measured step."""
    name: str
    model: ModelConfig
    layout: Layout
    global_batch: int
    seconds: float
    kernels: str = "eager"
    """paratrain.planner.ops.KERNELS: eager, compiled or fused (Megatron)."""
    precision: str = "bf16"


BOUNDS = {"best": (0.6, 0.95), "attention": (0.2, 0.45), "bandwidth": (0.6, 0.95), "launch_s": (2e-6, 20e-6)}
"""The searched range of each rate (bandwidth as a share of the data sheet's memory bandwidth). Attention is held
under 0.45 of peak, what the fused kernels PyTorch ships (FlashAttention-2) reach forward and backward on
current cards: in steps of 1-2k tokens it is a few percent of the time, and a fit on them alone would let it
take any value, which long sequences then pay for."""


def predict(row: Row, hw: Hardware) -> float:
    return step_time(row.model, row.layout, hw, global_batch=row.global_batch, seq=row.model.seq_len,
                     settings=replace(PRICED, precision=row.precision), kernels=row.kernels).step_s


def error(rows: list[Row], hw: Hardware) -> float:
    """Sum over rows of log(predicted / measured)^2."""
    return sum(math.log(predict(r, hw) / r.seconds) ** 2 for r in rows)


def fit(rows: list[Row], base: Hardware, *, rounds: int = 3, points: int = 6) -> tuple[Hardware, dict[str, float]]:
    """The rates (BOUNDS' names) with the least `error`, and the profile they make."""
    bw = DATASHEET_MEMORY_BW[base.name]
    ranges = dict(BOUNDS)
    best_params: dict[str, float] = {}
    for _ in range(rounds):
        grids = {k: [lo + (hi - lo) * i / (points - 1) for i in range(points)] for k, (lo, hi) in ranges.items()}
        scored = []
        for values in itertools.product(*grids.values()):
            params = dict(zip(grids, values))
            scored.append((error(rows, with_rates(base, **params, datasheet_bw=bw)), params))
        best_params = min(scored, key=lambda pair: pair[0])[1]
        ranges = {k: (max(BOUNDS[k][0], v - (hi - lo) / (points - 1)), min(BOUNDS[k][1], v + (hi - lo) / (points - 1)))
                  for (k, (lo, hi)), v in zip(ranges.items(), best_params.values())}
    return with_rates(base, **best_params, datasheet_bw=bw), best_params


def fit_overlap(rows: list[Row], base: Hardware, *, step: float = 0.05) -> tuple[Hardware, float]:
    """The overlap loss in [0, 1] (a grid of `step`) with the least worst |log(predicted / measured)| over the rows
    (the check is a bound on every row), and the profile with it."""
    grid = [round(i * step, 6) for i in range(int(round(1 / step)) + 1)]
    worst = {loss: max(abs(math.log(predict(r, replace(base, overlap_loss=loss)) / r.seconds)) for r in rows)
             for loss in grid}
    loss = min(grid, key=lambda value: worst[value])
    return replace(base, overlap_loss=loss), loss


def bench_rows(paths: list[str]) -> list[Row]:
    """The engine's rows of bench/bench_gpu.py results (one GPU): each variant's fastest repeat (interference
    only slows a step). Offloaded activations and the full-logits loss are not what the model prices."""
    fastest: dict[tuple, dict] = {}
    for path in paths:
        for record in json.loads(Path(path).read_text()):
            if record["kind"] != "engine" or record.get("offload") or record.get("loss"):
                continue
            key = (record["model"], record["compile"], record.get("recompute", "none"), record["global_batch"],
                   record["micro_batch"])
            if key not in fastest or record["step_s"] < fastest[key]["step_s"]:
                fastest[key] = record
    rows = []
    for (model, compiled, recompute, batch, micro), record in sorted(fastest.items()):
        layout = Layout.of(micro_batch=micro, recompute=recompute)
        name = f"{model} {'compiled' if compiled else 'eager'} recompute {recompute}"
        rows.append(Row(name, preset(model), layout, batch, record["step_s"], "compiled" if compiled else "eager"))
    return rows


def published_rows() -> list[Row]:
    """Korthikanti et al. 2022's Table 5 (paratrain.planner.published) as rows: Megatron's fused kernels, fp16."""
    from paratrain.planner.published import korthikanti_table5

    return _rows(korthikanti_table5())


def zero3_rows() -> list[Row]:
    """Narayanan et al. 2021's Table 2, ZeRO-3 without model parallelism (paratrain.planner.published) as rows."""
    from paratrain.planner.published import narayanan_table2

    return _rows([r for r in narayanan_table2() if r.layout.zero == 3])


def _rows(runs: list[PublishedRun]) -> list[Row]:
    """Published runs as rows: Megatron's fused kernels."""
    return [Row(r.name, r.model, r.layout, r.global_batch, r.step_s, "fused", r.precision) for r in runs]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="*", help="bench/bench_gpu.py result files")
    parser.add_argument("--published", action="store_true", help="fit the a100-80gb profile to Korthikanti et al. "
                        "2022's Table 5 instead")
    parser.add_argument("--overlap", action="store_true", help="fit the overlap loss of the shipped a100-80gb profile "
                        "to Narayanan et al. 2021's ZeRO-3 runs (Table 2) instead")
    parser.add_argument("--hardware", default="h100-80gb", choices=sorted(DATASHEETS))
    args = parser.parse_args(argv)
    if args.overlap:
        rows = zero3_rows()
        hw, loss = fit_overlap(rows, PROFILES["a100-80gb"])
        print(json.dumps({"overlap_loss": loss}))
        for row in rows:
            print(f"{row.name:40s} published {row.seconds:.2f} s predicted {predict(row, hw):.2f} s "
                  f"({predict(row, hw) / row.seconds:.3f})")
        return
    if not args.published and not args.results:
        parser.error("give bench/bench_gpu.py result files, --published or --overlap")
    rows = published_rows() if args.published else bench_rows(args.results)
    hw, params = fit(rows, DATASHEETS["a100-80gb" if args.published else args.hardware])
    print(json.dumps({k: round(v, 9) for k, v in params.items()}))
    for row in rows:
        print(f"{row.name:40s} measured {row.seconds:.4f} s predicted {predict(row, hw):.4f} s "
              f"({predict(row, hw) / row.seconds:.3f})")


if __name__ == "__main__":
    main()
