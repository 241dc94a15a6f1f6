"""What precision fp8 changes in a step's price (paratrain.memory.float8 runs it): estimates, not measured on a GPU.

    matmuls   the blocks' linears (not the head, the router or the experts) at the device's float8 rate:
              Hardware.float8_speedup x the 16-bit peak (H100 and H200: 1,979 / 989 dense TFLOP/s on the data
              sheet, 2x; the CPU's float8 is emulated: 1x; an A100 has none: refused)
    casts     memory-bound passes over each operand a float8 matmul reads: its amax (a read), its cast (a read
              and a one-byte write), 5 bytes an element of a 16-bit tensor; forward x and W, backward g and W
              again, and for the weight gradient the transposed x and g (tensorwise: copies of the float8 values,
              2 bytes an element; rowwise: cast anew along the tokens, 5)
    gathers   ZeRO-3 gathers the float8 linears' weights in one byte (tensorwise; counted by
              paratrain.planner.dp_comm to the byte)

The activations are priced as bf16's (the tensorwise recipe keeps x in float8 for the weight gradient, half the
bytes: not counted).
"""

from __future__ import annotations

from paratrain.config.errors import ConfigError
from paratrain.config.model import ModelConfig

CAST_BYTES = 5
"""Bytes an element of a 16-bit operand costs to cast: read for the amax, read and written (one byte) by the cast."""
COPY_BYTES = 2
"""Bytes an element of a float8 tensor costs to transpose: read and written, one byte each."""


def block_linears(model: ModelConfig, *, mlp: bool = True) -> list[tuple[int, int, bool]]:
    """A block's linears as (d_in, d_out, column-parallel): q k v, out, and the MLP's up and down."""
    h, f = model.d_model, model.ff_dim
    return [(h, 3 * h, True), (h, h, False)] + ([(h, f, True), (f, h, False)] if mlp else [])


def linear_flops_per_token(model: ModelConfig) -> float:
    """Forward and backward FLOPs of the blocks' float8 linears per token (the dense blocks' MLP; a MoE layer's
    experts stay in 16 bits)."""
    dense_layers = model.n_layer - model.moe_layers
    return 6.0 * sum(d_in * d_out for d_in, d_out, _ in block_linears(model)) * dense_layers + 6.0 * sum(
        d_in * d_out for d_in, d_out, _ in block_linears(model, mlp=False)) * model.moe_layers


def cast_bytes(shapes: list[tuple[int, int]], tokens: int, recipe: str) -> tuple[float, float]:
    """(forward, backward) bytes the casts of linears move, for this rank's [d_in, d_out] products over `tokens`."""
    forward = sum(CAST_BYTES * (tokens * d_in + d_in * d_out) for d_in, d_out in shapes)
    transposed = COPY_BYTES if recipe == "tensorwise" else CAST_BYTES
    backward = sum(CAST_BYTES * (tokens * d_out + d_in * d_out) + transposed * tokens * (d_in + d_out)
                   for d_in, d_out in shapes)
    return float(forward), float(backward)


def float8_speedup(hardware_name: str, speedup: float) -> float:
    """The float8 rate over the 16-bit peak, or a ConfigError where the device has no float8 matmuls."""
    if speedup <= 0:
        raise ConfigError(f"precision fp8 needs float8 matmuls, which the {hardware_name} does not have (NVIDIA's "
                          "from compute capability 8.9: L40S, H100, H200): plan it in bf16")
    return speedup
