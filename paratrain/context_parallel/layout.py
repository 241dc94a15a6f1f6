"""How a sequence is split over the cp ranks: which global positions each rank holds, and in what order.

Contiguous (balanced=False): rank r holds positions [r S/cp, (r + 1) S/cp). Under a causal mask this is
lopsided: rank 0's queries see only its own keys, rank cp - 1's see everyone's, so in ring attention
rank cp - 1 computes at every step while rank 0 idles after the first (cp steps of work against 1).

Load-balanced (balanced=True, the default; the split of Megatron-Core's context parallelism through
TransformerEngine, torchtitan's head-tail load balancer, "zigzag" in ring-flash-attention): the sequence
is cut into 2 cp equal chunks of c = S / (2 cp) positions and rank r holds chunks r and 2 cp - 1 - r,
concatenated in that order. cp = 2, S = 8:

    positions   0 1 | 2 3 | 4 5 | 6 7
    chunk         0     1     2     3
    rank 0:  chunks 0, 3 -> positions [0 1 6 7]
    rank 1:  chunks 1, 2 -> positions [2 3 4 5]

Each rank holds one early and one late chunk, so each meets the same number of unmasked (query, key)
pairs from every other rank's block: 2 c^2 (two whole chunk pairs; see paratrain.context_parallel.ring).

Document-aware (document_split; ParallelConfig.cp_balance 'documents'): with packed documents a query meets
only the earlier keys of its own document, so a rank's attention work is the sum over its tokens of
(position in the document + 1), not its positions' count: a window of short documents does far less work
than the causal split assumes, and the rank holding a long document's tail does most of it. The split then
cuts the window into cp x c equal pieces (c per rank, up to MAX_PIECES), weighs each by that work summed over
the micro-batch's rows, and deals them out so that every rank holds c pieces and the heaviest rank's work is
as close to the mean as the pieces allow (largest first to the lightest rank with room, then swaps between
the heaviest and the lightest). Every cp rank computes it from the same integers, so all agree with no
collective; the split changes with every micro-batch's documents, and travels with them
(paratrain.nn.documents.WindowSplit). Positions only decide which rank computes what: the loss, the
gradients and the weights are one process's, up to float rounding.
"""

from __future__ import annotations

import torch

from paratrain.config.errors import ConfigError


def chunk_ids(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2 cp) that `rank` holds in the load-balanced split, in its local order."""
    _check_rank(rank, cp)
    return rank, 2 * cp - 1 - rank


def check_divisible(seq_len: int, cp: int, *, balanced: bool = True) -> None:
    """Refuse a sequence length the split cannot cut into equal parts (ConfigError: rule, numbers, fix)."""
    if cp < 1:
        raise ConfigError(f"cp is the number of ranks the sequence is split over, at least 1; got {cp}")
    parts = 2 * cp if balanced else cp
    if seq_len % parts:
        padded = -(-seq_len // parts) * parts
        if balanced:
            cut, other = f"load-balanced context-parallel split cuts the sequence into 2 * cp = {parts} equal chunks", \
                "a cp for which 2 * cp divides"
        else:
            cut, other = f"contiguous context-parallel split cuts the sequence into cp = {cp} equal parts", \
                "a cp dividing"
        raise ConfigError(
            f"the {cut}, so the sequence length must be divisible by {parts}; got {seq_len}: pad the sequence "
            f"to {padded} (the next multiple of {parts}) or choose {other} {seq_len}"
        )


def local_positions(seq_len: int, rank: int, cp: int, *, balanced: bool = True) -> torch.Tensor:
    """The global positions `rank` holds, in its local order: LongTensor [seq_len / cp] (on the CPU)."""
    check_divisible(seq_len, cp, balanced=balanced)
    _check_rank(rank, cp)
    if not balanced:
        part = seq_len // cp
        return torch.arange(rank * part, (rank + 1) * part)
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in chunk_ids(rank, cp)])


def shard_sequence(x: torch.Tensor, dim: int, rank: int, cp: int, *, balanced: bool = True) -> torch.Tensor:
    """This rank's part of the whole sequence `x` along `dim`: x.size(dim) / cp entries, in local order
    (local_positions). Differentiable: the gradient lands in this rank's positions, zeros elsewhere."""
    seq_len = x.size(dim)
    check_divisible(seq_len, cp, balanced=balanced)
    _check_rank(rank, cp)
    if not balanced:
        part = seq_len // cp
        return x.narrow(dim, rank * part, part)
    chunk = seq_len // (2 * cp)
    return torch.cat([x.narrow(dim, c * chunk, chunk) for c in chunk_ids(rank, cp)], dim=dim)


def unshard_sequence(parts: list[torch.Tensor], dim: int, cp: int, *, balanced: bool = True) -> torch.Tensor:
    """The inverse of shard_sequence: the whole sequence along `dim` from every rank's part (parts[r]
    from rank r, as shard_sequence gave it)."""
    if len(parts) != cp:
        raise ValueError(f"unshard_sequence needs one part per cp rank: got {len(parts)} parts for cp = {cp}")
    if not balanced:
        return torch.cat(parts, dim=dim)
    local = parts[0].size(dim)
    check_divisible(local * cp, cp, balanced=True)
    chunk = local // 2
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        if part.size(dim) != local:
            raise ValueError(f"unshard_sequence: rank {rank}'s part has {part.size(dim)} entries along dim {dim}, "
                             f"rank 0's has {local}; every rank holds seq_len / cp")
        first, second = chunk_ids(rank, cp)
        chunks[first], chunks[second] = part.narrow(dim, 0, chunk), part.narrow(dim, chunk, chunk)
    return torch.cat([c for c in chunks if c is not None], dim=dim)


MAX_PIECES = 16
"""The document-aware split's pieces per rank, at most (fewer where the window does not divide): more pieces
balance finer, and cut each rank's positions into more runs."""


def document_split(documents: torch.Tensor, cp: int) -> torch.Tensor:
    """Every rank's positions [cp, S / cp] (row r rank r's, ascending) for a micro-batch's packed documents
    documents [B, S] or [S] (each token's position in its document, paratrain.nn.documents; on the host),
    balancing attention work (attention_pairs) rather than positions. Deterministic: integers only, ties
    broken by position and rank."""
    documents = documents.reshape(-1, documents.shape[-1]).to("cpu", torch.int64)
    seq_len = documents.shape[-1]
    check_divisible(seq_len, cp)
    pieces = max(c for c in range(2, MAX_PIECES + 1) if seq_len % (cp * c) == 0)
    size = seq_len // (cp * pieces)
    work = (documents + 1).sum(0).view(cp * pieces, size).sum(1).tolist()
    owners = _deal(work, cp, pieces)
    rows = [torch.cat([torch.arange(i * size, (i + 1) * size) for i in sorted(own)]) for own in owners]
    return torch.stack(rows)


def attention_pairs(documents: torch.Tensor, group_positions: torch.Tensor) -> torch.Tensor:
    """int64 [cp]: the (query, key) pairs each rank's queries meet under packed documents' causal mask, summed
    over the rows of documents [B, S] (or [S]), for a split's group_positions [cp, S / cp]: the work a kernel
    that skips masked pairs does (the sum over a rank's tokens of their positions in their documents + 1)."""
    per_token = (documents.reshape(-1, documents.shape[-1]).to("cpu", torch.int64) + 1).sum(0)
    return per_token[group_positions].sum(1)


def _deal(work: list[int], cp: int, pieces: int) -> list[list[int]]:
    """Piece indices for each of cp ranks, `pieces` each, the heaviest rank's total work near the mean."""
    owners: list[list[int]] = [[] for _ in range(cp)]
    load = [0] * cp
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):  # largest first, to the lightest with room
        r = min((r for r in range(cp) if len(owners[r]) < pieces), key=lambda r: (load[r], r))
        owners[r].append(i)
        load[r] += work[i]
    for _ in range(4 * cp * pieces):  # swap a piece of the heaviest with a lighter one of the lightest
        hi, lo = max(range(cp), key=lambda r: (load[r], -r)), min(range(cp), key=lambda r: (load[r], r))
        gap, best = load[hi] - load[lo], None
        for a in owners[hi]:
            for b in owners[lo]:
                moved = work[a] - work[b]
                if 0 < moved < gap and (best is None or abs(gap - 2 * moved) < best[0]):
                    best = (abs(gap - 2 * moved), a, b)
        if best is None or best[0] >= gap:
            break
        _, a, b = best
        owners[hi][owners[hi].index(a)], owners[lo][owners[lo].index(b)] = b, a
        load[hi], load[lo] = load[hi] - work[a] + work[b], load[lo] + work[a] - work[b]
    return owners


def _check_rank(rank: int, cp: int) -> None:
    if not 0 <= rank < cp:
        raise ValueError(f"a cp rank is in [0, cp) = [0, {cp}); got {rank}")
