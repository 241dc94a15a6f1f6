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


def test_mfu():
    assert mfu(1000.0, 6e9, 2, 1e13) == pytest.approx(0.3)
    assert mfu(1000.0, 6e9, 2, None) is None
