"""MemFerry: which units the GPU computes on in host memory in forward (Alg. 1, §IV-B), and which
write their gradients straight into host memory (GO-MemFerry, §IV-D).

**Forward modes (Alg. 1).** Each unit runs GFGB (copied into the GPU tier, then computed) or DHA
(computed by the GPU directly on pinned host memory: no copy, a slower forward). Going through
the units in order, the algorithm keeps the forward time so far (``T_all``) and the *reserved
overlap time* (``T_res``): compute during which the link is free to load later units. A unit whose
DHA forward is no slower than its copy plus GPU forward runs DHA, and its compute adds to the
reserve. Otherwise it runs GFGB: if the reserve hides its copy, its copy is taken from the reserve;
if not, earlier GFGB units whose copies were hidden are turned to DHA, first to last, while that
shortens the forward (backtracking, Fig. 7), and what is still not hidden is waited for.

Interpretation of the printed pseudo-code: ``update`` at the end of ``backtrack`` *sets* ``T_all``
and ``T_res`` (the base it computes already contains the old ``T_all``; adding would count it
twice), and only earlier GFGB units are candidates (the unit being placed runs GFGB whatever the
loop decides, line 13).

**Backward modes.** ``backward_modes`` turns DHA units into DFGB where the idle link allows (see
its docstring).

**Gradient placement (GO-MemFerry).**
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
from typing import Optional

GFGB, DHA = "gfgb", "dha"


def forward_modes(
    transfer_seconds: Sequence[float],
    gpu_forward_seconds: Sequence[float],
    dha_forward_seconds: Sequence[float],
    between_seconds: Optional[Sequence[float]] = None,
) -> tuple[list[str], float]:
    """MemFerry Alg. 1: a mode per unit (``"gfgb"`` or ``"dha"``) and the forward time it predicts.

    ``between_seconds[l]``: compute between unit l and the next that uses no parameters (``T_FP(A_{l,l+1})``).
    """
    n = len(transfer_seconds)
    if not len(gpu_forward_seconds) == len(dha_forward_seconds) == n:
        raise ValueError("transfer, GPU-forward and DHA-forward times need one entry per unit each.")
    between = list(between_seconds) if between_seconds is not None else [0.0] * n
    trans, fp, dha = list(transfer_seconds), list(gpu_forward_seconds), list(dha_forward_seconds)
    modes = [GFGB] * n
    t_all = t_res = 0.0
    tag = -1  # first GFGB unit since the last backtrack whose copy the reserve hid
    for k in range(n):
        if dha[k] <= fp[k] + max(trans[k], 0.0):
            modes[k] = DHA
            t_all, t_res = t_all + dha[k], t_res + dha[k]
        elif trans[k] < t_res:
            if tag == -1:
                tag = k
            t_all, t_res = t_all + fp[k], t_res + fp[k] - trans[k]
        else:
            base = t_all + trans[k] + fp[k] - t_res  # wait for what the reserve does not hide
            reserve = t_res
            if tag != -1:
                base, reserve, tag = _backtrack(modes, tag, k, trans, fp, dha, t_all, base, reserve)
            t_all, t_res = base, max(reserve - trans[k], 0.0) + fp[k]
        t_all, t_res = t_all + between[k], t_res + between[k]
    return modes, t_all


def _backtrack(
    modes: list[str], tag: int, k: int, trans: list[float], fp: list[float], dha: list[float], t_all: float, base: float, reserve: float
) -> tuple[float, float, int]:
    """Alg. 1's backtracking for unit ``k``, whose copy the reserve cannot hide: earlier GFGB units
    (from ``tag``) turned DHA while that shortens the forward, their copies' time added to the
    reserve; the new (forward time, reserve, tag)."""
    for i in range(tag, k):
        if modes[i] != GFGB:
            continue
        gain = trans[i] + dha[i] - fp[i]
        candidate = max(trans[k] - reserve - gain, 0.0) + t_all + (dha[i] - fp[i] + fp[k])
        if candidate < base:
            modes[i], tag = DHA, i + 1
            base, reserve = candidate, reserve + gain
            if reserve >= trans[k]:
                break
    return base, reserve, tag


DFGB = "dfgb"


def backward_modes(
    modes: Sequence[str],
    nbytes: Sequence[int],
    transfer_seconds: Sequence[float],
    gpu_backward_seconds: Sequence[float],
    dha_backward_seconds: Sequence[float],
    idle_seconds: float,
    gpu_bytes_free: int,
) -> list[str]:
    """MemFerry's backward pass: which DHA units become DFGB (computed in place in forward, then
    copied into the GPU tier so that their backward runs on the GPU, §IV-B).

    The link is idle between the end of forward's parameter loading and the start of backward's
    gradient transfers (``idle_seconds``). Greedy, precisely: the candidates are the DHA units
    whose backward is faster on the GPU (``dha_backward > gpu_backward``); they are taken in
    decreasing order of backward seconds saved per byte copied, ``(dha_backward - gpu_backward) /
    nbytes`` (ties: the later unit first, as backward reaches it first), each while its copy time
    fits in what is left of the idle window and its bytes in ``gpu_bytes_free``; a candidate that
    does not fit is skipped and the next tried. Returns the modes with the chosen units as ``"dfgb"``.
    """
    n = len(modes)
    if not (len(nbytes) == len(transfer_seconds) == len(gpu_backward_seconds) == len(dha_backward_seconds) == n):
        raise ValueError("modes, sizes, transfer and backward times need one entry per unit each.")
    candidates = [i for i in range(n) if modes[i] == DHA and dha_backward_seconds[i] > gpu_backward_seconds[i] and nbytes[i] > 0]
    candidates.sort(key=lambda i: ((dha_backward_seconds[i] - gpu_backward_seconds[i]) / nbytes[i], i), reverse=True)
    out = list(modes)
    window, free = idle_seconds, gpu_bytes_free
    for i in candidates:
        if transfer_seconds[i] <= window and nbytes[i] <= free:
            out[i] = DFGB
            window -= transfer_seconds[i]
            free -= nbytes[i]
    return out


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
