"""paratrain's tensor parallelism against torch's DTensor tensor parallel (parallelize_module) as a peer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.helpers import LR, TINY, lr_at, rel_diff, tiny_run
from tests.margins import within

STEPS = 10


def dtensor_run(steps: int = STEPS, seed: int = 7, global_batch: int = 16) -> list[float]:
    """The tiny GPT under torch's DTensor TP (Megatron layout on the blocks; embedding, head and norms
    replicated), torch's AdamW and norm clipping at 1, the tests' learning rate, the same data: per-step losses."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import paratrain
    from paratrain.data import GlobalBatchLoader, load_source

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = paratrain.build_gpt(TINY, seed=seed)
    plan = {"blocks.*.attn.qkv": ColwiseParallel(), "blocks.*.attn.out": RowwiseParallel(),
            "blocks.*.mlp.up": ColwiseParallel(), "blocks.*.mlp.down": RowwiseParallel()}
    parallelize_module(model, mesh, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    loader = GlobalBatchLoader(load_source("builtin").train, seq_len=TINY.seq_len, global_batch=global_batch,
                               dp=1, dp_index=0, seed=seed)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        loss_sum, count = paratrain.lm_loss(model, loader.next())
        loss = loss_sum / count
        loss.backward()
        # torch's clip_grad_norm_ refuses a mix of DTensor and plain gradients: the same rule by hand
        grads = [p.grad for p in model.parameters()]
        norm = sum(float((g.full_tensor() if hasattr(g, "full_tensor") else g).double().pow(2).sum())
                   for g in grads) ** 0.5
        for g in grads:
            g.mul_(min(1.0, 1.0 / (norm + 1e-6)))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return losses


def _both() -> dict:
    return {"dtensor": dtensor_run(), "paratrain": tiny_run(dp=1, tp=dist.get_world_size(), micro_batch=None,
                                                           steps=STEPS)["losses"]}


def test_same_losses_as_dtensor_tensor_parallel(pools):
    ref = tiny_run(dp=None, micro_batch=None, steps=STEPS)["losses"]
    for tp in (2, 4):
        got = pools(tp).run(_both)[0]
        within(rel_diff(got["dtensor"], ref), 1e-5, f"DTensor loss vs 1 process, tp {tp}")  # the peer agrees with the single process ...
        within(rel_diff(got["paratrain"], got["dtensor"]), 1e-5, f"loss vs DTensor, tp {tp}")  # ... and with us
