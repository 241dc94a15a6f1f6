"""The CUDA path (NCCL backend, bf16, MFU): run on a machine with an NVIDIA GPU; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.config import preset
from paratrain.train.metrics import peak_flops

pytestmark = pytest.mark.gpu


def test_single_gpu_bf16_step_learns():
    ctx = paratrain.init(device="cuda")
    assert ctx.device.type == "cuda"
    config = preset("small")
    model = paratrain.build_gpt(config, seed=0)
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                                   options=paratrain.EngineOptions(precision="bf16", micro_batch=8))
    x = torch.randint(0, 256, (16, config.seq_len), generator=torch.Generator().manual_seed(0))
    losses = [engine.train_step((x, torch.roll(x, -1, 1)), paratrain.lm_loss) for _ in range(20)]
    assert next(model.parameters()).device.type == "cuda"
    assert losses[-1] < losses[0] - 1.0


def test_known_gpu_has_a_peak():
    name = torch.cuda.get_device_name(0)
    if not any(key in name for key in ("H100", "H200", "A100", "L40S", "A10", "V100")):
        pytest.skip(f"no peak FLOP/s on record for {name}")
    assert peak_flops(torch.device("cuda", 0)) > 1e14


def test_keyed_dropout_draws_the_same_bits_on_cuda():
    """Dropout masks are a pure function of (key, index), computed in int64 without overflow: a GPU
    rank and a CPU rank (or the CPU reference) draw the same mask."""
    from paratrain.rng import hashed_uniform

    index = torch.arange(1 << 20) * 7919 + (1 << 33)
    assert torch.equal(hashed_uniform(99, index.cuda()).cpu(), hashed_uniform(99, index))


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_step_that_does_not_log_never_waits_for_the_gpu(optimizer):
    """Engine.step queues the whole step: CUDA's sync debug mode raises on any synchronisation (Muon's matrix
    exchange had one, a repeat_interleave without output_size, until an H200 run found it)."""
    from paratrain.optim import MuonFactory, MuonSettings

    ctx = paratrain.init(device="cuda")
    config = preset("small", n_layer=24)  # 24 blocks: more than FEW_SPANS spans of matrices, Muon's indexed path
    model = paratrain.build_gpt(config, seed=0)
    factory = (MuonFactory(MuonSettings(lr=1e-3)) if optimizer == "muon"
               else lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True))
    engine = paratrain.parallelize(model, ctx, optimizer=factory,
                                   options=paratrain.EngineOptions(precision="bf16", micro_batch=4, grad_clip=1.0))
    x = torch.randint(0, 256, (8, config.seq_len + 1), generator=torch.Generator().manual_seed(0)).cuda()
    batch = (x[:, :-1], x[:, 1:])
    engine.step(batch, paratrain.lm_loss).stats()  # buffers and optimizer state exist from here on
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = [engine.step(batch, paratrain.lm_loss) for _ in range(3)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert pending[-1].stats().loss < pending[0].stats().loss


def _cuda_run(compile: bool, recompute: str = "none", steps: int = 5) -> list[float]:
    ctx = paratrain.init(device="cuda")
    config = preset("small", dropout=0.0)
    model = paratrain.build_gpt(config, seed=0)
    engine = paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                   options=paratrain.EngineOptions(micro_batch=4, grad_clip=1.0, compile=compile,
                                                                   recompute=recompute))
    x = torch.randint(0, 256, (8, config.seq_len + 1), generator=torch.Generator().manual_seed(0)).cuda()
    return [engine.train_step((x[:, :-1], x[:, 1:]), paratrain.lm_loss) for _ in range(steps)]


def test_compiled_blocks_match_eager_on_cuda():
    """float32 on the GPU, eager vs inductor's Triton kernels (TF32 off: torch's default for matmuls)."""
    eager = _cuda_run(False)
    for recompute in ("none", "full"):
        compiled = _cuda_run(True, recompute)
        worst = max(abs(a - b) / abs(b) for a, b in zip(compiled, eager))
        print(f"compiled ({recompute}) vs eager on cuda: worst relative loss difference {worst:.2e}")
        assert worst < 1e-5



def test_memory_snapshot_writes_the_allocator_history_on_cuda(tmp_path):
    """--memory-snapshot 2 on one GPU: the allocator's history (a pickle memory_viz reads) and the JSON of measured
    memory beside the planner's prediction, whose model states equal the engine's report."""
    import json
    import pickle
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "paratrain", "train", "--nproc", "1", "--device", "cuda", "--model",
                          "tiny", "--steps", "3", "--eval-every", "0", "--sample-tokens", "0", "--no-progress",
                          "--memory-snapshot", "2", "--profile-dir", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "rank0-step2.memory.json").read_text())
    assert report["measured"]["peak_allocated"] > 0
    for part in ("params", "grads", "optimizer"):
        assert report["measured"][part] == report["predicted"][part]
    with open(tmp_path / "rank0-step2.pickle", "rb") as snapshot:
        assert "segments" in pickle.load(snapshot)
