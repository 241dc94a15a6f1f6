"""ZeRO-1/2 and hierarchical sharding against the single-process reference, and the ZeRO memory formulas."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import paratrain
from tests.helpers import LR, TINY, lr_at, max_state_diff, regression_rows, rel_diff, squared_error, tiny_run
from tests.margins import within

STEPS = 6  # AdamW steps against one process (the margins in docs were measured over 10)
_cache: dict = {}


def reference(dtype: str = "float32") -> dict:
    if dtype not in _cache:
        _cache[dtype] = tiny_run(dp=None, micro_batch=None, steps=STEPS, dtype=dtype)
    return _cache[dtype]


def _job(**kwargs) -> dict:
    return tiny_run(steps=STEPS, **kwargs)


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("dp,accumulation", [(2, 2), (4, 1)])  # the float64 tests below cover more layouts
def test_zero_matches_single_process(pools, zero, dp, accumulation):
    got = pools(dp).run(_job, dp=dp, micro_batch=16 // (dp * accumulation), zero=zero)
    ref = reference()
    for rank_result in got:
        within(rel_diff(rank_result["losses"], ref["losses"]), 1e-5, "loss")  # measured <= 1.6e-7
    for other in got[1:]:  # the all-gather leaves every rank with the same full weights
        assert max_state_diff(other["model"], got[0]["model"]) == 0.0
    within(max_state_diff(got[0]["model"], ref["model"]), 1e-4, "weights")
    within(max_state_diff(got[0]["optimizer"], ref["optimizer"]), 1e-4, "optimizer state")  # full, gathered state


_LAYOUTS = [
    (1, 2, "all_reduce"), (2, 2, "all_reduce"), (1, 2, "reduce_scatter"), (2, 2, "reduce_scatter"),
    (2, 4, "reduce_scatter"), (1, 1, "reduce_scatter"), (2, 1, "all_reduce"),
    (3, 2, "all_reduce"), (3, 2, "reduce_scatter"), (3, 1, "all_reduce"), (3, 4, "reduce_scatter"),
]


# every layout without offload; offload (the same update code on another device) on one layout per stage
@pytest.mark.parametrize("zero,shard_group,grad_reduce,offload",
                         [(*layout, "none") for layout in _LAYOUTS]
                         + [(*_LAYOUTS[i], "optimizer") for i in (0, 3, 6, 10)])
def test_hierarchical_and_primitives_float64(pools, zero, shard_group, grad_reduce, offload):
    got = pools(4).run(_job, dp=4, micro_batch=2, zero=zero, shard_group=shard_group, grad_reduce=grad_reduce,
                       dtype="float64", offload=offload)
    ref = reference("float64")
    within(rel_diff(got[0]["losses"], ref["losses"]), 1e-13, "loss (float64)")
    within(max_state_diff(got[0]["model"], ref["model"]), 1e-12, "weights (float64)")
    within(max_state_diff(got[0]["optimizer"], ref["optimizer"]), 1e-12, "optimizer state (float64)")


def _memory(zero: int, dtype: str) -> dict:
    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=dist.get_world_size(), zero=zero, bucket_mb=0.05))
    model = paratrain.build_gpt(TINY, seed=0, dtype=getattr(torch, dtype))
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    x = torch.randint(0, 256, (2, TINY.seq_len))
    engine.train_step((x, torch.roll(x, -1, 1)), paratrain.lm_loss)  # creates the optimizer state
    groups = len(getattr(engine.grads, "groups", getattr(engine.grads, "buckets", [])))
    return {"report": engine.memory_report(), "groups": groups}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_memory_matches_the_zero_paper(pools, zero):
    """Per-device bytes of ZeRO (Rajbhandari et al. 2020, fig. 1) for fp32 Adam: parameters 4 psi,
    gradients 4 psi, optimizer state K psi with K = 8 (two moments; fp32 weights are their own
    master copy). Baseline: (4 + 4 + 8) psi; P_os: 4 psi + 4 psi + 8 psi / N; P_os+g: 4 psi + 12 psi / N;
    P_os+g+p: 16 psi / N. Up to the padding of each flat group to a multiple of N (at most N - 1
    elements per group)."""
    n = 4
    psi = TINY.num_params()
    got = pools(n).run(_memory, zero, "float32")
    expected = {
        0: {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi},
        1: {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi / n},
        2: {"params": 4 * psi, "grads": 4 * psi / n, "optimizer": 8 * psi / n},
        3: {"params": 4 * psi / n, "grads": 4 * psi / n, "optimizer": 8 * psi / n},
    }[zero]
    for rank_result in got:
        report, groups = rank_result["report"], rank_result["groups"]
        slack = {"params": 4 * (n - 1) * groups, "grads": 4 * (n - 1) * groups,
                 "optimizer": 8 * (n - 1) * groups / n + 4 * groups}  # + Adam's step counter per group
        for key, value in expected.items():
            assert value <= report[key] <= value + slack[key] + 1, (key, report[key], value)


def _save_zero2_load_dp(tmp: str) -> list[float]:
    from paratrain.checkpoint import load_checkpoint, save_checkpoint
    from paratrain.data import GlobalBatchLoader, load_source

    def engine_for(zero: int):
        ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=dist.get_world_size(), zero=zero, bucket_mb=0.05))
        model = paratrain.build_gpt(TINY, seed=2)
        # the same optimizer and clipping as tests.helpers.tiny_run, the reference below
        return ctx, paratrain.parallelize(model, ctx,
                                          optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=0.1),
                                          options=paratrain.EngineOptions(micro_batch=2, grad_clip=1.0))

    source = load_source("builtin")
    ctx, engine = engine_for(2)
    loader = GlobalBatchLoader(source.train, seq_len=TINY.seq_len, global_batch=16, dp=ctx.mesh.degree("dp"),
                               dp_index=ctx.mesh.index("dp"), seed=2)
    for step in range(3):
        engine.set_lr(lr_at(step))
        engine.train_step(loader.next(), paratrain.lm_loss)
    state = engine.state_dict()
    if ctx.is_main:
        save_checkpoint(tmp, 3, state, {"loader": loader.state_dict()})
    dist.barrier()
    ctx2, plain = engine_for(0)
    saved, meta = load_checkpoint(tmp)
    plain.load_state_dict(saved)
    loader.load_state_dict(meta["loader"])
    losses = []
    for step in range(3, 6):
        plain.set_lr(lr_at(step))
        losses.append(plain.train_step(loader.next(), paratrain.lm_loss))
    return losses


def test_zero2_checkpoint_resumes_as_plain_dp(pools, tmp_path):
    """Saved by ZeRO-2 on 2 ranks after 3 steps, resumed as plain DP: steps 4-6 of one uninterrupted run."""
    uninterrupted = tiny_run(dp=None, micro_batch=2, steps=6, seed=2)
    got = pools(2).run(_save_zero2_load_dp, str(tmp_path))[0]
    within(rel_diff(got, uninterrupted["losses"][3:]), 1e-5, "loss")


class _Residual(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(torch.tanh(self.norm(x)))


def _generic_zero3(dp: int | None, wrap, reshard: bool) -> list[float]:
    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=dp, zero=3 if dp else 0))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), *[_Residual(16) for _ in range(3)], torch.nn.Linear(16, 3))
    model = model.double()
    zero = {"wrap": wrap, "reshard_after_forward": reshard} if dp else {}
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2),
                                   options=paratrain.EngineOptions(micro_batch=2, **zero))
    batch = regression_rows(ctx, 6, 3)
    return [engine.train_step(batch, squared_error) for _ in range(5)]


@pytest.mark.parametrize("wrap,reshard", [(_Residual, True), (_Residual, False), (r"[13]", True), (torch.nn.Linear, True)])
def test_zero3_any_module_with_a_wrap_policy(pools, wrap, reshard):
    reference_losses = _generic_zero3(None, None, True)
    for losses in pools(2).run(_generic_zero3, 2, wrap, reshard):
        within(rel_diff(losses, reference_losses), 1e-12, "loss (float64)")


def _volume(zero: int, grad_reduce: str) -> dict:
    """Bytes moved by every collective of one step (after a warm-up step), counted at torch's dispatcher."""
    from paratrain.comm import CollectiveCounter

    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=dist.get_world_size(), zero=zero,
                                                                       grad_reduce=grad_reduce))
    model = paratrain.build_gpt(TINY, seed=0)
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    x = torch.randint(0, 256, (2, TINY.seq_len))
    engine.train_step((x, torch.roll(x, -1, 1)), paratrain.lm_loss)  # warm: prefetch state settles
    with CollectiveCounter() as counter:
        engine.train_step((x, torch.roll(x, -1, 1)), paratrain.lm_loss)
    return dict(counter.volume.bytes)


@pytest.mark.parametrize("zero,grad_reduce,low,high", [
    (0, "auto", 2.0, 2.001),               # all-reduce: 2 psi
    (1, "reduce_scatter", 2.0, 2.01),      # reduce-scatter psi + all-gather psi (+ padding)
    (2, "reduce_scatter", 2.0, 2.01),
    (3, "reduce_scatter", 2.85, 3.01),     # 3 psi, less the root unit's backward all-gather
    (1, "all_reduce", 3.0, 3.01),          # gloo's faster choice: all-reduce 2 psi + all-gather psi
])
def test_communication_volume_per_step(pools, zero, grad_reduce, low, high):
    """Every collective of a step, whoever issued it (gradients, parameters, and the engine's few scalars:
    loss and token totals, the norm), in the ZeRO paper's accounting (section 7), over psi in bytes."""
    psi_bytes = 4 * TINY.num_params()
    volume = pools(2).run(_volume, zero, grad_reduce)[0]
    ratio = sum(volume.values()) / psi_bytes
    assert ratio >= low, (volume, ratio)
    within(ratio, high, "bytes moved / psi")


def _held_between_steps(name: str) -> dict:
    """Live tensor bytes this rank holds after two steps of AdamW on a GPT, paratrain ZeRO-3 or torch FSDP2
    (each block a unit, zero_grad(set_to_none=True)), over what it held before building the model."""
    import torch.nn.functional as F

    from paratrain.config import preset
    from paratrain.memory import live_tensor_bytes

    config = preset("tiny", seq_len=32, n_layer=2, d_model=256, n_head=4)
    batch = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(dist.get_rank()))
    before = live_tensor_bytes()
    model = paratrain.build_gpt(config, seed=0)
    if name == "paratrain":
        ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(zero=3))
        engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        for _ in range(2):
            engine.train_step((batch[:, :-1], batch[:, 1:]), paratrain.lm_loss)
        report = engine.memory_report()
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            F.cross_entropy(model(batch[:, :-1]).reshape(-1, 256), batch[:, 1:].reshape(-1)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        report = None
    return {"held": live_tensor_bytes() - before, "report": report}


@pytest.mark.parametrize("world", [2, 4])
def test_zero3_holds_no_more_than_fsdp2_between_steps(pools, world):
    """Between steps ZeRO-3 holds its parameter shards and AdamW's moments of them, as FSDP2 does; the
    gradient shards are released after each update. Measured: 0.99999x FSDP2's bytes on 2 and on 4 processes
    (the engine's between_steps report is 99.9 % and 99.8 % of them: the rest is the rotary tables and the batch)."""
    ours = pools(world).run(_held_between_steps, "paratrain")
    theirs = pools(world).run(_held_between_steps, "fsdp2")
    for mine, peer in zip(ours, theirs, strict=True):
        assert mine["held"] <= 1.05 * peer["held"], (mine["held"], peer["held"])
        assert mine["report"]["between_steps"] <= mine["held"]  # the model states, of everything held
