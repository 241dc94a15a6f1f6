"""Jobs and references shared by the distributed tests. Module level, so pool workers can import them."""

from __future__ import annotations

import math
from typing import Any

import torch

import paratrain
from paratrain.config import preset
from paratrain.data import GlobalBatchLoader, load_source
from paratrain.models import lm_loss
from tests.margins import within

TINY = preset("tiny", seq_len=32)

LR, WARMUP = 1e-3, 10
"""The parity tests' recipe: AdamW at lr 1e-3, warmed up linearly over 10 steps (the tests' horizon).
Without warmup Adam's first steps move every weight by about lr whatever its gradient's size, which
amplifies rounding: in ONE process, accumulation 2 vs none (only the summation order differs) drifted
from 2e-16 to 4.5e-13 by step 20 in float64 at lr 3e-3 (AMD EPYC, avx2) and to 8e-3 by step 9 in
float32 on an Intel Xeon (avx512); at 1e-3 without warmup the 6-layer model's grad norm still jumped
to 3.3e-13 (float64) / 5e-5 (float32) at step 10. With this recipe steps 1-10 stay at 2-3e-16
(float64) and 3e-7 (float32), 4 and 6 layers, avx2 and default kernels. tests/unit/test_recipe.py
keeps it so."""


def lr_at(step: int, lr: float = LR, warmup: int = WARMUP) -> float:
    """The recipe's learning rate at optimizer step `step` (0-based)."""
    return lr * min(1.0, (step + 1) / warmup) if warmup else lr


def tiny_run(*, dp: int | None, micro_batch: int | None, steps: int = 10, global_batch: int = 16,
             dtype: str = "float32", seed: int = 7, lr: float = LR, grad_clip: float = 1.0,
             recompute: bool | str = False, bucket_mb: float = 0.05, zero: int = 0, shard_group: int | None = None,
             grad_reduce: str = "auto", offload: str = "none", tp: int = 1, sequence_parallel: bool = False,
             dropout: float = 0.0, start: dict[str, Any] | None = None, start_step: int = 0,
             return_state: bool = False, pp: int = 1, schedule: str = "1f1b", virtual_stages: int = 1,
             pp_split: tuple[int, ...] = (), n_layer: int = 4, warmup: int = WARMUP,
             compile: bool | str = False, save_sharded: str | None = None, load_sharded: str | None = None,
             precision: str = "fp32", ep: int = 1, model: str = "tiny", overrides: tuple[tuple[str, Any], ...] = (),
             cp: int = 1, cp_mode: str = "ring", cp_ulysses: int = 1, ps_mode: str = "off", ps_servers: int = 0,
             staleness: int = 0, ps_sparse: tuple[str, ...] = (), optimizer: str = "adamw",
             expert_tp: bool = False, keep_grads: bool = False, tp_mode: str = "1d",
             tp_depth: int = 1, routing_ids: bool = False) -> dict[str, Any]:
    """Train the tiny GPT `steps` steps on the built-in corpus under a layout; per-step losses and
    grad norms, and the final full state. dp None: the single-process reference (no process group).
    start, start_step: resume from a full state (engine.state_dict()) taken after start_step steps.
    save_sharded / load_sharded: a root to write a sharded checkpoint into at the end / read the newest
    one from first (paratrain.checkpoint.sharded; start_step must then be the step it was saved at).
    model, overrides: another preset (tiny-moe) and ModelConfig fields to change, as (name, value) pairs.
    ps_mode, ps_servers, staleness, ps_sparse: the parameter server (a dedicated server rank serves and returns
    its pushes; a trainer returns the sparse rows' bytes it pushed). optimizer: "adamw" (weight decay 0.1) or
    "sgd" (plain: no momentum, no weight decay) or "adagrad" (no weight decay, eps 1e-2) or "muon" (Muon on the
    matrices, Moonshot's lr match, AdamW on the embedding and vectors). routing_ids: every token's chosen experts
    at every step (RoutingProbe)."""
    torch.manual_seed(12345)  # must not matter: init and data order are keyed
    ctx = paratrain.init(device="cpu", config=paratrain.ParallelConfig(dp=dp, tp=tp, sequence_parallel=sequence_parallel, pp=pp,
                                                  schedule=schedule, virtual_stages=virtual_stages, pp_split=pp_split,
                                                  bucket_mb=bucket_mb, zero=zero, shard_group=shard_group,
                                                  grad_reduce=grad_reduce, offload=offload, ep=ep, cp=cp,
                                                  cp_mode=cp_mode, cp_ulysses=cp_ulysses, ps_mode=ps_mode,
                                                  ps_servers=ps_servers,
                                                  staleness=staleness, ps_sparse=ps_sparse,
                                                  expert_tp=expert_tp, keep_grads=keep_grads, tp_mode=tp_mode,
                                                  tp_depth=tp_depth))
    config = (preset(model, seq_len=32, dropout=dropout, n_layer=n_layer, **dict(overrides))
              if dropout or n_layer != 4 or model != "tiny" or overrides else TINY)
    gpt = paratrain.build_gpt(config, seed=seed, dtype=getattr(torch, dtype))

    def element_wise(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr)
        if optimizer == "adagrad":
            # eps 1e-2: g / (sqrt(sum g^2) + eps) with the default 1e-10 turns a gradient's last bits near
            # zero into a whole step (it amplifies rounding: 3.1e-13 against dense with default kernels)
            return torch.optim.Adagrad(params, lr=lr, eps=1e-2)
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.1)

    make_optimizer: Any = element_wise
    if optimizer == "muon":  # Newton-Schulz in float64 for float64 runs (exactness), torch's bfloat16 otherwise
        from paratrain.optim import AdamWSettings, MuonFactory, MuonSettings

        make_optimizer = MuonFactory(MuonSettings(lr=lr, adjust_lr_fn="match_rms_adamw",
                                                  ns_dtype=torch.float64 if dtype == "float64" else torch.bfloat16),
                                     AdamWSettings(weight_decay=0.1))
    options = paratrain.EngineOptions(micro_batch=micro_batch, grad_clip=grad_clip, recompute=recompute, seed=seed,
                                      compile=compile, precision=precision)
    if ctx.is_server:
        served = paratrain.serve(gpt, ctx, optimizer=make_optimizer, options=options, save=save_sharded or "",
                                 resume=load_sharded or "")
        return {"server": True, "pushes": served.pushes}
    engine = paratrain.parallelize(gpt, ctx, optimizer=make_optimizer, options=options)
    probe = RoutingProbe(engine) if routing_ids else None
    source = load_source("builtin")
    loader = GlobalBatchLoader(source.train, seq_len=TINY.seq_len, global_batch=global_batch,
                               dp=ctx.mesh.degree("dp"), dp_index=ctx.mesh.index("dp"), seed=seed)
    bytes_read = None
    if start is not None:
        engine.load_state_dict(start)
        loader.load_state_dict({"epoch": 0, "cursor": start_step * global_batch})
    if load_sharded is not None:
        from paratrain.checkpoint import resolve_checkpoint, verify_shared
        from paratrain.checkpoint.sharded import load_sharded as load

        folder = resolve_checkpoint(load_sharded)
        meta = verify_shared(folder)  # as the trainer: each rank hashes a share of the files
        assert meta["step"] == start_step
        bytes_read = load(folder, meta, engine.view()).bytes_read
        loader.load_state_dict({"epoch": 0, "cursor": start_step * global_batch})
    losses, norms, routing = [], [], []
    for step in range(start_step, start_step + steps):
        engine.set_lr(lr_at(step, lr, warmup))
        losses.append(engine.train_step(loader.next(), lm_loss))
        assert engine.last is not None
        norms.append(engine.last.grad_norm)
        routing.append(engine.last.moe)
    if save_sharded is not None:
        from paratrain.checkpoint.sharded import save_sharded as save

        engine.before_save(start_step + steps)
        save(save_sharded, start_step + steps, engine.view(), {})
    engine.close()
    state = engine.state_dict()
    moments = {f"{name}::{key}": value.clone() for name, values in state["optimizer"]["state"].items()
               for key, value in values.items() if isinstance(value, torch.Tensor)}
    return {"losses": losses, "grad_norms": norms, "routing": routing, "state": state if return_state else None,
            # this rank's own tensors (ZeRO-3 frees them between steps: none then)
            "local": {} if engine.grads.params_sharded else {n: p.detach().clone()
                                                             for n, p in engine.model.named_parameters()},
            "model": {k: v.clone() for k, v in state["model"].items()}, "optimizer": moments,
            "memory": engine.memory_report(), "bytes_read": bytes_read,
            "sparse_bytes": getattr(engine.grads, "sparse_bytes", None),
            "launched_during_backward": getattr(engine.grads, "launched_during_backward", None),
            "matrix_traffic": engine.update.matrices.traffic() if getattr(engine.update, "matrices", None) else None,
            "owner_flops": engine.update.matrices.owner_flops if getattr(engine.update, "matrices", None) else None,
            "exchange_peak": engine.update.matrices.peak_bytes() if getattr(engine.update, "matrices", None) else None,
            "buckets": len(getattr(engine.grads, "buckets", getattr(engine.grads, "groups", []))),
            "timeline": engine.pipeline.times if engine.pipeline is not None else None,
            "routing_ids": probe.chosen if probe is not None else None}


class RoutingProbe:
    """Every token's chosen experts (before capacity) at every training forward of every MoE layer on this rank:
    (step, layer, global row, global position) -> the k expert ids, in choice order. Under cp or sequence
    parallelism the layer's split gives its tokens' positions; the rows are where the engine's dropout stream says the
    micro-batch starts. Recomputations in backward are left out."""

    def __init__(self, engine: Any) -> None:
        from paratrain.nn.moe import MoE

        self.engine = engine
        self.chosen: dict[tuple[int, str, int, int], tuple[int, ...]] = {}
        for name, module in engine.model.named_modules():
            if isinstance(module, MoE):
                module.router.register_forward_hook(self._hook(name, module))

    def _hook(self, name: str, moe: Any) -> Any:
        def record(router: Any, args: Any, routing: Any) -> None:
            if not moe.training or torch._C._current_graph_task_id() != -1:
                return
            expert = routing.expert.detach().cpu()
            rows, length = expert.shape[:2]
            positions = (moe.sequence.positions(length, torch.device("cpu")).tolist() if moe.sequence is not None
                         else list(range(length)))
            stream = self.engine.dropout
            for b in range(rows):
                for s, position in enumerate(positions):
                    key = (stream.step, name, stream.row_offset + b, int(position))
                    ids = tuple(expert[b, s].tolist())
                    assert self.chosen.setdefault(key, ids) == ids, key
        return record


def merged_routing(ranks: list[dict[str, Any]]) -> dict[tuple[int, str, int, int], tuple[int, ...]]:
    """The ranks' RoutingProbe records as one (a token routed on two ranks, as tp without sequence parallelism
    routes it, must have chosen alike on both)."""
    out: dict[tuple[int, str, int, int], tuple[int, ...]] = {}
    for rank in ranks:
        for key, ids in rank["routing_ids"].items():
            assert out.setdefault(key, ids) == ids, key
    return out


def plain_token_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, logits: torch.Tensor,
                     labels: torch.Tensor, lr: float) -> tuple[float, float]:
    """One step of the plain-PyTorch oracle of a language model, as the engine counts it: the *sum* of the token
    cross-entropies backpropagated (labels -100 left out), the gradients divided by the token count, AdamW at lr.
    -> (mean loss, gradient norm)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                              reduction="sum")
    count = int((labels != -100).sum())
    optimizer.zero_grad()
    total.backward()
    for p in model.parameters():
        p.grad /= count
    norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
    optimizer.step()
    return total.item() / count, norm


def rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b, strict=True))


def max_state_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def squared_error(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """A loss_fn for plain regression models: (sum of squared errors, number of terms)."""
    inputs, targets = batch
    return ((model(inputs) - targets) ** 2).sum(), targets.numel()


def regression_rows(ctx: paratrain.Context, inputs: int, outputs: int, rows: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """This dp rank's slice of a fixed float64 regression batch of `rows` rows (same on every layout)."""
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(rows, inputs, generator=generator, dtype=torch.float64)
    y = torch.randn(rows, outputs, generator=generator, dtype=torch.float64)
    per_rank = rows // ctx.mesh.degree("dp")
    lo = ctx.mesh.index("dp") * per_rank
    return x[lo: lo + per_rank], y[lo: lo + per_rank]


_REFERENCES: dict[tuple, dict[str, Any]] = {}


def reference_run(steps: int = 10, **kwargs: Any) -> dict[str, Any]:
    """The single-process tiny_run (cached per process), the oracle of the parity tests."""
    key = (steps, tuple(sorted(kwargs.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = tiny_run(dp=None, micro_batch=None, steps=steps, **kwargs)
    return _REFERENCES[key]


def ranked_run(**kwargs: Any) -> dict[str, Any]:
    """tiny_run on a pool rank, tagged with the rank (results come back in rank order)."""
    import torch.distributed as dist

    return {**tiny_run(**kwargs), "rank": dist.get_rank()}


def assert_matches_reference(got: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    """Every rank's per-step losses and grad norms match the single process (float32, relative 1e-5),
    and the whole gathered state (weights and optimizer state) is within 1e-4."""
    for rank_result in got:
        # Worst measured (docs/testing.md: avx2 and default kernels, 1 and 2 reference threads): step-1
        # loss 4.3e-8 (a forward from the same weights), loss 1.6e-7, grad norm 7.9e-7 (already at step 1:
        # a float32 sum of squares in another order), weights 1.4e-6, optimizer state 1e-8.
        within(rel_diff(rank_result["losses"][:1], ref["losses"][:1]), 1e-6, "step-1 loss")
        within(rel_diff(rank_result["losses"], ref["losses"]), 1e-5, "loss")
        within(rel_diff(rank_result["grad_norms"], ref["grad_norms"]), 1e-5, "grad norm")
    within(max_state_diff(got[0]["model"], ref["model"]), 1e-4, "weights")
    within(max_state_diff(got[0]["optimizer"], ref["optimizer"]), 1e-4, "optimizer state")
