"""Activation offload on CPU: the same pack / prefetch / unpack path as on CUDA, copying into
separate host buffers, so parity with no offload must be exact and the counters must add up."""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from paratrain.config import preset
from paratrain.memory import ActivationOffload, apply_activation_offload, apply_recompute, saved_activations
from paratrain.memory.offload import MIN_OFFLOAD_BYTES
from paratrain.models import KeyedDropout, build_gpt, lm_loss
from paratrain.rng import DropoutStream

TINY = preset("tiny")


def batch(rows: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(0, TINY.vocab_size, (rows, TINY.seq_len), generator=torch.Generator().manual_seed(seed))
    return x, torch.roll(x, -1, 1)


def gpt(*, dropout: float = 0.0) -> torch.nn.Module:
    """The tiny GPT; with dropout, each KeyedDropout draws from a stream as under the engine (masks
    keyed by name and position, not by torch's generator)."""
    model = build_gpt(preset("tiny", dropout=dropout), seed=0)
    stream = DropoutStream(seed=7, step=3)
    for name, module in model.named_modules():
        if isinstance(module, KeyedDropout):
            module.attach(stream, name)
    return model


def step(model: torch.nn.Module, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], *, bf16: bool = False,
         all_forwards_first: bool = False) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Losses and accumulated gradients. all_forwards_first: every forward, then every backward
    (several graphs alive at once, as in GPipe); otherwise forward, backward, forward, ..."""
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    losses, pending = [], []
    for micro in micro_batches:
        with autocast:
            loss, _ = lm_loss(model, micro)
        losses.append(loss.detach())
        if all_forwards_first:
            pending.append(loss)
        else:
            loss.backward()
    for loss in pending:
        loss.backward()
    return losses, {name: p.grad for name, p in model.named_parameters()}


def assert_bitwise(a: tuple[list[torch.Tensor], dict[str, torch.Tensor]],
                   b: tuple[list[torch.Tensor], dict[str, torch.Tensor]]) -> None:
    for la, lb in zip(a[0], b[0], strict=True):
        assert torch.equal(la, lb), (la.item(), lb.item())
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert torch.equal(a[1][name], b[1][name]), name


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_offload_matches_no_offload_bitwise(bf16, dropout):
    reference = step(gpt(dropout=dropout), [batch()], bf16=bf16)
    model = gpt(dropout=dropout)
    offload = apply_activation_offload(model)
    assert offload.names == [f"blocks.{i}" for i in range(TINY.n_layer)]
    assert_bitwise(step(model, [batch()], bf16=bf16), reference)
    stats = offload.stats()
    assert stats.bytes > 0 and stats.tensors >= stats.storages > 0
    # every storage came back through a backward hook before backward asked for it
    assert stats.prefetched == stats.storages and stats.on_demand == 0 and stats.resident == 0


@pytest.mark.parametrize("all_forwards_first", [False, True], ids=["1f1b", "gpipe"])
def test_micro_batches_accumulate_bitwise(all_forwards_first):
    micro = [batch(2, seed=1), batch(2, seed=2), batch(2, seed=3)]
    reference = step(gpt(), micro, all_forwards_first=all_forwards_first)
    model = gpt()
    offload = apply_activation_offload(model)
    assert_bitwise(step(model, micro, all_forwards_first=all_forwards_first), reference)
    # a micro-batch's block 0 does not chain to the previous one's last block: nothing is fetched
    # early for another graph, and nothing is fetched late
    stats = offload.stats()
    assert stats.prefetched == stats.storages and stats.on_demand == 0


def test_offloaded_bytes_are_what_the_blocks_save():
    """The pack hook sees every activation the blocks save: the bytes it copies out are the
    storages saved_activations records inside the blocks, less the model's buffers (the RoPE
    tables, kept like parameters: they exist anyway) and storages under min_bytes."""
    plain = gpt()
    records = []

    def recorded(forward, *args, **kwargs):
        with saved_activations(plain) as record:
            out = forward(*args, **kwargs)
        records.append(record)
        return out

    for block in plain.blocks:
        block.forward = functools.partial(recorded, block.forward)
    loss, _ = lm_loss(plain, batch())
    storages = {ptr: size for record in records for ptr, size in record.storages.items()}
    buffers = {b.untyped_storage().data_ptr() for b in plain.buffers()}
    expected = sum(size for ptr, size in storages.items() if size >= MIN_OFFLOAD_BYTES and ptr not in buffers)
    assert any(ptr in buffers for ptr in storages)  # the RoPE tables are saved, and left out

    model = gpt()
    offload = apply_activation_offload(model)
    lm_loss(model, batch())[0].backward()
    assert offload.stats().bytes == expected > 0

    everything = gpt()
    offload = apply_activation_offload(everything, min_bytes=0)
    lm_loss(everything, batch())[0].backward()
    assert offload.stats().bytes == sum(size for ptr, size in storages.items() if ptr not in buffers)
    assert offload.stats().kept > 0  # parameters, and the RoPE tables


@pytest.mark.parametrize("start", [1, 2, 3])
def test_prefetch_runs_one_block_ahead(start):
    """Backward from block `start`'s output runs blocks start+1.. only; each block's hook brings
    back its own storages and those of the block before it, so blocks start-1.. stay on the host."""
    model = gpt()
    offload = apply_activation_offload(model)
    outputs = {}
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda module, args, output, i=i: outputs.__setitem__(i, output))
    loss, _ = lm_loss(model, batch())
    storages = offload.stats().storages
    assert storages % TINY.n_layer == 0
    per_block = storages // TINY.n_layer
    assert offload.stats().prefetched == 0
    torch.autograd.grad(loss, outputs[start])
    # the hook on block start's output fires too (its gradient is ready): blocks start.. and start-1
    assert offload.stats().prefetched == (TINY.n_layer - start + 1) * per_block
    assert offload.stats().on_demand == 0


def test_without_grad_nothing_is_packed():
    model = gpt()
    offload = apply_activation_offload(model)
    with torch.no_grad():
        model(batch()[0])
    assert offload.stats() == type(offload.stats())()


def test_refuses_a_recomputed_block():
    model = gpt()
    apply_recompute(model, r"blocks\.1")
    with pytest.raises(ValueError, match=r"'blocks\.1'.*recompute"):
        apply_activation_offload(model)
    inside = gpt()
    apply_recompute(inside, r"blocks\.\d+\.attn")  # recomputed inside an offloaded block: also refused
    with pytest.raises(ValueError, match=r"'blocks\.0'.*'blocks\.0\.attn' is recomputed"):
        apply_activation_offload(inside)


def test_refuses_offloading_twice():
    model = gpt()
    apply_activation_offload(model)
    with pytest.raises(ValueError, match="already offloaded"):
        apply_activation_offload(model, r"blocks\.0")


def test_a_pattern_matching_nothing():
    model = gpt()
    with pytest.raises(ValueError, match="matched no module"):
        apply_activation_offload(model, r"layers\.\d+")
    offload = apply_activation_offload(model, r"layers\.\d+", required=False)
    assert isinstance(offload, ActivationOffload) and offload.names == []


def test_an_exception_inside_a_block_leaves_no_hooks_entered():
    """The forward hook that leaves saved_tensors_hooks is always called: a block that raises after
    the pre-hook entered them leaves later computations alone."""
    model = gpt()
    offload = apply_activation_offload(model)

    def fail(module, args):
        raise RuntimeError("boom")

    model.blocks[1].register_forward_pre_hook(fail)  # runs after offload's pre-hook
    with pytest.raises(RuntimeError, match="boom"):
        lm_loss(model, batch())
    before = offload.stats()
    x = torch.randn(64, 64, requires_grad=True)
    (x.tanh() * x).sum().backward()  # saves tensors far over min_bytes
    assert offload.stats() == before
