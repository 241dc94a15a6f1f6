"""The papers' closed forms, as plain functions, so that docs and tests can put them next to
paratrain's own accounting (paratrain.planner.memory, which counts paratrain's padding, buffers
and phases).

    zero_model_state_bytes        Rajbhandari et al. 2020 (ZeRO), section 5 and figure 1
    korthikanti_activation_bytes  Korthikanti et al. 2022 (Reducing activation recomputation), table 2
    bubble_fraction               Huang et al. 2019 (GPipe); Narayanan et al. 2021, sections 2.2-2.3
    training_days                 Narayanan et al. 2021, section 5.1: time = 8 T P / (n X)
"""

from __future__ import annotations

from paratrain.config.parallel import ScheduleError
from paratrain.pipeline.schedules import Schedule

RECOMPUTE = ("none", "selective", "full")


def zero_model_state_bytes(num_params: int, *, stage: int, dp: int, param_bytes: int = 2, grad_bytes: int = 2,
                           optimizer_bytes_per_param: int = 12) -> dict[str, float]:
    """Model states per device under ZeRO stage 0-3 over dp ranks, in bytes.

    Mixed-precision Adam: 2 bytes of fp16/bf16 parameters, 2 of gradients, K = 12 of optimizer state
    (fp32 master 4, two fp32 moments 8) per parameter: (2 + 2 + K) psi = 16 psi without sharding.
    P_os (stage 1) splits the K psi over N_d ranks, P_os+g (2) the gradients too, P_os+g+p (3) all.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    psi = float(num_params)
    params = param_bytes * psi / (dp if stage >= 3 else 1)
    grads = grad_bytes * psi / (dp if stage >= 2 else 1)
    optimizer = optimizer_bytes_per_param * psi / (dp if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer, "total": params + grads + optimizer}


def korthikanti_activation_bytes(*, seq: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                                 sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Activation bytes one transformer layer keeps for backward, 16-bit activations (table 2).

        no parallelism                  s b h (34 + 5 a s / h)
        tensor parallel                 s b h (10 + 24 / t + 5 a s / (h t))
        tensor + sequence parallel      s b h (34 + 5 a s / h) / t
        + selective recompute           drops the 5 a s / h term (attention scores, softmax, dropout)
        full recompute                  2 s b h: the layer's input only (/ t with sequence parallelism)

    The 10 in the tensor-parallel form is what stays whole without sequence parallelism: the two
    layer norms' inputs (4 s b h) and the two dropout masks and outputs after the row-parallel layers
    (6 s b h)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    s, b, h, a, t = seq, micro_batch, hidden, heads, tp
    if recompute == "full":
        return 2.0 * s * b * h / (t if sequence_parallel else 1)
    attention = 0.0 if recompute == "selective" else 5.0 * a * s / h
    if sequence_parallel:
        return s * b * h * (34.0 + attention) / t
    return s * b * h * (10.0 + 24.0 / t + attention / t)


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle share of a pipeline step (idle time over total time per rank) with equal stages: the schedule's own
    formula (paratrain.pipeline.schedules.Schedule.bubble; gpipe, 1f1b (p - 1) / (m + p - 1), interleaved
    (p - 1) / (v m + p - 1))."""
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"p, m and v must be >= 1, got p={p}, m={m}, v={v}")
    try:
        return Schedule(schedule, p, v).bubble(m)
    except ScheduleError as error:
        raise ValueError(str(error)) from None


def training_days(tokens: float, params: float, gpus: int, flops_per_gpu: float) -> float:
    """Days to train on `tokens` with activation recomputation: 8 T P / (n X) seconds (forward 2 T P,
    backward 4 T P, the recomputed forward 2 T P), at X achieved FLOP/s per GPU."""
    if gpus < 1 or flops_per_gpu <= 0:
        raise ValueError(f"gpus must be >= 1 and flops_per_gpu > 0, got {gpus} and {flops_per_gpu}")
    return 8.0 * tokens * params / (gpus * flops_per_gpu) / 86400.0
