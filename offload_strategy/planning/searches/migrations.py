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
    timeline = _Timeline(kernel_seconds, kernel_memory, capacity, ssd_write, ssd_read, host_bandwidth)
    gaps = [(t, t.uses[i], t.uses[i + 1]) for t in tensors for i in range(len(t.uses) - 1) if t.uses[i + 1] > t.uses[i] + 1]
    planned: set[tuple[str, int]] = set()
    host_used = 0
    plan = MigrationPlan()
    while any(m > capacity for m in timeline.memory):
        best = timeline.best([gap for gap in gaps if (gap[0].name, gap[1]) not in planned], host_limit - host_used)
        if best is None:
            break
        _, t, last, following, destination, placed, kernels = best
        timeline.take(t, destination, placed, kernels)
        host_used += t.nbytes if destination == HOST else 0
        planned.add((t.name, last))
        urgent = placed[3] > timeline.starts[following - 1]
        plan.migrations.append(Migration(t.name, destination, (placed[0], placed[1]), (placed[2], placed[3]), tuple(kernels), urgent))
    plan.memory = timeline.memory
    plan.over_capacity = {k: m - capacity for k, m in enumerate(timeline.memory) if m > capacity}
    return plan


class _Timeline:
    """The kernels' start times and memory, and the busy intervals of the SSD channel (one, both
    ways) and of host memory's two directions, as migrations are planned onto them."""

    def __init__(
        self, kernel_seconds: Sequence[float], kernel_memory: Sequence[int], capacity: int, ssd_write: float, ssd_read: float, host_bandwidth: float,
    ) -> None:
        self.seconds, self.capacity = kernel_seconds, capacity
        self.starts = [0.0]
        for d in kernel_seconds:
            self.starts.append(self.starts[-1] + d)
        self.memory = list(kernel_memory)
        self.bandwidth = {SSD: (ssd_write, ssd_read), HOST: (host_bandwidth, host_bandwidth)}
        ssd = _Channel()
        self.channels = {SSD: (ssd, ssd), HOST: (_Channel(), _Channel())}

    def window(self, t: TensorUses, last: int, following: int, destination: str) -> Optional[tuple[float, float, float, float]]:
        """(offload start, end, prefetch start, end) of ``t`` between its uses, or None."""
        write, read = self.bandwidth[destination]
        if write <= 0 or read <= 0:
            return None
        out_channel, in_channel = self.channels[destination]
        off_start = out_channel.earliest(self.starts[last + 1], t.nbytes / write)
        off_end = off_start + t.nbytes / write
        pre_start = in_channel.latest(self.starts[following], t.nbytes / read)
        if destination == SSD and off_start < pre_start + t.nbytes / read and pre_start < off_end:
            return None  # one channel: the two moves would overlap
        if pre_start < off_end:
            return None
        return off_start, off_end, pre_start, pre_start + t.nbytes / read

    def covered(self, off_end: float, pre_start: float) -> list[int]:
        return [k for k in range(len(self.memory)) if self.starts[k] >= off_end and self.starts[k + 1] <= pre_start]

    def best(self, gaps: Sequence[tuple[TensorUses, int, int]], host_room: int) -> Optional[tuple]:
        """The migration that frees the most over-capacity memory-time per second of transfer:
        the SSD when it can take the move, host memory only when it cannot."""
        best = None
        for t, last, following in gaps:
            for destination in (SSD, HOST):
                if destination == HOST and t.nbytes > host_room:
                    continue
                placed = self.window(t, last, following, destination)
                if placed is None:
                    continue
                kernels = self.covered(placed[1], placed[2])
                benefit = sum(min(t.nbytes, max(self.memory[k] - self.capacity, 0)) * self.seconds[k] for k in kernels)
                if benefit <= 0:
                    continue
                cost = (placed[1] - placed[0]) + (placed[3] - placed[2])
                ratio = benefit / cost if cost > 0 else float("inf")
                if best is None or ratio > best[0]:
                    best = (ratio, t, last, following, destination, placed, kernels)
                break
        return best

    def take(self, t: TensorUses, destination: str, placed: tuple[float, float, float, float], kernels: list[int]) -> None:
        out_channel, in_channel = self.channels[destination]
        out_channel.take(placed[0], placed[1])
        in_channel.take(placed[2], placed[3])
        for k in kernels:
            self.memory[k] -= t.nbytes
