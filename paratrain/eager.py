"""`@eager`: a function torch.compile must not trace (collectives, per-step keyed dropout).

The same as `torch.compiler.disable`, except that torch._dynamo (1.5 s to import, in every process of
every launch) is imported only when something is being compiled: outside a compile the function is
called as it is; inside one, dynamo meets the disabled function, breaks its graph there and runs it
eagerly (tests/unit/test_eager.py).
"""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)


def eager(fn: F) -> F:
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():
            return torch.compiler.disable(fn)(*args, **kwargs)
        return fn(*args, **kwargs)

    return run  # type: ignore[return-value]
