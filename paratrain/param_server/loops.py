"""A dedicated server's loop until every trainer says STOP: synchronous here, asynchronous with bounded
staleness in paratrain.param_server.async_server.

Synchronous: each round, one header from every trainer, in trainer order; they must all be of one kind:

    PUSH   the clock's pushes received and summed in trainer order, applied (ShardServer.sync_clock), and
           every trainer sent the new slices
    PULL   every trainer sent the current slices
    INIT   trainer 0's initial values of this server's slices (every trainer says it)
    SAVE   this server writes its pieces of the checkpoint the trainers are writing
    STOP   the loop returns
"""

from __future__ import annotations

from typing import Callable

from paratrain.param_server.async_server import serve_async
from paratrain.param_server.protocol import INIT, PULL, PUSH, SAVE, STOP, ServerLost, recv_header, wait
from paratrain.param_server.server import ShardServer


def serve_loop(server: ShardServer, *, staleness: int | None = None,
               save: Callable[[int], None] | None = None) -> list[tuple[int, int, int]]:
    """Serve until every trainer says STOP. staleness None: synchronous; an int: asynchronous with that bound.
    save: writes this server's pieces of the checkpoint of a step, when the trainers write theirs (collective
    with them; None: a SAVE writes nothing). Returns the pushes in the order they were applied, as (clock, trainer,
    version) (synchronous: trainer order)."""
    if staleness is not None:
        return serve_async(server, staleness, save)
    peers, log = server.exchange.peers, []
    where = server.exchange.peers.describe_server(server.index)
    while True:
        headers = [recv_header(server.optimizer_groups, peers.trainer_rank(i),
                               f"{where} waiting for {peers.describe_trainer(i)}", server.exchange.pg)[0]
                   for i in range(peers.trainers)]
        kinds = {h.kind for h in headers}
        if len(kinds) != 1:
            raise ServerLost(f"{where} received {sorted(h.name for h in headers)} from the trainers in one "
                             "synchronous clock: every trainer must send the same")
        kind = kinds.pop()
        if kind == STOP:
            return log
        if kind == INIT:  # every trainer says it; trainer 0's carries the values
            server.receive_init()
            continue
        if kind == SAVE:
            if save is not None:
                save(headers[0].clock)
            continue
        if kind == PUSH:
            server.sync_clock(headers)
            log += [(headers[0].clock, i, h.version) for i, h in enumerate(headers)]
        elif kind != PULL:
            raise ServerLost(f"{where} cannot serve a {headers[0].name} message")
        works = [w for i in range(peers.trainers) for w in server.reply(i)]
        for work in works:
            wait(work, f"{where} sending parameters")
