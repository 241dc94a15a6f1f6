"""The loop's steps under `--fault-tolerance replica` (paratrain.topology.quorum): each step's rows of the global
batch from the quorum, the step redone by the survivors when a replica group is lost, and a group that joins a
running job sent the whole state by a peer at a step boundary, over the network, with a hash check.

Rows: with Q groups in the quorum, the group at place q trains rows [q G / Q, (q + 1) G / Q) of each global batch of
G, cut over its own dp ranks as ever, so a step's samples (and keyed dropout's positions) are the same whoever
computes them: after a loss the survivors' steps are the steps the whole job would have taken.

State sent to a joiner (by each rank of the admitting group to the rank at its place): the optimizer's state dict,
the steps done, the loader's cursor, the dropout step and the loss scale (one pickled message), then every tensor
of the model's state as the strategy holds it (ZeRO's flat parameters and masters, the other parameters, the
buffers); the joiner compares the SHA-256 of those tensors' bytes with the sender's.
"""

from __future__ import annotations

import hashlib
import io
import logging
import time
from typing import Any, Protocol

import torch

from paratrain.hybrid import Engine
from paratrain.hybrid.engine import LossFn
from paratrain.topology import Context
from paratrain.topology.quorum import Epoch, Quorum, ReplicaLost


class Cursor(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class TrainLoop(Protocol):
    """What these steps read and set of the loop that runs them (paratrain.train.loop.TrainLoop)."""

    engine: Engine
    ctx: Context
    loss_fn: LossFn
    train: Cursor
    log: logging.Logger
    step: int


class ReplicaSteps:
    """What TrainLoop calls under fault tolerance: begin() once; boundary() before each step's batch is read, step()
    to run it."""

    def __init__(self, quorum: Quorum) -> None:
        self.quorum = quorum
        self.joined = ""
        """A group that joined a running job: the SHA-256 of the state it received (equal to the sender's)."""
        self.recoveries: list[dict[str, Any]] = []
        """Each recovery: the step redone, the members after it, the seconds from the failure to the redone step."""
        self.rounds_said = 0

    def begin(self, loop: TrainLoop) -> None:
        """Meet the other groups; a group joining a running job waits to be admitted and receives the state."""
        if self.quorum.start():
            epoch = self.quorum.request_join()
            self.joined = receive_state(loop, self.quorum, epoch)
            if self.quorum.leader:
                loop.log.warning("replica group %d joined at step %d (epoch %d, groups %s); its weights' SHA-256 %s "
                                 "equals replica group %d's", self.quorum.group, loop.step + 1, epoch.number,
                                 list(epoch.members), self.joined, epoch.source)

    def boundary(self, loop: TrainLoop) -> None:
        """Before step loop.step + 1 reads its batch: groups registered to join are admitted (from the next step), and
        an epoch that admits some now is entered, the admitting group sending them the state as it stands."""
        admitting = self.quorum.boundary(loop.step + 1)
        if admitting is not None:
            send_state(loop, self.quorum, admitting)

    def step(self, loop: TrainLoop, batch: Any) -> Any:
        """Step loop.step + 1 on this rank's rows under the quorum; lost groups cost a redo, not the step."""
        number = loop.step + 1
        while True:
            lo, hi = self.rows(loop, _rows(batch))
            try:
                pending = loop.engine.step(_cut(batch, lo, hi), loop.loss_fn, first_row=lo)
                self._say_lost_rounds(loop)
                if self.recoveries and self.recoveries[-1].get("seconds") is None:
                    record = self.recoveries[-1]
                    pending.stats()  # the redone step is complete
                    record["seconds"] = time.monotonic() - record["failed_at"]
                    if self.quorum.coordinator:
                        loop.log.warning("replica group(s) %s lost at step %d; the step was redone by %s: %.2f s from "
                                         "the failure to the step's end", record["lost"], number, record["members"],
                                         record["seconds"])
                return pending
            except ReplicaLost:
                failed_at = time.monotonic()
                loop.engine.grads.after_step()  # the step's gradients are forgotten; nothing was applied
                before = set(self.quorum.epoch.members)
                epoch = self.quorum.recover(number)
                self.recoveries.append({"step": number, "members": list(epoch.members), "failed_at": failed_at,
                                        "lost": sorted(before - set(epoch.members)), "seconds": None})

    def _say_lost_rounds(self, loop: TrainLoop) -> None:
        """DiLoCo's outer rounds a group was lost in (the groups meet only there: the survivors averaged without it)."""
        outer = loop.engine.update.replicas()
        while outer is not None and len(outer.lost_rounds) > self.rounds_said:
            record = outer.lost_rounds[self.rounds_said]
            self.rounds_said += 1
            self.recoveries.append({**record, "seconds": 0.0})
            if self.quorum.coordinator:
                loop.log.warning("replica group(s) %s lost in the outer round of step %d: the pseudo-gradient "
                                 "averaged over %s, the lost group's inner steps of the round left out",
                                 record["lost"], record["step"], record["members"])

    def rows(self, loop: TrainLoop, total: int) -> tuple[int, int]:
        """This rank's rows [lo, hi) of a global batch of `total` rows under the current quorum."""
        place, count = self.quorum.place()
        dp, index = loop.ctx.mesh.degree("dp"), loop.ctx.mesh.index("dp")
        share, mine = total // count, total // (count * dp)
        return place * share + index * mine, place * share + (index + 1) * mine

    def end(self) -> None:
        """The run's last step is done."""
        self.quorum.end()

    def saves(self) -> bool:
        """Whether this group writes the run's checkpoints and logs: replica group 0 (each group holds the whole
        state; one writes it)."""
        return self.quorum.group == 0


def _rows(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (tuple, list)) else batch
    return int(first.shape[0])


def _cut(batch: Any, lo: int, hi: int) -> Any:
    if isinstance(batch, (tuple, list)):
        return type(batch)(t[lo:hi] for t in batch)
    return batch[lo:hi]


def state_tensors(engine: Engine) -> list[torch.Tensor]:
    """Every tensor of this rank's training state as its strategy holds it, in one order on every group of the same
    layout: ZeRO's flat parameters (ZeRO-3: this rank's shard of them) and separate masters, the other parameters,
    the persistent buffers."""
    tensors: list[torch.Tensor] = []
    grouped: set[int] = set()
    for g in engine.flat_groups:
        tensors.append(g.param_flat if g.persistent else g.shard)  # ZeRO-3: its own shard (the full flat is freed)
        if g.own_master:
            tensors.append(g.master.data)
        grouped.update(id(p) for p in g.params)
    tensors += [p.data for p in engine.model.parameters() if id(p) not in grouped]
    tensors += [b for _, b in engine.model.named_buffers()]
    outer = engine.update.replicas()
    if outer is not None:  # DiLoCo: the outer copy and momentum (a joiner starts a round: they are the sender's)
        outer.begin()
        tensors += outer.outer + [m for m in outer.momentum if m is not None]
    return tensors


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def send_state(loop: TrainLoop, quorum: Quorum, epoch: Epoch) -> None:
    """The admitting group's ranks send each joiner's rank at their place the whole state (the other members skip)."""
    if quorum.group != epoch.source:
        return
    engine = loop.engine
    tensors = state_tensors(engine)
    header = {"step": loop.step, "loader": loop.train.state_dict(), "dropout": engine.dropout.step,
              "scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
              "optimizer": engine.optimizer.state_dict(), "digest": digest(tensors)}
    buffer = io.BytesIO()
    torch.save(header, buffer)
    message = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    for joiner in epoch.joiners:
        quorum.send(torch.tensor([message.numel()], dtype=torch.int64), joiner, 0)
        quorum.send(message, joiner, 1)
        for k, t in enumerate(tensors):
            quorum.send(t.detach().contiguous(), joiner, 2 + k)


def receive_state(loop: TrainLoop, quorum: Quorum, epoch: Epoch) -> str:
    """A joiner's ranks take the state from the admitting group's rank at their place, and check its hash (returned)."""
    assert epoch.source is not None
    engine = loop.engine
    size = torch.zeros(1, dtype=torch.int64)
    quorum.recv(size, epoch.source, 0)
    message = torch.empty(int(size.item()), dtype=torch.uint8)
    quorum.recv(message, epoch.source, 1)
    header = torch.load(io.BytesIO(message.numpy().tobytes()), weights_only=False)
    tensors = state_tensors(engine)
    with torch.no_grad():
        for k, t in enumerate(tensors):
            received = torch.empty_like(t)
            quorum.recv(received, epoch.source, 2 + k)
            t.copy_(received)
    got = digest(tensors)
    if got != header["digest"]:
        raise RuntimeError(f"replica group {quorum.group}: the state received from replica group {epoch.source} "
                           f"hashes to {got}, the sender's to {header['digest']}")
    engine.optimizer.load_state_dict(header["optimizer"])
    if engine.scaler is not None and header["scaler"] is not None:
        engine.scaler.load_state_dict(header["scaler"])
    engine.dropout.restore(header["dropout"])
    loop.train.load_state_dict(header["loader"])
    loop.step = int(header["step"])
    return got
