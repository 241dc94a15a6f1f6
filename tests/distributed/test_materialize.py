"""A model built on the meta device and materialised piece by piece holds, on every rank and in every
layout, exactly (bitwise) the tensors a whole build gives that rank, and trains the same."""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.data import GlobalBatchLoader, load_source
from paratrain.hybrid.materialize import FromRank0
from paratrain.models import lm_loss
from tests.helpers import TINY


def _pieces(engine: paratrain.Engine) -> dict[str, torch.Tensor]:
    """Every tensor this rank keeps: parameters and buffers, or ZeRO's flat storage and masters."""
    groups = getattr(engine.grads, "groups", [])
    held = {f"group{g.index}/{'flat' if g.persistent else 'shard'}": (g.param_flat if g.persistent else g.shard)
            for g in groups}
    held.update({f"group{g.index}/master": g.master for g in groups if g.own_master})
    if not engine.grads.params_sharded:
        held.update(dict(engine.model.named_parameters()))
    held.update(dict(engine.model.named_buffers()))
    return {k: v.detach().clone() for k, v in held.items()}


def _build(ctx: paratrain.Context, device: str, precision: str, fallback: bool = False,
           model_name: str = "tiny") -> paratrain.Engine:
    config = paratrain.config.preset(model_name, seq_len=32, dropout=0.1)
    init = None
    if fallback:  # a model without param_inits: world rank 0 builds it whole, the others on meta
        whole = paratrain.build_gpt(config, seed=3) if ctx.rank == 0 else None
        init = FromRank0(whole, ctx.mesh, ctx.device)
    model = paratrain.build_gpt(config, seed=3, device=device)
    return paratrain.parallelize(model, ctx, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                                 options=paratrain.EngineOptions(micro_batch=4, precision=precision, seed=3),
                                 init=init)


def materialize_job(*, precision: str = "fp32", fallback: bool = False, model: str = "tiny", **layout) -> dict:
    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(bucket_mb=0.05, **layout))
    whole, meta = _build(ctx, "cpu", precision, model_name=model), _build(ctx, "meta", precision, fallback, model)
    expected, got = _pieces(whole), _pieces(meta)
    assert sorted(got) == sorted(expected), (sorted(got), sorted(expected))
    differ = [k for k in expected if not (expected[k].dtype == got[k].dtype and torch.equal(expected[k], got[k]))]
    source = load_source("builtin")
    losses = []
    for engine in (whole, meta):
        loader = GlobalBatchLoader(source.train, seq_len=TINY.seq_len, global_batch=16, dp=ctx.mesh.degree("dp"),
                                   dp_index=ctx.mesh.index("dp"), seed=3)
        losses.append([engine.train_step(loader.next(), lm_loss) for _ in range(2)])
    after = [k for k, v in _pieces(meta).items() if not torch.equal(v, _pieces(whole)[k])]
    return {"pieces": len(expected), "differ": differ, "losses": losses, "after": after}


@pytest.mark.parametrize("layout", [
    dict(dp=4, zero=3, precision="bf16"),  # shards in bf16 and float32 masters of a freed flat
    dict(dp=2, pp=2, zero=1, precision="bf16"),  # the head's tied copy on the last stage
    dict(tp=2, pp=2, schedule="interleaved", virtual_stages=2, sequence_parallel=True),  # SP's gradient hooks
    dict(dp=4, zero=2, offload="optimizer"),  # masters on the CPU, apart from the shard
    dict(tp=2, pp=2, fallback=True),  # FromRank0: broadcast along each axis
    dict(dp=2, ep=2, tp=2, model="tiny-moe"),  # each ep rank fills its experts' slice
    dict(dp=2, ep=2, tp=2, expert_tp=True, sequence_parallel=True, zero=1, model="tiny-moe"),  # cut along 2 dims
    dict(tp=4, tp_mode="2d", zero=1, precision="bf16"),  # a 2 x 2 grid's blocks, cut two ways, into flat shards
], ids=lambda layout: "-".join(f"{k}{v}" for k, v in layout.items()))
def test_meta_build_holds_the_whole_builds_pieces_bitwise(pools, layout):
    results = pools(4).run(materialize_job, **layout)
    for rank, result in enumerate(results):
        assert result["pieces"] > 0
        assert result["differ"] == [], f"rank {rank}: {result['differ'][:5]}"
        whole, meta = result["losses"]
        assert whole == meta, f"rank {rank}: losses {whole} (whole build) vs {meta} (meta)"
        assert result["after"] == [], f"rank {rank}: after two steps {result['after'][:5]}"
