"""Muon under every axis against the single process (the oracle): losses, gradient norms and trained weights,
float64 with Newton-Schulz in float64, 10 steps; its traffic against the formula; checkpoints across layouts."""

from __future__ import annotations

import pytest

from tests.helpers import max_state_diff, ranked_run, reference_run, rel_diff
from tests.margins import within

STEPS = 10


def _job(**kwargs) -> dict:
    return ranked_run(**{"steps": STEPS, "optimizer": "muon", "dtype": "float64", **kwargs})


def _as_planned(got: list[dict], layout: dict, *, model: str = "tiny", overrides: tuple = (),
                bucket_mb: float = 0.05) -> None:
    """The planner runs the exchange's own plan: every rank's elements sent (gather, scatter), buffers at the
    step's peak (float64: 8 bytes an element) and the owners' Newton-Schulz FLOPs equal the engine's, exactly."""
    from paratrain.config import preset
    from paratrain.planner.layout import Layout
    from paratrain.planner.optimizer import layout_exchange
    from paratrain.planner.settings import StepSettings
    from tests.helpers import TINY

    config = preset(model, seq_len=32, **dict(overrides)) if model != "tiny" or overrides else TINY
    # the planner prices models built in float32; these are float64 (parameters and Newton-Schulz), so every cap of
    # bucket_mb bytes holds half the elements: the same cuts as float32 elements under half the cap
    settings = StepSettings(bucket_mb=bucket_mb / 2, optimizer="muon", muon_ns_dtype="fp32")
    plan = layout_exchange(config, Layout.of(**layout), settings)
    engine = [(tuple(r["matrix_traffic"]), r["exchange_peak"], tuple(r["owner_flops"])) for r in got]
    planned = [(plan.sent[k], 8 * plan.peak[k], plan.owner_flops) for k in range(len(got))]
    assert planned == engine, f"{layout}: planner {planned} != engine {engine}"
    loads = plan.owner_flops  # the owners' loads differ by at most one largest matrix
    assert max(loads) - min(loads) <= plan.largest_flops, (layout, loads)


@pytest.mark.parametrize("layout", [
    dict(dp=2, micro_batch=4),                                  # replicas: each owns half the matrices
    dict(dp=4, zero=1, micro_batch=4),                          # flat shards through the matrices
    dict(dp=4, zero=2, micro_batch=2),
    dict(dp=4, zero=3, micro_batch=4),                          # parameters sharded too
    dict(dp=1, tp=2, micro_batch=8),                            # column and row slices
    dict(dp=1, tp=4, tp_mode="2d", micro_batch=8),              # 2 x 2 blocks
    dict(dp=1, pp=2, micro_batch=4),                            # each stage its own matrices
    dict(dp=1, cp=2, micro_batch=8),                            # no state split: replicas over cp
    dict(dp=2, tp=2, zero=1, sequence_parallel=True, micro_batch=4),  # slices of shards
], ids=["dp2", "zero1", "zero2", "zero3", "tp2", "tp2d", "pp2", "cp2", "dp2xtp2-zero1"])
def test_float64_layouts_equal_the_single_process(pools, layout):
    world = layout["dp"] * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    got = pools(world).run(_job, **layout)
    ref = reference_run(STEPS, optimizer="muon", dtype="float64")
    within(rel_diff(got[0]["losses"], ref["losses"]), 1e-12, "Muon loss (float64)")
    within(rel_diff(got[0]["grad_norms"], ref["grad_norms"]), 1e-12, "Muon grad norm (float64)")
    within(max_state_diff(got[0]["model"], ref["model"]), 1e-12, "Muon weights (float64)")
    _as_planned(got, layout)


MOE = (("capacity_factor", 1.0),)


@pytest.mark.parametrize("layout", [
    dict(dp=2, ep=2, tp=2, expert_tp=True, micro_batch=8),       # each expert cut over tp, experts over ep
    dict(dp=2, ep=2, zero=3, micro_batch=4),                      # experts whole per ep rank, the rest sharded
], ids=["ep2xetp2", "ep2-zero3"])
def test_float64_moe_experts_each_their_own_matrix(pools, layout):
    """Each expert of a stacked (experts, rows, cols) weight is one matrix, owned on the ep rank holding it."""
    world = layout["dp"] * layout.get("tp", 1)
    got = pools(world).run(_job, model="tiny-moe", overrides=MOE, **layout)
    ref = reference_run(STEPS, optimizer="muon", dtype="float64", model="tiny-moe", overrides=MOE)
    within(rel_diff(got[0]["losses"], ref["losses"]), 1e-12, "Muon MoE loss (float64)")
    within(max_state_diff(got[0]["model"], ref["model"]), 1e-12, "Muon MoE weights (float64)")
    _as_planned(got, layout, model="tiny-moe", overrides=MOE)


def test_float64_3d_layout_equals_the_single_process(pools):
    got = pools(8).run(_job, dp=2, tp=2, pp=2, zero=1, micro_batch=2)
    ref = reference_run(STEPS, optimizer="muon", dtype="float64")
    within(rel_diff(got[0]["losses"], ref["losses"]), 1e-12, "Muon loss dp2 x tp2 x pp2 ZeRO-1 (float64)")
    within(max_state_diff(got[0]["model"], ref["model"]), 1e-12, "Muon weights dp2 x tp2 x pp2 ZeRO-1 (float64)")
    _as_planned(got, dict(dp=2, tp=2, pp=2, zero=1, micro_batch=2))


MATRIX_ELEMENTS = 4 * (192 * 64 + 64 * 64 + 256 * 64 + 64 * 256)
"""The tiny GPT's matrices (4 blocks: qkv, out, up, down; the tied embedding is AdamW's)."""


def test_traffic_equals_the_formula_and_owners_balance(pools):
    """Elements sent per step (float64 here: 8 bytes each): replicas gather nothing and send the other its matrices
    back; tp slices gather and scatter half of every matrix; ZeRO-1's shards all but the owner's piece. Owners'
    Newton-Schulz FLOPs differ by at most the largest matrix's."""
    from paratrain.optim import newton_schulz_flops

    largest = newton_schulz_flops((256, 64))
    dp = pools(2).run(_job, steps=1, dp=2, micro_batch=8)
    assert sum(r["matrix_traffic"][0] for r in dp) == 0
    assert sum(r["matrix_traffic"][1] for r in dp) == MATRIX_ELEMENTS
    assert max(dp[0]["owner_flops"]) - min(dp[0]["owner_flops"]) <= largest
    tp = pools(2).run(_job, steps=1, dp=1, tp=2, micro_batch=8)
    assert [r["matrix_traffic"] for r in tp] and sum(r["matrix_traffic"][0] for r in tp) == MATRIX_ELEMENTS // 2
    assert sum(r["matrix_traffic"][1] for r in tp) == MATRIX_ELEMENTS // 2
    assert max(tp[0]["owner_flops"]) - min(tp[0]["owner_flops"]) <= largest
    zero = pools(4).run(_job, steps=1, dp=4, zero=1, micro_batch=4)
    gathered = sum(r["matrix_traffic"][0] for r in zero)
    assert gathered == sum(r["matrix_traffic"][1] for r in zero)  # no replicas: back as much as came
    assert 0 < gathered < MATRIX_ELEMENTS  # each owner holds part of its units
    assert max(zero[0]["owner_flops"]) - min(zero[0]["owner_flops"]) <= largest


def test_checkpoint_saved_under_zero3_resumes_under_tp2_and_one_process(pools, tmp_path):
    """The momentum is per element: a sharded checkpoint of Muon's state is layout-free (float64, 1e-12)."""
    from tests.helpers import tiny_run

    root = str(tmp_path / "ckpt")
    pools(4).run(_job, steps=STEPS // 2, save_sharded=root, dp=4, zero=3, micro_batch=4)
    ref = reference_run(STEPS, optimizer="muon", dtype="float64")["losses"][STEPS // 2:]
    got = pools(2).run(_job, steps=STEPS // 2, start_step=STEPS // 2, load_sharded=root, dp=1, tp=2, micro_batch=8)
    within(rel_diff(got[0]["losses"], ref), 1e-12, "Muon loss, saved ZeRO-3, loaded tp 2 (float64)")
    single = tiny_run(dp=None, micro_batch=None, steps=STEPS // 2, start_step=STEPS // 2, load_sharded=root,
                      dtype="float64", optimizer="muon")
    within(rel_diff(single["losses"], ref), 1e-12, "Muon loss, saved ZeRO-3, loaded in one process (float64)")


def _exchange_job(bucket_sizes: tuple[int, ...]) -> dict:
    """Four ranks hold pieces of eight matrices as layouts cut them: A [48, 40] by rows, each half on two replicas;
    B [32, 64] in flat shards of unequal length, one through a row; C0..C5 [16, 16] whole on every rank.
    Newton-Schulz in float64 through exchanges of several bucket sizes, and the whole matrices mapped in one
    process."""
    import functools

    import torch
    import torch.distributed as dist

    from paratrain.optim import Held, MatrixExchange
    from paratrain.optim.muon import newton_schulz
    from paratrain.topology import AxisGroup

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    shapes = {"A": (48, 40), "B": (32, 64), **{f"C{i}": (16, 16) for i in range(6)}}
    whole = {n: torch.randn(*shape, generator=gen, dtype=torch.float64) for n, shape in shapes.items()}
    cuts = [0, 500, 1000, 1700, 2048]  # B's shards
    mine = {"A": (24 * 40 * (rank // 2), 24 * 40), "B": (cuts[rank], cuts[rank + 1] - cuts[rank]),
            **{n: (0, 256) for n in shapes if n.startswith("C")}}
    pieces = {n: whole[n].reshape(-1)[at: at + n_].clone() for n, (at, n_) in mine.items()}
    held = [Held(pieces[n], 0, n_, n, shapes[n], ((0, at, n_),)) for n, (at, n_) in mine.items()]
    group = AxisGroup("world", tuple(range(4)), rank, dist.group.WORLD, None)
    step = functools.partial(newton_schulz, coefficients=(3.4445, -4.7750, 2.0315), steps=5, eps=1e-7,
                             dtype=torch.float64)
    out: dict = {"buckets": [], "equal": []}
    for size in bucket_sizes:
        exchange = MatrixExchange(held, group, dtype=torch.float64, bucket_elements=size)
        result = exchange.apply([(pieces[n], pieces[n].clone()) for n in mine], step)
        out["buckets"].append([len(b.units) for b in exchange.buckets])  # units this rank owns, per bucket
        out["equal"].append(all(torch.equal(r, step(whole[n]).reshape(-1)[at: at + n_])
                                for r, (n, (at, n_)) in zip(result, mine.items())))
    return out


def test_buckets_change_no_bit(pools):
    """However the units are bucketed (each owner's one unit a bucket, several, one bucket of all) and so
    overlapped, every rank's update is bitwise the whole matrix's Newton-Schulz in one process, and every bucket
    gives work to every owner that has some left."""
    got = pools(4).run(_exchange_job, bucket_sizes=(1, 1200, 1 << 20))
    for r in got:
        assert all(r["equal"]), r
        assert len(r["buckets"][0]) >= 2 and len(r["buckets"][-1]) == 1, r["buckets"]
        assert r["buckets"][0][0] >= 1  # every rank owns units here (8 over 4), and some of the first bucket


def test_the_planner_runs_the_exchanges_plan_with_one_bucket(pools):
    """One bucket (100 MiB): the peak is the owned units and one message beside the inputs and their copy."""
    for layout in (dict(dp=4, zero=3, micro_batch=4), dict(dp=2, tp=2, zero=2, micro_batch=4)):
        got = pools(4).run(_job, steps=1, bucket_mb=100.0, **layout)
        _as_planned(got, layout, bucket_mb=100.0)
