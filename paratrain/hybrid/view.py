"""StateView: an engine's training state as pieces of the whole model, for saving and loading it.

One view serves every way state goes in and out of a layout: a sharded checkpoint writes
`local_state()` (paratrain.checkpoint.sharded), and `load(reader, meta)` reads this rank's pieces from
any Reader, a checkpoint's files or a whole-model state dict held in memory (MemoryReader:
Engine.load_state_dict). So saving, resharding onto another layout and loading in memory run one path.

What it covers: every parameter's exact value (ZeRO's float32 master where there is one) and
persistent buffer (BatchNorm's running statistics), under its whole-model name, the optimizer's
per-element state shaped like them (Adam's moments) as pieces the same way, its scalar state and
param groups by name, the dropout step and the fp16 loss scale. Which rank writes a value is its
placement's rule (paratrain.comm.placement.Placement.writes): one copy of every replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

import torch
from torch import nn

from paratrain.comm.placement import Placements
from paratrain.hybrid.pieces import Owned, Piece, Pieces, Run, Values, fill
from paratrain.memory import LossScaler
from paratrain.rng import DropoutStream
from paratrain.comm.flat import FlatGroup
from paratrain.topology.mesh import Mesh

SEP = "::"
"""Between a parameter's name and an optimizer state key: "blocks.0.mlp.up.weight::exp_avg"."""

DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16,
                                                     torch.int64, torch.int32, torch.uint8, torch.bool)}


class StateError(ValueError):
    """Saved state that does not fit the model or its optimizer."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Reader(Protocol):
    """Values of the whole model's tensors by name ("name" or "name::state key"), any range of them."""

    def keys(self) -> Iterable[str]: ...
    def dtype(self, key: str) -> torch.dtype: ...
    def open(self, key: str) -> Values: ...


@dataclass
class LocalState:
    """What one rank writes: 1-D tensors by key, their index entries, scalar optimizer state and param
    groups by name."""

    tensors: dict[str, torch.Tensor]
    index: dict[str, dict[str, Any]]
    scalars: dict[str, dict[str, Any]]
    groups: list[dict[str, Any]]


@dataclass(frozen=True)
class StateView:
    model: nn.Module
    mesh: Mesh
    optimizer: torch.optim.Optimizer
    groups: Sequence[FlatGroup]
    """ZeRO's flat groups (empty without ZeRO)."""
    pieces: Pieces
    placements: Placements
    dropout: DropoutStream
    scaler: LossScaler | None
    restart: Callable[[], None]
    """Called once state is loaded (the gradient strategy starts a step afresh)."""
    buffers: bool = True
    """Whether this rank saves and loads the model's persistent buffers (a parameter server holds none)."""
    replicas: Replicas | None = None
    """DiLoCo: this rank's replica group, whose state is its own (None: one state for the whole job)."""

    def owners(self) -> list[Owned]:
        """This rank's exact values by what holds them: parameters (by optimizer owner: a flat group's
        master over its shard, every other parameter whole), then persistent buffers."""
        return self.pieces.owners(self.model, self.groups) + self._buffers()

    def _buffers(self) -> list[Owned]:
        """The persistent buffers (BatchNorm's running statistics), each stored tensor once, whole."""
        owned: list[Owned] = []
        if not self.buffers:
            return owned
        seen = {id(p) for p in self.model.parameters()}
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            if id(tensor) not in seen:
                seen.add(id(tensor))
                owned.append(Owned(tensor, 0, tensor.numel(), self.pieces.piece(name), 0, name))
        return owned

    def writes(self, owned: Owned) -> bool:
        """Whether this rank writes `owned` (one copy of every replica; a pipeline stage's tied copy never)."""
        if owned.local_name in self.pieces.tied:
            return False
        sharded = any(owned.owner is g.master for g in self.groups)
        tensor = self.model.get_parameter(owned.local_name) if _is_param(self.model, owned.local_name) else owned.owner
        return self.placements(tensor).writes(self.mesh.groups.get("tp"), sharded=sharded)

    def local_state(self, *, to_cpu: bool = True) -> LocalState:
        """This rank's pieces to write: values and per-element optimizer state, as 1-D CPU tensors (to_cpu False:
        where they are, views where they can be: for a caller that copies them itself)."""
        out = LocalState({}, {}, {}, [])
        state = self.optimizer.state
        owners = self.owners()
        prefix = self.replicas.prefix if self.replicas is not None else ""
        extra = self.replicas.state() if self.replicas is not None else {}
        for owned in owners:
            if not self.writes(owned):
                continue
            name = owned.piece.name
            entries = [(prefix + name, owned.owner)]
            for key, value in {**state.get(owned.owner, {}), **extra.get(id(owned.owner), {})}.items():
                if isinstance(value, torch.Tensor) and value.shape == owned.owner.shape and value.dim() > 0:
                    entries.append((f"{prefix}{name}{SEP}{key}", value))
                else:
                    out.scalars.setdefault(name, {})[key] = _scalar(value, name)
            for key, tensor in entries:
                if key in out.tensors:
                    raise StateError(f"two pieces of {key} on one rank")
                flat = tensor.detach().reshape(-1)[owned.offset: owned.offset + owned.length]
                out.tensors[key] = flat.to("cpu").contiguous() if to_cpu else flat
                out.index[key] = {"shape": list(owned.piece.shape), "dtype": dtype_name(tensor.dtype),
                                  "split": _cuts_entry(owned.piece),
                                  "lo": owned.lo, "hi": owned.lo + owned.length}
        names = _names_by_owner(owners)
        out.groups = [{**{k: v for k, v in g.items() if k != "params"},
                       "params": sorted(set().union(*(names.get(id(p), set()) for p in g["params"])))}
                      for g in self.optimizer.param_groups]
        return out

    def scalars(self) -> dict[str, Any]:
        """The state that is not a tensor of the model: the dropout step and the fp16 loss scale."""
        out: dict[str, Any] = {"rng": {"dropout_step": self.dropout.step}}
        if self.scaler is not None:
            out["loss_scaler"] = self.scaler.state_dict()
        if self.replicas is not None:
            out["replica_groups"] = self.replicas.groups
        return out

    @torch.no_grad()
    def load(self, reader: Reader, meta: Mapping[str, Any]) -> None:
        """This rank's values, optimizer state and scalars from `reader` (only the pieces it keeps);
        meta: {"optimizer": {"scalars": {name: {key: value}}, "param_groups": [...]}, "rng": ...,
        "loss_scaler": ...} as a sharded checkpoint's meta.json holds them. DiLoCo: this replica group's state
        (the first group's under the plain names, each other's under its prefix), from a checkpoint of as many."""
        groups = self.replicas.groups if self.replicas is not None else 1
        if int(meta.get("replica_groups", 1)) != groups:
            raise StateError(f"the saved state holds {meta.get('replica_groups', 1)} DiLoCo replica group(s) and this "
                             f"run has {groups}: resume with replica_groups {meta.get('replica_groups', 1)} "
                             "(dp_mode diloco), or from a checkpoint of this layout")
        if self.replicas is not None and self.replicas.prefix:
            reader = _Prefixed(reader, self.replicas.prefix)
        keys = set(reader.keys())
        by_name: dict[str, list[Run]] = {}
        for run in self.pieces.storage(self.model, self.groups, buffers=False):
            by_name.setdefault(run.piece.name, []).append(run)
        for owned in self._buffers():
            by_name.setdefault(owned.piece.name, []).append(Run(owned.owner.data.view(-1), owned.piece, 0))
        missing = sorted(name for name in by_name if name not in keys)
        if missing:
            raise StateError(f"the saved state lacks {len(missing)} tensors of this model: {missing[:6]} "
                             "(a checkpoint of another model?)")
        for name, runs in sorted(by_name.items()):
            fill(reader.open(name), runs)
        self._load_optimizer(reader, keys, meta["optimizer"], self.owners())
        if self.scaler is not None and "loss_scaler" in meta:
            self.scaler.load_state_dict(meta["loss_scaler"])
        self.dropout.restore(int(meta.get("rng", {}).get("dropout_step", 0)))
        self.restart()

    def _load_optimizer(self, reader: Reader, keys: set[str], saved: Mapping[str, Any], owners: list[Owned]) -> None:
        state = self.optimizer.state
        state.clear()
        scalars = saved["scalars"]
        params = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        for owned in owners:
            if id(owned.owner) not in params or self.placements(owned.owner).served:  # a buffer, a frozen
                continue  # parameter, or a parameter server's (it loads the state): no optimizer state here
            name = owned.piece.name
            own = state.setdefault(owned.owner, {})
            prefix = f"{name}{SEP}"
            for key in sorted(k for k in keys if k.startswith(prefix)):
                dtype, field = reader.dtype(key), key[len(prefix):]
                if field not in own:
                    own[field] = torch.zeros(owned.owner.shape, dtype=dtype, device=owned.owner.device)
                target = own[field].view(-1)[owned.offset: owned.offset + owned.length]
                fill(reader.open(key), [Run(target, Piece(key, owned.piece.shape, dtype, owned.piece.split), owned.lo)])
            for field, value in scalars.get(name, {}).items():
                own[field] = _unscalar(value)
            if not own:
                del state[owned.owner]
        names = _names_by_owner(owners)
        for group in self.optimizer.param_groups:
            mine = set().union(*(names.get(id(p), set()) for p in group["params"]))
            matches = [g for g in saved["param_groups"] if mine & set(g["params"])]
            if len(matches) != 1:
                raise StateError(f"an optimizer group of {len(mine)} parameters matches {len(matches)} saved groups "
                                 "(a checkpoint of another model or optimizer?)")
            group.update({k: v for k, v in matches[0].items() if k != "params"})


class Replicas(Protocol):
    """DiLoCo's replica groups, as the view saves and loads them (paratrain.data_parallel.diloco.OuterStep)."""

    groups: int
    """How many replica groups the state has."""
    prefix: str
    """Before this group's keys ('' for the first group: its state is the checkpoint's plain one)."""

    def state(self) -> Mapping[int, Mapping[str, torch.Tensor]]:
        """Per-element state to save beside the optimizer's, by id() of the tensor the optimizer steps."""
        ...


@dataclass(frozen=True)
class _Prefixed:
    """A Reader of the keys under `prefix`, by their names without it."""

    reader: Reader
    prefix: str

    def keys(self) -> Iterable[str]:
        return [k[len(self.prefix):] for k in self.reader.keys() if k.startswith(self.prefix)]

    def dtype(self, key: str) -> torch.dtype:
        return self.reader.dtype(self.prefix + key)

    def open(self, key: str) -> Values:
        return self.reader.open(self.prefix + key)


class MemoryReader:
    """A Reader over a whole-model state dict in memory (Engine.state_dict()'s form: "model" tensors by
    name, "optimizer" {"state": {name: {key: value}}, "param_groups"}); `meta` is what StateView.load
    takes besides."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        self.tensors: dict[str, torch.Tensor] = {name: t.detach() for name, t in state["model"].items()}
        scalars: dict[str, dict[str, Any]] = {}
        for name, values in state["optimizer"]["state"].items():
            for key, value in values.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    self.tensors[f"{name}{SEP}{key}"] = value.detach()
                else:
                    scalars.setdefault(name, {})[key] = value.clone() if isinstance(value, torch.Tensor) else value
        self.meta = {"optimizer": {"scalars": scalars, "param_groups": state["optimizer"]["param_groups"]},
                     **{k: state[k] for k in ("rng", "loss_scaler") if k in state}}

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].dtype

    def open(self, key: str) -> Values:
        return _Whole(key, self.tensors[key])


@dataclass(frozen=True)
class _Whole:
    key: str
    tensor: torch.Tensor

    def values(self, shape: Sequence[int], lo: int, hi: int) -> torch.Tensor:
        if tuple(shape) != tuple(self.tensor.shape):
            raise StateError(f"{self.key}: the saved state holds shape {tuple(self.tensor.shape)}, the model "
                             f"{tuple(shape)}")
        return self.tensor.reshape(-1)[lo:hi].to("cpu")


def _is_param(model: nn.Module, name: str) -> bool:
    module_name, _, attr = name.rpartition(".")
    return attr in (model.get_submodule(module_name) if module_name else model)._parameters


def _names_by_owner(owners: Sequence[Owned]) -> dict[int, set[str]]:
    names: dict[int, set[str]] = {}
    for owned in owners:
        names.setdefault(id(owned.owner), set()).add(owned.piece.name)
    return names


def _scalar(value: Any, where: str) -> Any:
    if isinstance(value, torch.Tensor):
        if value.dim() > 0:
            raise StateError(f"{where}: optimizer state of shape {tuple(value.shape)} is neither per element nor a "
                             "scalar; sharded checkpoints support element-wise optimizers (SGD, Adam, ...)")
        return {"tensor": value.item(), "dtype": dtype_name(value.dtype)}
    return value


def _unscalar(value: Any) -> Any:
    """A saved scalar back; a tensor one on the CPU, where torch's optimizers keep their step counts."""
    if isinstance(value, dict) and set(value) == {"tensor", "dtype"}:
        return torch.tensor(value["tensor"], dtype=DTYPES[value["dtype"]])
    return value


def _cuts_entry(piece: Piece) -> list[Any] | None:
    """A piece's cuts as a checkpoint index holds them: [dim, index, parts] for one (the format before
    two-dim cuts existed), a list of those for several, None for a whole tensor."""
    cuts = piece.cuts
    return None if not cuts else list(cuts[0]) if len(cuts) == 1 else [list(c) for c in cuts]
