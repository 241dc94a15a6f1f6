"""chunked_cross_entropy (paratrain.nn.loss) against F.cross_entropy(reduction="sum") on the real
columns: loss and logits gradient, in float64, float32 and bf16, and what it saves for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratrain.models import VocabOutput
from paratrain.models.gpt import upcast
from paratrain.nn.loss import CHUNK_BYTES, chunked_cross_entropy, default_chunk_rows
from tests.margins import within

N, V, VP = 96, 1000, 1024  # rows, real vocabulary, padded vocabulary


def _logits(dtype: torch.dtype, *, seed: int, transposed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(leaf, logits[N, VP]): the leaf collects the gradient; logits is the leaf itself or, when
    transposed, a non-contiguous view of a [VP, N] leaf. Spread (std 4) so the softmax is not flat."""
    base = torch.randn(VP, N, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)) * 4
    leaf = (base if transposed else base.t().contiguous()).to(dtype).requires_grad_()
    return leaf, leaf.t() if transposed else leaf


def _targets(seed: int) -> torch.Tensor:
    targets = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(seed + 100))
    targets[::7] = -100  # ignored rows
    return targets


def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in units of the bf16 spacing at the larger of |a|, |b| (8 bits of mantissa)."""
    a, b = a.float(), b.float()
    _, exponent = torch.frexp(torch.maximum(a.abs(), b.abs()))
    return float(((a - b).abs() / torch.ldexp(torch.ones_like(a), exponent - 8)).max())


@pytest.mark.parametrize("dtype,loss_bound,grad_bound", [
    (torch.float64, 1e-14, 1e-13),  # measured 2.1e-16 (relative), 2.2e-15 (absolute)
    (torch.float32, 1e-5, 2e-5),    # measured 1.1e-7, 1.2e-6
])
def test_matches_cross_entropy(dtype, loss_bound, grad_bound):
    """Worst over chunk sizes (1 row, a few, exactly N, more than N, the default), a contiguous and a
    transposed view, padded columns and ignored targets; the gradient entries are in [-1, 1]."""
    worst_loss, worst_grad = 0.0, 0.0
    for seed in range(3):
        targets = _targets(seed)
        for transposed in (False, True):
            ref_leaf, ref_logits = _logits(dtype, seed=seed, transposed=transposed)
            expected = F.cross_entropy(ref_logits[:, :V], targets, reduction="sum")
            expected.backward()
            for chunk_rows in (1, 5, N, 4 * N, None):
                leaf, logits = _logits(dtype, seed=seed, transposed=transposed)
                loss = chunked_cross_entropy(logits, targets, vocab_size=V, chunk_rows=chunk_rows)
                loss.backward()
                assert loss.dtype == dtype and leaf.grad.dtype == dtype
                assert not leaf.grad[V:].any() if transposed else not leaf.grad[:, V:].any()  # padding
                worst_loss = max(worst_loss, ((loss - expected).abs() / expected.abs()).item())
                worst_grad = max(worst_grad, float((leaf.grad - ref_leaf.grad).abs().max()))
    within(worst_loss, loss_bound, f"relative loss difference ({dtype})")
    within(worst_grad, grad_bound, f"max gradient difference ({dtype})")


def test_bf16_matches_the_float32_upcast():
    """bf16 logits: the loss is F.cross_entropy of their float32 upcast, the gradient that one's float32
    gradient rounded to bf16 (what autograd gives through the upcast). Both gradients are roundings
    of float32 values some tens of float32 ulps apart, far below a bf16 ulp (2^-8 relative), so they
    can differ by at most one rounding step: the bound of 1 ulp is the maths, not a margin."""
    worst_loss, worst_ulps = 0.0, 0.0
    for seed in range(5):
        targets = _targets(seed)
        ref_leaf, ref_logits = _logits(torch.bfloat16, seed=seed)
        expected = F.cross_entropy(upcast(ref_logits)[:, :V], targets, reduction="sum")
        expected.backward()
        for chunk_rows in (1, 5, None):
            leaf, logits = _logits(torch.bfloat16, seed=seed)
            loss = chunked_cross_entropy(logits, targets, vocab_size=V, chunk_rows=chunk_rows)
            loss.backward()
            assert loss.dtype == torch.float32 and leaf.grad.dtype == torch.bfloat16
            worst_loss = max(worst_loss, ((loss - expected).abs() / expected.abs()).item())
            worst_ulps = max(worst_ulps, _bf16_ulps(leaf.grad, ref_leaf.grad))
    within(worst_loss, 1e-5, "relative loss difference (bf16 logits)")  # measured 1.1e-7
    within(worst_ulps, 1.0, "max gradient difference in bf16 ulps")  # measured 1.0 (10 of 96k entries)


def _saved(fn: object) -> tuple[int, list[tuple[torch.dtype, int]]]:
    """Bytes of the distinct storages autograd saves while fn() runs, and (dtype, numel) of each save."""
    storages: dict[int, int] = {}
    saves: list[tuple[torch.dtype, int]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        saves.append((tensor.dtype, tensor.numel()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()  # type: ignore[operator]
    return sum(storages.values()), saves


def test_saves_the_bf16_logits_and_no_float32_copy():
    """bf16 logits[96, 1024] (real vocabulary 1000): the chunked loss saves 197,856 bytes = the logits
    themselves (2 N Vp = 196,608) + targets, mask and lse (8 N + N + 4 N = 1,248), nothing [N, V] in
    float32; F.cross_entropy(upcast(...)) saves 384,772 bytes = its float32 log-softmax
    (4 N V = 384,000) + targets (8 N)
    + a 4-byte scalar. At GPT-2 scale (16 x 1024 rows, Vp = 50304) the logits are
    1.6 GB, alive anyway while the loss runs; the old loss saved 3.3 GB beside them, the new 0.2 MB."""
    targets = _targets(0)
    _, logits = _logits(torch.bfloat16, seed=0)
    new_bytes, new_saves = _saved(lambda: chunked_cross_entropy(logits, targets, vocab_size=V))
    old_bytes, old_saves = _saved(lambda: F.cross_entropy(upcast(logits[:, :V]), targets, reduction="sum"))
    assert new_bytes == 2 * N * VP + 8 * N + N + 4 * N == 197_856
    assert old_bytes == 4 * N * V + 8 * N + 4 == 384_772  # + 4: nll_loss's total_weight scalar
    assert not [s for s in new_saves if s[0] != torch.bfloat16 and s[1] > N]  # only O(N) beside the logits
    assert (torch.float32, N * V) in old_saves


def test_vocab_output_uses_it():
    """VocabOutput.loss on [B, S, Vp] logits of a padded vocabulary: (sum, count) as F.cross_entropy."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 16, 256, dtype=torch.float64, generator=generator).requires_grad_()
    targets = torch.randint(0, 250, (2, 16), generator=generator)
    targets[0, :3] = -100
    total, count = VocabOutput(250).loss(logits, targets)
    expected = F.cross_entropy(logits[..., :250].reshape(-1, 250), targets.reshape(-1), reduction="sum")
    difference = ((total - expected).abs() / expected).item()
    within(difference, 1e-14, "VocabOutput relative loss difference (float64)")  # measured 1.7e-16
    assert int(count) == 29
    total.backward()
    assert not logits.grad[..., 250:].any() and not logits.grad[0, :3].any()


def test_default_chunk_and_errors():
    assert default_chunk_rows(50304, torch.bfloat16) == 1334  # 256 MiB of float32 per chunk
    assert default_chunk_rows(10**9, torch.float32) == 1
    assert default_chunk_rows(1000, torch.float64) * 1000 * 8 <= CHUNK_BYTES
    logits, targets = torch.randn(4, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="vocab_size 9 must be in"):
        chunked_cross_entropy(logits, targets, vocab_size=9)
    with pytest.raises(ValueError, match="chunk_rows is 0"):
        chunked_cross_entropy(logits, targets, chunk_rows=0)
    with pytest.raises(ValueError, match="do not match"):
        chunked_cross_entropy(logits, targets[:3])
    assert float(chunked_cross_entropy(logits, torch.full((4,), -100))) == 0.0  # all ignored


@pytest.mark.gpu
def test_cuda_peak_memory_is_the_logits_and_their_gradient():
    """bf16 logits[8192, 50304] on the GPU (824 MB): forward and backward of the chunked loss peak at
    the logits + their bf16 gradient + a few 256 MiB chunks; F.cross_entropy(upcast(...)) adds several
    float32 copies. Measured on an H100: see the report in the pull request."""
    rows, vocab, padded = 8192, 50257, 50304
    targets = torch.randint(0, vocab, (rows,), device="cuda")
    logits = torch.randn(rows, padded, device="cuda").bfloat16().requires_grad_()

    def peak(fn: object) -> int:
        logits.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn().backward()  # type: ignore[operator]
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    new = peak(lambda: chunked_cross_entropy(logits, targets, vocab_size=vocab))
    new_grad = logits.grad.clone()
    old = peak(lambda: F.cross_entropy(upcast(logits[:, :vocab]), targets, reduction="sum"))
    logit_bytes = logits.numel() * logits.element_size()
    assert new <= logit_bytes + 4 * CHUNK_BYTES, (new, old)
    assert old >= logit_bytes + 2 * 4 * rows * vocab, (new, old)
    within(_bf16_ulps(new_grad, logits.grad), 1.0, "max gradient difference in bf16 ulps (CUDA)")
