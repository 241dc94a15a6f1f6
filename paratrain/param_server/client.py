"""ServerClient: a trainer's side of the parameter server.

The trainer keeps every flat bucket whole (paratrain.param_server.layout): its parameters are views of the
buckets' flat buffers, its gradients views of a second set, accumulated over the step's micro-batches as in
plain data parallelism. Per step, after backward (Engine.step calls `update`):

    sync, dedicated servers    push each server its slice of every bucket (a header, then one message per
                               bucket), then receive from each its updated slices, straight into the
                               parameters' buffers, with the clock's global loss, tokens and norm
    sync, colocated            trainer i is server i: it pushes the other trainers their slices, sums the
                               pushes of its own slice in trainer order, updates it (a ShardServer over views
                               of its own buffers), sends it to the others and receives theirs: a
                               reduce-scatter and an all-gather in point-to-point messages, ZeRO-2's traffic
    async (dedicated)          push, then pull the parameters of the next clock, which a server answers
                               once it has applied clock c - s (paratrain.param_server.async_server); the
                               step's staleness is its clock less the oldest version it received

Nothing is summed over the trainers on the trainers: the servers hold the only optimizer state. At the start
every trainer says INIT and trainer 0 sends the servers its slices (the trainers hold the same values:
parallelize broadcasts them); a trainer that loaded a checkpoint sends nothing (the servers loaded theirs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from paratrain.comm.flat import FlatGroup
from paratrain.comm.norms import NormPart
from paratrain.param_server.protocol import (BODY, HEAD, INIT, PULL, PUSH, SAVE, STOP, Header, nbytes, post_recv,
                                             post_send, recv_header, wait)
from paratrain.param_server.server import ClockResult, Exchange, Push, ShardServer
from paratrain.param_server.sparse import TouchedRows


@dataclass(frozen=True)
class Reply:
    """What a step's update gave this trainer."""

    loss: float
    """The clock's loss sum over every trainer (sync), or this trainer's own (async)."""
    tokens: float
    norm: float
    """The global gradient norm of the newest clock the servers applied (sync: this step's)."""
    skipped: bool
    version: int
    """The oldest version of the parameters this trainer received (sync: the clocks applied, this one too)."""
    staleness: int = 0
    """Clocks of updates the parameters of this trainer's next step miss (async; 0 in sync)."""
    stale_max: float = 0.0
    """Over every trainer's push of the newest applied clock: the most clocks it was behind."""
    stale_mean: float = 0.0
    asynchronous: bool = False


@dataclass
class ServerClient:
    buckets: list[FlatGroup]
    """Every bucket, whole (colocated: shard `index` is also the local server's master)."""
    exchange: Exchange
    index: int
    """This trainer's index (0 .. T-1)."""
    optimizer_groups: int
    mode: str = "sync"
    staleness: int = 0
    local: ShardServer | None = None
    """Colocated: the server of this trainer's own slices."""
    clock: int = 0
    """Steps pushed so far: the next push's clock."""
    version: int = 0
    """The version of the parameters this trainer holds."""
    loaded: bool = False
    """Set when a checkpoint was loaded: the servers loaded theirs, nothing to INIT."""
    record: list[tuple[int, tuple[int, ...]]] = field(default_factory=list)
    """Async: (clock, the version received from each server) of every pull."""
    tables: list[TouchedRows] = field(default_factory=list)
    """The sparse tables (paratrain.param_server.sparse): their rows travel only where a step touched them."""
    sparse_bytes: int = 0  # sparse gradient rows pushed so far (unique ids x width x element size per server, step)
    pushed_bytes: int = 0  # gradients this trainer sent so far (dense slices, sparse ids and rows; headers aside)
    pulled_bytes: int = 0  # parameters it received so far (dense slices, sparse ids and rows; headers aside)
    keep_grads: bool = False
    """Keep the dense gradient buffers between steps (ParallelConfig.keep_grads); False: released after each."""
    grads: list[torch.Tensor] = field(init=False)

    params_sharded = False
    """Every trainer holds the whole parameters."""

    @property
    def groups(self) -> list[FlatGroup]:
        """The flat groups whose masters (and optimizer state) this rank holds: colocated, its own slices;
        with dedicated servers none (the servers hold them: a trainer's parameters are copies)."""
        return self.buckets + [t.group for t in self.tables] if self.local is not None else []

    def __post_init__(self) -> None:
        self.grads = []  # the dense buckets' gradients, allocated by begin_step, released by after_step
        self._started = False

    # --- the gradient strategy's protocol (paratrain.hybrid.parts.GradientStrategy) ---

    def attach(self) -> None:
        pairs = [*zip(self.buckets, self.grads), *((t.group, t.grad) for t in self.tables)]
        for g, flat in pairs:
            for param, view in zip(g.params, g.views(flat)):
                if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                    param.grad = view

    def begin_step(self) -> None:
        if not self.grads:
            self.grads = [torch.zeros_like(g.param_flat) for g in self.buckets]
        self.attach()

    def begin_micro_batch(self, *, sync: bool) -> None:
        """Every micro-batch only accumulates: the push happens once, in update()."""

    def end_backward(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def owned_grads(self) -> list[torch.Tensor]:
        return self.grads + [t.grad for t in self.tables]

    def norm_parts(self) -> list[NormPart]:
        return []  # the servers compute the norm

    def before_optimizer_step(self) -> None:
        pass

    def after_step(self) -> None:
        """The dense gradients released (keep_grads: zeroed), the tables' rows zeroed (they accumulate sparsely)."""
        for flat in self.grads if self.keep_grads else ():
            flat.zero_()
        if not self.keep_grads:
            self.grads = []
            for param in (p for g in self.buckets for p in g.params):
                param.grad = None
        for table in self.tables:
            table.grad.zero_()
            table.clear()

    def model_state(self) -> dict[str, torch.Tensor]:
        return {}

    def close(self) -> None:
        """No gradient hook to remove (the buckets' views accumulate; ServedUpdate.close stops the servers)."""

    def memory(self) -> dict[str, int]:
        groups = self.buckets + [t.group for t in self.tables]
        tables = sum(t.grad.numel() * t.grad.element_size() for t in self.tables)  # kept: sparse rows accumulate
        dense = sum(g.param_flat.numel() * g.param_flat.element_size() for g in self.buckets)
        return {"params": sum(g.param_flat.numel() * g.param_flat.element_size() for g in groups),
                "grads": dense + tables, "grads_kept": tables + (dense if self.keep_grads else 0)}

    def check_memory_load(self) -> None:
        """Engine.load_state_dict: refused with dedicated servers, which hold the parameters' values."""
        if self.local is None:
            raise RuntimeError("with dedicated parameter servers the parameters and their optimizer state live on "
                               "the servers, which a trainer's load_state_dict cannot reach: resume from a sharded "
                               "checkpoint (the servers load their slices of it)")

    def mark_loaded(self, step: int) -> None:
        """A checkpoint of `step` steps was loaded (the servers loaded their slices of it): nothing to INIT,
        and the next push is clock `step`."""
        self.loaded = True
        self.clock = self.version = step

    # --- the exchange ---

    def update(self, *, loss: float, tokens: float, scale: float, lrs: tuple[float, ...]) -> Reply:
        """Push this step's gradients and take the parameters of the next (module docstring)."""
        if not self._started:
            self._start()
        header = Header(PUSH, self.index, clock=self.clock, version=self.version, loss=loss, tokens=tokens,
                        scale=scale, lrs=lrs)
        if self.local is not None:
            result = self._colocated_clock(header)
            self.clock += 1
            self.version = result.version
            return Reply(result.loss, result.tokens, result.norm, result.skipped, result.version)
        sends = [w for j in range(self.exchange.peers.servers) for w in self._push(j, header)]
        self.clock += 1
        if self.mode == "sync":
            replies = self._pull(None)
        else:
            replies = self._pull(self.clock)
        for work in sends:
            wait(work, "a gradient push")
        first = replies[0]
        self.version = min(r.version for r in replies)
        if self.mode == "sync":
            return Reply(first.loss, first.tokens, first.norm, first.skipped, self.version)
        self.record.append((self.clock, tuple(r.version for r in replies)))
        return Reply(loss, tokens, first.norm, first.skipped, self.version, staleness=self.clock - self.version,
                     stale_max=max(r.stale_max for r in replies), stale_mean=first.stale_mean, asynchronous=True)

    def _start(self) -> None:
        """Every trainer says INIT; trainer 0 sends the servers its slices (not after a checkpoint was loaded:
        the servers loaded theirs). Colocated: the trainers hold the same values already."""
        self._started = True
        if self.local is not None or self.loaded:
            return
        peers = self.exchange.peers
        header = Header(INIT, self.index).pack(self.optimizer_groups)
        works = []
        for j in range(peers.servers):
            rank = peers.server_rank(j)
            works.append(post_send(header, rank, HEAD, self.exchange.pg))
            if self.index == 0:
                groups = self.buckets + [t.group for t in self.tables]
                works += [post_send(self._slice(g.param_flat, g, j), rank, BODY, self.exchange.pg) for g in groups]
        for work in works:
            wait(work, "the initial parameters to the servers")

    def _slice(self, flat: torch.Tensor, g: FlatGroup, server: int) -> torch.Tensor:
        return flat[server * g.shard_numel: (server + 1) * g.shard_numel]

    def _push(self, server: int, header: Header) -> list[dist.Work]:
        rank = self.exchange.peers.server_rank(server)
        pg = self.exchange.pg
        slices = [self._slice(flat, g, server) for g, flat in zip(self.buckets, self.grads)]
        works = [post_send(header.pack(self.optimizer_groups), rank, HEAD, pg)]
        works += [post_send(t, rank, BODY, pg) for t in slices]
        self.pushed_bytes += nbytes(slices)
        for table in self.tables:  # [count], ids, rows: only the rows this step touched
            parts = table.push_parts(server)
            self.sparse_bytes += nbytes(parts[2:])
            self.pushed_bytes += nbytes(parts[1:])
            works += [post_send(t, rank, BODY, pg) for t in parts]
        return works

    def _receive_reply(self, server: int) -> Header:
        """Server `server`'s reply: its header, its slices (into the parameters' buffers), then each sparse
        table's rows it updated (into the table)."""
        peers, pg = self.exchange.peers, self.exchange.pg
        rank, who = peers.server_rank(server), peers.describe_server(server)
        slices = [self._slice(g.param_flat, g, server) for g in self.buckets]
        works = [post_recv(t, rank, BODY, pg) for t in slices]
        header, _ = recv_header(self.optimizer_groups, rank, f"the reply of {who}", pg)
        for work in works:
            wait(work, f"the parameters from {who}")
        self.pulled_bytes += nbytes(slices)
        for table in self.tables:
            self.pulled_bytes += table.receive(server, rank, pg, f"the sparse rows from {who}")
        return header

    def _pull(self, clock: int | None) -> list[Header]:
        """Receive every server's reply (its header and slices, into the parameters' buffers); clock: ask for
        the parameters of that clock first (async), None: the reply follows the push (sync)."""
        peers, pg = self.exchange.peers, self.exchange.pg
        asks = []
        if clock is not None:
            ask = Header(PULL, self.index, clock=clock).pack(self.optimizer_groups)
            asks = [post_send(ask, peers.server_rank(j), HEAD, pg) for j in range(peers.servers)]
        replies = [self._receive_reply(j) for j in range(peers.servers)]
        for work in asks:
            wait(work, "a pull request")
        return replies

    def _colocated_clock(self, header: Header) -> ClockResult:
        """Trainer i as server i: push the others their slices, sum and update its own, exchange the results."""
        assert self.local is not None
        peers, pg = self.exchange.peers, self.exchange.pg
        others = [j for j in range(peers.trainers) if j != self.index]
        sends = [w for j in others for w in self._push(j, header)]
        headers = []
        for j in range(peers.trainers):
            headers.append(header if j == self.index else recv_header(
                self.optimizer_groups, peers.trainer_rank(j), f"the push of {peers.describe_trainer(j)}", pg)[0])
        own = Push([self._slice(flat, g, self.index) for g, flat in zip(self.buckets, self.grads)],
                   [[tuple(table.push_parts(self.index)[1:])] for table in self.tables])
        result = self.local.sync_clock(headers, local=own)  # updates this trainer's own slices in place
        self.local.dirty.pop(self.index, None)  # its own rows are updated in place
        replies = [w for j in others for w in self.local.reply(j)]
        for j in others:  # the other servers' updated slices
            self._receive_reply(j)
        for work in sends + replies:
            wait(work, "the colocated exchange")
        return result

    def save(self, step: int) -> None:
        """Tell the servers a checkpoint of `step` steps is being written (they write their slices)."""
        self._tell(SAVE, step)

    def stop(self) -> None:
        """The run is over: the servers leave their loop (async: once every clock is applied)."""
        if self.mode == "async":
            self._pull(self.clock + self.staleness)  # wait until every clock is applied, take the result
        self._tell(STOP, self.clock)

    def _tell(self, kind: float, clock: int) -> None:
        if self.local is not None:
            return
        if not self._started:
            self._start()
        peers, pg = self.exchange.peers, self.exchange.pg
        header = Header(kind, self.index, clock=clock).pack(self.optimizer_groups)
        works = [post_send(header, peers.server_rank(j), HEAD, pg) for j in range(peers.servers)]
        for work in works:
            wait(work, "a message to the servers")

