"""Dry runs: one rank of layouts up to 1,024 ranks, built and stepped on the meta device with a fake
process group, holds exactly the model-state bytes the planner predicts and moves exactly the bytes it
predicts, by axis and operation: dp's gradients and parameters, tp's activations, loss vectors and norm
gradients, the pipeline's sends, the tied embedding's gradient and the step's scalars."""

from __future__ import annotations

import dataclasses
import json

import pytest

from paratrain.cli import main
from paratrain.config import ParallelConfig, preset
from paratrain.planner.dryrun import dry_run

SHORT = preset("tiny", seq_len=48)  # seq x micro-batch != d_model: the loss's vectors and the norms' differ
UNTIED = dataclasses.replace(preset("tiny", n_layer=8), tie_embeddings=False)
MTP = preset("tiny", mtp_depth=2)  # multi-token prediction: the depths' blocks, embedding and head on the last stage
MTP_UNTIED = dataclasses.replace(MTP, tie_embeddings=False)
GRID = [  # (model, world, rank, layout, global batch, micro-batch, precision, recompute)
    ("tiny", 8, 5, dict(dp=2, tp=2, pp=2, zero=1, sequence_parallel=True, schedule="interleaved", virtual_stages=2),
     8, 2, "fp32", "none"),
    (SHORT, 2, 1, dict(tp=2, sequence_parallel=True), 4, 2, "fp32", "full"),
    (SHORT, 4, 3, dict(dp=2, tp=2, zero=3), 8, 2, "bf16", "full"),
    (UNTIED, 16, 8, dict(dp=2, tp=2, pp=4, zero=2, schedule="zero-bubble"), 8, 1, "fp32", "selective"),
    # a last stage of only the final norm and the (tied) head, a first of only the embedding: every
    # stage still reduces both parts of the gradient norm (tp slices, replicas), in the same order
    ("tiny", 4, 2, dict(tp=2, pp=2, pp_split=(5,)), 4, 1, "fp32", "none"),
    ("tiny", 4, 0, dict(tp=2, pp=2, pp_split=(1,), sequence_parallel=True, schedule="zero-bubble"), 4, 1, "fp32",
     "full"),
    ("tiny", 4, 3, dict(dp=4, zero=3, grad_reduce="reduce_scatter"), 16, 2, "bf16", "none"),
    # hierarchical sharding: ZeRO within shard groups of 2, their copies all-reduced
    ("tiny", 8, 5, dict(dp=4, tp=2, zero=2, shard_group=2, grad_reduce="reduce_scatter", sequence_parallel=True),
     8, 1, "bf16", "none"),
    ("tiny", 4, 2, dict(dp=4, zero=3, shard_group=2), 8, 1, "fp32", "none"),
    ("tiny", 8, 7, dict(dp=4, pp=2, zero=1, shard_group=2, grad_reduce="reduce_scatter"), 8, 1, "fp32", "none"),
    ("gpt3-175b", 1024, 1000, dict(dp=16, tp=8, pp=8, zero=1, sequence_parallel=True, grad_reduce="reduce_scatter"),
     16, 1, "bf16", "none"),
    ("gpt3-175b", 1024, 3, dict(dp=16, tp=8, pp=8, zero=1, sequence_parallel=True), 16, 1, "bf16", "full"),
    ("gpt3-6.7b", 1024, 777, dict(dp=128, tp=8, zero=3, grad_reduce="reduce_scatter"), 128, 1, "bf16", "none"),
    ("gpt3-13b", 512, 300, dict(dp=8, tp=8, pp=8, zero=2), 16, 1, "fp32", "none"),
    # context parallelism: gradients and ZeRO over dp x cp ("dp_cp"), Ulysses' all-to-alls on "cp"
    ("tiny", 8, 6, dict(dp=2, cp=2, tp=2, sequence_parallel=True, zero=1, cp_mode="ulysses",
                        grad_reduce="reduce_scatter"), 8, 1, "bf16", "selective"),
    ("tiny", 8, 5, dict(dp=2, cp=2, pp=2, zero=2), 8, 1, "fp32", "full"),
    ("tiny", 8, 3, dict(dp=4, cp=2, zero=2, shard_group=2, grad_reduce="reduce_scatter"), 8, 1, "fp32", "none"),
    ("gpt3-175b", 1024, 1000, dict(dp=4, cp=4, tp=8, pp=8, zero=1, sequence_parallel=True, cp_mode="ulysses",
                                   grad_reduce="reduce_scatter"), 16, 1, "bf16", "none"),
    # ZB-V: two chunks a rank in a V; rank 0 holds the embedding and the tied head (no tied all-reduce), the turn's
    # hand-off stays on its rank (no send); W repeats the backward's traffic on every chunk but chunk 0
    (preset("tiny", n_layer=6), 16, 0, dict(dp=2, tp=2, pp=4, zero=1, sequence_parallel=True, schedule="zb-v"), 8, 1,
     "bf16", "none"),
    (preset("tiny", n_layer=6), 16, 13, dict(dp=2, tp=2, pp=4, zero=1, schedule="zb-v"), 8, 1, "fp32", "full"),
    (MTP, 4, 1, dict(dp=1, tp=2, pp=2, sequence_parallel=True, schedule="zb-v"), 8, 1, "bf16", "none"),
    ("tiny-moe", 4, 3, dict(dp=2, ep=2, pp=2, schedule="zb-v"), 8, 1, "bf16", "full"),
    # DualPipeV: ZB-V's V, but only some backward passes split (the rest whole B): W repeats only where one runs
    (preset("tiny", n_layer=6), 16, 2, dict(dp=2, tp=2, pp=4, zero=1, sequence_parallel=True, schedule="dualpipev"),
     16, 1, "bf16", "none"),
    ("tiny", 4, 2, dict(tp=2, pp=2, schedule="dualpipev"), 8, 1, "fp32", "none"),
    ("tiny-moe", 4, 2, dict(dp=2, ep=2, pp=2, schedule="dualpipev"), 8, 1, "bf16", "none"),
    # USP: Ulysses' all-to-alls on "cp_ulysses", the ring across (its sends are the kernel's, not counted)
    ("tiny", 16, 13, dict(dp=2, cp=4, tp=2, sequence_parallel=True, zero=1, cp_mode="usp", cp_ulysses=2), 8, 1,
     "bf16", "none"),
    ("gpt3-xl", 64, 33, dict(dp=2, cp=8, pp=4, zero=1, cp_mode="usp", cp_ulysses=4), 8, 1, "bf16", "selective"),
    # the grid modes: SUMMA's broadcasts and reduces on tp_row / tp_col, the cube's gathers on tp_input / tp_weight /
    # tp_output, 2.5d's depth all-reduces; blocks between pipeline stages
    ("tiny", 4, 1, dict(tp=4, tp_mode="2d"), 8, 2, "fp32", "full"),
    # a first stage of only the embedding: no norm's block there, still every part of the gradient norm reduced
    ("tiny", 8, 0, dict(tp=4, pp=2, tp_mode="2d", pp_split=(1,)), 4, 2, "fp32", "none"),
    (SHORT, 8, 6, dict(pp=2, tp=4, tp_mode="2d", zero=1, schedule="interleaved", virtual_stages=2), 8, 2, "bf16",
     "none"),
    ("tiny", 8, 5, dict(tp=8, tp_mode="3d"), 8, 4, "fp32", "selective"),
    ("tiny", 16, 9, dict(dp=2, tp=8, tp_mode="2.5d", tp_depth=2, zero=3), 16, 4, "fp32", "none"),
    ("gpt3-175b", 1024, 700, dict(dp=2, tp=64, pp=8, tp_mode="3d", zero=1, grad_reduce="reduce_scatter"), 64, 16,
     "bf16", "none"),
    # MTP depths: their tokens ahead gathered over cp, their tp traffic and norms' gradients, the last stage's tied
    # copy of the embedding; ZB-H1's W module by module (untied) or over the whole chunk (the head and the depths
    # share the tied copy); their blocks as ZeRO-3 units
    (MTP, 16, 15, dict(dp=2, cp=2, tp=2, pp=2, sequence_parallel=True, zero=1), 8, 1, "bf16", "none"),
    (MTP_UNTIED, 4, 3, dict(tp=2, pp=2, zero=1, schedule="zb-h1"), 8, 1, "fp32", "none"),
    (MTP, 4, 3, dict(tp=2, pp=2, zero=1, schedule="zb-h1"), 8, 1, "fp32", "none"),
    (MTP, 8, 6, dict(dp=4, tp=2, zero=3), 8, 1, "bf16", "full"),
    # Mixture-of-Experts (tiny-dsmoe: 16 experts, top-4, an MTP depth), routed evenly on the meta device: ep's
    # all-to-alls (the counts, the rows both ways), the experts' gradients over edp, the routing statistics, the
    # experts' norm parts; under tp replicated (their gradients summed over tp with sequence parallelism) or cut
    # (expert_tp: the chunks' rows gathered and scattered); cp's per-sequence fractions; ZB-H1's whole-chunk W
    ("tiny-dsmoe", 64, 37, dict(dp=64, ep=8, zero=1), 128, 2, "bf16", "none"),
    ("tiny-dsmoe", 8, 5, dict(dp=2, ep=2, tp=2, cp=2, sequence_parallel=True, expert_tp=True), 8, 2, "bf16", "none"),
    ("tiny-dsmoe", 8, 7, dict(dp=2, ep=2, tp=2, pp=2, sequence_parallel=True, zero=1), 8, 1, "fp32", "full"),
    ("tiny-dsmoe", 8, 6, dict(dp=4, ep=2, pp=2, schedule="zb-h1"), 8, 1, "fp32", "none"),
    ("tiny-dsmoe", 8, 3, dict(dp=4, ep=2, cp=2, zero=2, cp_mode="ulysses"), 8, 1, "fp32", "selective"),
]


def _id(g: tuple) -> str:
    model = g[0]
    name = model if isinstance(model, str) else (f"tiny-{model.n_layer}x{model.seq_len}"
                                                 f"{'' if model.tie_embeddings else '-untied'}"
                                                 f"{f'-mtp{model.mtp_depth}' if model.mtp_depth else ''}")
    return f"{name}-{g[1]}ranks-rank{g[2]}" + ("" if g[7] == "none" else f"-{g[7]}")


@pytest.mark.parametrize("model,world,rank,layout,global_batch,micro_batch,precision,recompute", GRID,
                         ids=[_id(g) for g in GRID])
def test_a_dry_run_equals_the_planner_exactly(model, world, rank, layout, global_batch, micro_batch, precision,
                                              recompute):
    run = dry_run(preset(model) if isinstance(model, str) else model, ParallelConfig(**layout), rank=rank,
                  world_size=world, global_batch=global_batch, micro_batch=micro_batch, precision=precision,
                  recompute=recompute)
    assert run.memory == run.predicted_memory
    assert run.volume == run.predicted_volume
    cp, ep = layout.get("cp", 1), layout.get("ep", 1)
    config = preset(model) if isinstance(model, str) else model
    axes = {"tp": layout.get("tp", 1), "pp": layout.get("pp", 1), "dp_cp" if cp > 1 else "dp": layout.get("dp", 1) * cp,
            "cp": cp if layout.get("cp_mode") == "ulysses" or config.mtp_depth or config.n_experts else 1,
            "cp_ulysses": layout.get("cp_ulysses", 1),
            "ep": ep, "edp_cp" if cp > 1 else "edp": layout.get("dp", 1) // ep * cp if ep > 1 else 1}
    hierarchical = {"dp_shard", "dp_replicate"} if layout.get("shard_group") else set()
    grid = {"tp_row", "tp_col", "tp_depth", "tp_input", "tp_weight", "tp_output"}
    assert set(run.volume) - {"tied"} - hierarchical - grid == {axis for axis, degree in axes.items() if degree > 1}
    assert bool(run.actions) == (layout.get("pp", 1) > 1) == ("send" in run.volume.get("pp", {}))


def test_the_command_reports_a_rank_of_1024(capsys):
    code = main(["plan", "--model", "gpt3-175b", "--gpus", "1024", "--dp", "16", "--tp", "8", "--pp", "8", "--zero", "1",
                 "--sequence-parallel", "--global-batch", "16", "--dry-run", "--rank", "1023", "--json"])
    record = json.loads(capsys.readouterr().out)
    assert code == 0 and record["exact"] and record["coords"] == {"dp": 15, "tp": 7, "pp": 7}
    assert record["actions"][:2] == ["RECV_F chunk 7 mb 0", "F chunk 7 mb 0"]
    with pytest.raises(ValueError, match="--rank must be in"):
        dry_run(preset("tiny"), ParallelConfig(dp=2), rank=2, world_size=2, global_batch=2)
    with pytest.raises(ValueError, match="fp16 cannot be dry-run"):
        dry_run(preset("tiny"), ParallelConfig(dp=2), rank=0, world_size=2, global_batch=2, precision="fp16")
    with pytest.raises(ValueError, match="shard_group 1 .* does not"):
        dry_run(preset("tiny"), ParallelConfig(dp=4, zero=3, shard_group=1), rank=0, world_size=4, global_batch=4)
