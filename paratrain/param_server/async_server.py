"""A dedicated server's asynchronous loop with bounded staleness (the SSP rule of Ho et al. 2013, "More
Effective Distributed ML via a Stale Synchronous Parallel Parameter Server", NIPS).

Trainers run ahead of each other by at most `staleness` clocks:

    a push carries its clock c and the version v of the parameters it was computed on; it is applied
    atomically on arrival: added to its clock's sum, in arrival order
    a clock's update runs once every trainer has pushed it, clocks in order (ShardServer.apply)
    a pull at clock c is answered once the server has applied clock c - s - 1 (version >= c - s); until
    then it waits, and its trainer with it

so the parameters a step computes on miss at most s clocks of updates (staleness = c - v <= s). With s = 0
every trainer computes clock c on the parameters after clock c - 1: the synchronous run, and with two
trainers bit for bit (a + b = b + a; with more, sums in another order differ by rounding). With larger s a
fast trainer goes on while a slow one computes, and the result depends on the order pushes arrived in: the
server returns its pushes as (clock, trainer, version) in that order, and paratrain.param_server.replay
reproduces the run from them in one process, exactly.

A checkpoint after k steps waits until every trainer asked for it and clock k - 1 is applied; the run stops
when every trainer has said STOP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from paratrain.param_server.protocol import INIT, PULL, PUSH, SAVE, STOP, ServerLost, recv_header

if TYPE_CHECKING:
    from paratrain.param_server.server import Push, ShardServer


@dataclass
class _Clock:
    """The pushes of one clock received so far."""

    total: Push | None = None
    pushes: int = 0
    loss: float = 0.0
    tokens: float = 0.0
    scale: float = 1.0
    lrs: tuple[float, ...] = ()
    behind: list[int] = field(default_factory=list)
    """Each push's clock less the version it computed on."""


@dataclass
class _State:
    clocks: dict[int, _Clock] = field(default_factory=dict)
    pulls: list[tuple[int, int]] = field(default_factory=list)
    """(trainer, clock) of pulls that wait for their clock's version."""
    saves: dict[int, set[int]] = field(default_factory=dict)
    """Checkpoint step -> the trainers that asked for it."""
    stopped: set[int] = field(default_factory=set)
    log: list[tuple[int, int, int]] = field(default_factory=list)
    save: Callable[[int], None] | None = None
    """Writes this server's pieces of the checkpoint of a step (serve_loop's `save`)."""


def serve_async(server: ShardServer, staleness: int,
                save: Callable[[int], None] | None = None) -> list[tuple[int, int, int]]:
    """Serve until every trainer has stopped; the pushes in arrival order as (clock, trainer, version). save: as
    serve_loop's."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    peers, state = server.exchange.peers, _State(save=save)
    where = f"{peers.describe_server(server.index)} waiting for any trainer"
    while len(state.stopped) < peers.trainers:
        header, _ = recv_header(server.optimizer_groups, None, where, server.exchange.pg)
        trainer = header.sender
        if header.kind == PUSH:
            push = server.receive_push(trainer)
            clock = state.clocks.setdefault(header.clock, _Clock(scale=header.scale, lrs=header.lrs))
            clock.total = push if clock.total is None else clock.total.add(push)
            held = [c.total for c in state.clocks.values() if c.total is not None]  # the clocks' sums
            server.hold(held + ([push] if clock.total is not push else []))  # and this push, once added
            clock.pushes += 1
            clock.loss += header.loss
            clock.tokens += header.tokens
            clock.behind.append(header.clock - header.version)
            state.log.append((header.clock, trainer, header.version))
            _apply_complete(server, state, staleness)
        elif header.kind == PULL:
            state.pulls.append((trainer, header.clock))
            _answer_pulls(server, state, staleness)
        elif header.kind == SAVE:
            state.saves.setdefault(header.clock, set()).add(trainer)
            _save_when_ready(server, state)
        elif header.kind == STOP:
            state.stopped.add(trainer)
        elif header.kind == INIT:  # every trainer says it; trainer 0's carries the values
            if trainer == 0:
                server.receive_init()
                _answer_pulls(server, state, staleness)
        else:
            raise ServerLost(f"{peers.describe_server(server.index)} cannot serve a {header.name} message")
    server.finish_replies()
    return state.log


def _apply_complete(server: ShardServer, state: _State, staleness: int) -> None:
    """Apply every complete clock in order, then answer the pulls and saves they unblock."""
    trainers = server.exchange.peers.trainers
    while server.version in state.clocks and state.clocks[server.version].pushes == trainers:
        clock = state.clocks.pop(server.version)
        assert clock.total is not None
        server.apply(clock.total, loss=clock.loss, tokens=clock.tokens, scale=clock.scale, lrs=clock.lrs,
                     behind=clock.behind)
        _answer_pulls(server, state, staleness)
        _save_when_ready(server, state)


def _answer_pulls(server: ShardServer, state: _State, staleness: int) -> None:
    if not server.ready:  # no values yet: trainer 0's INIT, or a checkpoint's, comes first
        return
    ready = [(t, c) for t, c in state.pulls if server.version >= c - staleness]
    state.pulls = [(t, c) for t, c in state.pulls if server.version < c - staleness]
    for trainer, _ in ready:  # posted, not waited: its trainer may first wait for a server in an all-reduce with
        server.post_reply(trainer)  # this one (ShardServer.apply completes them before the slices change)


def _save_when_ready(server: ShardServer, state: _State) -> None:
    trainers = server.exchange.peers.trainers
    for step in sorted(state.saves):
        if len(state.saves[step]) == trainers and server.version == step:
            del state.saves[step]
            if state.save is not None:
                state.save(step)
