"""2D tensor parallelism (paratrain.tensor_parallel.grid): each grid layer against its dense layer, the GPT
against the single process (float64), with dp and ZeRO, and the bytes each linear moves against the formula."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paratrain.comm.volume import CollectiveCounter
from paratrain.config import ConfigError, ParallelConfig
from paratrain.models.norms import RMSNorm
from paratrain.nn.loss import VocabOutput
from paratrain.tensor_parallel.cube import Cube
from paratrain.tensor_parallel.cube_layers import CubeEmbedding, CubeLinear
from paratrain.tensor_parallel.grid import Activations, Grid
from paratrain.tensor_parallel.grid_layers import GridEmbedding, GridLinear, SplitNorm, SplitOutput
from paratrain.topology import Mesh, ParallelDims
from tests.helpers import max_state_diff, ranked_run, reference_run, rel_diff, tiny_run
from tests.margins import within

B, S, D, OUT, V = 4, 3, 8, 12, 16


def _grid() -> Grid:
    return Grid.of(Mesh.build(ParallelDims(tp=dist.get_world_size(), tp_mode="2d"), dist.get_rank()))


def _block(t: torch.Tensor, grid: Grid, *cuts: tuple[int, int]) -> torch.Tensor:
    """The block of t cut along (dim, index) pairs into q parts each."""
    for dim, index in cuts:
        part = t.shape[dim] // grid.q
        t = t.narrow(dim, index * part, part)
    return t


def _diff(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The largest difference of each (grid, dense) pair relative to the dense tensor's largest element."""
    return max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-300)) for a, b in pairs)


def _layers_job() -> dict[str, float]:
    """Every grid layer's output and gradients against its dense layer's block of them (float64)."""
    grid = _grid()
    i, j = grid.i, grid.j
    torch.manual_seed(0)
    x = torch.randn(B, S, D, dtype=torch.float64)
    ids = torch.randint(0, V, (B, S))
    targets = torch.randint(0, V - 2, (B, S))
    targets[0, 0] = -100
    dense = {"linear": nn.Linear(D, OUT).double(), "embedding": nn.Embedding(V, D, padding_idx=3).double(),
             "rms": RMSNorm(D, 1e-5).double(), "layer": nn.LayerNorm(D).double()}
    with torch.no_grad():
        for norm in ("rms", "layer"):
            dense[norm].weight.normal_()
        dense["layer"].bias.normal_()
    out: dict[str, float] = {}
    counters: dict[str, dict[str, int]] = {}
    for name in ("linear", "rms", "layer"):
        layer = dense[name]
        grid_layer = GridLinear(layer, grid) if name == "linear" else SplitNorm(layer, grid.stream)
        x_dense = x.clone().requires_grad_()
        y_dense = layer(x_dense)
        y_dense.pow(3).sum().backward()
        x_grid = _block(x, grid, (0, i), (2, j)).clone().requires_grad_()
        with CollectiveCounter() as counter:
            y_grid = grid_layer(x_grid)
            y_grid.pow(3).sum().backward()
        counters[name] = dict(counter.volume.bytes)
        pairs = [(y_grid, _block(y_dense, grid, (0, i), (2, j))), (x_grid.grad, _block(x_dense.grad, grid, (0, i), (2, j)))]
        if name == "linear":
            pairs.append((grid_layer.weight.grad, _block(layer.weight.grad, grid, (0, i), (1, j))))
        pairs.append((grid_layer.bias.grad if name != "rms" else grid_layer.weight.grad,
                      _block(layer.bias.grad if name != "rms" else layer.weight.grad, grid, (0, j))))
        if name == "layer":
            pairs.append((grid_layer.weight.grad, _block(layer.weight.grad, grid, (0, j))))
        out[name] = _diff(pairs)
    embedding = GridEmbedding(dense["embedding"], grid)
    rows_dense = dense["embedding"](ids)
    rows_dense.pow(3).sum().backward()
    rows_grid = embedding(ids)
    rows_grid.pow(3).sum().backward()
    out["embedding"] = _diff([(rows_grid, _block(rows_dense, grid, (0, i), (2, j))),
                              (embedding.weight.grad, _block(dense["embedding"].weight.grad, grid, (0, i), (1, j)))])
    logits = torch.randn(B, S, V, dtype=torch.float64, requires_grad=True)
    loss_dense, count_dense = VocabOutput(V - 2).loss(logits, targets)
    loss_dense.backward()
    logits_grid = _block(logits.detach(), grid, (0, i), (2, j)).clone().requires_grad_()
    loss_grid, count_grid = SplitOutput(V - 2, grid.stream).loss(logits_grid, targets)
    loss_grid.backward()
    out["loss"] = _diff([(loss_grid, loss_dense), (logits_grid.grad, _block(logits.grad, grid, (0, i), (2, j)))])
    out["count"] = float(count_grid != count_dense)
    return {"diffs": out, "bytes": counters["linear"]}


def test_each_grid_layer_matches_its_dense_layer(pools):
    """Outputs, input gradients and weight gradients equal the dense layer's blocks (float64, relative to the
    largest element; worst measured 4.5e-16 on 4 ranks, AMD EPYC avx2 and default kernels). The linear moves exactly SUMMA's bytes:
    forward T out / q + |W| / q, backward T out / q + 2 |W| / q (broadcasts and reduces), + its bias's all-reduce."""
    for got in pools(4).run(_layers_job):
        for name, diff in got["diffs"].items():
            within(diff, 1e-13, f"2d {name} against dense (float64)")
        q, tokens, size = 2, B * S, 8  # float64
        weight, activation = OUT * D * size // q, tokens * OUT * size // q  # |W| / q and T out / q, in bytes
        forward = {"broadcast": weight, "reduce": activation}  # W blocks down the columns; Y partials along rows
        backward = {"broadcast": activation + weight, "reduce": weight}  # dY along rows, W again; dW down columns
        assert got["bytes"] == {"broadcast": forward["broadcast"] + backward["broadcast"],
                                "reduce": forward["reduce"] + backward["reduce"],
                                "all_reduce": 2 * OUT * size // q}, got["bytes"]  # the bias's gradient, down the column


def _rows_width(t: torch.Tensor, acts: Activations, width_dim: int = 2) -> torch.Tensor:
    """The block of t[B, ..., h] a layout gives this rank: rows block row_block of row_parts, width by acts.width."""
    rows = t.shape[0] // acts.row_parts
    width = t.shape[width_dim] // acts.width.size
    return t.narrow(0, acts.row_block * rows, rows).narrow(width_dim, acts.width.index * width, width)


def _cube_job() -> dict:
    """The cube's column -> row pair, embedding, norm and loss against the dense layers (float64), and the bytes of
    one column linear."""
    cube = Cube.of(Mesh.build(ParallelDims(tp=dist.get_world_size(), tp_mode="3d"), dist.get_rank()))
    q, rows = cube.q, 2 * cube.q * cube.q
    torch.manual_seed(0)
    x = torch.randn(rows, S, D, dtype=torch.float64)
    ids, targets = torch.randint(0, V, (rows, S)), torch.randint(0, V - 2, (rows, S))
    up, down = nn.Linear(D, OUT).double(), nn.Linear(OUT, D).double()
    x_dense = x.clone().requires_grad_()
    down(up(x_dense)).pow(3).sum().backward()
    column, row = CubeLinear(up, cube, "column"), CubeLinear(down, cube, "row")
    x_cube = _rows_width(x, cube.stream).clone().requires_grad_()
    with CollectiveCounter() as counter:
        hidden = column(x_cube)
    forward = dict(counter.volume.bytes)
    y = row(hidden)
    y.pow(3).sum().backward()
    with torch.no_grad():
        y_dense = down(up(x))
    pairs = [(y, _rows_width(y_dense, cube.stream)), (x_cube.grad, _rows_width(x_dense.grad, cube.stream)),
             (column.bias.grad, up.bias.grad.narrow(0, cube.input.index * (OUT // q), OUT // q)),
             (row.bias.grad, down.bias.grad.narrow(0, cube.output.index * (D // q), D // q))]
    for layer, dense in ((column, up), (row, down)):
        (dim0, i0, p0), (dim1, i1, p1) = layer.blocks()["weight"].cuts
        expected = dense.weight.grad.narrow(0, i0 * dense.weight.shape[0] // p0, dense.weight.shape[0] // p0)
        pairs.append((layer.weight.grad, expected.narrow(1, i1 * dense.weight.shape[1] // p1, dense.weight.shape[1] // p1)))
    embedding_dense = nn.Embedding(V, D).double()
    embedding = CubeEmbedding(embedding_dense, cube)
    embedding_dense(ids).pow(3).sum().backward()
    embedded = embedding(ids)
    embedded.pow(3).sum().backward()
    with torch.no_grad():
        rows_dense = embedding_dense(ids)
    cuts = embedding.blocks()["weight"].cuts
    grad = embedding_dense.weight.grad.narrow(0, cuts[0][1] * V // cuts[0][2], V // cuts[0][2])
    pairs += [(embedded, _rows_width(rows_dense, cube.stream)),
              (embedding.weight.grad, grad.narrow(1, cuts[1][1] * D // q, D // q))]
    logits = torch.randn(rows, S, V, dtype=torch.float64, requires_grad=True)
    loss_dense, _ = VocabOutput(V - 2).loss(logits, targets)
    loss_dense.backward()
    logits_cube = _rows_width(logits.detach(), cube.turned).clone().requires_grad_()
    loss_cube, _ = SplitOutput(V - 2, cube.turned).loss(logits_cube, targets)
    loss_cube.backward()
    pairs += [(loss_cube, loss_dense), (logits_cube.grad, _rows_width(logits.grad, cube.turned))]
    return {"diff": _diff(pairs), "forward": forward, "tokens": rows * S}


def test_each_cube_layer_matches_its_dense_layer(pools):
    """3d (q = 2, 8 ranks): a column -> row pair with biases, the embedding and the loss against the dense layers'
    blocks (float64, relative; worst measured 4.4e-16, AMD EPYC avx2 and default kernels). A column linear's
    forward gathers T in / q^2 (input rows) + |W| / q^2 (weight) and reduce-scatters T out / q^2 (gloo: as an
    all-reduce, counted twice)."""
    for got in pools(8).run(_cube_job):
        within(got["diff"], 1e-13, "3d layers against dense (float64)")
        q, size = 2, 8
        gathered = (got["tokens"] * D + OUT * D) * size // q**2
        scattered = got["tokens"] * OUT * size // q**2
        forward = got["forward"]
        assert forward["all_gather"] == gathered, forward
        assert forward.get("reduce_scatter", 0) + forward.get("all_reduce", 0) // 2 == scattered, forward


def _job(**kwargs) -> dict:
    return ranked_run(dtype="float64", **kwargs)


LAYOUTS = {  # (world, kwargs): 2d on 4 ranks (tied embedding, dropout, untied), with dp and ZeRO on 8; 2.5d, 3d,
    # pipeline stages with recompute on 8
    "2d": (4, dict(dp=1, tp=4, tp_mode="2d", micro_batch=4, dropout=0.1)),
    "2d-untied": (4, dict(dp=1, tp=4, tp_mode="2d", micro_batch=2, overrides=(("tie_embeddings", False),))),
    "dp2-2d-zero1": (8, dict(dp=2, tp=4, tp_mode="2d", zero=1, micro_batch=4)),
    "dp2-2d-zero3": (8, dict(dp=2, tp=4, tp_mode="2d", zero=3, micro_batch=4)),
    "2.5d": (8, dict(dp=1, tp=8, tp_mode="2.5d", tp_depth=2, micro_batch=4, dropout=0.1)),  # d = 2, q = 2
    "3d": (8, dict(dp=1, tp=8, tp_mode="3d", micro_batch=4, dropout=0.1)),  # q = 2
    "pp2-2d-zero1-interleaved": (8, dict(dp=1, pp=2, tp=4, tp_mode="2d", zero=1, micro_batch=4, schedule="interleaved",
                                         virtual_stages=2, recompute=True)),  # blocks travel between stages
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_2d_gpt_matches_the_single_process(pools, name):
    """Loss and grad norm at every step, weights and AdamW state after 3 steps, float64. Worst measured over 5 steps
    (AMD EPYC, avx2 and default kernels): loss 3.3e-16, grad norm 9.7e-16, weights 7.6e-15 (dropout; 132x under the
    bound), optimizer 8.3e-17."""
    world, kwargs = LAYOUTS[name]
    got = pools(world).run(_job, steps=3, **kwargs)
    extra = {k: v for k, v in kwargs.items() if k in ("dropout", "overrides")}
    ref = reference_run(3, dtype="float64", **extra)
    for rank in got:
        within(rel_diff(rank["losses"], ref["losses"]), 1e-12, f"{name} loss (float64)")
        within(rel_diff(rank["grad_norms"], ref["grad_norms"]), 1e-12, f"{name} grad norm (float64)")
    within(max_state_diff(got[0]["model"], ref["model"]), 1e-12, f"{name} weights (float64)")
    within(max_state_diff(got[0]["optimizer"], ref["optimizer"]), 1e-12, f"{name} optimizer state (float64)")


def test_2_5d_of_depth_1_is_2d_exactly(pools):
    """One grid in the stack is the 2d layout: the same collectives in the same order, bit for bit."""
    kwargs = dict(steps=2, dp=1, tp=4, micro_batch=4, dropout=0.1)
    flat, stacked = pools(4).run(_job, tp_mode="2d", **kwargs), pools(4).run(_job, tp_mode="2.5d", **kwargs)
    assert flat[0]["losses"] == stacked[0]["losses"] and flat[0]["grad_norms"] == stacked[0]["grad_norms"]
    assert max_state_diff(flat[0]["model"], stacked[0]["model"]) == 0.0


def test_a_2d_checkpoint_continues_under_3d_1d_and_one_process(pools, tmp_path):
    """Saved by a 2 x 2 grid after 3 steps, resumed by a 2 x 2 x 2 cube, 1d tp 4 and one process: steps 4-6 give
    the uninterrupted single process's losses (float64; measured 2e-16)."""
    root, common = str(tmp_path / "ckpt"), dict(steps=3, dropout=0.1)
    pools(4).run(_job, save_sharded=root, dp=1, tp=4, tp_mode="2d", micro_batch=4, **common)
    ref = reference_run(6, dtype="float64", dropout=0.1)["losses"][3:]
    resumed = {"3d": pools(8).run(_job, start_step=3, load_sharded=root, dp=1, tp=8, tp_mode="3d", micro_batch=4,
                                  **common)[0],
               "1d": pools(4).run(_job, start_step=3, load_sharded=root, dp=1, tp=4, micro_batch=4, **common)[0],
               "one": tiny_run(dp=None, micro_batch=None, start_step=3, load_sharded=root, dtype="float64", **common)}
    for name, got in resumed.items():
        within(rel_diff(got["losses"], ref), 1e-12, f"2d checkpoint resumed under {name} (float64)")


def test_a_tie_keeps_a_copy_uncounted():
    """2.5d counts a matrix block on grid 0 only; a pipeline's tie of that block must not count it again."""
    from paratrain.comm.placement import Placement, Placements

    weight, placements = torch.nn.Parameter(torch.zeros(2)), Placements()
    placements.add(Placement(counted=False), [id(weight)])
    placements.tie(weight, None, counted=True)
    assert not placements(weight).counted


def _documents_job() -> str:
    import paratrain
    from tests.helpers import TINY

    ctx = paratrain.init(device="cpu", config=ParallelConfig(tp=4, tp_mode="2d"))
    engine = paratrain.parallelize(paratrain.build_gpt(TINY, seed=0), ctx, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    x = torch.randint(0, 256, (4, TINY.seq_len))
    try:
        engine.train_step((x, x, torch.zeros_like(x)), paratrain.lm_loss)
    except ConfigError as error:
        return str(error)
    return "trained"


def test_packed_documents_are_refused_on_the_grid(pools):
    for message in pools(4).run(_documents_job):
        assert "packed documents (positions) under tp_mode 2d" in message, message


@pytest.mark.parametrize("config,message", [
    (dict(tp=8, tp_mode="2d"), "tp must be a square of at least 4"),
    (dict(tp=4, tp_mode="2d", sequence_parallel=True), "tp_mode 2d with sequence_parallel"),
    (dict(tp=4, tp_mode="4d"), "tp_mode must be one of 1d, 2d"),
    (dict(tp=4, tp_mode="3d"), "tp must be a cube of at least 8"),
    (dict(tp=12, tp_mode="2.5d", tp_depth=2), "tp must be 2 x a square of at least 4"),
    (dict(tp=8, tp_mode="2d", tp_depth=2), "tp_depth .2. stacks the grids of tp_mode 2.5d"),
])
def test_2d_refusals_give_the_rule(config, message):
    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**config).resolved(config["tp"])
