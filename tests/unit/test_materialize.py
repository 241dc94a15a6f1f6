"""Keyed init drawn piece by piece equals the same piece of the whole draw, bit for bit; a model built
on the meta device, materialised in one process, equals the whole build; wrong input is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain
from paratrain.config import preset
from paratrain.hybrid.pieces import Piece
from paratrain.models.init import BLOCK, Constant, KeyedNormal
from paratrain.comm.flat import FlatGroup


def test_keyed_normal_ranges_and_slices_equal_the_whole_draw():
    init = KeyedNormal(1, "w", 0.02)
    shape = (6, 3 * BLOCK // 4 + 4)  # 4.5 blocks: ranges cross block boundaries
    whole = init.values(shape, 0, 6 * shape[1]).view(shape)
    assert whole.std().item() == pytest.approx(0.02, rel=0.01)
    for split in (None, (0, 1, 3), (1, 2, 4), ((1, 2, 4), (0, 1, 3))):  # the last cut along two dims (ep, tp)
        piece = Piece("w", shape, torch.float32, split)
        local = whole
        for dim, index, parts in piece.cuts:
            size = shape[dim] // parts
            local = local.narrow(dim, index * size, size)
        flat = local.reshape(-1)
        for lo, hi in [(0, flat.numel()), (7, min(BLOCK + 12345, flat.numel())), (flat.numel() - 3, flat.numel()),
                       (5, 5)]:
            assert torch.equal(piece.values(init, lo, hi), flat[lo:hi]), (split, lo, hi)
    experts = torch.arange(4 * 6 * 8.0).view(4, 6, 8)  # [E, D, F] cut over E and F: runs of F / parts
    piece = Piece("down", (4, 6, 8), torch.float32, ((0, 1, 2), (2, 1, 2)))
    local = experts[2:4, :, 4:8].reshape(-1)
    assert piece.numel == local.numel() and piece.local_shape == (2, 6, 4)
    assert piece.runs(0, piece.numel)[:2] == [(0, 100, 4), (4, 108, 4)]  # experts[2, 0, 4:8], experts[2, 1, 4:8]
    assert all(torch.equal(experts.view(-1)[b: b + n], local[a: a + n]) for a, b, n in piece.runs(3, 41))
    with pytest.raises(ValueError, match="two cuts of one dim"):
        Piece("w", (4, 4), torch.float32, ((0, 0, 2), (0, 1, 2)))
    small = KeyedNormal(1, "b", 1.0)  # one block: the values of a single draw from (seed, name)
    from paratrain.rng import keyed_generator
    assert torch.equal(small.values((5, 4), 0, 20), torch.empty(20).normal_(generator=keyed_generator(1, "param/b")))
    assert torch.equal(Constant(1.0).values((3,), 0, 3), torch.ones(3))


def test_meta_build_in_one_process_equals_the_whole_build():
    config = preset("tiny", seq_len=16)
    ctx = paratrain.init(device="cpu")
    engines = [paratrain.parallelize(paratrain.build_gpt(config, seed=4, device=device), ctx,
                                     optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3))
               for device in ("cpu", "meta")]
    whole, meta = (dict(e.model.state_dict(keep_vars=True)) | dict(e.model.named_buffers()) for e in engines)
    assert sorted(whole) == sorted(meta)
    for name in whole:
        assert torch.equal(whole[name], meta[name]), name
    assert meta["head.weight"] is meta["tok_emb.weight"]  # the tie survives materialisation
    batch = (torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16)))
    assert engines[0].train_step(batch, paratrain.lm_loss) == engines[1].train_step(batch, paratrain.lm_loss)


def test_a_meta_model_without_inits_is_refused_with_the_fix():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="param_inits.*FromRank0"):
        paratrain.parallelize(model, paratrain.init(device="cpu"), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    with pytest.raises(KeyError, match="no init for '0.bias'"):
        paratrain.parallelize(model, paratrain.init(device="cpu"), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                              init={"0.weight": KeyedNormal(0, "0.weight", 0.1)})
    with pytest.raises(ValueError, match="init= is for a model built on the meta device"):
        paratrain.parallelize(nn.Linear(2, 2), paratrain.init(device="cpu"), optimizer=lambda ps: torch.optim.SGD(ps),
                              init={})
    with torch.device("meta"):
        params = [nn.Parameter(torch.empty(3))]
    with pytest.raises(ValueError, match="needs device="):
        FlatGroup(0, params, shards=1, shard_index=0, optimizer_group=0)


def test_a_user_model_with_its_own_inits():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    inits = {name: KeyedNormal(9, name, 0.1) if name.endswith("weight") else Constant(0.0)
             for name, _ in model.named_parameters()}
    engine = paratrain.parallelize(model, paratrain.init(device="cpu"), optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                                   init=inits)
    for name, param in engine.model.named_parameters():
        assert not param.is_meta and torch.equal(param.detach().view(-1), inits[name].values(param.shape, 0, param.numel()))
