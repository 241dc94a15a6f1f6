"""Each tensor-parallel layer against its dense counterpart: forward, input and weight gradients (float64)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.comm.volume import CollectiveCounter
from paratrain.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from paratrain.topology import AxisGroup
from tests.margins import within

B, S, D, F_HIDDEN, V = 2, 8, 16, 32, 24


def _tp_group() -> AxisGroup:
    ranks = list(range(dist.get_world_size()))
    return AxisGroup("tp", tuple(ranks), dist.get_rank(), dist.new_group(ranks))


def _slice(t: torch.Tensor, dim: int, group: AxisGroup) -> torch.Tensor:
    part = t.shape[dim] // group.size
    return t.narrow(dim, group.index * part, part)


def _dense_mlp() -> tuple[nn.Linear, nn.Linear, torch.Tensor]:
    torch.manual_seed(0)
    up, down = nn.Linear(D, F_HIDDEN).double(), nn.Linear(F_HIDDEN, D).double()
    return up, down, torch.randn(B, S, D, dtype=torch.float64)


def _max_diff(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    return max(float((a - b).abs().max()) for a, b in pairs)


def _mlp(sequence_parallel: bool) -> float:
    group = _tp_group()
    up, down, x = _dense_mlp()
    column = ColumnParallelLinear(up, group, sequence_parallel=sequence_parallel)
    row = RowParallelLinear(down, group, sequence_parallel=sequence_parallel)
    x_dense = x.clone().requires_grad_()
    y_dense = down(F.gelu(up(x_dense)))
    y_dense.pow(2).sum().backward()
    # sequence parallel: each rank holds its slice of the sequence, in and out
    x_tp = (_slice(x, 1, group) if sequence_parallel else x).clone().requires_grad_()
    y_tp = row(F.gelu(column(x_tp)))
    y_tp.pow(2).sum().backward()
    expected_y = _slice(y_dense, 1, group) if sequence_parallel else y_dense
    expected_dx = _slice(x_dense.grad, 1, group) if sequence_parallel else x_dense.grad
    # in sequence-parallel mode the loss is a sum of per-rank pieces: weight grads are partial sums
    weights = [column.weight.grad, column.bias.grad, row.weight.grad, row.bias.grad]
    if sequence_parallel:
        for grad in (row.bias.grad,):  # replicated parameters: their gradient is summed over tp
            dist.all_reduce(grad, group=group.pg)
    return _max_diff([
        (y_tp, expected_y), (x_tp.grad, expected_dx),
        (weights[0], _slice(up.weight.grad, 0, group)), (weights[1], _slice(up.bias.grad, 0, group)),
        (weights[2], _slice(down.weight.grad, 1, group)), (weights[3], down.bias.grad),
    ])


def _gather_and_scatter() -> float:
    group = _tp_group()
    up, _, x = _dense_mlp()
    column = ColumnParallelLinear(up, group, gather_output=True)
    row_full = nn.Linear(F_HIDDEN, D).double()
    row = RowParallelLinear(row_full, group, input_is_parallel=False)
    x_dense, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    row_full(up(x_dense)).sum().backward()
    y = row(column(x_tp))
    y.sum().backward()
    return _max_diff([(y, row_full(up(x))), (x_tp.grad, x_dense.grad)])


def _embedding() -> float:
    group = _tp_group()
    torch.manual_seed(1)
    full = nn.Embedding(V, D).double()
    ids = torch.randint(0, V, (B, S))
    tp = VocabParallelEmbedding(full, group)
    full(ids).pow(2).sum().backward()
    out = tp(ids)
    out.pow(2).sum().backward()
    return _max_diff([(out, full(ids)), (tp.weight.grad, _slice(full.weight.grad, 0, group))])


def _cross_entropy() -> float:
    group = _tp_group()
    torch.manual_seed(2)
    logits = torch.randn(B * S, V, dtype=torch.float64)
    targets = torch.randint(0, V, (B * S,))
    targets[:3] = -100
    dense = logits.clone().requires_grad_()
    expected = F.cross_entropy(dense, targets, reduction="none", ignore_index=-100)
    (expected * torch.arange(B * S, dtype=torch.float64)).sum().backward()  # a non-uniform upstream grad
    local = _slice(logits, 1, group).clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, targets, group)
    (loss * torch.arange(B * S, dtype=torch.float64)).sum().backward()
    return _max_diff([(loss, expected), (local.grad, _slice(dense.grad, 1, group))])


def _cross_entropy_padded(dtype_name: str, vocab_size: int, chunk_rows: int | None) -> tuple[float, float]:
    """Padded vocabulary (columns >= vocab_size out of the softmax), ignored targets, row chunks:
    (max loss difference, max logits-gradient difference) against F.cross_entropy on the float32
    (or float64) upcast of the same logits' real columns; bf16 gradients are compared in bf16 ulps."""
    group = _tp_group()
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(3)
    logits = (torch.randn(B * S, V, dtype=torch.float64) * 4).to(dtype)
    targets = torch.randint(0, vocab_size, (B * S,))
    targets[1::5] = -100
    weights = torch.arange(B * S, dtype=torch.float64) / (B * S)  # a non-uniform upstream grad
    dense = logits.clone().requires_grad_()
    expected = F.cross_entropy(dense.to(torch.promote_types(dtype, torch.float32))[:, :vocab_size], targets,
                               reduction="none", ignore_index=-100)
    (expected * weights.to(expected.dtype)).sum().backward()
    local = _slice(logits, 1, group).clone().requires_grad_()
    with CollectiveCounter() as counter:
        loss = vocab_parallel_cross_entropy(local, targets, group, vocab_size=vocab_size, chunk_rows=chunk_rows)
    assert counter.calls == [("all_reduce", B * S)] * 3, counter.calls  # max, sum, target: per call, not chunk
    (loss * weights.to(loss.dtype)).sum().backward()
    assert loss.dtype == expected.dtype and local.grad.dtype == dtype
    expected_grad = _slice(dense.grad, 1, group)
    if dtype == torch.bfloat16:
        a, b = local.grad.float(), expected_grad.float()
        _, exponent = torch.frexp(torch.maximum(a.abs(), b.abs()))
        grad_diff = float(((a - b).abs() / torch.ldexp(torch.ones_like(a), exponent - 8)).max())
    else:
        grad_diff = _max_diff([(local.grad, expected_grad)])
    return float((loss - expected).abs().max()), grad_diff


@pytest.mark.parametrize("dtype,vocab_size,chunk_rows,loss_bound,grad_bound", [
    ("float64", 21, 3, 1e-12, 1e-12),  # measured 4.4e-16, 1.1e-16
    ("float64", 17, 1, 1e-12, 1e-12),  # at tp 4 the last rank holds only padding; measured 2.2e-16, 1.1e-16
    # bf16 logits against F.cross_entropy of their float32 upcast: losses (up to ~20) within a few
    # float32 ulps, gradients in bf16 ulps, at most one rounding step apart
    ("bfloat16", 21, 5, 2e-5, 1.0),    # measured 9.5e-7, 0 ulps
    ("bfloat16", 17, None, 2e-5, 1.0),  # measured 9.5e-7, 0 ulps
])
@pytest.mark.parametrize("tp", [2, 4])  # innermost: tp varies slowest, so each pool starts once
def test_vocab_cross_entropy_padded_chunked(pools, tp, dtype, vocab_size, chunk_rows, loss_bound, grad_bound):
    for loss_diff, grad_diff in pools(tp).run(_cross_entropy_padded, dtype, vocab_size, chunk_rows):
        within(loss_diff, loss_bound, f"max loss difference ({dtype})")
        unit = ", bf16 ulps" if dtype == "bfloat16" else ""
        within(grad_diff, grad_bound, f"max gradient difference ({dtype}{unit})")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("job,args", [(_mlp, (False,)), (_mlp, (True,)), (_gather_and_scatter, ()),
                                      (_embedding, ()), (_cross_entropy, ())],
                         ids=["column-row", "sequence-parallel", "gather-scatter", "vocab-embedding",
                              "vocab-cross-entropy"])
def test_layer_matches_dense(pools, tp, job, args):
    for diff in pools(tp).run(job, *args):
        within(diff, 1e-12, "max difference (float64)")


def _reduce_scatter_primitives() -> float:
    """Both primitives of the sequence reduce-scatter agree: the reduce-scatter one is what NCCL runs,
    exercised here on gloo (the regions pick all-reduce + slice for CPU tensors)."""
    from paratrain.comm.regions import reduce_scatter_along

    group = _tp_group()
    x = torch.randn(2, 4 * group.size, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(group.index))
    return _max_diff([(reduce_scatter_along(x, group, 1, primitive="reduce_scatter"),
                       reduce_scatter_along(x, group, 1, primitive="all_reduce"))])


def test_reduce_scatter_primitives_agree(pools):
    for diff in pools(2).run(_reduce_scatter_primitives):
        within(diff, 1e-12, "max difference (float64)")
