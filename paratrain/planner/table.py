"""`paratrain plan`'s table: the search's candidates, fastest first, each layout in a few words with its memory, step
time and why it lost to the best (paratrain.planner.command prints it; --json prints the record instead)."""

from __future__ import annotations

from typing import Any

from paratrain.planner.textbook import training_days


def layout_text(layout: dict[str, Any]) -> str:
    text = f"dp{layout['dp']} tp{layout['tp']} pp{layout['pp']}"
    if layout["virtual_stages"] > 1:
        text += f"x{layout['virtual_stages']}"
    if layout["pp"] > 1 and layout["schedule"] not in ("1f1b", "interleaved"):  # those two: pp alone, or x chunks
        text += f" {layout['schedule']}"
    if layout["ep"] > 1:
        text += f" ep{layout['ep']}"
    if layout["cp"] > 1:
        text += f" cp{layout['cp']}" + {"ulysses": "u", "usp": f"usp{layout['cp_ulysses']}"}.get(layout["cp_mode"], "")
    text += f" z{layout['zero']} mb{layout['micro_batch']}"
    if layout["ps_mode"] != "off":
        text += f" ps-{layout['ps_mode']}" + (f"x{layout['ps_servers']}" if layout["ps_servers"] else "")
        text += f" s{layout['staleness']}" if layout["ps_mode"] == "async" else ""
    if layout["recompute"] != "none":
        text += " rc" if layout["recompute"] == "full" else " rc-sel"
    if layout["sequence_parallel"]:
        text += " sp"
    if layout.get("expert_tp"):
        text += " etp"
    if layout.get("tp_mode", "1d") != "1d":
        text += f" {layout['tp_mode']}" + (f"x{layout['tp_depth']}" if layout["tp_mode"] == "2.5d" else "")
    return text


def _why(record: dict[str, Any], best: dict[str, Any]) -> str:
    """What makes a runner-up slower than the best: its largest difference."""
    if not record["fits"]:  # (the first row too, when none fits)
        return "does not fit"
    if record is best:
        return "best"
    gaps = {"compute (recompute / stage balance)": record["compute_s"] - best["compute_s"],
            "communication": record["comm_s"] - best["comm_s"],
            "pipeline bubble": record["step_time_s"] * record["bubble"] - best["step_time_s"] * best["bubble"]}
    name, gap = max(gaps.items(), key=lambda kv: kv[1])
    return f"+{gap:.3g} s {name}" if gap > 0 else "ties"


def plan_table(record: dict[str, Any], top: int, *, tokens: float | None) -> str:
    gb = 1e9
    model, hw, candidates = record["model"], record["hardware"], record["candidates"]
    rate = ("priced by operation" if hw["memory_bw"] and hw["gemm"] else f"x {hw['efficiency']:g}")
    lines = [f"{model['preset']} ({model['params'] / 1e9:.2f}B parameters) on {record['devices']} x {hw['name']} "
             f"({hw['memory_bytes'] / gb:.0f} GB, {hw['peak_flops'] / 1e12:.0f} TFLOP/s peak {rate})"]
    if not candidates:
        if "unmade" in record:  # no layout made at all: the rule that left the grids out
            lines.append(f"no layout is made of these devices: {record['unmade']}")
        else:
            lines.append(f"no layout passes paratrain's rules ({len(record['rejected'])} refused); first reason: "
                         + (record["rejected"][0]["reason"] if record["rejected"] else "none"))
        return "\n".join(lines)
    best = candidates[0]
    if "diloco" in record:
        groups, steps = record["diloco"]["replica_groups"], record["diloco"]["inner_steps"]
        lines.append(f"DiLoCo: {groups} replica groups of {record['devices'] // groups} devices, an outer step every "
                     f"{steps} steps; each row is one group's layout (run it with --dp {groups} x its dp "
                     f"--dp-mode diloco --replica-groups {groups}); peak GB counts the outer copy and momentum, step "
                     "s the outer all-reduce's share, tok/s every group's")
    header = (f"{'layout':<32} {'peak GB':>8} {'between':>7} {'params':>7} {'grads':>7} {'optim':>7} {'activ':>7} {'step s':>8} "
              f"{'tok/s':>10} {'MFU':>5} {'bubble':>6}" + (f" {'days':>6}" if tokens else "") + "  why")
    lines.append(header)
    for r in candidates[:top]:
        m = r["memory"]
        row = (f"{layout_text(r['layout']):<32} {m['peak'] / gb:>8.1f} {m['between_steps'] / gb:>7.1f} "
               f"{m['params'] / gb:>7.1f} {m['grads'] / gb:>7.1f} "
               f"{m['optimizer'] / gb:>7.1f} {m['activations'] / gb:>7.1f} {r['step_time_s']:>8.3f} "
               f"{r['tokens_per_s']:>10.0f} {r['mfu']:>5.1%} {r['bubble']:>6.1%}"
               + (f" {r['train_days']:>6.1f}" if tokens else ""))
        lines.append(row + "  " + _why(r, best))
    fitting = sum(r["fits"] for r in candidates)
    lines.append(f"{fitting} layouts fit, {len(candidates) - fitting} do not, {len(record['rejected'])} refused by "
                 "paratrain's rules (--json lists every one with its reason)")
    if tokens:
        days = training_days(tokens, model["params"], record["devices"], hw["peak_flops"] * hw["efficiency"])
        lines.append(f"8 T P / (n X) estimate (Narayanan et al. 2021) at {hw['efficiency']:g} of peak: {days:.1f} days")
    return "\n".join(lines)
