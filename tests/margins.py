"""Bounds with their measured values: a parity check is `within(value, bound, what)`, which asserts
and records. `pytest --margins PATH` writes every record of the session to PATH (JSON), so the
margin of each bound can be read off any machine's run, and runs compared:

    python -m pytest tests/distributed --margins avx2.json
    ATEN_CPU_CAPABILITY=default python -m pytest tests/distributed --margins default.json
    python -m tests.margins avx2.json default.json        # one table: the worst value of each check

A bound is believable when the worst value over machines, kernels and thread counts stays well
under it; docs/testing.md lists the table.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

_RECORDS: list[dict[str, Any]] = []


def within(value: float, bound: float, what: str) -> None:
    """assert value <= bound, and record both under the running test's name."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    _RECORDS.append({"test": test, "what": what, "value": float(value), "bound": float(bound)})
    assert value <= bound, f"{what}: {value:.3g} exceeds the bound {bound:g}"


def write(path: str | Path) -> None:
    Path(path).write_text(json.dumps(_RECORDS, indent=0))


def table(paths: list[str]) -> str:
    """Markdown: per test and check, the bound, the worst value of each file, and bound / worst."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    worst: dict[tuple[str, str], dict[int, float]] = defaultdict(dict)
    bounds: dict[tuple[str, str], float] = {}
    for i, records in enumerate(runs):
        for r in records:
            key = (r["test"], r["what"])
            worst[key][i] = max(worst[key].get(i, 0.0), r["value"])
            bounds[key] = r["bound"]
    names = [Path(p).stem for p in paths]
    lines = [f"| test | check | bound | {' | '.join(names)} | margin |",
             "|---|---|---|" + "---|" * len(names) + "---|"]
    for key in sorted(worst):
        values = [worst[key].get(i) for i in range(len(runs))]
        top = max(v for v in values if v is not None)
        margin = f"{bounds[key] / top:.0f}x" if top > 0 else "exact"
        cells = " | ".join("-" if v is None else f"{v:.1e}" for v in values)
        test = key[0].split("::", 1)[-1]
        lines.append(f"| {test} | {key[1]} | {bounds[key]:.0e} | {cells} | {margin} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1:]))
