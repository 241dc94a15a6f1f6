"""What context parallelism costs the planner, beside the code it prices (paratrain.context_parallel): the exchange of
its attention (seconds on the critical path), the buffers attention holds while one layer runs, and the tensors its
attention saves for backward. The other terms only read how many tokens of a sequence a rank holds
(Layout.local_tokens) and how many ranks hold the same parameters (ParallelDims.replicas)."""

from __future__ import annotations

from paratrain.config.model import ModelConfig
from paratrain.planner.hardware import Hardware, bus_time
from paratrain.planner.layout import Layout


def exchange_time(model: ModelConfig, layout: Layout, hw: Hardware, *, seq: int, act: int, rate: float) -> float:
    """Seconds cp's attention exchange adds per block and micro-batch on the critical path (rate: attention's FLOP/s):
    ring, cp - 1 hops of this rank's K/V block in forward, and in backward cp - 1 again with the (dK, dV) accumulators
    beside them, each hop overlapping one block of attention compute (only what it takes longer is exposed), and the
    accumulators' last hop home; Ulysses, 4 all-to-alls of b s/cp h (q, k, v, out) each way, on the critical path;
    USP, Ulysses' all-to-alls over its U ranks, then a ring of cp / U hops, each the same bytes as a ring hop at cp
    and overlapping U times a ring step's compute."""
    cp, tp = layout.cp, layout.tp
    if cp == 1:
        return 0.0
    block = layout.micro_batch * seq // cp * model.d_model / tp * act  # [B, h / tp, seq / cp, hd]
    bw = hw.bandwidth(tp * cp)
    if layout.cp_mode == "ulysses":  # q, k, v, out each way; (cp - 1) / cp of each leaves the rank
        return 8 * bus_time(block, cp, bw, hw.latency_s, factor=1)
    inner = layout.cp_ulysses if layout.cp_mode == "usp" else 1
    exchange = 8 * bus_time(block, inner, hw.bandwidth(tp * inner), hw.latency_s, factor=1) if inner > 1 else 0.0
    ring = cp // inner
    hop = hw.latency_s + 2 * block / bw  # this rank's k and v to the next rank (USP: U x the positions, 1 / U the heads)
    # one ring step of causal attention under the balanced split: this rank's queries meet 2 c^2 keys of the
    # block (c = s / 2 ring), 4 (h / tp / U) FLOPs a pair (q k^T and p v): 2 b (s / ring)^2 (h / tp) / U; backward
    # twice that
    attention = 2.0 * layout.micro_batch * (seq / ring) ** 2 * model.d_model / tp / inner / rate
    forward = (ring - 1) * max(0.0, hop - attention)
    backward = (ring - 1) * max(0.0, 2 * hop - 2 * attention) + hop  # K/V and their (dK, dV); the last home
    return exchange + forward + backward


def transient_bytes(model: ModelConfig, layout: Layout, *, seq: int, act: int) -> float:
    """Bytes attention under cp holds while one layer runs (not saved: freed when it returns). Ring, in
    backward: this rank's K/V block, the one arriving, and the two (dK, dV) accumulators, each
    2 [B, h / tp, seq / cp, hd]. Ulysses: the all-to-all's send and receive buffers of q, k, v and the
    output, 2 x 4 [B, h / tp, seq / cp, hd], at most. An estimate, not checked to the byte."""
    if layout.cp == 1:
        return 0.0
    block = layout.micro_batch * seq // layout.cp * model.d_model / layout.tp * act  # [B, h / tp, seq / cp, hd]
    return 4 * 2 * block if layout.cp_mode == "ring" else 2 * 4 * block  # USP: the larger, Ulysses' buffers


def saved_attention(layout: Layout, *, seq: int) -> tuple[int, float]:
    """What attention keeps for backward besides its float32 log-sum-exp and a copy of its output: (how many
    [n, d / tp] tensors, bytes beyond them; seq: a whole sequence's tokens). SDPA's or the ring's own backward: q, k,
    v (a view of qkv's output, 3), rotated q and k (2), the output (1). Ulysses: its head-sharded q, k, v and output
    (4) and the sort orders (2 int64 [seq]); USP: Ulysses' four, the ring's log-sum-exp, no sort."""
    if layout.cp > 1 and layout.cp_mode == "ulysses":
        return 4, 2 * 8 * seq
    if layout.cp > 1 and layout.cp_mode == "usp":
        return 4, 0.0
    return 6, 0.0


def rotation_bytes(model: ModelConfig, layout: Layout, *, local: int, mode: str) -> float:
    """Under cp in float32 each block's rotation keeps its float32 cos and sin at the rank's `local` positions (in
    16-bit compute the block's 16-bit copies are counted with it, cp or not)."""
    return 2 * local * (model.head_dim // 2) * 4 if layout.cp > 1 and mode == "fp32" else 0.0


def positions_bytes(layout: Layout, *, seq: int) -> float:
    """Ring attention keeps the positions of this rank's tokens (int64 [seq / cp]), one storage shared by
    every layer (paratrain.context_parallel.shard); USP's ring its Ulysses group's, a view of every cp rank's
    ([cp, seq / cp]: 8 seq bytes, one storage); nothing without cp, with Ulysses, or when the attention core is
    recomputed."""
    if layout.cp == 1 or layout.cp_mode == "ulysses" or layout.recompute != "none":
        return 0.0
    return 8 * seq if layout.cp_mode == "usp" else 8 * seq // layout.cp


def step_volume(model: ModelConfig, layout: Layout, *, blocks: int, last: bool, micro_batches: int,
                act: int) -> dict[str, dict[str, int]]:
    """cp's own collectives of a step on a pipeline rank running `blocks` blocks (last: it holds the head), {axis: {op:
    bytes}} counted as paratrain.comm.volume counts (each call its input; act: the stream's element bytes).
    Ulysses' all-to-alls (USP's inside its Ulysses groups, axis cp_ulysses, each call the same tensor as Ulysses'
    own): per block 4 calls forward (q, k, v, the output) and 4 backward, each [B, h / tp, seq / cp, hd] (the GPT has
    no grouped kv heads); a recomputed block (full) runs its 4 forward calls again in backward, a recomputed attention
    core (selective) 3: torch.utils.checkpoint stops once it has what backward keeps, and nothing keeps the output's
    all-to-all inside the core. On the head's rank, each MTP depth's tokens and labels ahead: the token ids gathered
    over cp (int64; look_ahead)."""
    volume: dict[str, dict[str, int]] = {}
    if layout.cp == 1:
        return volume
    if model.mtp_depth and last:
        volume["cp"] = {"all_gather": micro_batches * 2 * model.mtp_depth * layout.micro_batch * model.seq_len * 8}
    if layout.cp_mode != "ring":
        calls = 8 + {"full": 4, "selective": 3}.get(layout.recompute, 0)
        tensor = layout.micro_batch * model.seq_len // layout.cp * model.d_model // layout.tp
        axis = "cp_ulysses" if layout.cp_mode == "usp" else "cp"
        volume.setdefault(axis, {})["all_to_all"] = blocks * calls * tensor * act * micro_batches
    return volume
