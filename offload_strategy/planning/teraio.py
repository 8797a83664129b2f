"""TeraIO's lifetime-aware migration planning (§3.2): which inactive tensors leave the GPU, when,
and to the SSD or to host memory, until the memory every kernel needs fits.

The step is a sequence of kernels with known durations and the GPU memory each needs if nothing
moves. A tensor is inactive between two of its uses; moving it out for that gap lowers the memory
of every kernel that runs entirely while it is away. Repeatedly:

- for every inactive period not yet planned, and each destination (the SSD first; host memory when
  the SSD cannot fit the moves in, within the host limit), the offload is placed at the earliest
  time after the last use when that link is free, and the prefetch at the latest time that still
  ends before the next use when it is free: migrations already planned delay both (I/O-aware);
- its **benefit** is the integral over time of the critical memory pressure it removes (the part of
  a kernel's memory above capacity, at most the tensor's size, times the kernel's duration), its
  **cost** the offload plus prefetch time;
- the candidate with the best benefit / cost is planned and the memory of the kernels it covers
  lowered;

until no kernel is over capacity, or no candidate removes any pressure (what is left must stall).
A prefetch that ends within the kernel right before the next use is marked urgent: the runtime
serves it before other pending migrations. The SSD is one channel for reads and writes; host
memory has one per direction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

SSD, HOST = "ssd", "host"


@dataclass(frozen=True)
class TensorUses:
    name: str
    nbytes: int
    uses: tuple[int, ...]  # kernel indices, increasing


@dataclass(frozen=True)
class Migration:
    tensor: str
    destination: str
    offload: tuple[float, float]
    prefetch: tuple[float, float]
    kernels: tuple[int, ...]  # kernels that run while it is away
    urgent: bool


@dataclass
class MigrationPlan:
    migrations: list[Migration] = field(default_factory=list)
    memory: list[int] = field(default_factory=list)  # each kernel's memory after the plan
    over_capacity: dict[int, int] = field(default_factory=dict)  # kernel -> bytes still over (stalls)


class _Channel:
    """Busy intervals of one link, for earliest / latest free slots."""

    def __init__(self) -> None:
        self.busy: list[tuple[float, float]] = []

    def earliest(self, after: float, duration: float) -> float:
        start = after
        for s, e in sorted(self.busy):
            if start + duration <= s:
                break
            start = max(start, e)
        return start

    def latest(self, before: float, duration: float) -> float:
        end = before
        for s, e in sorted(self.busy, reverse=True):
            if e <= end - duration:
                break
            end = min(end, s)
        return end - duration

    def take(self, start: float, end: float) -> None:
        self.busy.append((start, end))


def plan_migrations(
    kernel_seconds: Sequence[float],
    kernel_memory: Sequence[int],
    tensors: Sequence[TensorUses],
    capacity: int,
    *,
    ssd_write: float,
    ssd_read: float,
    host_bandwidth: float,
    host_limit: int,
) -> MigrationPlan:
    """Bandwidths in bytes/s (0: no such path); memory in bytes; see the module docstring."""
    if len(kernel_seconds) != len(kernel_memory):
        raise ValueError(f"{len(kernel_seconds)} kernel durations but {len(kernel_memory)} memory figures; give one of each per kernel.")
    starts = [0.0]
    for d in kernel_seconds:
        starts.append(starts[-1] + d)
    memory = list(kernel_memory)
    ssd, host_out, host_in = _Channel(), _Channel(), _Channel()
    host_used = 0
    gaps = [(t, t.uses[i], t.uses[i + 1]) for t in tensors for i in range(len(t.uses) - 1) if t.uses[i + 1] > t.uses[i] + 1]
    planned: set[tuple[str, int]] = set()
    plan = MigrationPlan()

    def window(t: TensorUses, last: int, following: int, destination: str) -> Optional[tuple[float, float, float, float]]:
        write, read = (ssd_write, ssd_read) if destination == SSD else (host_bandwidth, host_bandwidth)
        if write <= 0 or read <= 0:
            return None
        out_channel, in_channel = (ssd, ssd) if destination == SSD else (host_out, host_in)
        off_start = out_channel.earliest(starts[last + 1], t.nbytes / write)
        off_end = off_start + t.nbytes / write
        pre_start = in_channel.latest(starts[following], t.nbytes / read)
        if destination == SSD and off_start < pre_start + t.nbytes / read and pre_start < off_end:
            return None  # one channel: the two moves would overlap
        if pre_start < off_end:
            return None
        return off_start, off_end, pre_start, pre_start + t.nbytes / read

    def covered(off_end: float, pre_start: float) -> list[int]:
        return [k for k in range(len(memory)) if starts[k] >= off_end and starts[k + 1] <= pre_start]

    while any(m > capacity for m in memory):
        best = None
        for t, last, following in gaps:
            if (t.name, last) in planned:
                continue
            for destination in (SSD, HOST):
                if destination == HOST and host_used + t.nbytes > host_limit:
                    continue
                placed = window(t, last, following, destination)
                if placed is None:
                    continue
                kernels = covered(placed[1], placed[2])
                benefit = sum(min(t.nbytes, max(memory[k] - capacity, 0)) * kernel_seconds[k] for k in kernels)
                if benefit <= 0:
                    continue
                cost = (placed[1] - placed[0]) + (placed[3] - placed[2])
                ratio = benefit / cost if cost > 0 else float("inf")
                if best is None or ratio > best[0]:
                    best = (ratio, t, last, following, destination, placed, kernels)
                break  # the SSD when it can take the move; host memory only when it cannot
        if best is None:
            break
        _, t, last, following, destination, (off_start, off_end, pre_start, pre_end), kernels = best
        if destination == SSD:
            ssd.take(off_start, off_end)
            ssd.take(pre_start, pre_end)
        else:
            host_out.take(off_start, off_end)
            host_in.take(pre_start, pre_end)
            host_used += t.nbytes
        for k in kernels:
            memory[k] -= t.nbytes
        planned.add((t.name, last))
        urgent = pre_end > starts[following - 1]
        plan.migrations.append(Migration(t.name, destination, (off_start, off_end), (pre_start, pre_end), tuple(kernels), urgent))
    plan.memory = memory
    plan.over_capacity = {k: m - capacity for k, m in enumerate(memory) if m > capacity}
    return plan
