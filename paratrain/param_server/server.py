"""ShardServer: one parameter server's slices of the model, their optimizer, and the update of a clock.

A server holds its slice of every flat bucket (paratrain.param_server.layout) as the optimizer's master
and the optimizer state for it. A clock's update is the engine's own, on the slices:

    g = the clock's pushed gradients summed (sync: in trainer order; async: in arrival order)
    norm = sqrt(sum over every server of |g_j|^2) / (tokens x scale)     one all-reduce among the servers
    skipped if any server's g holds an inf or nan (fp16: an overflow), or the loss or norm is not finite
    g *= 1 / (tokens x scale) x min(1, clip / (norm + 1e-6));  optimizer.step() on the masters

with tokens the clock's token count summed over the pushes, so the update is data parallelism's over the
same global batch (paratrain.comm.norms: divide_and_clip_). The learning rates come with the pushes (the
trainers run the schedule).

Dedicated servers run a loop (paratrain.param_server.loops): synchronous (every trainer's push of a clock
received in trainer order, summed, applied, the new slices sent back to every trainer) or asynchronous with
bounded staleness (paratrain.param_server.async_server). A trainer that also serves a slice (colocated) runs the same
update from its client (paratrain.param_server.client).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from paratrain.comm import all_reduce
from paratrain.comm.norms import divide_and_clip_
from paratrain.param_server.sparse import sparse_grad, sum_rows
from paratrain.param_server.protocol import BODY, HEAD, REPLY, Header, Peers, nbytes, post_recv, post_send, wait
from paratrain.comm.flat import FlatGroup, optimizer_state_bytes
from paratrain.topology.mesh import AxisGroup


@dataclass
class ClockResult:
    """What a clock's update gave: sent back with the parameters (REPLY)."""

    version: int
    """Clocks applied after this one."""
    loss: float = 0.0
    tokens: float = 0.0
    norm: float = 0.0
    skipped: bool = False
    stale_max: float = 0.0
    """The most clocks a push of this clock was behind (its clock less the version it computed on)."""
    stale_mean: float = 0.0


@dataclass
class Push:
    """One push, or a clock's sum of them: the dense slices, and per sparse table its parts (ids, rows)."""

    dense: list[torch.Tensor]
    sparse: list[list[tuple[torch.Tensor, torch.Tensor]]]

    def copy(self) -> Push:
        return Push([t.clone() for t in self.dense], [list(parts) for parts in self.sparse])

    @property
    def nbytes(self) -> int:
        """Bytes of the dense slices."""
        return nbytes(self.dense)

    def add(self, other: Push) -> Push:
        """This sum and `other` (the dense slices added, the sparse parts kept in order: summed in apply)."""
        for mine, theirs in zip(self.dense, other.dense):
            mine.add_(theirs)
        for mine_parts, theirs_parts in zip(self.sparse, other.sparse):
            mine_parts.extend(theirs_parts)
        return self


@dataclass
class Exchange:
    """How this server talks: the ranks, the gloo group every message goes over, the servers' own group
    (the norm's all-reduce; None with one server)."""

    peers: Peers
    pg: dist.ProcessGroup
    servers: AxisGroup | None


@dataclass
class ShardServer:
    index: int
    groups: list[FlatGroup]
    """Its slices: each bucket's FlatGroup with shard_index = index (master = the slice)."""
    optimizer: torch.optim.Optimizer
    """Over the groups' masters (paratrain.comm.flat.point_optimizer_at)."""
    exchange: Exchange
    clip: float = 0.0
    on_non_finite: str = "raise"
    version: int = 0
    """Clocks applied so far."""
    ready: bool = False
    """The slices hold the run's values: trainer 0's INIT arrived, or a checkpoint was loaded."""
    last: ClockResult = field(default_factory=lambda: ClockResult(0))
    before_step: Callable[[int], None] | None = None
    """Called with the (1-based) step whose update is about to be applied (fault injection)."""
    tables: list[FlatGroup] = field(default_factory=list)
    """Its rows of each sparse table (paratrain.param_server.sparse): shard `index` of the table's group."""
    widths: list[int] = field(default_factory=list)
    """Each sparse table's row width D."""
    dirty: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    """Trainer -> per table, the rows updated since that trainer last received them."""
    exchange_peak: int = 0
    """The most bytes of pushed gradients held at once (received, or summed for a clock not yet applied)."""
    received_bytes: int = 0
    """Bytes of pushes received so far (dense slices, sparse ids and rows; headers aside)."""
    sent_bytes: int = 0
    """Bytes of parameters sent in replies so far (dense slices, sparse ids and rows; headers aside)."""
    unsent: list[tuple[dist.Work, str]] = field(default_factory=list)
    """Replies posted and not yet received (the asynchronous loop's): they read the slices, so they complete before
    an update changes them (finish_replies)."""

    @property
    def slices(self) -> list[torch.Tensor]:
        """This server's current values: each bucket's master slice."""
        return [g.master.data for g in self.groups]

    def rows(self, table: int) -> torch.Tensor:
        """Sparse table `table`'s rows on this server, [V / S, D] (a view of its master)."""
        return self.tables[table].master.data.view(-1, self.widths[table])

    @property
    def optimizer_groups(self) -> int:
        return len(self.optimizer.param_groups)

    def memory(self) -> dict[str, int]:
        """Bytes this server holds between clocks ("params": its slices and table rows; "optimizer": their
        optimizer state), and "exchange": the most bytes of pushes it held at once."""
        groups = self.groups + self.tables
        return {"params": sum(g.master.numel() * g.master.element_size() for g in groups),
                "optimizer": optimizer_state_bytes(self.optimizer), "exchange": self.exchange_peak}

    def hold(self, pushes: list[Push]) -> None:
        """Note the pushes held at once now (exchange_peak)."""
        self.exchange_peak = max(self.exchange_peak, sum(push.nbytes for push in pushes))

    def zeros(self) -> list[torch.Tensor]:
        return [torch.zeros_like(s) for s in self.slices]

    # --- the update ---

    @torch.no_grad()
    def apply(self, push: Push, *, loss: float, tokens: float, scale: float, lrs: tuple[float, ...],
              behind: list[int]) -> ClockResult:
        """One clock's update from its summed gradients (every server calls it for the same clock: the
        norm's all-reduce). behind: each push's clock less the version it was computed on."""
        if self.before_step is not None:
            self.before_step(self.version + 1)
        grads = push.dense
        summed = [sum_rows(parts, width) for parts, width in zip(push.sparse, self.widths)]  # (ids, rows) per table
        every = grads + [rows for _, rows in summed]
        wide = torch.promote_types(every[0].dtype, torch.float32) if every else torch.float64
        squares = (torch.stack(torch._foreach_norm(every, dtype=wide)).pow(2).sum() if every
                   else torch.zeros((), dtype=wide))
        bad = torch.tensor(0.0 if all(bool(torch.isfinite(g).all()) for g in every) else 1.0, dtype=wide)
        shared = torch.stack([squares, bad])
        if self.exchange.servers is not None:
            all_reduce(shared, self.exchange.servers)
        # the replies still reading the slices complete now, not before the servers' all-reduce: a trainer receives
        # the servers' replies in order, and one it waits for may come from a server in that all-reduce
        self.finish_replies()
        divisor = torch.tensor(max(tokens, 1.0) * scale, dtype=torch.float64)
        norm = shared[0].sqrt() / divisor
        overflow = scale != 1.0 and float(shared[1]) > 0
        non_finite = not (math.isfinite(loss) and math.isfinite(float(norm)))
        skipped = overflow or non_finite
        if not skipped:
            divide_and_clip_(every, divisor, norm, self.clip)
            for group, lr in zip(self.optimizer.param_groups, lrs):
                group["lr"] = lr
            for g, master in zip(self.groups, grads):
                g.master.grad = master
            for g, (ids, rows) in zip(self.tables, summed):  # only the rows pushed: a sparse gradient
                g.master.grad = sparse_grad(ids, rows, g.master.numel())
            self.optimizer.step()
            for g in self.groups + self.tables:
                g.master.grad = None
                g.push_master()
            for trainer in range(self.exchange.peers.trainers):  # each trainer gets these rows at its next pull
                mine = self.dirty.setdefault(trainer, [torch.zeros(0, dtype=torch.int64) for _ in self.tables])
                self.dirty[trainer] = [torch.unique(torch.cat([d, ids])) for d, (ids, _) in zip(mine, summed)]
        self.version += 1
        self.last = ClockResult(self.version, loss, tokens, float(norm), skipped, float(max(behind, default=0)),
                                sum(behind) / len(behind) if behind else 0.0)
        return self.last

    # --- messages ---

    def reply(self, trainer: int) -> list[dist.Work]:
        """Send trainer `trainer` the newest statistics, this server's slices and the sparse rows updated since
        its last reply (posted, not waited)."""
        peers, pg = self.exchange.peers, self.exchange.pg
        r = self.last
        header = Header(REPLY, self.index, version=self.version, loss=r.loss, tokens=r.tokens, norm=r.norm,
                        skipped=r.skipped, stale_max=r.stale_max, stale_mean=r.stale_mean).pack(self.optimizer_groups)
        rank = peers.trainer_rank(trainer)
        works = [post_send(header, rank, HEAD, pg)] + [post_send(s, rank, BODY, pg) for s in self.slices]
        self.sent_bytes += nbytes(self.slices)
        dirty = self.dirty.pop(trainer, [torch.zeros(0, dtype=torch.int64) for _ in self.tables])
        for table, ids in enumerate(dirty):
            rows = self.rows(table)[ids].reshape(-1).contiguous()
            works += [post_send(t, rank, BODY, pg) for t in (torch.tensor([ids.numel()]), ids.contiguous(), rows)]
            self.sent_bytes += nbytes([ids, rows])
        return works

    def post_reply(self, trainer: int) -> None:
        """Post a reply to trainer `trainer` and go on (the asynchronous loop): finish_replies completes it."""
        what = f"{self.exchange.peers.describe_server(self.index)} sending parameters to " \
               f"{self.exchange.peers.describe_trainer(trainer)}"
        self.unsent += [(work, what) for work in self.reply(trainer)]

    def finish_replies(self) -> None:
        """Wait until every posted reply is received (before the slices change, and when the loop ends)."""
        for work, what in self.unsent:
            wait(work, what)
        self.unsent.clear()

    def receive(self, trainer: int) -> tuple[list[torch.Tensor], list[dist.Work]]:
        """Post the receives of a push's dense slices from trainer `trainer`: (buffers, works)."""
        peers, pg = self.exchange.peers, self.exchange.pg
        buffers = self.zeros()
        rank = peers.trainer_rank(trainer)
        return buffers, [post_recv(b, rank, BODY, pg) for b in buffers]

    def receive_rows(self, trainer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The sparse part of trainer `trainer`'s push, after its dense slices: (ids, rows flattened) per table."""
        peers, pg = self.exchange.peers, self.exchange.pg
        rank, parts = peers.trainer_rank(trainer), []
        what = f"the sparse rows from {peers.describe_trainer(trainer)} to {peers.describe_server(self.index)}"
        for table, width in enumerate(self.widths):
            count = torch.zeros(1, dtype=torch.int64)
            wait(post_recv(count, rank, BODY, pg), what)
            ids = torch.empty(int(count), dtype=torch.int64)
            rows = torch.empty(int(count) * width, dtype=self.tables[table].master.dtype)
            for work in (post_recv(ids, rank, BODY, pg), post_recv(rows, rank, BODY, pg)):
                wait(work, what)
            self.received_bytes += nbytes([ids, rows])
            parts.append((ids, rows))
        return parts

    def receive_push(self, trainer: int) -> Push:
        """Trainer `trainer`'s whole push (its dense slices, then its sparse rows), waited for."""
        buffers, works = self.receive(trainer)
        for work in works:
            wait(work, f"the gradient push from {self.exchange.peers.describe_trainer(trainer)} to "
                       f"{self.exchange.peers.describe_server(self.index)}")
        self.received_bytes += nbytes(buffers)
        return Push(buffers, [[part] for part in self.receive_rows(trainer)])

    def receive_init(self) -> None:
        """Trainer 0's initial values of this server's slices and rows (a dedicated server at the start)."""
        buffers, works = self.receive(0)
        for work in works:
            wait(work, f"the initial parameters from {self.exchange.peers.describe_trainer(0)}")
        for s, b in zip(self.slices, buffers):
            s.copy_(b)
        for g in self.tables:
            wait(post_recv(g.master.data, self.exchange.peers.trainer_rank(0), BODY, self.exchange.pg),
                 f"the initial rows from {self.exchange.peers.describe_trainer(0)}")
        self.ready = True

    def loaded(self, step: int) -> None:
        """This server's slices were loaded from the checkpoint of `step` steps: they hold the run's values, and the
        next clock is `step` + 1."""
        self.version = step
        self.ready = True

    def sync_clock(self, headers: list[Header], local: Push | None = None) -> ClockResult:
        """A synchronous clock: every trainer's push received and summed in trainer order (`local`: this
        process's own, colocated), then applied."""
        peers = self.exchange.peers
        posted = {i: self.receive(i) for i in range(peers.trainers) if not (local is not None and i == self.index)}
        held = [Push(buffers, []) for buffers, _ in posted.values()]  # every trainer's receive, posted at once
        self.received_bytes += sum(push.nbytes for push in held)
        total: Push | None = None
        for i in range(peers.trainers):
            if i in posted:
                buffers, works = posted[i]
                for work in works:
                    wait(work, f"the gradient push from {peers.describe_trainer(i)} to "
                               f"{peers.describe_server(self.index)}")
                push = Push(buffers, [[part] for part in self.receive_rows(i)])  # the server's own: summed into
            else:
                assert local is not None
                push = local
                if total is None:  # the caller's gradients are only read: the sum starts in a copy
                    push = local.copy()
                    held.append(push)
            total = push if total is None else total.add(push)
        self.hold(held)
        assert total is not None
        loss = sum(h.loss for h in headers)
        tokens = sum(h.tokens for h in headers)
        return self.apply(total, loss=loss, tokens=tokens, scale=headers[0].scale, lrs=headers[0].lrs,
                          behind=[h.clock - h.version for h in headers])

