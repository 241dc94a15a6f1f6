"""Float8's pieces in one process: power-of-two scales, the kernel against a dequantised reference, the rules."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from paratrain.config import ConfigError, ModelConfig, ParallelConfig
from paratrain.config.model_rules import check_float8
from paratrain.config.run import FP8_RECIPES, PRECISIONS
from paratrain.memory import FLOAT8_RECIPES, POLICIES, Float8Settings, ScaleLog, apply_float8
from paratrain.memory.float8 import Float8Linear
from paratrain.memory.float8_linears import float8_linears
from paratrain.nn.kernels import power_of_two_scale
from paratrain.nn.kernels import KernelLinear


def test_the_names_agree():
    assert PRECISIONS == tuple(POLICIES) and FP8_RECIPES == tuple(FLOAT8_RECIPES)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_power_of_two_scales_are_the_largest_that_fit(dtype):
    """s = 2^k with amax * s <= the format's max < amax * 2s, exactly, over magnitudes from 2^-100 to 2^100 and
    the format's max itself (amax 0: 1)."""
    top = torch.finfo(dtype).max
    amax = torch.cat([torch.logspace(-100, 100, 20001, base=2.0), torch.tensor([top, top * (1 - 2**-20), 0.0])])
    scale = power_of_two_scale(amax, dtype)
    assert torch.equal(torch.frexp(scale)[0], torch.full_like(scale, 0.5))  # powers of two
    fits = amax.double() * scale.double() <= top
    assert fits.all()
    assert (amax[:-1].double() * 2 * scale[:-1].double() > top).all()
    assert scale[-1] == 1


@pytest.mark.parametrize("recipe", list(FLOAT8_RECIPES))
def test_the_kernel_is_its_dequantised_reference(recipe):
    """Forward and both gradients equal the float64 products of the dequantised operands (float32 accumulation's
    rounding apart), and the linear learns as nn.Linear does within float8's error."""
    torch.manual_seed(0)
    dense = nn.Linear(64, 48)
    x = torch.randn(3, 16, 64, requires_grad=True)
    log = ScaleLog()
    layer = KernelLinear(dense, Float8Linear(FLOAT8_RECIPES[recipe], "layer", log=log))
    g = torch.randn(3, 16, 48)
    y = layer(x)
    y.backward(g)
    spec = FLOAT8_RECIPES[recipe]

    def dequantised(t: torch.Tensor, dtype: torch.dtype, rows: bool) -> torch.Tensor:
        amax = t.abs().amax(dim=1, keepdim=True) if rows else t.abs().amax()
        s = power_of_two_scale(amax, dtype)
        return (t * s).to(dtype).double() / s.double()

    flat, w, gf = x.detach().reshape(-1, 64), dense.weight.detach(), g.reshape(-1, 48)
    rows = spec.rowwise
    want_y = dequantised(flat, spec.forward, rows) @ dequantised(w, spec.forward, rows).t() + dense.bias.double()
    want_dx = dequantised(gf, spec.gradient, rows) @ dequantised(w.t(), spec.forward, rows).t()
    want_dw = dequantised(gf.t(), spec.gradient, rows) @ dequantised(flat.t(), spec.forward, rows).t()
    for got, want in ((y.reshape(-1, 48), want_y), (x.grad.reshape(-1, 64), want_dx), (dense.weight.grad, want_dw)):
        assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    dense_y = nn.functional.linear(x, dense.weight, dense.bias)
    assert float((y - dense_y).detach().norm() / dense_y.detach().norm()) < 0.08  # e4m3's 3 mantissa bits
    assert [entry[:2] for entry in log.take()] == ([("layer", "x"), ("layer", "w"), ("layer", "g")] if not rows else
                                                    [("layer", o) for o in ("x", "w", "g", "w_t", "g_t", "x_t")])


def test_which_linears_become_float8():
    """The blocks' nn.Linear layers, not the head, nor what the skip regex or `dense` (a plan's partial_linear) name;
    the Parameters stay the same; none found is refused (fp8 would change nothing)."""
    block = nn.ModuleDict({"up": nn.Linear(32, 64), "gate": nn.Linear(32, 16), "down": nn.Linear(64, 32)})
    model = nn.ModuleDict({"blocks": nn.ModuleList([block]), "head": nn.Linear(32, 64)})
    before = {name: id(p) for name, p in model.named_parameters()}
    chosen = float8_linears(model, r"blocks\.\d+", Float8Settings(), parts=1, dense=frozenset({"blocks.0.down"}))
    assert chosen == ["blocks.0.up"]
    apply_float8(model, Float8Settings(), {name: () for name in chosen})
    assert isinstance(model["blocks"][0]["up"], KernelLinear) and type(model["head"]) is nn.Linear
    assert type(model["blocks"][0]["down"]) is nn.Linear
    assert {name: id(p) for name, p in model.named_parameters()} == before
    with pytest.raises(ConfigError, match="multiple of 16 in each of the 2 slices"):
        float8_linears(model, r"blocks\.\d+", Float8Settings(skip="up"), parts=2)  # gate: [16, 32]
    with pytest.raises(ConfigError, match="found no nn.Linear in the blocks"):
        float8_linears(model, r"blocks\.\d+", Float8Settings(skip="."), parts=1)


def test_the_rules_before_launch():
    small = ModelConfig(d_model=64, n_head=4)
    check_float8(small, ParallelConfig(tp=2), "fp8")
    with pytest.raises(ConfigError, match="multiple of 16 in each of the 8 slices"):
        check_float8(small, ParallelConfig(tp=8), "fp8")
    check_float8(small, ParallelConfig(tp=4, tp_mode="2d"), "fp8")
    with pytest.raises(ConfigError, match="tp_mode 3d"):
        check_float8(small, ParallelConfig(tp=8, tp_mode="3d"), "fp8")
    check_float8(small, ParallelConfig(tp=8), "bf16")
    with pytest.raises(ValueError, match="fp8 recipe must be one of tensorwise, rowwise"):
        Float8Settings(recipe="blockwise")




def test_the_planner_prices_float8():
    """On an H100 profile fp8 prices the blocks' linears at twice the 16-bit rate plus their casts: faster than bf16,
    slower than the linears' time halved; an A100 (no float8) and a grid are refused with the rule."""
    from paratrain.config import preset
    from paratrain.planner.hardware import PROFILES
    from paratrain.planner.layout import Layout
    from paratrain.planner.settings import PRICED
    from paratrain.planner.timing import step_time

    model, layout = preset("gpt3-xl"), Layout.of(dp=8, zero=3, micro_batch=4)
    times = {p: step_time(model, layout, PROFILES["h100-80gb"], global_batch=64, seq=2048,
                          settings=replace(PRICED, precision=p))
             for p in ("bf16", "fp8")}
    gemms = times["bf16"].terms["compute: GEMMs"]
    assert times["fp8"].terms["compute: GEMMs"] < gemms
    assert times["fp8"].terms["compute: memory-bound ops"] > times["bf16"].terms["compute: memory-bound ops"]
    assert times["bf16"].step_s - gemms / 2 < times["fp8"].step_s < times["bf16"].step_s
    with pytest.raises(ConfigError, match="a100-80gb does not have"):
        step_time(model, layout, PROFILES["a100-80gb"], global_batch=64, seq=2048,
                  settings=replace(PRICED, precision="fp8"))
    with pytest.raises(ConfigError, match="tp_mode 3d"):
        step_time(model, Layout.of(tp=8, tp_mode="3d", micro_batch=8), PROFILES["h100-80gb"], global_batch=64,
                  seq=2048, settings=replace(PRICED, precision="fp8"))


def test_compiled_blocks_trace_the_float8_kernel():
    """One process, nothing to reduce: torch.compile traces the float8 product into each block's graph (no break) and
    gives eager's losses."""
    import paratrain
    from paratrain.data import GlobalBatchLoader, load_source
    from tests.helpers import LR, TINY
    from torch._dynamo.utils import counters

    def run(compile: bool | str) -> list[float]:
        model = paratrain.build_gpt(TINY, seed=1)
        engine = paratrain.parallelize(model, paratrain.init(device="cpu"),
                                       optimizer=lambda ps: torch.optim.AdamW(ps, lr=LR),
                                       options=paratrain.EngineOptions(micro_batch=8, precision="fp8", compile=compile))
        loader = GlobalBatchLoader(load_source("builtin").train, seq_len=TINY.seq_len, global_batch=8, dp=1,
                                   dp_index=0, seed=1)
        return [engine.train_step(loader.next(), paratrain.lm_loss) for _ in range(2)]

    counters.clear()
    assert run("aot_eager") == run(False)
    assert not counters["graph_break"], dict(counters["graph_break"])
