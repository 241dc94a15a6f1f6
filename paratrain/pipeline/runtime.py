"""The executor: runs one rank's pipeline program (paratrain.pipeline.schedules) on real tensors.

Per action:
    SEND_F / SEND_B   posted without waiting (a send completes when its receiver takes it); an
                      activation's data is freed as soon as its send has completed
    RECV_F / RECV_B   waited for
    F                 the chunk's forward (the last chunk also computes the loss)
    B                 the chunk's backward from the received gradient (the last chunk: from the loss)
    I / W             zero bubble: the input gradient only (graph kept), later the weight gradients

The communication actions, their batching, the shape headers and the freeing of sent activations
are the point-to-point protocol (paratrain.pipeline.p2p); this file drives the program and computes.

Every step leaves its timeline in `times` (StepTimes.events): paratrain.pipeline.timeline turns it
into the measured bubble, a replay in the simulator and a Chrome trace.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from paratrain.pipeline.p2p import BoundaryTensors, Event, PeerExchange
from paratrain.pipeline.schedules import Action, Schedule
from paratrain.pipeline.stages import StageModel
from paratrain.rng import DropoutStream
from paratrain.topology.mesh import AxisGroup

LossOnOutput = Callable[[StageModel, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""loss(stage, last chunk's output, targets) -> (sum of per-token losses, token count)."""

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
class _Step(BoundaryTensors):
    """What one step keeps per (chunk, micro-batch): the tensors crossing boundaries, and for zero
    bubble the module outputs W starts from."""

    module_outputs: dict[tuple[int, int], list[tuple[nn.Module, torch.Tensor]]] = field(default_factory=dict)
    """Zero bubble: outputs of the parameter-holding modules of a forward."""
    weight_grads: dict[tuple[int, int], list[tuple[nn.Module, torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    """Zero bubble: (module, its output, that output's gradient from I), for W."""


class PipelineExecutor:
    def __init__(self, stage: StageModel, group: AxisGroup, *, schedule: Schedule,
                 loss: LossOnOutput, device: torch.device, recomputed: bool = False,
                 boundary_shape: Callable[[torch.Size], tuple[torch.Size, torch.dtype]] | None = None) -> None:
        """recomputed: modules of the stage are recomputed in backward (then zero-bubble's W runs as one
        pass, not module by module: a recomputed block would be recomputed once per module).
        boundary_shape: on the meta device (a dry run), the activation every chunk sends for a
        micro-batch of the given input shape; elsewhere a header message tells it (None)."""
        if schedule.stages != group.size:
            raise ValueError(f"a schedule of {schedule.stages} stages on a pipeline group of {group.size} ranks")
        self.stage, self.group, self.schedule = stage, group, schedule
        self.loss, self.device = loss, device
        self.stages, self.rank = group.size, group.index
        self.last_chunk = self.stages * schedule.chunks - 1
        self.p2p = PeerExchange(group, device, schedule, local_chunks=frozenset(stage.chunks),
                                last_chunk=self.last_chunk, boundary_shape=boundary_shape)
        self.times = StepTimes()
        self._programs: dict[int, list[Action]] = {}
        # Zero bubble: W from each parameter-holding module's output gradient (captured during I)
        # runs only the weight-gradient ops; otherwise W walks the whole chunk again.
        self._weight_modules = _weight_modules(stage) if schedule.splits_backward and not recomputed else []
        self._capture: list[tuple[nn.Module, torch.Tensor]] | None = None
        self._uncaptured = False
        """A weight module of the forward in progress returned no single tensor that requires grad (a MoE router
        returns its routing): its weights' gradient cannot come from its output's, so W walks the whole chunk."""
        for module in self._weight_modules:
            module.register_forward_hook(self._record_output)

    def _record_output(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._capture is None:
            return
        if isinstance(output, torch.Tensor) and output.requires_grad:
            self._capture.append((module, output))
        else:
            self._uncaptured = True

    def program(self, microbatches: int) -> list[Action]:
        if microbatches not in self._programs:
            self._programs[microbatches] = self.schedule.program(self.rank, microbatches)
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
        if len(micro_batches[0]) > 2:  # every rank alike, before anything is sent: none waits on a refusal
            self.stage.check_positions()
        prog = self.program(len(micro_batches)) if train else self.forward_program(len(micro_batches))
        self._forward_context = forward_context
        rows = micro_batches[0][0].shape[0]
        step = _Step()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)
        started, compute = time.perf_counter(), 0.0
        by_kind: dict[str, list[float]] = {}
        events: list[Event] = []
        self.p2p.start(prog, micro_batches[0][0], train=train, events=events, started=started)
        peak = 0
        i = 0
        while i < len(prog):
            if prog[i].kind.startswith(("RECV", "SEND")):
                j = i
                while j < len(prog) and prog[j].kind.startswith(("RECV", "SEND")):
                    j += 1
                self.p2p.communicate(prog, i, j, step)
                i = j
                continue
            action = prog[i]
            dropout.at_rows(first_row + action.mb * rows)  # recompute in backward redraws the same masks
            t0 = time.perf_counter()
            if action.kind == "F":
                self._forward(action, micro_batches, step, loss_scale, train, totals)
            else:
                self._backward(action, step)
            t1 = time.perf_counter()
            elapsed = t1 - t0
            events.append((action.kind, action.chunk, action.mb, t0 - started, t1 - started))
            compute += elapsed
            by_kind.setdefault(action.kind, []).append(elapsed)
            peak = max(peak, len(step.outputs))
            self.p2p.free_sent()
            i += 1
        self.p2p.finish()
        self.times = StepTimes(compute=compute, total=time.perf_counter() - started,
                               by_kind=tuple((k, sum(v), len(v)) for k, v in sorted(by_kind.items())),
                               peak_in_flight=peak, events=tuple(events), sent_bytes=self.p2p.sent_bytes)
        return totals

    # ---- compute ----------------------------------------------------------------------------
    def _forward(self, action: Action, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], step: _Step,
                 loss_scale: float, train: bool, totals: torch.Tensor) -> None:
        """The chunk's forward; on the last chunk, the loss, whose (sum, count) go into `totals`."""
        key = (action.chunk, action.mb)
        x = step.inputs.get(key) if action.chunk > 0 else micro_batches[action.mb][0]
        self._capture = [] if train and self._weight_modules else None
        self._uncaptured = False
        with self._forward_context():  # autocast, for the forward only
            micro = micro_batches[action.mb]  # (inputs, targets) or (inputs, targets, positions)
            out = self.stage.run_chunk(action.chunk, x, micro[2] if len(micro) > 2 else None, micro[0])
            if action.chunk == self.last_chunk:
                loss_sum, count = self.loss(self.stage, out, micro_batches[action.mb][1])
        if self._capture and not self._uncaptured:  # else W walks the whole chunk (every weight module's path)
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
            step.module_outputs.pop(key, None)  # (captured for a W that a whole backward leaves out: DualPipeV)
            if x is not None:
                step.inputs[key] = x.grad  # what SEND_B sends
        elif action.kind == "I":
            if x is not None:  # the input's gradient, and each weight module's output's for W; an output off the
                # path to the input (the MTP depths' embedding lookup) has its gradient computed here too
                captured = step.module_outputs.get(key, [])
                step.inputs[key], *seen = _ENGINE.run_backward(
                    (out,), (grad,), True, False, (x, *(output for _, output in captured)), True, False)
                if captured and all(g is not None for g in seen):
                    step.weight_grads[key] = [(m, o, g) for (m, o), g in zip(captured, seen)]
            step.grads[key] = grad  # W falls back to the whole chunk from this


def _weight_modules(stage: nn.Module) -> list[nn.Module]:
    """Modules holding parameters directly, when W can run module by module: each parameter in one module (a W from
    one module's output would also take a shared parameter's gradient through the other modules holding it)."""
    owners: dict[int, int] = {}
    modules = []
    for module in stage.modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad]
        if own:
            modules.append(module)
            for p in own:
                owners[id(p)] = owners.get(id(p), 0) + 1
    return [] if any(n > 1 for n in owners.values()) else modules
