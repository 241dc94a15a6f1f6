import math

import pytest

from paratrain.train import lr_at
from paratrain.train.metrics import mfu


def test_warmup_then_cosine():
    lrs = [lr_at(s, total_steps=111, peak=1.0, warmup_steps=10, min_ratio=0.1) for s in range(111)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[-1] == pytest.approx(0.1)
    assert lrs[60] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_wsd_linear_and_constant():
    """wsd: warmup, flat at the peak, then the last round(0.2 x 100) = 20 steps straight down to the floor."""
    def at(schedule: str) -> list[float]:
        return [lr_at(s, total_steps=100, peak=1.0, warmup_steps=10, min_ratio=0.1, schedule=schedule,
                      decay_fraction=0.2) for s in range(100)]

    wsd = at("wsd")
    assert wsd[9] == 1.0 and wsd[10:80] == [1.0] * 70 and wsd[80] == pytest.approx(1 - 0.9 / 20)
    assert wsd[-1] == pytest.approx(0.1) and all(a > b for a, b in zip(wsd[79:], wsd[80:]))
    linear = at("linear")
    assert linear[10] == 1.0 and linear[-1] == pytest.approx(0.1) and linear[55] == pytest.approx(1 - 0.9 * 45 / 89)
    assert at("constant")[10:] == [1.0] * 90


def test_mfu():
    assert mfu(1000.0, 6e9, 2, 1e13) == pytest.approx(0.3)
    assert mfu(1000.0, 6e9, 2, None) is None
