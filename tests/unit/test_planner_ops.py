"""The per-operation step-time model (paratrain.planner.ops, issue 28) against what runs measured: the repo's
one-H100 steps (bench/results/h100-*.json), Korthikanti et al. 2022's Table 5 and Narayanan et al. 2021's Tables 1
and 2 (paratrain.planner.published).
Every figure here is a deterministic function of committed data: the bounds are the issue's (15 %), the values
reached are written next to them."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from paratrain.config import ConfigError, preset
from paratrain.planner import fit
from paratrain.planner.hardware import DATASHEETS, GIB, PROFILES, hardware
from paratrain.planner.layout import Layout
from paratrain.planner.published import korthikanti_table5
from paratrain.planner.search import PRICED, memory

FP16 = replace(PRICED, precision="fp16")
from paratrain.planner.timing import step_time

RESULTS = sorted(str(p) for p in (Path(__file__).parents[2] / "bench" / "results").glob("h100-gpt*.json"))


@pytest.fixture(scope="module")
def h100_rows() -> list[fit.Row]:
    rows = fit.bench_rows(RESULTS)
    assert {r.model.d_model for r in rows} == {768, 2048} and len(rows) == 12  # gpt2, gpt3-xl x 2 modes x 3 recomputes
    return rows


def _worst(rows: list[fit.Row], hw) -> float:
    return max(abs(fit.predict(r, hw) / r.seconds - 1) for r in rows)


@pytest.mark.parametrize("fitted, held_out", [("gpt3-xl", "gpt2"), ("gpt2", "gpt3-xl")])
def test_rates_fitted_on_one_model_predict_the_other(h100_rows, fitted, held_out):
    """The issue's calibration split: the rates fitted on one model's six rows (eager and compiled; no, selective
    and full recomputation) predict every row of the other within 15 % (reached: gpt2 from gpt3-xl 10.9 %,
    gpt3-xl from gpt2 10.2 %), and the step-time ratios eager / compiled and recompute / none within 12 %
    (reached 10.3 %): the shape dependence comes from the operations, not from the fit."""
    train = [r for r in h100_rows if r.model == preset(fitted)]
    test = [r for r in h100_rows if r.model == preset(held_out)]
    hw, _ = fit.fit(train, DATASHEETS["h100-80gb"])
    assert _worst(test, hw) < 0.15
    by_name = {r.name.split(" ", 1)[1]: r for r in test}
    for a, b in [("eager recompute none", "compiled recompute none"),
                 ("eager recompute full", "eager recompute none"), ("compiled recompute full", "compiled recompute none"),
                 ("eager recompute selective", "eager recompute none"),
                 ("compiled recompute selective", "compiled recompute none")]:
        measured = by_name[a].seconds / by_name[b].seconds
        predicted = fit.predict(by_name[a], hw) / fit.predict(by_name[b], hw)
        assert abs(predicted / measured - 1) < 0.12, (a, b, measured, predicted)


def test_the_shipped_h100_profile_and_mfu_rising_with_width(h100_rows):
    """The shipped h100-80gb rates are the fit on all twelve rows (python -m paratrain.planner.fit ...: every
    row within 6.7 %); at a fixed layout the predicted MFU rises with the width, as published tables show and
    one efficiency cannot (it predicts the same MFU for every width)."""
    h100 = PROFILES["h100-80gb"]
    assert _worst(h100_rows, h100) < 0.08
    for family, seq in (("gpt2", 1024), ("gpt3", 2048)):
        names = (["gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"] if family == "gpt2" else
                 ["gpt3-small", "gpt3-medium", "gpt3-large", "gpt3-xl", "gpt3-2.7b"])
        for kernels in ("eager", "compiled"):
            mfu = [step_time(preset(n), Layout.of(micro_batch=8), h100, global_batch=16, seq=seq,
                             kernels=kernels).mfu for n in names]
            assert mfu == sorted(mfu) and mfu[-1] > 1.5 * mfu[0], (family, kernels, mfu)
    flat = hardware("h100-80gb", efficiency=0.5)
    assert not flat.per_operation
    mfu = {step_time(preset(n), Layout.of(micro_batch=8), flat, global_batch=16, seq=2048).mfu
           for n in ("gpt3-small", "gpt3-2.7b")}
    assert max(mfu) / min(mfu) < 1.05


def test_published_megatron_runs_step_time_and_memory():
    """Korthikanti et al. 2022, Table 5 (22B, 175B, 530B, 1T on 8-512 A100s; full recomputation, and sequence
    parallelism with selective recomputation): every row within 15 % of its published seconds (reached 4.1 %
    with the shipped a100-80gb rates, which were fitted to these rows); MFU rising from 22B to 175B to 530B as
    published (41.7 -> 51.4 -> 56.0 % with seqsel; predicted 43.1 -> 53.2 -> 58.0 %); every run fits its 80 GB (peaks 55-65 GiB), the model states
    near Figure 1's (paratrain keeps 16 bytes a parameter where Megatron keeps 18: its fp16 copy is ours per
    step, among the activations). No single
    efficiency gets every row within 15 %: the 22B and 1T rows need efficiencies 1.4x apart."""
    a100 = hardware("a100-80gb")
    runs = korthikanti_table5()
    mfu = {}
    for run in runs:
        t = step_time(run.model, run.layout, a100, global_batch=run.global_batch, seq=2048, settings=FP16,
                      kernels="fused")
        assert abs(t.step_s / run.step_s - 1) < 0.15, (run.name, t.step_s, run.step_s)
        mfu[run.name] = t.mfu
        mem = memory(run.model, run.layout, global_batch=run.global_batch, seq=2048, settings=FP16)
        assert mem["peak"] < 80 * GIB, (run.name, mem["peak"] / GIB)
        if run.states_gib is not None:
            states = (mem["params"] + mem["grads"] + mem["optimizer"]) / GIB
            assert 0.88 < states / run.states_gib < 0.97, (run.name, states, run.states_gib)  # 0.902 .. 0.963
    for recompute in ("full", "seqsel"):
        assert mfu[f"22B {recompute}"] < mfu[f"175B {recompute}"] < mfu[f"530B {recompute}"]
    for efficiency in [0.3 + 0.02 * i for i in range(31)]:  # 0.3 .. 0.9
        flat = hardware("a100-80gb", efficiency=efficiency)
        ratios = [step_time(r.model, r.layout, flat, global_batch=r.global_batch, seq=2048,
                            settings=FP16).step_s / r.step_s for r in runs]
        assert max(abs(x - 1) for x in ratios) > 0.15, efficiency


def test_the_fit_recovers_known_rates():
    """Rows priced by a profile of known rates are fitted back to within 1 % of their seconds (the search finds
    the optimum of its grid; the rates themselves trade against each other on few rows)."""
    known = fit.with_rates(DATASHEETS["h100-80gb"], best=0.8, attention=0.4, bandwidth=0.8, launch_s=8e-6,
                           datasheet_bw=3.35e12)
    rows = []
    for name, micro in (("gpt2", 16), ("gpt3-xl", 8)):
        for kernels in ("eager", "compiled"):
            for recompute in ("none", "full"):
                row = fit.Row(name, preset(name), Layout.of(micro_batch=micro, recompute=recompute), 2 * micro, 1.0,
                              kernels)
                rows.append(replace(row, seconds=fit.predict(row, known)))
    hw, _ = fit.fit(rows, DATASHEETS["h100-80gb"])
    assert _worst(rows, hw) < 0.01


def test_device_calibration_measures_a_profile(tmp_path):
    """The CUDA calibration's measurements run on any device: on the CPU, small, they make a per-operation
    profile that the planner reads back from its JSON file and prices a step with."""
    from paratrain.planner.calibrate_device import calibrate_device

    hw = calibrate_device(torch.device("cpu"), dtype=torch.float32, tokens=128, dims=(16, 32, 64),
                          copy_bytes=2**22, attention_shape=(1, 2, 64, 16))
    assert hw.per_operation and hw.launch_s > 0 and hw.attention_efficiency > 0 and len(hw.gemm) == 3
    assert all(0 < e <= 1 for row in hw.gemm for e in row[1:]) and [r[0] for r in hw.gemm] == sorted(r[0] for r in hw.gemm)
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(hw.to_dict()))
    loaded = hardware(str(path))
    assert loaded == hw
    t = step_time(preset("tiny"), Layout.of(micro_batch=2), loaded, global_batch=4, seq=64)
    assert math.isclose(sum(t.terms.values()), t.step_s, rel_tol=1e-9) and t.terms["compute: kernel launches"] > 0


@pytest.mark.parametrize("held_out", ["22B", "1T"])
def test_published_rates_predict_a_model_left_out(held_out):
    """The a100-80gb rates are fitted to the rows they are checked on; fitted without the smallest or the
    largest model, they still predict its two rows within 15 % (reached: 22B 4.3 %, 1T 6.3 %; 175B and 530B
    left out: 3.6 %, 4.3 %)."""
    rows = fit.published_rows()
    hw, _ = fit.fit([r for r in rows if not r.name.startswith(held_out + " ")], DATASHEETS["a100-80gb"])
    assert _worst([r for r in rows if r.name.startswith(held_out + " ")], hw) < 0.15


def _published_ratio(run, hw) -> float:
    return step_time(run.model, run.layout, hw, global_batch=run.global_batch, seq=2048, settings=FP16,
                     kernels="fused").step_s / run.step_s


def test_published_weak_scaling_runs():
    """Narayanan et al. 2021, Table 1 (1.7B-1T on 32-3,072 A100s, full recomputation; paratrain.planner.published),
    which does not give the micro-batch. The pipelined runs (39.1B-1T) with micro-batch 1, as Table 5's pipelined
    runs on the same machine used: every one within 15 % (reached 4.7 %), TFLOP/s per GPU rising with size as
    published (138 -> 163), every run fitting 80 GB (peaks 26-39 GiB). The runs without a pipeline hang on the
    unpublished micro-batch (and on their gradient all-reduce, which crosses nodes): with 1 they come within 8.4,
    14.6, 27.0 and 16.7 %, with 2 within 0.1, 4.9, 15.9 and 7.5 %, with 4 within 7.0, 2.7, 7.6 and 1.5 %; asserted:
    some micro-batch of 1, 2 or 4 within 15 % (each fits 80 GB). The a100-80gb rates were not fitted to this table."""
    from paratrain.planner.published import NARAYANAN, narayanan_table1

    a100 = hardware("a100-80gb")
    by_micro = {mb: {r.name: r for r in narayanan_table1(micro_batch=mb)} for mb in (1, 2, 4)}
    rates = []
    for name, run in by_micro[1].items():
        mem = memory(run.model, run.layout, global_batch=run.global_batch, seq=2048, settings=FP16)
        assert mem["peak"] < 80 * GIB, (name, mem["peak"] / GIB)
        if run.layout.pp > 1:
            assert abs(_published_ratio(run, a100) - 1) < 0.15, (name, _published_ratio(run, a100))
            rates.append(NARAYANAN[name][7] / _published_ratio(run, a100))  # the paper's FLOPs over the prediction
        else:
            assert min(abs(_published_ratio(by_micro[mb][name], a100) - 1) for mb in (1, 2, 4)) < 0.15, name
    assert rates == sorted(rates)


def test_published_ptdp_against_zero3():
    """Narayanan et al. 2021, Table 2: PTD-P (tp 8 x pp 12 or 35, micro-batch 1) against ZeRO-3 without model
    parallelism on the same GPUs, GPT-3 175B and 530B on 384-2,240 A100s. Every row within 15 % of its published
    step (reached: PTD-P 1.4-5.0 % low with the rates fitted to Table 5, no overlap under their pipeline; ZeRO-3
    12.2 % with the overlap loss fitted to its six rows, 0.45); PTD-P faster than ZeRO-3 at every equal count of
    GPUs, as published, and ZeRO-3's step shrinking by under 15 % from 768 to 1,536 GPUs or from 1,120 to 2,240
    (predicted 8 % each; published 66.75 s both, 180-184 s: its gathers cross the nodes whatever the count). With
    the overlap perfect (loss 0) ZeRO-3 comes up to 34 % fast: the fitted term is what makes those rows. The days for 300B tokens follow from the
    TFLOP/s within one (a check of the transcription)."""
    from paratrain.planner.published import NARAYANAN_TABLE2, narayanan_table2

    a100 = hardware("a100-80gb")
    runs = narayanan_table2()
    for run, (_, _, _, batch, _, _, _, days) in zip(runs, NARAYANAN_TABLE2):
        assert abs(300e9 / (batch * 2048) * run.step_s / 86400 - days) < 1.0, run.name
    ratios = {run.name: _published_ratio(run, a100) for run in runs}
    assert max(abs(r - 1) for r in ratios.values()) < 0.15, ratios
    predicted = {run.name: run.step_s * ratios[run.name] for run in runs}
    for size, gpus in [("174.6B", 384), ("174.6B", 768), ("174.6B", 1536), ("529.6B", 1120), ("529.6B", 2240)]:
        assert predicted[f"{size} PTD-P {gpus}"] < predicted[f"{size} ZeRO-3 {gpus}"], (size, gpus)
    assert predicted["174.6B ZeRO-3 1536"] > 0.85 * predicted["174.6B ZeRO-3 768"]
    assert predicted["529.6B ZeRO-3 2240"] > 0.85 * predicted["529.6B ZeRO-3 1120"]
    perfect = replace(a100, overlap_loss=0.0)
    assert max(abs(_published_ratio(r, perfect) - 1) for r in runs if r.layout.zero == 3) > 0.15
    assert fit.fit_overlap(fit.zero3_rows(), a100)[1] == pytest.approx(a100.overlap_loss)


def test_recompute_collectives_and_grid_cuts():
    """Full recomputation repeats the forward's tp collectives as far as backward needs them: paratrain 1 of its 4
    all-reduces per block (planner.comm counts them to the byte against the engine), Megatron's fused runs 2; a
    grid rank holds 1/tp of the residual stream and runs its own products (the cube's [T/q, d/q] x [d/q, d/q])."""
    from paratrain.planner.ops import Cut

    model, h100 = preset("gpt3-xl"), hardware("h100-80gb")
    def tp_term(recompute: str, kernels: str) -> float:
        layout = Layout.of(tp=8, micro_batch=4, recompute=recompute)
        return step_time(model, layout, h100, global_batch=4, seq=2048, kernels=kernels).terms["tp collectives"]
    assert math.isclose(tp_term("full", "eager") / tp_term("none", "eager"), 5 / 4, rel_tol=1e-9)
    assert math.isclose(tp_term("full", "fused") / tp_term("none", "fused"), 6 / 4, rel_tol=1e-9)
    cube = Cut.of(Layout.of(tp=8, tp_mode="3d"))
    assert cube.stream(4096, 2048) == 4096 * 2048 / 8 and Cut.of(Layout.of(tp=8)).stream(4096, 2048) == 4096 * 2048
    gemm, reps = cube.products(4096, 2048, 8192)
    assert (gemm.m, gemm.n, gemm.k, reps) == (2048, 4096, 1024, 1)
    summa, reps = Cut.of(Layout.of(tp=16, tp_mode="2d")).products(4096, 2048, 8192)
    assert (summa.m, summa.n, summa.k, reps) == (1024, 2048, 512, 4)
    with pytest.raises(ConfigError, match="kernels must be one of"):
        step_time(model, Layout.of(), h100, global_batch=4, seq=2048, kernels="jit")


def test_a_moe_layer_is_priced_by_operation():
    """A MoE model on a GPU profile is priced by operation (paratrain.planner.moe_cost), not by one efficiency. Checks
    of consistency, not of a GPU run (none measured): two experts of half the MLP's width, each token sent to both,
    do the dense MLP's FLOPs: their GEMMs within 10 % of the dense MLP's (reached 5.8 %: products half as wide run
    3.6 % slower, and the router's product, bandwidth-bound, adds 2.1 %); top-2 costs more expert GEMM time than
    top-1 and less than twice plus the router; expert parallelism over 8 ranks takes the experts' weight-gradient
    accumulation off 7 of 8 and adds the all-to-alls; full recomputation runs the layer's forward again."""
    from paratrain.planner.layout import Layout
    from paratrain.planner.moe_cost import moe_layer_work
    from paratrain.planner.ops import Cut, Numerics, block_work

    h100 = hardware("h100-80gb")
    dense = preset("gpt3-xl")
    halves = replace(dense, n_experts=2, top_k=2, d_expert=dense.ff_dim // 2)
    layout = Layout.of(micro_batch=4)
    common = dict(tokens=4 * 2048, seq=2048, cut=Cut(), recompute="none", numerics=Numerics("eager", 2))
    mlp = block_work(dense, h100, **common).gemm - block_work(dense, h100, **common, mlp=False).gemm
    moe = moe_layer_work(halves, layout, h100, tokens=4 * 2048, act=2, kernels="eager")
    assert abs(moe.gemm / mlp - 1) < 0.1, moe.gemm / mlp

    def gemm(top_k: int, **fields) -> float:
        model = replace(dense, n_experts=8, top_k=top_k)
        return moe_layer_work(model, Layout.of(micro_batch=4, **fields), h100, tokens=4 * 2048, act=2,
                              kernels="eager")

    assert gemm(1).gemm < gemm(2).gemm < 2.1 * gemm(1).gemm
    assert gemm(2, dp=8, ep=8).memory < gemm(2).memory
    assert gemm(2, recompute="full").total > 1.2 * gemm(2).total  # the forward again: 1.28x
    model = replace(dense, n_experts=8, top_k=2)
    one, spread = (step_time(model, Layout.of(micro_batch=4, dp=8, **fields), h100, global_batch=256, seq=2048)
                   for fields in ({}, {"ep": 8}))
    assert "compute: GEMMs" in one.terms and spread.terms["ep all-to-alls"] > 0
    assert spread.terms["compute: memory-bound ops"] < one.terms["compute: memory-bound ops"]


@pytest.mark.parametrize("fields, grad_reduce", [
    (dict(dp=4), "reduce_scatter"), (dict(dp=4, zero=1), "reduce_scatter"), (dict(dp=4, zero=2), "reduce_scatter"),
    (dict(dp=4, zero=3), "reduce_scatter"), (dict(dp=4, zero=3), "all_reduce"), (dict(dp=2, pp=2, zero=2), "all_reduce"),
    (dict(dp=2, cp=2, zero=1), "reduce_scatter"), (dict(dp=2, tp=8, tp_mode="2.5d", tp_depth=2, zero=1), "reduce_scatter"),
    (dict(dp=4, zero=3, shard_group=2), "reduce_scatter"), (dict(dp=4, zero=2, shard_group=2), "reduce_scatter"),
])
def test_data_parallel_time_moves_what_the_engine_moves(fields, grad_reduce):
    """The step time's dp term prices the bytes paratrain.planner.comm counts for the engine (which dry runs check to
    the byte): on links of one byte a second and no latency its seconds are the volume x (k - 1) / k, up to the flat
    groups' padding (none here: equal). With shard groups, the traffic within a group (its links in one node). The
    estimate prices 16-bit gradients on the wire (--grad-dtype bf16; the default float32 buffers move twice the
    gradient bytes, counted by planner.comm, not yet by this estimate)."""
    from paratrain.planner.comm import StepSettings
    from paratrain.planner.dp_comm import data_parallel_volume
    from paratrain.planner.hardware import Hardware
    from paratrain.planner.timing import _data_parallel_time

    model, layout = preset("small"), Layout.of(micro_batch=2, **fields)
    hierarchical = layout.shard_group is not None
    span = layout.tp * layout.cp * (layout.shard_group or layout.dp)  # the whole group in one node, or the shard group
    links = Hardware("links", 1e15, 1e12, 1.0, 1e30 if hierarchical else 1.0, devices_per_node=span, latency_s=0.0)
    seconds, _ = _data_parallel_time(model, layout, links, compute=0.0, micro_batches=2, precision="bf16",
                                     grad_reduce=grad_reduce)
    settings = StepSettings(precision="bf16", grad_reduce=grad_reduce, grad_dtype="bf16")  # what the estimate prices
    axis = "dp_shard" if hierarchical else ("dp_cp" if layout.cp > 1 else "dp")
    moved = max(sum(data_parallel_volume(model, layout, stage=s, micro_batches=2, settings=settings)[axis].values())
                for s in {0, layout.pp - 1})
    ranks = layout.shards if hierarchical or layout.zero else layout.dp * layout.cp
    assert seconds * ranks / (ranks - 1) == pytest.approx(moved, rel=1e-6)
