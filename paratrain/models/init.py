"""Layout-free parameter initialisation.

Every logical parameter is drawn from its own generator, seeded from (seed, parameter name), on its
full shape. So the values do not depend on how many processes exist, on which rank a parameter
lives, on the order modules were built in, or on what other code drew random numbers before.
A sharded strategy draws the full tensor and keeps its slice, and gets the same numbers.
"""

from __future__ import annotations

import torch

from paratrain.rng import keyed_generator


@torch.no_grad()
def keyed_normal_(tensor: torch.Tensor, *, seed: int, name: str, std: float) -> torch.Tensor:
    """Fill `tensor` with N(0, std^2) drawn in float32 on CPU from the (seed, name) generator."""
    values = torch.empty(tensor.shape, dtype=torch.float32)
    values.normal_(0.0, std, generator=keyed_generator(seed, f"param/{name}"))
    return tensor.copy_(values)
