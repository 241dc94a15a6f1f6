"""Wrap a module in its place without adding a level to the names.

A strategy that changes how a module runs (recompute it, feed it other positions) wraps it rather than
mutating it: no class swap, no assigned `forward`. A `Wrapper` holds the module's own parameter,
buffer, child and hook dicts (the same dict objects), so names, state dicts, tensor-parallel plans and
ZeRO-3's units still see `blocks.3.attn.qkv.weight`; the module itself is neither changed nor
registered again. Other attributes are read from the module. A subclass writes `forward`, calling the
module's own forward through `self.wrapped`.
"""

from __future__ import annotations

from typing import Any

from torch import nn

_SHARED = tuple(key for key, value in vars(nn.Module()).items() if isinstance(value, (dict, set)))
"""What a Wrapper holds of its module's own state: parameters, buffers, children, the set of
non-persistent buffers and every hook dict (nn.Module keeps each in its own dict)."""


class Wrapper(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        for key in _SHARED:
            self.__dict__[key] = module.__dict__[key]
        self.__dict__["_wrapped"] = module  # not a child: it would add a level to every name
        self.training = module.training

    @property
    def wrapped(self) -> nn.Module:
        return self.__dict__["_wrapped"]

    def train(self, mode: bool = True) -> Wrapper:
        self.wrapped.train(mode)  # its forward reads its own `training`
        return super().train(mode)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if "_wrapped" not in self.__dict__:  # not built yet (unpickling)
                raise
            return getattr(self.__dict__["_wrapped"], name)

    def _get_name(self) -> str:
        return f"{type(self).__name__}[{self.wrapped._get_name()}]"
