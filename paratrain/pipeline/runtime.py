"""The executor: runs one rank's pipeline program (paratrain.pipeline.schedules) on real tensors.

Per action:
    SEND_F / SEND_B   posted without waiting (a send completes when its receiver takes it); an
                      activation's data is freed as soon as its send has completed, keeping only
                      its autograd node (Megatron-LM's deallocate-output trick), unless the node
                      that made it saves its own result
    RECV_F / RECV_B   waited for
    F                 the chunk's forward (the last chunk also computes the loss)
    B                 the chunk's backward from the received gradient (the last chunk: from the loss)
    I / W             zero bubble: the input gradient only (graph kept), later the weight gradients

Consecutive communication actions go out as batches of point-to-point operations: first every
send of the run, then every receive; on NCCL as one grouped launch (batch_isend_irecv), on gloo,
which runs each operation on its own anyway, one by one (35 instead of 110-150 us of host time per
operation, measured). Posting sends before the receives that precede them in the program only
removes waits, so a program the simulator accepts cannot deadlock here.

Every step leaves its timeline in `times` (StepTimes.events): paratrain.pipeline.timeline turns it
into the measured bubble, a replay in the simulator and a Chrome trace.

The first activation sent across each chunk boundary is preceded by a small header with its shape
and dtype, once per micro-batch shape (micro-batches of a step have one shape, and a chunk's output
shape must follow from it: the sender checks). Gradients need none: the receiver knows the shape of
its own output.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.pipeline.schedules import Action, peer, program
from paratrain.pipeline.stages import StageModel
from paratrain.rng import DropoutStream
from paratrain.topology.mesh import AxisGroup

LossOnOutput = Callable[[StageModel, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""loss(stage, last chunk's output, targets) -> (sum of per-token losses, token count)."""

_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64]
_HEADER = 10
_Op = tuple[bool, torch.Tensor, int]
"""A point-to-point operation: (send, not receive; the tensor; the peer's index in the pp group)."""
_AHEAD = 4
"""gloo: receives posted ahead of need (beyond the current run's): a receive posted after its
message was sent still takes 0.4-0.75 ms to complete (measured: a round trip, not a copy). NCCL
takes only the next run's, since a posted receive holds up its stream."""
_ENGINE = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]


@dataclass(frozen=True)
class StepTimes:
    """Seconds this rank spent in the last step: computing (F, B, I, W) and in all; bytes it sent."""

    compute: float = 0.0
    total: float = 0.0
    by_kind: tuple[tuple[str, float, int], ...] = ()
    """(action kind, seconds, count) of the compute actions."""
    peak_in_flight: int = 0
    """Most micro-batch chunks whose activations were kept at once."""
    events: tuple[tuple[str, int, int, float, float], ...] = ()
    """(kind, chunk, micro-batch, start, end) in seconds from the step's start: every compute action,
    and every wait for a receive ("WAIT_F" / "WAIT_B", "WAIT_HEADER" for a boundary's shape): the
    step's timeline on this rank."""
    sent_bytes: int = 0
    """Point-to-point bytes this rank sent (activations, gradients and shape headers)."""


@dataclass
class _Step:
    """What one step keeps per (chunk, micro-batch)."""

    receives: list[Action]
    """The program's receives, in order; posted up to `next_post`, waited for up to `consumed`."""
    next_post: int = 0
    consumed: int = 0
    inputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """Received activations (leaves that collect their gradient), then that gradient to send back."""
    outputs: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """Chunk outputs (the scaled loss for the last chunk), kept for backward."""
    shapes: dict[tuple[int, int], tuple[torch.Size, torch.dtype]] = field(default_factory=dict)
    grads: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """Received output gradients; under zero bubble, kept from I for W."""
    pending_sends: list[tuple[dist.Work, torch.Tensor | None]] = field(default_factory=list)
    headers_sent: set[int] = field(default_factory=set)
    shapes_received: dict[int, tuple[torch.Size, torch.dtype]] = field(default_factory=dict)
    posted: dict[Action, tuple[dist.Work, torch.Tensor]] = field(default_factory=dict)
    """Receives posted ahead of their action, so the transfer overlaps the compute before it."""
    module_outputs: dict[tuple[int, int], list[tuple[nn.Module, torch.Tensor]]] = field(default_factory=dict)
    """Zero bubble: outputs of the parameter-holding modules of a forward."""
    weight_grads: dict[tuple[int, int], list[tuple[nn.Module, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    """Zero bubble: (module, its output, that output's gradient from I), for W."""


class PipelineExecutor:
    def __init__(self, stage: StageModel, group: AxisGroup, *, schedule: str, chunks: int,
                 loss: LossOnOutput, device: torch.device, recomputed: bool = False,
                 boundary_shape: Callable[[torch.Size], tuple[torch.Size, torch.dtype]] | None = None) -> None:
        """recomputed: modules of the stage are recomputed in backward (then zero-bubble's W runs as one
        pass, not module by module: a recomputed block would be recomputed once per module).
        boundary_shape: on the meta device (a dry run), the activation every chunk sends for a
        micro-batch of the given input shape; elsewhere a header message tells it (None)."""
        self.stage, self.group, self.schedule, self.chunks = stage, group, schedule, chunks
        self.boundary_shape = boundary_shape
        self.loss, self.device = loss, device
        self.stages, self.rank = group.size, group.index
        self.last_chunk = self.stages * chunks - 1
        self.times = StepTimes()
        self._events: list[tuple[str, int, int, float, float]] = []
        self._started = 0.0
        self._sent = 0
        self._grouped = dist.get_backend(group.pg) == "nccl"
        self._boundary_shapes: dict[tuple[int, tuple[Any, ...]], tuple[torch.Size, torch.dtype]] = {}
        """(sending chunk, micro-batch input shape, dtype, train) -> that chunk's output shape and dtype:
        the header goes once per boundary and micro-batch shape, not once per step."""
        self._input_key: tuple[Any, ...] = ()
        self._programs: dict[int, list[Action]] = {}
        # Zero bubble: W from each parameter-holding module's output gradient (captured during I)
        # runs only the weight-gradient ops; otherwise W walks the whole chunk again.
        self._weight_modules = _weight_modules(stage) if schedule == "zero-bubble" and not recomputed else []
        self._capture: list[tuple[nn.Module, torch.Tensor]] | None = None
        for module in self._weight_modules:
            module.register_forward_hook(self._record_output)

    def _record_output(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._capture is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            self._capture.append((module, output))

    def program(self, microbatches: int) -> list[Action]:
        if microbatches not in self._programs:
            self._programs[microbatches] = program(self.schedule, self.stages, microbatches, self.rank, self.chunks)
        return self._programs[microbatches]

    def forward_program(self, microbatches: int) -> list[Action]:
        """Forward only (evaluation): each local chunk over every micro-batch, in chunk order."""
        actions = []
        for chunk in sorted(self.stage.chunks):
            for mb in range(microbatches):
                if chunk > 0:
                    actions.append(Action("RECV_F", chunk, mb))
                actions.append(Action("F", chunk, mb))
                if chunk < self.last_chunk:
                    actions.append(Action("SEND_F", chunk, mb))
        return actions

    def run(self, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *, dropout: DropoutStream,
            first_row: int, loss_scale: float = 1.0, train: bool = True,
            forward_context: Callable[[], AbstractContextManager[Any]] = contextlib.nullcontext) -> torch.Tensor:
        """Run the schedule (train) or the forward program over the micro-batches; gradients accumulate
        into the parameters' .grad (or the strategy's buffers). Returns float64 [2]: the sum of the
        losses computed on this rank and their token count, as the loss function counted them (zeros
        unless this rank holds the last chunk)."""
        prog = self.program(len(micro_batches)) if train else self.forward_program(len(micro_batches))
        self._forward_context = forward_context
        rows = micro_batches[0][0].shape[0]
        step = _Step(receives=[a for a in prog if a.kind.startswith("RECV")])
        # boundaries whose activation shape is known from an earlier step with micro-batches of this shape
        self._input_key = (tuple(micro_batches[0][0].shape), micro_batches[0][0].dtype, train)
        if self.boundary_shape is not None:  # shapes only (a dry run): no header can be read, none is sent
            for chunk in range(self.last_chunk):
                self._boundary_shapes[(chunk, self._input_key)] = self.boundary_shape(micro_batches[0][0].shape)
        for (chunk, input_key), known in self._boundary_shapes.items():
            if input_key == self._input_key:
                if chunk in self.stage.chunks:
                    step.headers_sent.add(chunk)
                else:
                    step.shapes_received[chunk] = known
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        started, compute = time.perf_counter(), 0.0
        by_kind: dict[str, list[float]] = {}
        self._events = []
        self._started = started
        self._sent = 0
        peak = 0
        i = 0
        while i < len(prog):
            if prog[i].kind.startswith(("RECV", "SEND")):
                j = i
                while j < len(prog) and prog[j].kind.startswith(("RECV", "SEND")):
                    j += 1
                post_until = step.consumed + sum(a.kind.startswith("RECV") for a in prog[i:j])
                if self._grouped:  # and the next run's receives
                    k = j
                    while k < len(prog) and not prog[k].kind.startswith(("RECV", "SEND")):
                        k += 1
                    while k < len(prog) and prog[k].kind.startswith(("RECV", "SEND")):
                        post_until += prog[k].kind.startswith("RECV")
                        k += 1
                else:
                    post_until = max(post_until, step.consumed + _AHEAD)
                self._communicate(prog[i:j], step, min(post_until, len(step.receives)))
                i = j
                continue
            action = prog[i]
            dropout.row_offset = first_row + action.mb * rows  # recompute in backward redraws the same masks
            t0 = time.perf_counter()
            if action.kind == "F":
                self._forward(action, micro_batches, step, loss_scale, train, totals)
            else:
                self._backward(action, step)
            t1 = time.perf_counter()
            elapsed = t1 - t0
            self._events.append((action.kind, action.chunk, action.mb, t0 - started, t1 - started))
            compute += elapsed
            by_kind.setdefault(action.kind, []).append(elapsed)
            peak = max(peak, len(step.outputs))
            self._free_sent(step)
            i += 1
        for work, _ in step.pending_sends:
            work.wait()
        self.times = StepTimes(compute=compute, total=time.perf_counter() - started,
                               by_kind=tuple((k, sum(v), len(v)) for k, v in sorted(by_kind.items())),
                               peak_in_flight=peak, events=tuple(self._events), sent_bytes=self._sent)
        return totals

    # ---- compute ----------------------------------------------------------------------------
    def _forward(self, action: Action, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], step: _Step,
                 loss_scale: float, train: bool, totals: torch.Tensor) -> None:
        """The chunk's forward; on the last chunk, the loss, whose (sum, count) go into `totals`."""
        key = (action.chunk, action.mb)
        x = step.inputs.get(key) if action.chunk > 0 else micro_batches[action.mb][0]
        self._capture = [] if train and self._weight_modules else None
        with self._forward_context():  # autocast, for the forward only
            out = self.stage.run_chunk(action.chunk, x)
            if action.chunk == self.last_chunk:
                loss_sum, count = self.loss(self.stage, out, micro_batches[action.mb][1])
        if self._capture:
            step.module_outputs[key] = self._capture
        self._capture = None
        if action.chunk == self.last_chunk:
            if train:
                step.outputs[key] = loss_sum * loss_scale if loss_scale != 1.0 else loss_sum
            totals[0] += loss_sum.detach().double()
            totals[1] += count
            return
        step.outputs[key] = out
        step.shapes[key] = (out.shape, out.dtype)
        if not train or x is None or not x.requires_grad:
            step.inputs.pop(key, None)

    def _backward(self, action: Action, step: _Step) -> None:
        key = (action.chunk, action.mb)
        out = step.outputs[key]
        if action.kind == "W":  # weight gradients from the graph I kept
            grad = step.grads.pop(key)
            local = step.weight_grads.pop(key, None)
            if local is not None:  # each module's own weight-gradient ops, from its output's gradient
                for module, output, output_grad in local:
                    params = tuple(p for p in module.parameters(recurse=False) if p.requires_grad)
                    _ENGINE.run_backward((output,), (output_grad,), True, False, params, True, True)
            else:  # the whole chunk again, restricted to the parameters
                params = tuple(p for p in self.stage.parameters() if p.requires_grad)
                _ENGINE.run_backward((out,), (grad,), False, False, params, True, True)
            del step.outputs[key]
            step.module_outputs.pop(key, None)
            return
        grad = torch.ones_like(out) if action.chunk == self.last_chunk else step.grads.pop(key)
        x = step.inputs.get(key)
        if action.kind == "B":
            _ENGINE.run_backward((out,), (grad,), False, False, (), True, True)
            del step.outputs[key]
            if x is not None:
                step.inputs[key] = x.grad  # what SEND_B sends
        elif action.kind == "I":
            if x is not None:
                captured = step.module_outputs.get(key, [])
                seen: list[torch.Tensor | None] = [None] * len(captured)
                handles = [output.register_hook(functools.partial(_store, seen, i))
                           for i, (_, output) in enumerate(captured)]
                (step.inputs[key],) = _ENGINE.run_backward((out,), (grad,), True, False, (x,), True, False)
                for handle in handles:
                    handle.remove()
                if captured and all(g is not None for g in seen):
                    step.weight_grads[key] = [(m, o, g) for (m, o), g in zip(captured, seen)]
            step.grads[key] = grad  # W falls back to the whole chunk from this

    # ---- point-to-point ---------------------------------------------------------------------
    def _communicate(self, actions: list[Action], step: _Step, post_until: int) -> None:
        """Post this run's sends, then its receives and, ahead, later ones up to `post_until` (an
        index into the program's receives) whose shape is known, in program order; wait for this
        run's receives."""
        sends: list[_Op] = []
        freeable: list[torch.Tensor | None] = []
        for action in actions:
            if not action.kind.startswith("SEND"):
                continue
            to = peer(action, self.stages)
            key = (action.chunk, action.mb)
            if action.kind == "SEND_F":
                out = step.outputs[key]
                boundary = (action.chunk, self._input_key)
                if action.chunk not in step.headers_sent:
                    step.headers_sent.add(action.chunk)
                    self._boundary_shapes[boundary] = (out.shape, out.dtype)
                    sends.append((True, _header(out), to))
                    freeable.append(None)
                elif self._boundary_shapes.get(boundary, (out.shape, out.dtype)) != (out.shape, out.dtype):
                    raise RuntimeError(
                        f"pipeline chunk {action.chunk} sent {tuple(out.shape)} {out.dtype}, but "
                        f"{self._boundary_shapes[boundary]} before for micro-batches of the same shape "
                        f"{self._input_key[0]}: a chunk's output shape must follow from its micro-batch's")
                sends.append((True, out.detach(), to))
                freeable.append(out if _result_not_saved(out) else None)
            else:
                sends.append((True, step.inputs.pop(key).contiguous(), to))
                freeable.append(None)
        if sends:
            step.pending_sends.extend(zip(self._post(sends), freeable))
        receives = [a for a in actions if a.kind.startswith("RECV")]
        headers = []
        for action in receives:
            if action.kind == "RECV_F" and action.chunk - 1 not in step.shapes_received:
                headers.append((action, torch.zeros(_HEADER, dtype=torch.int64, device=self.device)))
                step.shapes_received[action.chunk - 1] = (torch.Size(), torch.float32)  # filled below
        if headers:
            t0 = time.perf_counter()
            for work in self._post([(False, b, peer(a, self.stages)) for a, b in headers]):
                work.wait()
            self._events.append(("WAIT_HEADER", headers[0][0].chunk, 0, t0 - self._started,
                                 time.perf_counter() - self._started))
            for action, buffer in headers:
                step.shapes_received[action.chunk - 1] = _parse(buffer)
                self._boundary_shapes[(action.chunk - 1, self._input_key)] = step.shapes_received[action.chunk - 1]
        ops: list[_Op] = []
        buffers: list[tuple[Action, torch.Tensor]] = []
        while step.next_post < post_until:  # in program order: point-to-point messages match in order
            action = step.receives[step.next_post]
            known = self._receive_shape(action, step)
            if known is None:  # later receives wait for the forward that tells their shape
                break
            buffer = torch.empty(known[0], dtype=known[1], device=self.device)
            ops.append((False, buffer, peer(action, self.stages)))
            buffers.append((action, buffer))
            step.next_post += 1
        if ops:
            for (action, buffer), work in zip(buffers, self._post(ops)):
                step.posted[action] = (work, buffer)
        for action in receives:
            work, buffer = step.posted.pop(action)
            t0 = time.perf_counter()
            work.wait()
            self._events.append(("WAIT_" + action.kind[-1], action.chunk, action.mb, t0 - self._started,
                                 time.perf_counter() - self._started))
            key = (action.chunk, action.mb)
            if action.kind == "RECV_F":
                step.inputs[key] = buffer.requires_grad_(buffer.is_floating_point())
            else:
                step.grads[key] = buffer
        step.consumed += len(receives)

    def _receive_shape(self, action: Action, step: _Step) -> tuple[torch.Size, torch.dtype] | None:
        """An activation's from its boundary's header; a gradient's from the output it belongs to."""
        if action.kind == "RECV_F":
            return step.shapes_received.get(action.chunk - 1)
        return step.shapes.get((action.chunk, action.mb)) or self._boundary_shapes.get((action.chunk, self._input_key))

    def _post(self, ops: list[_Op]) -> list[dist.Work]:
        pg = self.group.pg
        self._sent += sum(tensor.numel() * tensor.element_size() for send, tensor, _ in ops if send)
        if self._grouped:
            return dist.batch_isend_irecv([dist.P2POp(dist.isend if send else dist.irecv, tensor,
                                                      self.group.ranks[to], pg) for send, tensor, to in ops])
        # the process group's own calls: torch.distributed.isend's checks cost as much as gloo's send
        return [pg.send([tensor], to, 0) if send else pg.recv([tensor], to, 0) for send, tensor, to in ops]

    @staticmethod
    def _free_sent(step: _Step) -> None:
        """Free the data of activations whose send has completed (their autograd node stays)."""
        still = []
        for work, tensor in step.pending_sends:
            if work.is_completed():
                if tensor is not None:
                    tensor.data = torch.empty((0,), dtype=tensor.dtype, device=tensor.device)
            else:
                still.append((work, tensor))
        step.pending_sends = still


def _weight_modules(stage: nn.Module) -> list[nn.Module]:
    """Modules holding parameters directly, when W can run module by module: each parameter in one
    module."""
    owners: dict[int, int] = {}
    modules = []
    for module in stage.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own:
            modules.append(module)
            for p in own:
                owners[id(p)] = owners.get(id(p), 0) + 1
    return [] if any(n > 1 for n in owners.values()) else modules


def _store(seen: list[torch.Tensor | None], index: int, grad: torch.Tensor) -> None:
    seen[index] = grad


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
