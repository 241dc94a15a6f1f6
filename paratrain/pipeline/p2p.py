"""The point-to-point protocol between pipeline neighbours: what the executor
(paratrain.pipeline.runtime) sends and receives across chunk boundaries, and how.

Consecutive communication actions go out as batches of point-to-point operations: first every
send of the run, then every receive; on NCCL as one grouped launch (batch_isend_irecv), on gloo,
which runs each operation on its own anyway, one by one (35 instead of 110-150 us of host time per
operation, measured). Posting sends before the receives that precede them in the program only
removes waits, so a program the simulator accepts cannot deadlock here.

An activation's data is freed as soon as its send has completed, keeping only its autograd node
(Megatron-LM's deallocate-output trick), unless the node that made it saves its own result.

The first activation sent across each chunk boundary is preceded by a small header with its shape
and dtype, once per micro-batch shape (micro-batches of a step have one shape, and a chunk's output
shape must follow from it: the sender checks). Gradients need none: the receiver knows the shape of
its own output.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from paratrain.pipeline.schedules import Action, Schedule
from paratrain.topology.mesh import AxisGroup

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64]
_HEADER = 10
_Op = tuple[bool, torch.Tensor, int]
"""A point-to-point operation: (send, not receive; the tensor; the peer's index in the pp group)."""
_AHEAD = 4
"""gloo: receives posted ahead of need (beyond the current run's): a receive posted after its
message was sent still takes 0.4-0.75 ms to complete (measured: a round trip, not a copy). NCCL
takes only the next run's, since a posted receive holds up its stream."""

Event = tuple[str, int, int, float, float]
"""(kind, chunk, micro-batch, start, end) in seconds from the step's start."""


@dataclass
class BoundaryTensors:
    """The tensors of one step that cross chunk boundaries, per (chunk, micro-batch)."""

    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """Received activations (leaves that collect their gradient), then that gradient to send back."""
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """Chunk outputs (the scaled loss for the last chunk), kept for backward."""
    shapes: dict[tuple[int, int], tuple[torch.Size, torch.dtype]] = field(default_factory=dict)
    """Shape and dtype of each chunk output: its gradient's, to receive."""
    grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """Received output gradients; under zero bubble, kept from I for W."""


@dataclass
class _Traffic:
    """What the protocol keeps during one step."""

    receives: list[Action]
    """The program's receives, in order; posted up to `next_post`, waited for up to `consumed`."""
    next_post: int = 0
    consumed: int = 0
    pending_sends: list[tuple[dist.Work, weakref.ref[torch.Tensor] | None]] = field(default_factory=list)
    """Sends not yet seen complete, with a weak reference to the activation whose data to free then: a strong one
    would keep the activation's autograd graph, and a zero-bubble W's retained one with its saved tensors, alive
    until the send completes (on gloo a send reports completion only when waited for: the step's end)."""
    headers_sent: set[int] = field(default_factory=set)
    shapes_received: dict[int, tuple[torch.Size, torch.dtype]] = field(default_factory=dict)
    posted: dict[Action, tuple[dist.Work, torch.Tensor]] = field(default_factory=dict)
    """Receives posted ahead of their action, so the transfer overlaps the compute before it."""
    local: dict[Action, torch.Tensor] = field(default_factory=dict)
    """Hand-offs between two chunks of this rank (a V schedule's turn), by the receive that takes them."""


class PeerExchange:
    """One rank's sends and receives over its pipeline group, step after step."""

    def __init__(self, group: AxisGroup, device: torch.device, schedule: Schedule, *, local_chunks: frozenset[int],
                 last_chunk: int,
                 boundary_shape: Callable[[torch.Size], tuple[torch.Size, torch.dtype]] | None = None) -> None:
        """boundary_shape: on the meta device (a dry run), the activation every chunk sends for a
        micro-batch of the given input shape; elsewhere a header message tells it (None)."""
        self.group, self.device, self.schedule = group, device, schedule
        self.stages = group.size
        self.local_chunks, self.last_chunk = local_chunks, last_chunk
        self.boundary_shape = boundary_shape
        self.sent_bytes = 0
        """Point-to-point bytes sent this step (activations, gradients and shape headers)."""
        self._grouped = dist.get_backend(group.pg) == "nccl"
        self._boundary_shapes: dict[tuple[int, tuple[Any, ...]], tuple[torch.Size, torch.dtype]] = {}
        """(sending chunk, micro-batch input shape, dtype, train) -> that chunk's output shape and dtype:
        the header goes once per boundary and micro-batch shape, not once per step."""
        self._input_key: tuple[Any, ...] = ()
        self._traffic = _Traffic(receives=[])
        self._events: list[Event] = []
        self._started = 0.0

    def start(self, program: list[Action], first_input: torch.Tensor, *, train: bool, events: list[Event],
              started: float) -> None:
        """A new step runs `program` over micro-batches shaped like `first_input`; waits for receives
        go into `events`, timed from `started`."""
        receives = [a for a in program if a.kind.startswith("RECV") and not self._local(a)]
        self._traffic = traffic = _Traffic(receives=receives)
        self._events, self._started = events, started
        self.sent_bytes = 0
        # boundaries whose activation shape is known from an earlier step with micro-batches of this shape
        self._input_key = (tuple(first_input.shape), first_input.dtype, train)
        if self.boundary_shape is not None:  # shapes only (a dry run): no header can be read, none is sent
            for chunk in range(self.last_chunk):
                self._boundary_shapes[(chunk, self._input_key)] = self.boundary_shape(first_input.shape)
        for (chunk, input_key), known in self._boundary_shapes.items():
            if input_key == self._input_key:
                if chunk in self.local_chunks:
                    traffic.headers_sent.add(chunk)
                else:
                    traffic.shapes_received[chunk] = known

    def communicate(self, program: list[Action], start: int, end: int, tensors: BoundaryTensors) -> None:
        """Run the communication actions program[start:end]: post their sends, then their receives
        and, ahead, later ones whose shape is known, in program order; wait for their receives."""
        traffic = self._traffic
        actions = [a for a in program[start:end] if not self._local(a)]
        for action in program[start:end]:  # hand-offs within the rank: a send leaves it, its receive takes it
            if self._local(action):
                self._hand_off(action, tensors)
        post_until = traffic.consumed + sum(a.kind.startswith("RECV") for a in actions)
        if self._grouped:  # and the next run's receives
            k = end
            while k < len(program) and not program[k].kind.startswith(("RECV", "SEND")):
                k += 1
            while k < len(program) and program[k].kind.startswith(("RECV", "SEND")):
                post_until += program[k].kind.startswith("RECV") and not self._local(program[k])
                k += 1
        else:
            post_until = max(post_until, traffic.consumed + _AHEAD)
        self._send(actions, tensors)
        receives = [a for a in actions if a.kind.startswith("RECV")]
        self._read_headers(receives)
        self._post_receives(min(post_until, len(traffic.receives)), tensors)
        for action in receives:
            work, buffer = traffic.posted.pop(action)
            t0 = time.perf_counter()
            work.wait()
            self._events.append(("WAIT_" + action.kind[-1], action.chunk, action.mb, t0 - self._started,
                                 time.perf_counter() - self._started))
            key = (action.chunk, action.mb)
            if action.kind == "RECV_F":
                tensors.inputs[key] = buffer.requires_grad_(buffer.is_floating_point())
            else:
                tensors.grads[key] = buffer
        traffic.consumed += len(receives)

    def _local(self, action: Action) -> bool:
        """Whether a send or receive joins two chunks of this rank."""
        return self.schedule.peer(action) == self.group.index

    def _hand_off(self, action: Action, tensors: BoundaryTensors) -> None:
        """A send within the rank keeps its tensor for the receive that takes it: the activation (detached: the
        next chunk's input is a leaf of its own graph, as a received one) or the input's gradient."""
        key = (action.chunk, action.mb)
        if action.kind == "SEND_F":
            self._traffic.local[Action("RECV_F", action.chunk + 1, action.mb)] = tensors.outputs[key].detach()
        elif action.kind == "SEND_B":
            self._traffic.local[Action("RECV_B", action.chunk - 1, action.mb)] = tensors.inputs.pop(key)
        elif action.kind == "RECV_F":
            received = self._traffic.local.pop(action)
            tensors.inputs[key] = received.requires_grad_(received.is_floating_point())
        else:
            tensors.grads[key] = self._traffic.local.pop(action)

    def free_sent(self) -> None:
        """Free the data of activations whose send has completed (their autograd node stays)."""
        still = []
        for work, ref in self._traffic.pending_sends:
            if work.is_completed():
                tensor = ref() if ref is not None else None
                if tensor is not None:
                    tensor.data = torch.empty((0,), dtype=tensor.dtype, device=tensor.device)
            else:
                still.append((work, ref))
        self._traffic.pending_sends = still

    def finish(self) -> None:
        """Wait for every send of the step."""
        for work, _ in self._traffic.pending_sends:
            work.wait()
        self._traffic.pending_sends = []

    def _send(self, actions: list[Action], tensors: BoundaryTensors) -> None:
        traffic = self._traffic
        sends: list[_Op] = []
        freeable: list[weakref.ref[torch.Tensor] | None] = []
        for action in actions:
            if not action.kind.startswith("SEND"):
                continue
            to = self.schedule.peer(action)
            key = (action.chunk, action.mb)
            if action.kind == "SEND_F":
                out = tensors.outputs[key]
                boundary = (action.chunk, self._input_key)
                if action.chunk not in traffic.headers_sent:
                    traffic.headers_sent.add(action.chunk)
                    self._boundary_shapes[boundary] = (out.shape, out.dtype)
                    sends.append((True, _header(out), to))
                    freeable.append(None)
                elif self._boundary_shapes.get(boundary, (out.shape, out.dtype)) != (out.shape, out.dtype):
                    raise RuntimeError(
                        f"pipeline chunk {action.chunk} sent {tuple(out.shape)} {out.dtype}, but "
                        f"{self._boundary_shapes[boundary]} before for micro-batches of the same shape "
                        f"{self._input_key[0]}: a chunk's output shape must follow from its micro-batch's")
                sends.append((True, out.detach(), to))
                freeable.append(weakref.ref(out) if _result_not_saved(out) else None)
            else:
                sends.append((True, tensors.inputs.pop(key).contiguous(), to))
                freeable.append(None)
        if sends:
            traffic.pending_sends.extend(zip(self._post(sends), freeable))

    def _read_headers(self, receives: list[Action]) -> None:
        """Receive the shape headers of boundaries whose first activation these receives take."""
        traffic = self._traffic
        headers = []
        for action in receives:
            if action.kind == "RECV_F" and action.chunk - 1 not in traffic.shapes_received:
                headers.append((action, torch.zeros(_HEADER, dtype=torch.int64, device=self.device)))
                traffic.shapes_received[action.chunk - 1] = (torch.Size(), torch.float32)  # filled below
        if not headers:
            return
        t0 = time.perf_counter()
        for work in self._post([(False, b, self.schedule.peer(a)) for a, b in headers]):
            work.wait()
        self._events.append(("WAIT_HEADER", headers[0][0].chunk, 0, t0 - self._started,
                             time.perf_counter() - self._started))
        for action, buffer in headers:
            traffic.shapes_received[action.chunk - 1] = _parse(buffer)
            self._boundary_shapes[(action.chunk - 1, self._input_key)] = traffic.shapes_received[action.chunk - 1]

    def _post_receives(self, post_until: int, tensors: BoundaryTensors) -> None:
        """Post the program's receives up to index `post_until`, stopping at the first whose shape
        is not known yet."""
        traffic = self._traffic
        ops: list[_Op] = []
        buffers: list[tuple[Action, torch.Tensor]] = []
        while traffic.next_post < post_until:  # in program order: point-to-point messages match in order
            action = traffic.receives[traffic.next_post]
            known = self._receive_shape(action, tensors)
            if known is None:  # later receives wait for the forward that tells their shape
                break
            buffer = torch.empty(known[0], dtype=known[1], device=self.device)
            ops.append((False, buffer, self.schedule.peer(action)))
            buffers.append((action, buffer))
            traffic.next_post += 1
        if ops:
            for (action, buffer), work in zip(buffers, self._post(ops)):
                traffic.posted[action] = (work, buffer)

    def _receive_shape(self, action: Action, tensors: BoundaryTensors) -> tuple[torch.Size, torch.dtype] | None:
        """An activation's from its boundary's header; a gradient's from the output it belongs to."""
        if action.kind == "RECV_F":
            return self._traffic.shapes_received.get(action.chunk - 1)
        return tensors.shapes.get((action.chunk, action.mb)) or self._boundary_shapes.get((action.chunk, self._input_key))

    def _post(self, ops: list[_Op]) -> list[dist.Work]:
        pg = self.group.pg
        self.sent_bytes += sum(tensor.numel() * tensor.element_size() for send, tensor, _ in ops if send)
        if self._grouped:
            return dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, tensor,
                                                      self.group.ranks[to], pg) for send, tensor, to in ops])
        # the process group's own calls: torch.distributed.isend's checks cost as much as gloo's send
        return [pg.send([tensor], to, 0) if send else pg.recv([tensor], to, 0) for send, tensor, to in ops]


def _result_not_saved(tensor: torch.Tensor) -> bool:
    """Whether backward can do without this tensor's data: the node that made it does not keep its
    own result (an add does not; a tanh or a softmax does)."""
    node = tensor.grad_fn
    return node is not None and not hasattr(node, "_saved_result")


def _header(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dim() > _HEADER - 2 or tensor.dtype not in _DTYPES:
        raise ValueError(f"a pipeline activation must have at most {_HEADER - 2} dims and a dtype in {_DTYPES}, "
                         f"got {tuple(tensor.shape)} {tensor.dtype}")
    header = torch.zeros(_HEADER, dtype=torch.int64, device=tensor.device)
    header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
    header[2: 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header


def _parse(header: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    values = header.tolist()
    return torch.Size(values[2: 2 + values[0]]), _DTYPES[values[1]]
