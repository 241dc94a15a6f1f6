"""Sparse rows: embedding tables whose rows travel only where a batch touched them.

A table named in ParallelConfig.ps_sparse (an nn.Embedding's weight [V, D], not tied) stays out of the
dense buckets: it is a flat group of its own, cut into S row ranges (V divisible by S, so that every
server's slice is V / S whole rows). A trainer records the ids its step's micro-batches look up (a
forward pre-hook on the embedding) and, after backward, pushes each server the unique ids in its range
with their gradient rows; the server sums the pushes' rows (duplicates added: trainer order, or arrival
order), adds their squares to the norm, divides and clips them as the dense gradients, and hands its
optimizer a sparse gradient over just those rows; it sends every trainer the union of the ids it was
pushed with their new values. Bytes per push and pull: unique ids x D x element size (and 8 per id).

The update must leave untouched rows as they are (a trainer's copy of them is not refreshed): the
optimizer must update only the rows a gradient names. torch's SGD without momentum or weight decay does
(the result is dense SGD's exactly: an untouched row's gradient is zero), as do Adagrad without weight
decay and SparseAdam ("lazy" Adam: an untouched row's moments do not decay, so it differs from dense
Adam); AdamW and Adam are refused (they move every row: weight decay, moments).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.flat import FlatGroup
from paratrain.config.errors import ConfigError
from paratrain.param_server.protocol import BODY, nbytes, post_recv, wait


def check_sparse_optimizer(optimizer: torch.optim.Optimizer, names: list[str]) -> None:
    """Refuse an optimizer that would move rows no gradient names (module docstring)."""
    if not names:
        return
    kind = type(optimizer).__name__
    lazy = kind == "SparseAdam" or (kind in ("SGD", "Adagrad") and all(
        not g.get("weight_decay", 0) and not g.get("momentum", 0) for g in optimizer.param_groups))
    if not lazy:
        raise ConfigError(f"ps_sparse tables ({', '.join(names)}) send only the rows a batch touched, so the "
                          f"optimizer must update only those: {kind} with these settings moves every row (weight "
                          "decay, momentum or moments). Use SGD without momentum and weight decay (dense SGD's "
                          "result exactly), Adagrad without weight decay, or SparseAdam (lazy Adam: untouched rows' "
                          "moments do not decay)")


def table_module(model: nn.Module, name: str) -> nn.Embedding:
    """The nn.Embedding whose weight is `name` (a sparse table), or ConfigError naming what is wrong."""
    module_name, _, attr = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        raise ConfigError(f"ps_sparse names {name!r}, which is no parameter of the model") from None
    if not isinstance(module, nn.Embedding) or attr != "weight":
        raise ConfigError(f"ps_sparse names {name!r}: a sparse table is an nn.Embedding's weight (its rows looked up "
                          f"by id), and this is {type(module).__name__}.{attr}")
    for other, param in model.named_parameters(remove_duplicate=False):
        if param is module.weight and other != name:
            raise ConfigError(f"ps_sparse table {name!r} is tied to {other!r}, whose gradient touches every row: "
                              "untie them, or leave the table dense")
    return module


@dataclass
class TouchedRows:
    """A trainer's sparse table: its flat group (whole), its gradient buffer, the ids looked up this step."""

    name: str
    group: FlatGroup
    grad: torch.Tensor
    width: int
    """D: elements per row."""
    ids: list[torch.Tensor] = field(default_factory=list)
    _unique: torch.Tensor | None = None
    """The step's ids deduplicated (sorted), once the first push asks for them."""

    def record(self, module: nn.Module, args: tuple) -> None:
        if torch.is_grad_enabled():  # a training forward (not validation)
            self.ids.append(args[0].detach().reshape(-1).to("cpu", torch.int64))

    def rows_of(self, server: int) -> torch.Tensor:
        """The unique ids of this step in server `server`'s rows, as its local row indices (int64, sorted)."""
        if self._unique is None:
            self._unique = torch.unique(torch.cat(self.ids)) if self.ids else torch.zeros(0, dtype=torch.int64)
        rows, ids = self.group.shard_numel // self.width, self._unique
        mine = ids[(ids >= server * rows) & (ids < (server + 1) * rows)]
        return mine - server * rows

    def push_parts(self, server: int) -> list[torch.Tensor]:
        """[count], ids (local rows), their gradient rows flattened: what server `server` receives."""
        local = self.rows_of(server)
        table = self.grad.view(-1, self.width)[server * (self.group.shard_numel // self.width):]
        return [torch.tensor([local.numel()], dtype=torch.int64), local, table[local].reshape(-1).contiguous()]

    def clear(self) -> None:
        self.ids, self._unique = [], None

    def receive(self, server: int, rank: int, pg: dist.ProcessGroup, what: str) -> int:
        """After a reply's dense slices: the rows server `server` updated ([count], ids, rows from `rank`),
        written into the table; returns the bytes received (ids and rows)."""
        count = torch.zeros(1, dtype=torch.int64)
        wait(post_recv(count, rank, BODY, pg), what)
        ids = torch.empty(int(count), dtype=torch.int64)
        rows = torch.empty(int(count) * self.width, dtype=self.group.param_flat.dtype)
        for work in (post_recv(ids, rank, BODY, pg), post_recv(rows, rank, BODY, pg)):
            wait(work, what)
        first = server * (self.group.shard_numel // self.width)
        self.group.param_flat.view(-1, self.width)[first + ids] = rows.view(-1, self.width)
        return nbytes([ids, rows])


def sum_rows(parts: list[tuple[torch.Tensor, torch.Tensor]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pushes (ids, rows flattened) summed: (unique ids, their summed rows [u, D]), in the order given."""
    if not parts:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, width)
    ids = torch.cat([p[0] for p in parts])
    rows = torch.cat([p[1].view(-1, width) for p in parts])
    unique, inverse = torch.unique(ids, return_inverse=True)
    summed = torch.zeros(unique.numel(), width, dtype=rows.dtype).index_add_(0, inverse, rows)
    return unique, summed


def sparse_grad(ids: torch.Tensor, rows: torch.Tensor, numel: int) -> torch.Tensor:
    """A 1-D sparse COO gradient over a flat slice of numel elements holding `rows` at row `ids`."""
    width = rows.shape[1] if rows.dim() == 2 else 1
    elements = (ids.unsqueeze(1) * width + torch.arange(width)).reshape(1, -1)
    return torch.sparse_coo_tensor(elements, rows.reshape(-1), (numel,), check_invariants=True).coalesce()
