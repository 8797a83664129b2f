"""10Cache §3.3.1: how many fixed-size buffers of each tensor size to pre-allocate per tier.

The paper sizes its pinned pools from the model's tensor-size distribution instead of one
buffer size for all tensors (which wastes half of a 1024-byte buffer on a 512-byte tensor):
Algorithm 1 turns the count of tensors per size into each size's share of the bytes,
Algorithm 2 splits each tier's budget by those shares into whole buffers. The pools in
``offload_strategy.memory.pools`` then carve the buffers from one contiguous block (Fig. 5).

Pure functions on plain numbers: no torch, so the planner and the simulator can run anywhere.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# Algorithm 2 divides floating-point shares; a quotient this close (relatively) to a whole
# number is that number, not one buffer less. Rounding in the shares is ~1e-16 relative, so
# 1e-12 absorbs it, and for budgets under 1 TB the buffers still cannot exceed the budget.
_WHOLE_TOLERANCE = 1e-12


@dataclass(frozen=True)
class SizeClass:
    """``count`` buffers of ``slot_bytes`` each: one row of the table in 10Cache Fig. 5.

    Defined here (torch-free) so the planner can return pool layouts; ``memory.pools``
    re-exports it for the runtime.
    """

    slot_bytes: int
    count: int

    def __post_init__(self) -> None:
        if isinstance(self.slot_bytes, bool) or not isinstance(self.slot_bytes, int) or self.slot_bytes <= 0:
            raise ValueError(f"SizeClass(slot_bytes={self.slot_bytes!r}): a slot holds a whole number of bytes > 0.")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 0:
            raise ValueError(f"SizeClass(slot_bytes={self.slot_bytes}, count={self.count!r}): the count must be a whole number >= 0.")

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes * self.count


def _check_counts(counts: Mapping[int, int]) -> None:
    for size, count in counts.items():
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"tensor size {size!r} (count {count!r}): sizes are whole numbers of bytes > 0.")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"tensor size {size} has count {count!r}: counts are whole numbers >= 0.")


def size_counts(sizes: Iterable[int]) -> dict[int, int]:
    """Tensor size in bytes -> number of tensors of that size (``TC`` in 10Cache Alg. 1 and 2).

    Zero-byte tensors are left out: they need no buffer, and Algorithm 2 would divide by
    their size. Sorted by size for stable, readable output.
    """
    counter: Counter[int] = Counter()
    for size in sizes:
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"tensor size {size!r}: sizes are whole numbers of bytes >= 0.")
        if size:
            counter[size] += 1
    return dict(sorted(counter.items()))


def tensor_size_distribution(counts: Mapping[int, int]) -> dict[int, float]:
    """10Cache, Algorithm 1 (Tensor Size Distribution Calculator).

    ``TSD[s] = s * c / sum(s_i * c_i)``: the share of all tensor bytes held by tensors of size
    ``s``. Deviation: when there are no bytes at all (empty ``TC`` or all counts zero) every
    share is 0.0 instead of a division by zero.
    """
    _check_counts(counts)
    total = sum(size * count for size, count in counts.items())
    if total == 0:
        return {size: 0.0 for size in counts}
    return {size: size * count / total for size, count in counts.items()}


def _whole(quotient: float) -> int:
    nearest = round(quotient)
    if abs(quotient - nearest) <= _WHOLE_TOLERANCE * max(1.0, abs(quotient)):
        return int(nearest)
    return math.floor(quotient)


def buffer_counts(
    counts: Mapping[int, int], distribution: Mapping[int, float], gpu_bytes: int, cpu_bytes: int
) -> tuple[dict[int, int], dict[int, int]]:
    """10Cache, Algorithm 2 (Buffer Counter), lines 3-5: buffers per tensor size on GPU and CPU.

    ``gpu[s] = min(floor(TSD[s] * gpu_bytes / s), c)`` and
    ``cpu[s] = min(floor(TSD[s] * cpu_bytes / s), c - gpu[s])``: each tier gives each size its
    share of the tier's bytes, never more buffers than there are tensors of that size, and the
    CPU holds only what the GPU does not. Tensors left over go to NVMe (§3.3.2).

    Deviations: the budgets are arguments instead of the paper's memory-profiler calls (lines
    1-2), so the function stays pure and the caller decides what "available" means; the
    paper's division is taken as a whole number of buffers (floor), and a quotient within
    1e-12 of a whole number counts as that number, so floating-point shares such as 1/3 do not
    lose a buffer that fits exactly.
    """
    _check_counts(counts)
    for name, budget in (("gpu_bytes", gpu_bytes), ("cpu_bytes", cpu_bytes)):
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 0:
            raise ValueError(f"{name}={budget!r}: a budget is a whole number of bytes >= 0.")
    missing = sorted(set(counts) - set(distribution))
    if missing:
        raise ValueError(
            f"distribution has no share for tensor sizes {missing}; compute it from the same counts "
            f"with tensor_size_distribution(counts)."
        )
    shares = {size: distribution[size] for size in counts}
    bad = {size: share for size, share in shares.items() if not (0.0 <= share <= 1.0)}
    if bad:
        raise ValueError(f"distribution shares {bad} are not fractions in [0, 1].")
    if sum(shares.values()) > 1.0 + 1e-9:
        raise ValueError(
            f"distribution shares sum to {sum(shares.values()):.6g} > 1, which would hand out more than "
            f"the budget; Algorithm 1 gives shares that sum to 1."
        )
    gpu: dict[int, int] = {}
    cpu: dict[int, int] = {}
    for size, count in counts.items():
        gpu[size] = min(_whole(shares[size] * gpu_bytes / size), count)
        cpu[size] = min(_whole(shares[size] * cpu_bytes / size), count - gpu[size])
    return gpu, cpu


def size_classes(counts: Mapping[int, int]) -> list[SizeClass]:
    """Buffer counts (one tier's dict from :func:`buffer_counts`) as pool size classes: sizes
    with a count > 0, largest slot first (the pool lays slots out in the order given).
    """
    _check_counts(counts)
    return [SizeClass(size, count) for size, count in sorted(counts.items(), reverse=True) if count > 0]
