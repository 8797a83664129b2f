"""A discrete-event model of one training step under a placement: what the planner compares plans by.

Four resources work in parallel and each does one thing at a time: the GPU's compute stream, the
host -> GPU link, the GPU -> host link, and the NVMe drive (reads and writes share it); a CPU
worker updates offloaded units. Events, in the order the runtime issues them:

- forward, units in execution order: an offloaded unit is copied into a streaming buffer as soon
  as a buffer is free (a buffer frees when the unit computing in it finishes), after an NVMe read
  for units at home on NVMe; its compute starts when the copy is in and the stream is free;
- backward, in reverse: the units still in their buffers at the end of forward (the last ones, as
  many as there are buffers) are used in place, the others are fetched again the same way;
- after a unit's backward its gradient goes to the host (offloaded units), and the worker updates
  it (LoHan §IV-C's updates during backward); an NVMe unit's parameters and states are read as
  its gradient lands and written back behind the worker (LoHan Fig. 3b); persistent units update
  in the GPU tier after backward;
- under data parallelism (``Machine.world_size`` > 1) each unit's gradient is reduced across the
  ranks as the runtime reduces it: a persistent unit's right after its backward, on the GPU
  tier's collectives (``Machine.network``), an offloaded unit's once it has landed at home
  (widened to its master's dtype), on host memory's (``Machine.host_network``, gloo); a reduce to
  its owner with sharded states ((N-1)/N of its bytes per rank, ring-style), an all-reduce without
  (2(N-1)/N); only the owner updates it; after the updates the owners' parameters are sent to the
  others ((N-1)/N of the trainable bytes per rank, on the collectives of the tier each unit
  lives in) and non-owners write their NVMe units;
- the step ends when the last backward, the last update and the last write have.

Copies of different units queue on their link in issue order, so the model captures MemFerry's
and ProTrain's observation that loading, not compute, bounds offloaded training when the link is
slow, and how many buffers it takes to hide it. The NVMe drive is the exception: its reads
(prefetches on the fetch path, the worker's reads ahead) and its writes (behind the worker) come
from different threads, and the drive serves whichever is queued, so a transfer issued later
fills the time the drive would otherwise idle while an earlier one waits for its data
(:class:`_Timeline`); a drive that waited in issue order would idle through every update.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from .profile import StepProfile
from .placement import GPU, HOST, NVME  # defined once, as config.Tier


@dataclass(frozen=True)
class UnitCost:
    """One unit as the model sees it, in execution order."""

    nbytes: int  # parameters as they travel
    forward_seconds: float
    backward_seconds: float
    home: str = HOST
    gradient_bytes: int = 0  # what goes back to the host after backward (0: frozen)
    state_bytes: int = 0  # optimizer states (and masters) read and written around an NVMe unit's update
    update_seconds: float = 0.0  # the optimizer's work on the CPU (or GPU, for persistent units)
    owned: bool = True  # data parallel with sharded states: this rank updates it
    # data parallel: what its reduction moves, its gradients in their masters' dtype (fp32 beside
    # 16-bit parameters, the gradient the runtime reduces); None: ``gradient_bytes``
    reduced_bytes: Optional[int] = None
    tensors: int = 1  # trainable tensors: the runtime reduces each with a collective of its own
    direct_gradient: bool = False  # backward writes the gradient into host memory itself (GO-MemFerry): no copy on the link


@dataclass(frozen=True)
class Bandwidth:
    """The links a step moves bytes over, in bytes/s (0: that path does not exist). The one
    bandwidth type the planning models price with, made from a hardware spec by
    :func:`machine_from_spec`; each model extends it with what it adds (``Machine``: the ranks;
    ``activations.Links``: the parameter traffic already planned)."""

    h2d: float
    d2h: float
    nvme_read: float = 0.0
    nvme_write: float = 0.0


@dataclass(frozen=True)
class Machine(Bandwidth):
    """The links, and the data-parallel ranks sharing the step."""

    world_size: int = 1  # data-parallel ranks
    network: float = 0.0  # bytes/s each rank moves in collectives on the GPU tier (NCCL)
    shard_states: bool = True  # each unit updated by its owner only
    # bytes/s of collectives on host memory (gloo), which offloaded units' reductions and
    # parameter broadcasts use, beside the GPU tier's; None: not known apart, one link for both
    host_network: Optional[float] = None
    collective_latency: float = 0.0  # seconds a collective takes beyond its bytes (one call's cost)
    # each machine's ranks share one copy of host-homed units' parameters: after the step a
    # barrier once their owners have written them, and on several machines each update sent to
    # one rank of every other machine (the ranks of one local index broadcast a share each)
    shared_homes: bool = False
    machines: int = 1  # the ranks span this many machines, as many on each
    # every rank all-reduces and updates the persistent units (ProTrain §3.1.1): none is sent after the step
    replicated_persistent: bool = False

    @property
    def host_collectives(self) -> float:
        return self.network if self.host_network is None else self.host_network


@dataclass(frozen=True)
class StepPrediction:
    seconds: float  # the whole step
    forward_seconds: float
    backward_seconds: float  # from the end of forward to the end of the last backward
    compute_seconds: float  # forward + backward compute alone
    update_tail_seconds: float  # what the step waits for updates after backward
    h2d_bytes: int

    @property
    def exposed_seconds(self) -> float:
        """Time the step is longer than its compute: transfers and updates not hidden."""
        return self.seconds - self.compute_seconds


def costs_from_timing(
    timing: StepProfile, trainable: Sequence[bool], reduced: Optional[Mapping[int, int]] = None, owns: Optional[Callable[[int], bool]] = None,
    tensors: Optional[Sequence[int]] = None,
) -> dict[int, UnitCost]:
    """Each unit's costs, by index, from a timed training step (``StepProfile``), homes left to
    the caller. A unit kept in the GPU tier has no backward interval of its own: its backward
    time is inside its neighbours' (or the step's outside time), so it gets none here and the
    total stays what was measured; without any backward interval, backward is taken as twice
    forward. A unit not updated in the timed step is priced at the measured updates' rate per byte.
    ``reduced``: per unit, the bytes its reduction across ranks moves (``UnitSize.reduced_bytes``),
    where they differ from the parameters'; ``owns``: under sharded data
    parallelism, whether this rank updates a unit; ``tensors``: per unit, its trainable tensors."""
    measured_backward = bool(timing.backward_seconds)
    updated = [(timing.unit_bytes[i], t) for i, t in timing.update_seconds.items() if t > 0]
    per_byte = sum(t for _, t in updated) / max(sum(b for b, _ in updated), 1)
    costs = {}
    for i, nbytes in enumerate(timing.unit_bytes):
        forward = timing.forward_seconds.get(i, 0.0)
        costs[i] = UnitCost(
            nbytes=nbytes, forward_seconds=forward,
            backward_seconds=timing.backward_seconds.get(i, 0.0 if measured_backward else 2 * forward),
            gradient_bytes=nbytes if trainable[i] else 0,
            update_seconds=timing.update_seconds.get(i, per_byte * nbytes) if trainable[i] else 0.0,
            reduced_bytes=reduced.get(i) if reduced is not None and trainable[i] else None,
            owned=owns is None or owns(i),
            tensors=tensors[i] if tensors is not None else 1,
        )
    return costs


def outside_units(timing: StepProfile) -> UnitCost:
    """The step's compute in no unit (the loss, and on the way back the units kept in the GPU tier
    at the end of the model) as a unit with nothing to move, last in execution order."""
    return UnitCost(nbytes=0, forward_seconds=timing.outside_forward_seconds, backward_seconds=timing.outside_backward_seconds, home=GPU)


# bandwidths a hardware spec may leave unknown: a PCIe 3.0 x16 link each way and a SATA-class disk
UNKNOWN_LINK = 10e9
UNKNOWN_DISK = 0.5e9


def machine_from_spec(spec: Optional[Any], nvme: bool) -> Machine:
    """The links of a :class:`~offload_strategy.config.HardwareSpec` (GB/s) in bytes/s, with the
    fallbacks above where it does not know one; no NVMe link without an NVMe tier."""
    def gbps(name: str, unknown: float) -> float:
        value = getattr(spec, name, None) if spec is not None else None
        return value * 1e9 if value else unknown

    return Machine(
        h2d=gbps("h2d_gbps", UNKNOWN_LINK), d2h=gbps("d2h_gbps", UNKNOWN_LINK),
        nvme_read=gbps("nvme_read_gbps", UNKNOWN_DISK) if nvme else 0.0, nvme_write=gbps("nvme_write_gbps", UNKNOWN_DISK) if nvme else 0.0,
    )


def move_seconds(nbytes: float, bandwidth: float) -> float:
    """Seconds to move ``nbytes`` at ``bandwidth`` bytes/s: none for nothing, forever without a path."""
    if nbytes <= 0:
        return 0.0
    if bandwidth <= 0:
        return float("inf")
    return nbytes / bandwidth


def _buffer_classes(
    units: Sequence[UnitCost], offloaded: Sequence[int], buffers: Union[int, Mapping[int, int]],
) -> tuple[dict[int, int], dict[int, int]]:
    """The streaming buffers' size classes (bytes -> count), and the class each offloaded unit
    streams through: the smallest that holds it."""
    counts = {1 << 62: buffers} if isinstance(buffers, int) else dict(buffers)
    classes = {size: n for size, n in counts.items() if n > 0}
    if offloaded and not classes:
        raise ValueError(f"{len(offloaded)} units are offloaded but the GPU tier has 0 streaming buffers; give at least one.")
    class_of = {}
    for i in offloaded:
        fitting = [size for size in classes if size >= units[i].nbytes]
        if not fitting:
            raise ValueError(
                f"unit {i} of {units[i].nbytes} bytes is offloaded but no streaming buffer holds it "
                f"({sum(classes.values())} buffers of at most {max(classes, default=0)} bytes); give the GPU tier a buffer that large."
            )
        class_of[i] = min(fitting)
    return classes, class_of


class _Timeline:
    """A resource serving each transfer in the idle time it has from the transfer's ready time on:
    busy intervals, sorted and disjoint; a transfer may be split over several gaps, as a drive
    interleaves the requests queued on it."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.ends: list[float] = []

    @property
    def end(self) -> float:
        return self.ends[-1] if self.ends else 0.0

    def serve(self, ready: float, seconds: float) -> float:
        """Book ``seconds`` of work from ``ready`` on; when it is done."""
        if seconds <= 0.0:
            return ready
        if ready >= self.end:  # the common case: nothing booked after it
            return self._book(len(self.starts), ready, seconds)
        k = bisect.bisect_right(self.ends, ready)  # the first interval ending after ``ready``
        t = ready
        while seconds > 0.0 and k < len(self.starts):
            gap = self.starts[k] - t
            if gap > 0.0:
                used = min(gap, seconds)
                done = self._book(k, t, used)
                seconds -= used
                if seconds <= 0.0:
                    return done
                k = bisect.bisect_right(self.ends, t)
            t = max(t, self.ends[k])
            k += 1
        return self._book(len(self.starts), max(t, self.end), seconds)

    def _book(self, k: int, start: float, seconds: float) -> float:
        """Mark [start, start + seconds) busy before interval ``k`` (the gap there holds it),
        merged with its neighbours where they touch."""
        end = start + seconds
        if k > 0 and self.ends[k - 1] >= start:
            self.ends[k - 1] = end
            k -= 1
        else:
            self.starts.insert(k, start)
            self.ends.insert(k, end)
        if k + 1 < len(self.starts) and self.starts[k + 1] <= end:
            self.ends[k] = self.ends[k + 1]
            del self.starts[k + 1], self.ends[k + 1]
        return end


def simulate_step(units: Sequence[UnitCost], buffers: Union[int, Mapping[int, int]], machine: Machine, host_copies: int = 0) -> StepPrediction:
    """Predict one training step. ``buffers``: the streaming buffers in the GPU tier, a count (any
    unit fits any buffer) or the placement's size classes (slot bytes -> count), where a unit
    streams through the smallest class that holds it, as the runtime's prefetches do.
    ``host_copies``: NVMe units whose parameters host staging buffers keep from forward into
    backward (``Placement.host_copies``): the last ones forward reads, which backward reads from
    host memory instead of the disk."""
    step = _Step(units, buffers, machine, host_copies)
    forward_end = step.forward()
    backward_end = step.backward()
    end = step.finish(backward_end)
    compute_alone = sum(u.forward_seconds + u.backward_seconds for u in units)
    return StepPrediction(end, forward_end, backward_end - forward_end, compute_alone, end - backward_end, step.moved)


class _Step:
    """The clocks of one simulated step: when each stream (compute, host -> GPU, GPU -> host, NVMe,
    the update worker, the network) is next free, and when each streaming buffer frees."""

    def __init__(self, units: Sequence[UnitCost], buffers: Union[int, Mapping[int, int]], machine: Machine, host_copies: int = 0) -> None:
        self.units, self.machine = units, machine
        self.offloaded = [i for i, u in enumerate(units) if u.home != GPU]
        on_nvme = [i for i in self.offloaded if units[i].home == NVME]
        self.host_copies = set(on_nvme[len(on_nvme) - host_copies :]) if host_copies > 0 else set()
        self.in_backward = False
        self.classes, self.class_of = _buffer_classes(units, self.offloaded, buffers)
        self.compute = self.h2d = self.d2h = self.worker = self.net = self.host_net = 0.0
        self.nvme = _Timeline()
        ranks = machine.world_size
        self.sharded = ranks > 1 and machine.shard_states
        self.reduce_share = (ranks - 1) / ranks * (1 if self.sharded else 2)  # reduce to the owner / all-reduce
        self.moved = 0
        self.free = {size: [0.0] * n for size, n in self.classes.items()}  # when each buffer of each class frees

    def fetch(self, i: int) -> float:
        """Issue the copy of unit ``i`` into the next free buffer of its class; when it is in."""
        u = self.units[i]
        slot = heapq.heappop(self.free[self.class_of[i]])
        start = slot
        if u.home == NVME and not (self.in_backward and i in self.host_copies):
            start = self.nvme.serve(slot, move_seconds(u.nbytes, self.machine.nvme_read))
        self.h2d = max(self.h2d, start) + move_seconds(u.nbytes, self.machine.h2d)
        self.moved += u.nbytes
        return self.h2d

    def forward(self) -> float:
        for i, u in enumerate(self.units):
            ready = self.fetch(i) if u.home != GPU else 0.0
            self.compute = max(self.compute, ready) + u.forward_seconds
            if u.home != GPU:
                heapq.heappush(self.free[self.class_of[i]], self.compute)
        return self.compute

    def _still_resident(self) -> set[int]:
        """The last offloaded units of each class, as many as it has buffers, are still resident
        after forward; their buffers stay taken until their backward."""
        resident: set[int] = set()
        for size, n in self.classes.items():
            mine = [i for i in self.offloaded if self.class_of[i] == size]
            resident.update(mine[len(mine) - n :] if n else ())
            self.free[size] = sorted(self.free[size])[min(n, len(mine)) :]
            heapq.heapify(self.free[size])
        return resident

    def backward(self) -> float:
        resident = self._still_resident()
        self.in_backward = True
        gpu_ready = gpu_updates = 0.0
        for i in reversed(range(len(self.units))):
            u = self.units[i]
            ready = self.fetch(i) if u.home != GPU and i not in resident else 0.0
            self.compute = max(self.compute, ready) + u.backward_seconds
            owned = u.owned or not self.sharded or self._replicated(u)
            if u.home == GPU:
                gpu_ready = max(gpu_ready, self._reduce(u, self.compute))
                gpu_updates += u.update_seconds if owned else 0.0
                continue
            heapq.heappush(self.free[self.class_of[i]], self.compute)
            self.d2h = max(self.d2h, self.compute) + (0.0 if u.direct_gradient else move_seconds(u.gradient_bytes, self.machine.d2h))
            reduced = self._reduce(u, self.d2h)  # at home, once landed
            if owned and u.gradient_bytes:  # a frozen unit is never updated: nothing read or written for it
                self._update_offloaded(u, reduced)
        self.gpu_updates = gpu_updates
        return max(self.compute, gpu_ready)

    def _replicated(self, u: UnitCost) -> bool:
        """A persistent unit under sharded states that every rank all-reduces and updates."""
        return self.sharded and self.machine.replicated_persistent and u.home == GPU

    def _reduce(self, u: UnitCost, ready: float) -> float:
        """When the unit's gradients, ready at ``ready``, are reduced across ranks (then, on one rank)."""
        if self.machine.world_size > 1 and u.gradient_bytes:
            share = self.reduce_share
            if self._replicated(u):
                share *= 2  # an all-reduce: every rank updates the unit
            nbytes = (u.gradient_bytes if u.reduced_bytes is None else u.reduced_bytes) * share
            calls = u.tensors * self.machine.collective_latency
            if u.home == GPU or self.machine.host_network is None:
                self.net = max(self.net, ready) + calls + move_seconds(nbytes, self.machine.network)
                return self.net
            self.host_net = max(self.host_net, ready) + calls + move_seconds(nbytes, self.machine.host_network)
            return self.host_net
        return ready

    def _update_offloaded(self, u: UnitCost, ready: float) -> None:
        """The worker's update once the gradient is home (and reduced, at ``ready``); an NVMe
        unit's states read as the gradient lands, while the worker finishes the unit before, and
        written behind."""
        start = max(self.worker, ready)
        if u.home == NVME:
            start = max(self.worker, self.nvme.serve(self.d2h, move_seconds(u.state_bytes + u.nbytes, self.machine.nvme_read)))
        self.worker = start + u.update_seconds
        if u.home == NVME:
            self.nvme.serve(self.worker, move_seconds(u.state_bytes + u.nbytes, self.machine.nvme_write))

    def _to_other_machines(self, shared: list[int]) -> float:
        """Seconds this rank spends sending the shared host units' updates to the other machines:
        the ranks of each local index broadcast the units their index owns, a 1/ranks_per_machine
        share of them, each to machines - 1 others."""
        machines = self.machine.machines
        per_machine = self.machine.world_size // machines
        units = -(-len(shared) // per_machine)
        moved = sum(shared) / per_machine * (machines - 1) / machines
        return units * self.machine.collective_latency + move_seconds(moved, self.machine.host_collectives)

    def finish(self, backward_end: float) -> float:
        """The step's end: updates in the GPU tier after backward, the worker, NVMe; under sharded
        data parallelism the owners' updated parameters to every rank, then the others' NVMe units written."""
        end = max(backward_end + self.gpu_updates, self.worker, self.nvme.end)
        if self.machine.world_size > 1:
            end += self.machine.collective_latency  # the ranks agree on which parameters have gradients
        if not self.sharded:
            return end
        units, ranks = self.units, self.machine.world_size
        share, latency = (ranks - 1) / ranks, self.machine.collective_latency
        apart = self.machine.host_network is not None  # else one link carries both
        shared = self.machine.shared_homes
        sent = [u for u in units if u.gradient_bytes and not (shared and u.home == HOST) and not self._replicated(u)]
        if shared and any(u.gradient_bytes and u.home == HOST for u in units):
            end += latency  # the barrier after the owners' writes to the shared homes
        persistent = [u.nbytes for u in sent if u.home == GPU or not apart]
        offloaded = [u.nbytes for u in sent if u.home != GPU and apart]
        # one broadcast per unit
        self.net = max(self.net, end) + len(persistent) * latency + move_seconds(sum(persistent) * share, self.machine.network)
        self.host_net = max(self.host_net, end) + len(offloaded) * latency + move_seconds(sum(offloaded) * share, self.machine.host_collectives)
        if shared and self.machine.machines > 1:
            self.host_net += self._to_other_machines([u.nbytes for u in units if u.gradient_bytes and u.home == HOST and not self._replicated(u)])
        others_on_nvme = sum(u.nbytes for u in units if u.gradient_bytes and u.home == NVME and not u.owned)
        written = self.nvme.serve(self.host_net, move_seconds(others_on_nvme, self.machine.nvme_write))
        return max(end, self.net, self.host_net, written)
