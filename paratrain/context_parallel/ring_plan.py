"""Ring attention's plan: which (query, key) pairs each step of the ring computes on this rank.

Made on the host from this rank's query positions and every rank's key positions (a SequenceShard knows them
without asking the device), before the ring turns. At step s the rank holds rank (i - s)'s K/V block; under a
causal mask the rows that see no key of the block (queries before its first key) and the columns no query sees
(keys after the last query) are left out, and a block where nothing remains is skipped (it still passes on).
On the CPU's fused kernel the block is cut into pieces instead (paratrain.context_parallel.fused.plan_pieces:
runs of consecutive positions, and of packed documents when every row has the same).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paratrain.context_parallel.fused import Piece, plan_pieces
from paratrain.topology.mesh import AxisGroup


@dataclass(frozen=True)
class Step:
    """One ring step: the K/V block it holds and the part of it that can meet this rank's queries."""

    source: int
    """The group index of the rank whose K/V block this step holds."""
    k_pos: torch.Tensor
    rows: tuple[torch.Tensor | None, ...]
    """The query rows that see at least one key of the block, in chunks small enough that their scores against
    the block's columns stay within SCORES_BUDGET elements (a chunk None: all rows)."""
    cols: torch.Tensor | None
    """The key columns that at least one query sees (None: all)."""
    skip: bool
    """No query sees any key: nothing to compute (the block still passes on)."""
    pieces: tuple[Piece, ...] | None = None
    """The block as runs for the fused kernel (paratrain.context_parallel.fused); None: the plain kernel
    on rows x cols."""


SCORES_BUDGET = 2**24
"""The plain block kernel holds a chunk of rows' [B, H, rows, keys] scores (and probabilities) at a time: at
most this many elements per chunk (64 MiB in float32), whatever the sequence length."""


def plan(host_q: torch.Tensor, kv_pos: torch.Tensor, group: AxisGroup, *, causal: bool, device: torch.device,
         fused: bool = False, heads: int = 1, starts: tuple[int, ...] = ()) -> list[Step]:
    """The ring's steps for this rank, from its query positions and every rank's kv positions kv_pos
    [cp, S_l], both where kv_pos lives (the host, when a SequenceShard gave them, so no decision waits for
    the device); each step's rows, columns and positions are then moved to `device`. fused: cut each block
    into pieces for the fused kernel where the positions allow (starts: where packed documents start, when every
    row has the same). heads: B x H of the queries (for the plain kernel's row chunks)."""
    steps = []
    for s in range(group.size):
        source = (group.index - s) % group.size
        k_pos = kv_pos[source]
        pieces = plan_pieces(host_q, k_pos, causal=causal, starts=starts) if fused else None
        rows = torch.nonzero(host_q >= k_pos.min()).flatten() if causal else torch.arange(len(host_q))
        cols = torch.nonzero(k_pos <= host_q.max()).flatten() if causal else torch.arange(len(k_pos))
        chunk = max(1, SCORES_BUDGET // max(1, heads * len(cols)))
        if len(rows) == len(host_q) and len(rows) <= chunk:  # queries at or after the block's first key
            row_chunks: tuple[torch.Tensor | None, ...] = (None,)
        else:
            row_chunks = tuple(part.to(device) for part in rows.split(chunk))
        steps.append(Step(source, k_pos.to(device), row_chunks,  # keys at or before this rank's last query
                          None if len(cols) == len(k_pos) else cols.to(device), skip=len(rows) == 0,
                          pieces=pieces))
    return steps
