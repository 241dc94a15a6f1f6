"""Tensor-parallel plans and keyed dropout, without processes."""

from __future__ import annotations

import pytest
import torch

from paratrain.config import preset
from paratrain.models import GPT, KeyedDropout
from paratrain.rng import DropoutStream, hashed_uniform
from paratrain.models import GPT_PLAN
from paratrain.tensor_parallel import apply_tensor_parallel, resolve_plan
from paratrain.topology import AxisGroup


def test_gpt_plan_names_every_split_module():
    model = GPT(preset("tiny"))
    resolved = resolve_plan(model, GPT_PLAN)
    assert resolved["tok_emb"] == "embedding" and resolved["head"] == "column" and resolved["output"] == "vocab_output"
    assert sum(style == "column" for style in resolved.values()) == 2 * 4 + 1  # qkv, up per block; head
    assert resolved["blocks.3.attn.core.dropout"] == "heads_dropout"


def test_bad_plans_are_refused_with_the_rule():
    model = GPT(preset("tiny"))
    with pytest.raises(ValueError, match="'attn.qkvv' matches no module"):
        resolve_plan(model, {"attn.qkvv": "column"})
    with pytest.raises(ValueError, match="unknown tensor-parallel style"):
        resolve_plan(model, {"attn.qkv": "diagonal"})
    with pytest.raises(ValueError, match="matched by two plan entries"):
        resolve_plan(model, {"attn.qkv": "column", "blocks.*.attn.qkv": "row"})
    single = AxisGroup("tp", (0,), 0, None)  # type: ignore[arg-type]  # never communicates here
    with pytest.raises(TypeError, match="style 'column' applies to Linear, but 'blocks.0.attn_norm' is a RMSNorm"):
        apply_tensor_parallel(model, {"blocks.0.attn_norm": "column"}, single)


def test_hashed_uniform_is_uniform_and_keyed():
    index = torch.arange(200_000)
    u = hashed_uniform(1234, index)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005 and abs(float(u.var()) - 1 / 12) < 0.002
    assert abs(float(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1])) < 0.01  # neighbours independent
    assert torch.equal(hashed_uniform(1234, index[5:9]), u[5:9])  # a pure function of the index
    assert not torch.equal(hashed_uniform(1235, index[:64]), u[:64])
    big = torch.tensor([2**40 + 7, 2**40 + 8])  # indices past 2^32 still differ
    assert hashed_uniform(1, big)[0] != hashed_uniform(1, big)[1]


@pytest.mark.parametrize("dim", [1, 2])
def test_split_dropout_draws_the_slice_of_the_full_mask(dim):
    stream = DropoutStream(seed=3, step=5, row_offset=8)
    full = KeyedDropout(0.3)
    full.attach(stream, "blocks.0.mlp.dropout")
    x = torch.ones(4, 6, 10)
    expected = full(x)
    assert 0.55 < float((expected != 0).double().mean()) < 0.85
    for part in range(2):
        piece = KeyedDropout(0.3)
        piece.attach(stream, "blocks.0.mlp.dropout")
        piece.split_along(dim, part, 2)
        size = x.shape[dim] // 2
        assert torch.equal(piece(x.narrow(dim, part * size, size)), expected.narrow(dim, part * size, size))
    # rows are global-batch rows: rows 10..11 drawn as the micro-batch at offset 10 = rows 2..3 above
    stream.row_offset = 10
    assert torch.equal(full(x[:2]), expected[2:])
    stream.step = 6
    assert not torch.equal(full(x[:2]), expected[2:])  # a new step, a new mask


def test_placed_dropout_draws_the_mask_at_its_positions():
    """Context parallelism (a rank's positions of the sequence) with sequence parallelism on top (tp's even
    slice of that part) draws the whole mask's entries at those positions; `at` draws a block of it."""
    from paratrain.context_parallel import local_positions

    stream = DropoutStream(seed=3, step=5, row_offset=0)
    full = KeyedDropout(0.3)
    full.attach(stream, "d")
    x = torch.ones(2, 16, 4)
    expected = full(x)
    for cp_rank in range(2):
        at = local_positions(16, cp_rank, 2)  # 8 positions, two chunks
        for tp_rank in range(2):
            piece = KeyedDropout(0.3)
            piece.attach(stream, "d")
            piece.split_along(1, tp_rank, 2)  # registered first: the inner split (tp of the cp part)
            piece.place_along(1, lambda n, device, r=cp_rank: local_positions(n * 2, r, 2).to(device), 2)
            mine = at[tp_rank * 4: (tp_rank + 1) * 4]
            assert torch.equal(piece(x[:, :4]), expected[:, mine])
    block = full.at(x[:, :3], {1: (torch.tensor([5, 0, 9]), 16)})
    assert torch.equal(block, expected[:, [5, 0, 9]])


class _Tied(torch.nn.Module):
    """A tiny language model whose head is its embedding (one Parameter under two names)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(8, 4)
        self.mid = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.emb.weight


def test_a_plan_that_would_untie_a_weight_is_refused_with_the_fix():
    from paratrain.nn.ties import tied_parameters

    assert tied_parameters(_Tied()) == [("emb.weight", "head.weight")]
    single = AxisGroup("tp", (0,), 0, None)  # type: ignore[arg-type]  # never communicates here
    with pytest.raises(ValueError, match=r"emb.weight and head.weight are one tied parameter.*emb \(not in the plan\); "
                                         r"head \('column', dim 0\).*add \{'emb': 'embedding'\} to the plan"):
        apply_tensor_parallel(_Tied(), {"head": "column"}, single)
    with pytest.raises(ValueError, match=r"one tied parameter.*head \('row', dim 1\)"):
        apply_tensor_parallel(_Tied(), {"emb": "embedding", "head": "row"}, single)
    model = _Tied()
    apply_tensor_parallel(model, {"emb": "embedding", "head": "column"}, single)  # split alike: kept
    assert model.head.weight is model.emb.weight


def test_a_tie_split_by_pipeline_stages_is_checked_on_the_whole_model():
    """Once a pipeline cut puts each end on its own stage, no stage sees the tie: parallelize checks the
    plan on the whole model first (check_ties)."""
    from paratrain.tensor_parallel import check_ties

    end = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    end[2].weight = end[0].weight
    with pytest.raises(ValueError, match=r"0.weight and 2.weight are one tied parameter.*add \{'0': 'column'\}"):
        check_ties(end, {"2": "column"})
    check_ties(end, {"0": "column", "2": "column"})  # split alike: kept


def test_a_tie_between_middle_pipeline_stages_is_refused():
    from paratrain.config import ConfigError
    from paratrain.pipeline.schedules import Schedule
    from paratrain.pipeline.stages import StageModel, chunk_ranges, sequential_layers

    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(4)))
    model[2].weight = model[1].weight
    layers = sequential_layers(model)
    with pytest.raises(ConfigError, match=r"1.weight and 2.weight are one tied parameter.*ranks \[1, 2\] of 4"):
        StageModel(model, layers, chunk_ranges(layers, 4), Schedule("1f1b", 4), 0)
    end = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    end[2].weight = end[0].weight  # first and last stage: kept by a copy on the last
    layers = sequential_layers(end)
    last = StageModel(end, layers, chunk_ranges(layers, 2, [2]), Schedule("1f1b", 2), 1)
    assert last.tied == {"2.weight": "0.weight"} and last.tied_name == "2.weight"
    assert torch.equal(last.get_parameter("2.weight"), end[0].weight)
