"""A profile computed from a model's shapes and a ``HardwareSpec``, for models and machines that are
not at hand (the model can live on the meta device: nothing is allocated or run).

Each unit's forward costs 2 FLOPs per parameter per token for every module that multiplies by it
(a linear layer, or an output head tied to an embedding); an embedding lookup costs none. Backward
costs twice forward. Time is FLOPs over the GPU's dense peak at ``efficiency`` (model FLOPs
utilisation). Attention's sequence-squared work is not attached to parameters and is left out, so
short sequences are modelled better than long ones. The CPU optimizer updates ``cpu_params_per_s``
parameters per second per core (fused AdamW measured 0.8 G/s per core on the development machine).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..config import HardwareSpec
from ..runtime.units import TransferUnit

CPU_PARAMS_PER_S_PER_CORE = 0.8e9


@dataclass(frozen=True)
class AnalyticUnit:
    name: str
    nbytes: int
    trainable_bytes: int
    parameters: int
    forward_flops: float
    forward_seconds: float
    backward_seconds: float
    update_seconds: float


def analytic_units(
    units: list[TransferUnit],
    users: dict[nn.Module, list[TransferUnit]],
    tokens: int,
    hardware: HardwareSpec,
    dtype: str = "bf16",
    efficiency: float = 0.5,
) -> list[AnalyticUnit]:
    """Per-unit costs of one step of ``tokens`` tokens, in the units' order."""
    peak = hardware.peak_flops(dtype)
    if not peak:
        raise ValueError(f"hardware {hardware.name!r} gives no {dtype} peak FLOP/s; set gpu_{dtype}_tflops to model it.")
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency!r} must lie in (0, 1].")
    multiplies: dict[int, int] = {u.index: 0 for u in units}
    for module, used in users.items():
        if isinstance(module, nn.Embedding):
            continue
        for u in used:
            multiplies[u.index] += 1
    cpu_rate = CPU_PARAMS_PER_S_PER_CORE * max(hardware.cpu_cores, 1)
    out = []
    for u in units:
        matrix = sum(p.numel() for p in u.params if p.dim() >= 2)
        flops = 2.0 * matrix * tokens * multiplies[u.index]
        forward = flops / (peak * efficiency)
        trainable = sum(p.numel() for p in u.trainable)
        out.append(
            AnalyticUnit(
                name=u.name,
                nbytes=u.nbytes,
                trainable_bytes=sum(p.numel() * p.element_size() for p in u.trainable),
                parameters=sum(p.numel() for p in u.params),
                forward_flops=flops,
                forward_seconds=forward,
                backward_seconds=2 * forward,
                update_seconds=trainable / cpu_rate,
            )
        )
    return out
