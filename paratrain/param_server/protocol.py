"""The parameter server's messages: what trainers and servers send each other, over gloo point-to-point.

Every message goes over a gloo group of every rank (CPU tensors: CUDA trainers are refused,
paratrain.config.parallel.PS_ON_CPU). It is a header (float64 [HEADER + optimizer groups]) on tag HEAD, followed by its payload
(the bucket slices, one message per bucket) on tag BODY from the same sender. gloo delivers the messages
of one sender and tag in order, so a server that takes the next header from any trainer (recv from any
source) then reads that trainer's payload, never another's.

    kind       PUSH a gradient, PULL parameters, SAVE a checkpoint, STOP, INIT (trainer 0's parameters at the
               start), REPLY (a server's parameters and the newest applied clock's statistics)
    clock      the step the message belongs to (0-based): PUSH the gradient of step `clock`, PULL the
               parameters step `clock` computes on, SAVE after `clock` steps
    version    PUSH: the version of the parameters the gradient was computed on (the clocks applied when
               they were pulled); REPLY: the version sent
    loss, tokens  PUSH: this trainer's loss sum and token count of the step; REPLY: the newest applied
               clock's, summed over every trainer
    scale      the fp16 loss scale the gradient carries (1 otherwise)
    norm, skipped  REPLY: the newest applied clock's global gradient norm and whether its update was skipped
               (an fp16 overflow, or a non-finite loss or norm)
    stale_max, stale_mean  REPLY: how many clocks the newest applied clock's pushes were behind, most and mean
    lrs        PUSH: each optimizer group's learning rate at this step (the trainers run the schedule)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

PUSH, PULL, SAVE, STOP, INIT, REPLY = 1.0, 2.0, 3.0, 4.0, 5.0, 6.0
KINDS = {PUSH: "push", PULL: "pull", SAVE: "save", STOP: "stop", INIT: "init", REPLY: "reply"}
HEAD, BODY = 1, 2
"""Tags: headers, and payloads (bucket slices)."""
_FIELDS = ("kind", "sender", "clock", "version", "loss", "tokens", "scale", "norm", "skipped", "stale_max",
           "stale_mean")
HEADER = len(_FIELDS)
"""Header entries before the learning rates."""


@dataclass(frozen=True)
class Header:
    kind: float
    sender: int
    """A trainer's index (0 .. T-1), or a server's (in a REPLY)."""
    clock: int = 0
    version: int = 0
    loss: float = 0.0
    tokens: float = 0.0
    scale: float = 1.0
    norm: float = 0.0
    skipped: bool = False
    stale_max: float = 0.0
    """REPLY: the most clocks any push of the newest applied clock was behind (clock - version)."""
    stale_mean: float = 0.0
    """REPLY: the mean over those pushes."""
    lrs: tuple[float, ...] = ()

    def pack(self, groups: int) -> torch.Tensor:
        values = [self.kind, float(self.sender), float(self.clock), float(self.version), self.loss, self.tokens,
                  self.scale, self.norm, float(self.skipped), self.stale_max, self.stale_mean]
        lrs = list(self.lrs) + [0.0] * (groups - len(self.lrs))
        return torch.tensor(values + lrs, dtype=torch.float64)

    @classmethod
    def unpack(cls, tensor: torch.Tensor) -> Header:
        v = tensor.tolist()
        return cls(kind=v[0], sender=int(v[1]), clock=int(v[2]), version=int(v[3]), loss=v[4], tokens=v[5],
                   scale=v[6], norm=v[7], skipped=bool(v[8]), stale_max=v[9], stale_mean=v[10],
                   lrs=tuple(v[HEADER:]))

    @property
    def name(self) -> str:
        return KINDS.get(self.kind, f"kind {self.kind}")


class ServerLost(RuntimeError):
    """A peer of the parameter server's exchange failed or did not answer in time; the message names it."""


@dataclass(frozen=True)
class Peers:
    """The ranks of the exchange: trainers 0 .. T-1 are world ranks 0 .. T-1; servers are the S ranks after
    them (dedicated), or the trainers themselves (colocated: server j is trainer j)."""

    trainers: int
    servers: int
    dedicated: bool

    def trainer_rank(self, index: int) -> int:
        return index

    def server_rank(self, index: int) -> int:
        return self.trainers + index if self.dedicated else index

    def describe_server(self, index: int) -> str:
        return f"parameter server {index} (rank {self.server_rank(index)})"

    def describe_trainer(self, index: int) -> str:
        return f"trainer {index} (rank {self.trainer_rank(index)})"


def nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of message bodies (the byte counters of servers and clients)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def post_send(tensor: torch.Tensor, rank: int, tag: int, group: dist.ProcessGroup) -> dist.Work:
    return dist.isend(tensor, rank, group=group, tag=tag)


def post_recv(tensor: torch.Tensor, rank: int, tag: int, group: dist.ProcessGroup) -> dist.Work:
    return dist.irecv(tensor, rank, group=group, tag=tag)


def wait(work: dist.Work, what: str) -> None:
    """Wait for a point-to-point operation; a failure (the peer died, the timeout passed) names the peer."""
    try:
        work.wait()
    except RuntimeError as error:
        raise ServerLost(f"{what} failed: {str(error).splitlines()[0]}") from error


def recv_header(groups: int, rank: int | None, what: str, group: dist.ProcessGroup) -> tuple[Header, int]:
    """The next header from `rank`, or from any rank (None; gloo only): (header, the sender's world rank)."""
    buffer = torch.empty(HEADER + groups, dtype=torch.float64)
    try:
        sender = dist.recv(buffer, rank, group=group, tag=HEAD)
    except RuntimeError as error:
        raise ServerLost(f"{what} failed: {str(error).splitlines()[0]}") from error
    return Header.unpack(buffer), int(sender)
