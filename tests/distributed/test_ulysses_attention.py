"""Ulysses attention against single-process attention on the whole sequence (float64): O, dQ, dK, dV
at every rank's positions, for the contiguous, load-balanced and a permuted sequence split; its
all-to-all bytes against the module docstring's formula; its refusals."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.comm.volume import CollectiveCounter
from paratrain.context_parallel.layout import local_positions
from paratrain.context_parallel.spec import AttentionSpec
from paratrain.context_parallel.ulysses import ulysses_attention
from paratrain.topology import AxisGroup
from tests.margins import within

B, D = 2, 8


def _cp_group() -> AxisGroup:
    ranks = list(range(dist.get_world_size()))
    return AxisGroup("cp", tuple(ranks), dist.get_rank(), dist.new_group(ranks))


def _positions(split: str, seq: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions rank `rank` holds: the contiguous or load-balanced split of
    paratrain.context_parallel.layout, or the r-th contiguous slice of a fixed random permutation."""
    if split == "permuted":
        local = seq // cp
        return torch.randperm(seq, generator=torch.Generator().manual_seed(7))[rank * local:(rank + 1) * local]
    return local_positions(seq, rank, cp, balanced=split == "balanced")


def _whole(heads: int, kv_heads: int, seq: int) -> tuple[torch.Tensor, ...]:
    """q, k, v and an upstream gradient over the whole sequence, the same on every rank."""
    g = torch.Generator().manual_seed(0)
    shapes = [(B, heads, seq, D), (B, kv_heads, seq, D), (B, kv_heads, seq, D), (B, heads, seq, D)]
    return tuple(torch.randn(shape, dtype=torch.float64, generator=g) for shape in shapes)


def _parity(split: str, heads: int, kv_heads: int, seq: int, causal: bool) -> dict[str, float]:
    """Max |difference| of O, dQ, dK, dV at this rank's positions from one process's attention."""
    group = _cp_group()
    q, k, v, grad = _whole(heads, kv_heads, seq)
    scale = 0.3  # not 1/sqrt(D): the argument must reach the kernel
    qd, kd, vd = (t.clone().requires_grad_() for t in (q, k, v))
    expected = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale,
                                              enable_gqa=heads != kv_heads)
    (expected * grad).sum().backward()
    positions = _positions(split, seq, group.size, group.index)
    ql, kl, vl = (t.index_select(2, positions).requires_grad_() for t in (q, k, v))
    out = ulysses_attention(ql, kl, vl, group, q_positions=positions,
                            spec=AttentionSpec(causal=causal, scale=scale))
    (out * grad.index_select(2, positions)).sum().backward()
    pairs = {"O": (out, expected), "dQ": (ql.grad, qd.grad), "dK": (kl.grad, kd.grad), "dV": (vl.grad, vd.grad)}
    return {name: float((mine - whole.index_select(2, positions)).abs().max()) for name, (mine, whole) in pairs.items()}


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("split", ["contiguous", "balanced", "permuted"])
@pytest.mark.parametrize("cp,heads,kv_heads,seq", [
    (2, 8, 2, 16),  # GQA, kv heads split 1 per rank
    (2, 4, 1, 16),  # GQA, the one kv head replicated to both ranks
    (4, 8, 8, 32),
    (4, 8, 2, 32),  # GQA, each kv head replicated to two ranks
])  # innermost: cp varies slowest, so each pool starts once
def test_ulysses_matches_one_process(pools, cp, heads, kv_heads, seq, split, causal):
    for diffs in pools(cp).run(_parity, split, heads, kv_heads, seq, causal):
        for name, diff in diffs.items():
            within(diff, 1e-13, f"max {name} difference (float64)")  # measured: at most 3.6e-15 (dV)


def _bytes(heads: int, kv_heads: int, seq: int, causal: bool) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes this rank's collectives moved in forward and in backward, by operation."""
    group = _cp_group()
    positions = _positions("balanced", seq, group.size, group.index)
    q, k, v, grad = (t.index_select(2, positions).requires_grad_() for t in _whole(heads, kv_heads, seq))
    with CollectiveCounter() as forward:
        out = ulysses_attention(q, k, v, group, q_positions=positions,
                                spec=AttentionSpec(causal=causal))
    with CollectiveCounter() as backward:
        (out * grad.detach()).sum().backward()
    return forward.volume.bytes, backward.volume.bytes


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("cp,heads,kv_heads,seq", [(2, 8, 2, 16), (4, 8, 2, 32), (4, 8, 8, 32)])
def test_ulysses_all_to_all_bytes(pools, cp, heads, kv_heads, seq, causal):
    """The module docstring's formula: e B S_l D (2 H + 2 max(Hkv, cp)) each way, 8 cp S_l for positions."""
    local = seq // cp
    all_to_all = 8 * B * local * D * (2 * heads + 2 * max(kv_heads, cp))
    for forward, backward in pools(cp).run(_bytes, heads, kv_heads, seq, causal):
        assert forward == {"all_to_all": all_to_all, **({"all_gather": 8 * cp * local} if causal else {})}
        assert backward == {"all_to_all": all_to_all}


def _refusal(heads: int, kv_heads: int) -> str:
    group = _cp_group()
    x, kv = torch.zeros(B, heads, 4, D), torch.zeros(B, kv_heads, 4, D)
    try:
        ulysses_attention(x, kv, kv, group, q_positions=torch.arange(4) + 4 * group.index)
    except ValueError as error:
        return str(error)
    return "not refused"


@pytest.mark.parametrize("heads,kv_heads,rule", [(6, 6, "heads % cp must be 0"),
                                                 (12, 6, "kv_heads % cp == 0"),
                                                 (12, 3, "kv_heads % cp == 0")])
def test_ulysses_refuses_heads_it_cannot_split(pools, heads, kv_heads, rule):
    for message in pools(4).run(_refusal, heads, kv_heads):
        assert rule in message, message


def _duplicate_positions() -> str:
    group = _cp_group()
    x = torch.zeros(B, 2, 4, D)
    try:
        ulysses_attention(x, x, x, group, q_positions=torch.arange(4))  # every rank claims positions 0..3
    except ValueError as error:
        return str(error)
    return "not refused"


def test_ulysses_refuses_duplicate_positions(pools):
    for message in pools(2).run(_duplicate_positions):
        assert "distinct positions" in message, message
