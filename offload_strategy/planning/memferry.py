"""MemFerry: which units write their gradients straight into host memory (GO-MemFerry, §IV-D).

A unit's gradient is either produced in a GPU-tier buffer and copied to host memory afterwards
(fast backward, but the buffer occupies GPU memory), or written by the GPU directly into its host
buffer over PCIe (DHA: no GPU memory, a slower backward). The user allows a share of the gradient
bytes — the *reserve factor* — to stay in the GPU tier; the units kept there are chosen to gain
the most backward time:

    D[i, j] = max(D[i-1, j], D[i-1, j - s_i] + T_GBP(i) - T_CBP(i))

where ``s_i`` is unit i's gradient size, ``T_GBP(i)`` its backward time when its gradient is
written through DHA and ``T_CBP(i)`` when it is produced on the GPU (MemFerry's notation), and
``j`` the space used so far, up to ``reserve × Σ s_i``.

Deviation: sizes are counted in ``resolution`` equal steps of the capacity, rounded up, so the
table stays small for billions of bytes; rounding up never exceeds the reserve. Pure: no torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def gradient_offload_plan(
    sizes: Sequence[int],
    dha_seconds: Sequence[float],
    gpu_seconds: Sequence[float],
    reserve_factor: float,
    resolution: int = 4096,
) -> frozenset[int]:
    """Indices of the units whose gradients stay in the GPU tier; all others are written to host.

    ``dha_seconds[i]`` is T_GBP(i), ``gpu_seconds[i]`` is T_CBP(i).
    """
    if not 0.0 <= reserve_factor <= 1.0:
        raise ValueError(f"gradient reserve factor {reserve_factor!r} must lie in [0, 1]: the share of gradient bytes kept in the GPU tier.")
    if not (len(sizes) == len(dha_seconds) == len(gpu_seconds)):
        raise ValueError(f"{len(sizes)} sizes, {len(dha_seconds)} DHA times and {len(gpu_seconds)} GPU times: give one of each per unit.")
    capacity_bytes = reserve_factor * sum(sizes)
    gains = [d - g for d, g in zip(dha_seconds, gpu_seconds)]
    if capacity_bytes <= 0:
        return frozenset()
    if reserve_factor >= 1.0:  # everything fits: keep every unit that gains
        return frozenset(i for i, gain in enumerate(gains) if gain > 0)
    # Exact bytes when small enough, else `resolution` steps of the capacity.
    step = 1.0 if capacity_bytes <= resolution else capacity_bytes / resolution
    capacity = int(math.floor(capacity_bytes / step + 1e-9))
    weights = [int(math.ceil(s / step - 1e-9)) for s in sizes]

    # table[i][j]: best gain with units < i in space j (MemFerry's D[i, j]).
    table = [[0.0] * (capacity + 1)]
    for w, gain in zip(weights, gains):
        previous = table[-1]
        row = previous[:]
        if gain > 0:  # keeping a unit that gains nothing only uses space
            for j in range(w, capacity + 1):
                row[j] = max(previous[j], previous[j - w] + gain)
        table.append(row)
    kept, j = [], capacity
    for i in range(len(sizes), 0, -1):
        if table[i][j] != table[i - 1][j]:
            kept.append(i - 1)
            j -= weights[i - 1]
    return frozenset(kept)
