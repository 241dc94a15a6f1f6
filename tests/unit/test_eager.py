"""paratrain.eager: outside a compile the function runs as it is, and nothing imports torch._dynamo;
inside one, dynamo breaks its graph at the function, which runs eagerly."""

from __future__ import annotations

import subprocess
import sys

import torch

from paratrain.eager import eager


def test_importing_paratrain_does_not_import_dynamo():
    code = "import sys, paratrain, paratrain.cli; print('torch._dynamo' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_a_compiled_caller_breaks_its_graph_at_an_eager_function():
    seen = []

    @eager
    def double(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.compiler.is_compiling())
        return x * 2

    def f(x: torch.Tensor) -> torch.Tensor:
        return double(x.sin()).cos()

    x = torch.randn(4)
    assert torch.equal(torch.compile(f, backend="eager")(x), f(x))
    assert seen == [False, False]  # run eagerly both times
    explained = torch._dynamo.explain(f)(x)
    assert explained.graph_break_count == 1 and double.__name__ == "double"
