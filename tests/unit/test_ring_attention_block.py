"""Ring attention's pieces in one process (float64): the block kernel and its backward, the log-sum-exp
merge of two blocks against attention over their concatenation, fully masked rows, GQA, and the split."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratrain.config.errors import ConfigError
from paratrain.context_parallel import (
    block_attention,
    block_attention_backward,
    chunk_ids,
    local_positions,
    merge_partials,
    ring_attention,
    shard_sequence,
    unshard_sequence,
)
from paratrain.context_parallel.block import Scoring
from paratrain.context_parallel.ring_plan import plan
from paratrain.topology import AxisGroup
from tests.margins import within

B, H, D = 2, 4, 8


def _qkv(sq: int, sk: int, hkv: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, sq, D, dtype=torch.float64, generator=gen)
    k = torch.randn(B, hkv, sk, D, dtype=torch.float64, generator=gen)
    v = torch.randn(B, hkv, sk, D, dtype=torch.float64, generator=gen)
    return q, k, v


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
               causal: bool) -> torch.Tensor:
    mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1) if causal else None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _small(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One row of the batch and half the head dim, as leaves: gradcheck perturbs every element."""
    return tuple(t[:1, :, :, : D // 2].clone().requires_grad_() for t in tensors)


class _Block(torch.autograd.Function):
    """block_attention's out with block_attention_backward as its backward, for gradcheck."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, k_pos, causal):  # type: ignore[no-untyped-def]
        out, lse = block_attention(q, k, v, q_pos, k_pos, Scoring(causal, D ** -0.5))
        ctx.save_for_backward(q, k, v, q_pos, k_pos, out, lse)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[no-untyped-def]
        q, k, v, q_pos, k_pos, out, lse = ctx.saved_tensors
        dq, dk, dv = block_attention_backward(q, k, v, q_pos, k_pos, (out, lse, grad_out),
                                              Scoring(ctx.causal, D ** -0.5))
        return dq, dk, dv, None, None, None


@pytest.mark.parametrize("hkv", [4, 2, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_block_matches_sdpa_and_gradchecks(hkv, causal):
    q, k, v = _qkv(6, 6, hkv)
    pos = torch.randperm(6, generator=torch.Generator().manual_seed(1))
    out, lse = block_attention(q, k, v, pos, pos, Scoring(causal, D ** -0.5))
    within(float((out - _reference(q, k, v, pos, pos, causal)).abs().max()), 1e-14, "block out vs SDPA")
    inputs = _small(q, k, v)
    # autograd through the kernel's plain ops (out and lse), and the hand-written backward
    assert torch.autograd.gradcheck(lambda *x: block_attention(*x, pos, pos, Scoring(causal, D ** -0.5)), inputs)
    assert torch.autograd.gradcheck(lambda *x: _Block.apply(*x, pos, pos, causal), inputs)


@pytest.mark.parametrize("hkv", [4, 2])
def test_merge_of_two_blocks_is_attention_over_both(hkv):
    """Keys split in two blocks at scattered positions; the causal mask leaves some query rows with no key
    in one block (lse -inf there) but never in both."""
    q, k, v = _qkv(8, 8, hkv, seed=2)
    q_pos = torch.tensor([3, 9, 4, 15, 8, 0, 12, 6])
    k_pos = torch.tensor([0, 2, 7, 5, 9, 14, 11, 13])
    first, second = torch.arange(4), torch.arange(4, 8)  # keys 0, 2, 7, 5 | 9, 14, 11, 13
    scale = D ** -0.5

    def merged(q, k, v):  # type: ignore[no-untyped-def]
        a = block_attention(q, k[:, :, first], v[:, :, first], q_pos, k_pos[first], Scoring(True, scale))
        b = block_attention(q, k[:, :, second], v[:, :, second], q_pos, k_pos[second], Scoring(True, scale))
        return merge_partials(*a, *b)

    _, lse_second = block_attention(q, k[:, :, second], v[:, :, second], q_pos, k_pos[second], Scoring(True, scale))
    assert torch.isinf(lse_second).any() and not torch.isnan(lse_second).any()
    out, lse = merged(q, k, v)
    whole_out, whole_lse = block_attention(q, k, v, q_pos, k_pos, Scoring(True, scale))
    within(float((out - _reference(q, k, v, q_pos, k_pos, True)).abs().max()), 1e-14, "merged out vs SDPA")
    within(float((lse - whole_lse).abs().max()), 1e-14, "merged lse vs one block")
    assert torch.autograd.gradcheck(merged, _small(q, k, v))

    # the ring's backward: each block's share, from the merged out and lse, sums to the whole gradient
    grad_out = torch.randn_like(out)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    _reference(*x, q_pos, k_pos, True).backward(grad_out)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for cols in (first, second):
        dq_b, dk_b, dv_b = block_attention_backward(q, k[:, :, cols], v[:, :, cols], q_pos, k_pos[cols],
                                                    (out, lse, grad_out), Scoring(True, scale))
        dq, dk[:, :, cols], dv[:, :, cols] = dq + dq_b, dk_b, dv_b
    within(max(float((a - b.grad).abs().max()) for a, b in zip((dq, dk, dv), x)), 1e-14,
           "block backward shares vs SDPA gradients")


@pytest.mark.parametrize("hkv", [4, 2])
def test_fused_pieces_are_the_plain_block(hkv):
    """A block cut into runs for the fused kernel (every visible pair once: full, causal triangle or skipped)
    gives the plain kernel's (out, lse) and, from the same merged result, its dq, dk, dv (float64, 1e-13);
    positions in runs that overlap partly (cut at each other's ends) and the balanced split's blocks too."""
    from paratrain.context_parallel.fused import fused_block_backward, fused_block_forward, plan_pieces

    scoring = Scoring(causal=True, scale=D ** -0.5)
    cases = [(torch.tensor([3, 4, 5, 6, 12, 13, 0, 1]), torch.tensor([0, 1, 2, 5, 6, 7, 8, 13, 14]))]
    cases += [(local_positions(16, r, 2), local_positions(16, j, 2)) for r in range(2) for j in range(2)]
    for q_pos, k_pos in cases:
        q, k, v = _qkv(len(q_pos), len(k_pos), hkv, seed=len(q_pos))
        plain_out, plain_lse = block_attention(q, k, v, q_pos, k_pos, scoring)
        pieces = plan_pieces(q_pos, k_pos, causal=True)
        assert pieces is not None
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=q.dtype)
        fused_block_forward(q, k, v, pieces, scale=scoring.scale, out=out, lse=lse)
        within(float((out - plain_out).abs().max()), 1e-13, "fused block out (float64)")
        seen = torch.isfinite(plain_lse)
        assert torch.equal(seen, torch.isfinite(lse))
        within(float((lse[seen] - plain_lse[seen]).abs().max()), 1e-13, "fused block lse (float64)")
        grad = torch.randn_like(out)
        dq, dkv = torch.zeros_like(q), torch.zeros(2, *k.shape, dtype=k.dtype)
        lse_safe = torch.where(seen, lse, torch.zeros_like(lse))  # a fully masked row's share is 0 either way
        fused_block_backward(q, k, v, pieces, (out, lse_safe, grad), scale=scoring.scale, dq=dq, dkv=dkv)
        expected = block_attention_backward(q, k, v, q_pos, k_pos, (out, lse, grad), scoring)
        for got, want, what in zip((dq, dkv[0], dkv[1]), expected, ("dq", "dk", "dv")):
            within(float((got - want).abs().max()), 1e-13, f"fused block {what} (float64)")
    own = plan_pieces(local_positions(16, 0, 2), local_positions(16, 0, 2), causal=True)
    other = plan_pieces(local_positions(16, 0, 2), local_positions(16, 1, 2), causal=True)
    assert [p.causal for p in own] == [True, False, True] and other == (other[0],) and not other[0].causal


def test_fused_pieces_of_packed_documents_are_the_masked_block():
    """Packed documents the same in every row (document_starts): runs cut at each document's start, pairs of runs in
    different documents skipped, so the fused pieces compute only pairs inside documents and give the plain kernel's
    document-masked (out, lse) and gradients (float64, 1e-13), on the document-aware split's scattered positions."""
    from paratrain.context_parallel.fused import fused_block_backward, fused_block_forward, plan_pieces
    from paratrain.context_parallel.layout import document_split

    lengths = (5, 9, 3, 12, 2, 1)
    documents = torch.cat([torch.arange(n) for n in lengths])  # [32]: each token's position in its document
    starts = tuple(torch.nonzero(documents == 0).flatten().tolist())
    split = document_split(documents, 2)
    scoring = Scoring(causal=True, scale=D ** -0.5)
    for q_pos, k_pos in [(split[0], split[1]), (split[1], split[0]), (split[0], split[0])]:
        q, k, v = _qkv(len(q_pos), len(k_pos), 2, seed=int(q_pos[0]))
        q_doc = documents[q_pos].expand(B, -1)
        plain_out, plain_lse = block_attention(q, k, v, q_pos, k_pos, scoring, q_doc)
        pieces = plan_pieces(q_pos, k_pos, causal=True, starts=starts)
        assert pieces is not None and sum(p.nq * p.nk for p in pieces) < len(q_pos) * len(k_pos) // 2
        out, lse = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"), dtype=q.dtype)
        fused_block_forward(q, k, v, pieces, scale=scoring.scale, out=out, lse=lse)
        seen = torch.isfinite(plain_lse)
        assert torch.equal(seen, torch.isfinite(lse))
        within(float((out - plain_out).abs().max()), 1e-13, "fused documents out (float64)")
        within(float((lse[seen] - plain_lse[seen]).abs().max()), 1e-13, "fused documents lse (float64)")
        grad = torch.randn_like(out)
        dq, dkv = torch.zeros_like(q), torch.zeros(2, *k.shape, dtype=k.dtype)
        lse_safe = torch.where(seen, lse, torch.zeros_like(lse))
        fused_block_backward(q, k, v, pieces, (out, lse_safe, grad), scale=scoring.scale, dq=dq, dkv=dkv)
        expected = block_attention_backward(q, k, v, q_pos, k_pos, (out, lse, grad), scoring, q_doc)
        for got, want, what in zip((dq, dkv[0], dkv[1]), expected, ("dq", "dk", "dv")):
            within(float((got - want).abs().max()), 1e-13, f"fused documents {what} (float64)")


def test_fully_masked_rows_give_zero_not_nan():
    q, k, v = _qkv(4, 4, 2, seed=3)
    q_pos, k_pos = torch.tensor([0, 1, 10, 11]), torch.tensor([5, 6, 7, 8])  # rows 0, 1 see no key
    out, lse = block_attention(q, k, v, q_pos, k_pos, Scoring(True, D ** -0.5))
    assert torch.equal(out[:, :, :2], torch.zeros_like(out[:, :, :2]))
    assert torch.isneginf(lse[:, :, :2]).all() and torch.isfinite(lse[:, :, 2:]).all()
    both_out, both_lse = merge_partials(out, lse, out, lse)  # rows masked in both blocks stay masked
    assert not torch.isnan(both_out).any() and torch.isneginf(both_lse[:, :, :2]).all()
    grads = block_attention_backward(q, k, v, q_pos, k_pos, (out, lse, torch.ones_like(out)), Scoring(True, D ** -0.5))
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][:, :, :2], torch.zeros_like(grads[0][:, :, :2]))
    none_seen = torch.tensor([20, 21, 22, 23])  # every key after every query: the whole block masked
    empty_out, empty_lse = block_attention(q, k, v, q_pos, none_seen, Scoring(True, D ** -0.5))
    assert torch.equal(empty_out, torch.zeros_like(empty_out)) and torch.isneginf(empty_lse).all()


def _group(index: int, cp: int) -> AxisGroup:
    """A cp group as a rank sees it, without a process group (the plan and a ring of one need none)."""
    return AxisGroup("cp", tuple(range(cp)), index, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("kernel", ["fused", "plain-in-row-chunks"])
def test_ring_of_one_is_attention(kernel, monkeypatch):
    """Through the fused pieces, and through the plain block kernel holding scores of 3 rows at a time."""
    import paratrain.context_parallel.ring as ring
    import paratrain.context_parallel.ring_plan as ring_plan

    if kernel != "fused":
        monkeypatch.setattr(ring, "fused_available", lambda device, dtype: False)
        monkeypatch.setattr(ring_plan, "SCORES_BUDGET", 3 * B * H * 8)
    q, k, v = _qkv(8, 8, 2, seed=4)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    y = [t.clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*x, _group(0, 1), q_positions=torch.arange(8))
    expected = _reference(*y, torch.arange(8), torch.arange(8), True)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    expected.backward(grad_out)
    pairs = [(out.detach(), expected.detach())] + [(a.grad, b.grad) for a, b in zip(x, y)]
    within(max(float((a - b).abs().max()) for a, b in pairs), 1e-14, "ring of one vs SDPA (out, dq, dk, dv)")


def _count(index: torch.Tensor | None | tuple, every: int) -> int:
    if isinstance(index, tuple):
        return sum(_count(part, every) for part in index)
    return every if index is None else len(index)


@pytest.mark.parametrize("cp", [2, 4])
def test_balanced_split_gives_every_step_equal_work(cp):
    """Causal: the (query, key) pairs each rank computes at each ring step, after leaving out the rows and
    columns that meet only masked pairs. Balanced: (2c)^2 at step 0, 2 c^2 after, on every rank (c the
    chunk); contiguous: rank r computes (2c)^2 at steps 0..r and nothing after."""
    seq, c = 8 * cp, 4
    for balanced in (True, False):
        positions = torch.stack([local_positions(seq, r, cp, balanced=balanced) for r in range(cp)])
        for rank in range(cp):
            steps = plan(positions[rank], positions, _group(rank, cp), causal=True, device=torch.device("cpu"))
            work = [0 if s.skip else _count(s.rows, 2 * c) * _count(s.cols, 2 * c) for s in steps]
            if balanced:
                assert work == [4 * c * c] + [2 * c * c] * (cp - 1), (rank, work)
            else:
                assert work == [4 * c * c] * (rank + 1) + [0] * (cp - 1 - rank), (rank, work)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("balanced", [True, False])
def test_split_covers_the_sequence_once(cp, balanced):
    seq = 16
    positions = [local_positions(seq, r, cp, balanced=balanced) for r in range(cp)]
    assert torch.equal(torch.sort(torch.cat(positions)).values, torch.arange(seq))
    x = torch.randn(2, seq, 3)
    parts = [shard_sequence(x, 1, r, cp, balanced=balanced) for r in range(cp)]
    for r in range(cp):
        assert torch.equal(parts[r], x[:, positions[r]])
    assert torch.equal(unshard_sequence(parts, 1, cp, balanced=balanced), x)


def test_balanced_split_is_the_zigzag():
    assert chunk_ids(0, 2) == (0, 3) and chunk_ids(1, 2) == (1, 2)
    assert local_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    assert local_positions(8, 1, 2, balanced=False).tolist() == [4, 5, 6, 7]


def test_split_refuses_uneven_sequences():
    with pytest.raises(ConfigError, match=r"divisible by 8; got 30: pad the sequence to 32"):
        local_positions(30, 0, 4)
    with pytest.raises(ConfigError, match=r"divisible by 4; got 30: pad the sequence to 32"):
        shard_sequence(torch.zeros(30), 0, 0, 4, balanced=False)
    local_positions(12, 0, 4, balanced=False)  # 12 = 4 x 3 is fine contiguous, not balanced
    with pytest.raises(ConfigError, match="2 \\* cp = 8 equal chunks"):
        local_positions(12, 0, 4)
