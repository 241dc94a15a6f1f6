"""Gradient hooks that hold the strategy they call weakly.

Autograd keeps a parameter's hooks in tables of its own, which Python's collector cannot see through. A hook that
holds its strategy (a bound method: GradSync's, ZeroSync's) makes a circle the collector cannot break: parameter ->
hook -> strategy -> parameter. The strategy, its process groups and their threads (gloo's: three per group) then live
for as long as the model does, and a process that builds engines one after another (a notebook, a test pool)
piles them up. A WeakHook breaks the circle; Engine.close removes the hooks outright.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable


class WeakHook:
    """Calls `method` (a bound method) while its object lives; afterwards a backward through the parameter is refused:
    its gradient would no longer be reduced (a silent wrong run)."""

    def __init__(self, method: Callable[..., Any]) -> None:
        self._method = weakref.WeakMethod(method)  # type: ignore[arg-type]
        self._owner = type(method.__self__).__name__  # type: ignore[attr-defined]

    def __call__(self, *args: Any) -> Any:
        method = self._method()
        if method is None:
            raise RuntimeError(
                f"backward reached a parameter whose {self._owner} (the engine's gradient strategy) was freed: its "
                "gradient would not be reduced over the ranks. Keep the Engine alive while its model trains, and "
                "train through engine.step / engine.train_step")
        return method(*args)
