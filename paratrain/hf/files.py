"""How a family's files name and cut the model's tensors, where they differ from the module's own.

transformers (5.x) builds a mixture-of-experts layer with each layer's experts stacked in two tensors,

    model.layers.{i}.mlp.experts.gate_up_proj   [E, 2 I, D]   expert e: its gate rows, then its up rows
    model.layers.{i}.mlp.experts.down_proj      [E, D, I]

while the files on the Hub (and those save_pretrained writes) hold one tensor per expert and projection:

    mixtral              model.layers.{i}.block_sparse_moe.experts.{e}.w1 / w3 / w2.weight   (gate / up / down)
                         model.layers.{i}.block_sparse_moe.gate.weight                        (the router)
    qwen2_moe, qwen3_moe model.layers.{i}.mlp.experts.{e}.gate_proj / up_proj / down_proj.weight
    deepseek_v3

Every such conversion here is a concatenation of the files' tensors, flattened, in order: the stacked
gate_up_proj is w1_0 | w3_0 | w1_1 | w3_1 | ... as flat elements. So a model tensor is a list of Parts (a file's
tensor name and shape), and any element range of it, a rank's ZeRO shard, a tensor-parallel slice's rows,
reads only the parts it overlaps (paratrain.hf.load); export writes each part back under its own name
(paratrain.hf.export). tests/unit/test_hf_moe.py checks the result equals transformers' own from_pretrained.
A model's tensor the files already hold under its own name (files written fused) is read as it is.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")


@dataclass(frozen=True)
class Part:
    """One tensor of the files, a piece of a model tensor's flat elements."""

    key: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


_EXPERTS = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.experts\.(?P<tensor>gate_up_proj|down_proj)$")
_ROUTER = re.compile(r"^(?P<layer>model\.layers\.\d+)\.mlp\.gate\.weight$")
_PROJECTIONS = {"mixtral": ("block_sparse_moe", "w1.weight", "w3.weight", "w2.weight"),
                "qwen2_moe": ("mlp", "gate_proj.weight", "up_proj.weight", "down_proj.weight"),
                "qwen3_moe": ("mlp", "gate_proj.weight", "up_proj.weight", "down_proj.weight"),
                "deepseek_v3": ("mlp", "gate_proj.weight", "up_proj.weight", "down_proj.weight")}
"""model_type -> (the experts' module in the files, gate, up and down projections' names)."""


def file_parts(model_type: str, name: str, shape: tuple[int, ...]) -> list[Part]:
    """The files' tensors whose flattened concatenation is the model's tensor `name` of `shape`."""
    if model_type not in _PROJECTIONS:
        return [Part(name, shape)]
    where, gate, up, down = _PROJECTIONS[model_type]
    experts = _EXPERTS.match(name)
    if experts:
        prefix = f"{experts['layer']}.{where}.experts"
        if experts["tensor"] == "gate_up_proj":  # [E, 2I, D]: per expert its gate [I, D] then its up [I, D]
            count, rows, width = shape
            return [Part(f"{prefix}.{e}.{proj}", (rows // 2, width)) for e in range(count) for proj in (gate, up)]
        count, rows, width = shape  # down_proj [E, D, I]
        return [Part(f"{prefix}.{e}.{down}", (rows, width)) for e in range(count)]
    router = _ROUTER.match(name)
    if router and where != "mlp":
        return [Part(f"{router['layer']}.{where}.gate.weight", shape)]
    return [Part(name, shape)]


def files_layout(model_type: str, shapes: dict[str, tuple[int, ...]],
                 in_files: set[str] | None = None) -> dict[str, list[Part]]:
    """name -> its Parts for every model tensor of `shapes`; a name `in_files` holds itself reads as it is."""
    return {name: ([Part(name, shape)] if in_files is not None and name in in_files
                   else file_parts(model_type, name, shape)) for name, shape in shapes.items()}
