"""1,000 random combinations of `paratrain train` flags, valid and not (nan, inf, negative, zero, huge,
unknown names): each is either accepted or refused with a ConfigError, never a traceback. Checked as
the launcher checks before any process starts (paratrain.cli.launching.prepare_launch)."""

from __future__ import annotations

import math
import random

import pytest

from paratrain.cli.flags import TRAIN_FLAGS, build_parser, run_config_from_args
from paratrain.cli.launching import prepare_launch
from paratrain.config import ConfigError

INTS = [-1, 0, 1, 2, 3, 4, 8, 16, 64, 10**9]
FLOATS = [math.nan, math.inf, -math.inf, -1.0, 0.0, 1e-12, 1e-3, 0.5, 1.0, 3.0, 1e9]
STRINGS = {
    "--device": ["cpu", "auto", "cuda", "gpu"], "--schedule": ["gpipe", "1f1b", "interleaved", "zero-bubble", "pipedream"],
    "--offload": ["none", "optimizer", "activations", "optimizer,activations", "disk"], "--grad-reduce": ["auto", "reduce_scatter", "all_reduce", "ring"],
    "--model": ["tiny", "small", "gpt2", "gpt3-175b", "nano"], "--data": ["builtin", "/nonexistent/corpus.txt"],
    "--precision": ["fp32", "bf16", "fp16", "fp8"], "--rdzv-backend": ["static", "c10d", "etcd"],
    "--rdzv-endpoint": ["", "127.0.0.1:29500"], "--rdzv-id": ["job"], "--save": ["", "/tmp/paratrain-flags"],
    "--resume": ["", "/nonexistent/ckpt"], "--log-json": ["", "/tmp/paratrain-flags/log.jsonl"],
    "--fail-at": ["", "1:3", "x", "1:2:3"], "--pp-split": ["2", "1,3", "3,1", "0"],
    "--nan-policy": ["stop", "skip", "never"],
    "--dp-mode": ["sync", "diloco", "local"], "--fault-tolerance": ["off", "replica", "always"],
    "--lighthouse": ["", "127.0.0.1:1"],
}
SWITCHES = ["--recompute", "--recompute=selective", "--sequence-parallel", "--no-progress", "--keep-params",
            "--no-memory-check", "--compile", "--check-collectives"]


def _combo(rng: random.Random) -> list[str]:
    argv = ["train"]
    for flag in rng.sample(sorted(TRAIN_FLAGS), rng.randint(1, 7)):
        kind = TRAIN_FLAGS[flag][1]
        if flag in STRINGS:
            value = rng.choice(STRINGS[flag])
        elif kind is int:
            value = str(rng.choice(INTS))
        elif kind is float:
            value = str(rng.choice(FLOATS))
        else:
            continue
        argv.append(f"{flag}={value}")  # the = form: "-inf" is a value, not an option
    argv += rng.sample(SWITCHES, rng.randint(0, 2))
    return argv


@pytest.mark.parametrize("seed", range(4))
def test_random_flags_are_accepted_or_refused_with_the_rule(seed):
    rng = random.Random(seed)
    parser = build_parser()
    refused = accepted = 0
    for _ in range(250):
        argv = _combo(rng)
        try:
            prepare_launch(run_config_from_args(parser.parse_args(argv)), gpus=0)
            accepted += 1
        except ConfigError as error:
            refused += 1
            assert str(error), argv
        except Exception as error:  # noqa: BLE001 - the point of the test
            pytest.fail(f"{' '.join(argv)}\n-> {type(error).__name__}: {error}")
    assert accepted and refused
