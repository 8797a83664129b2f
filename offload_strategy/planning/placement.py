"""Where each transfer unit lives: a GPU-tier → host → NVMe allocator by first use.

This is the tensor allocator of 10Cache §3.3.2: the units needed first in forward take the GPU
tier (as persistent units, ProTrain §3.1.1) up to its budget, the rest take host memory, and what
host memory cannot hold goes to NVMe. The GPU tier also keeps a streaming pool of buffers into
which offloaded units are prefetched; its buffer counts per size follow 10Cache Algorithms 1-2.

Deviations, and why:
- The GPU tier first reserves twice the smallest working set of the streaming pool (the largest
  set of units one module needs at once), so that one module can compute while the next one's
  units are copied in; persistent units take what is left.
- NVMe staging buffers (two for fetching, two for updates, plus what host memory has left) keep the units last read from NVMe
  until the buffer is needed again, so backward and the optimizer step often find them in host
  memory (10Cache Alg. 4 keeps evicted tensors in CPU buffers for the same reason).
- Buffer counts are never below what one module needs at once, whatever Algorithm 2 says, or
  that module could not run; a unit may use a buffer of a larger size class.
Pure: no torch state.
"""

from __future__ import annotations

from ..config import Tier, format_bytes

from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Optional

from .sharding import Sharding
from .searches.buffer_counts import buffer_counts, tensor_size_distribution

GPU, HOST, NVME = Tier.GPU, Tier.HOST, Tier.NVME
DEVICE_SLOT_ALIGNMENT = 512
HOST_SLOT_ALIGNMENT = 4096  # O_DIRECT needs page-aligned buffers and lengths
# NVMe staging buffers: two to fetch units through, two for the update worker (parameters, states)
NVME_STAGING_BUFFERS = 4
UPDATE_STAGING_BUFFERS = 2
# Host buffers the gradients of NVMe units pass through when each lives only from its first
# gradient to its update (LoHan §IV-C): units in flight between backward and the update worker.
GRADIENT_BUFFERS = 4


def align(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


class PlacementError(ValueError):
    """The budgets cannot hold the model; the message gives the numbers and the fix.
    ``nvme_needed``: bytes that must go to NVMe, where the NVMe budget was the shortfall;
    ``tier``: the tier whose budget fell short (more of another would not help)."""

    def __init__(self, message: str, nvme_needed: int = 0, tier: Tier = Tier.GPU) -> None:
        super().__init__(message)
        self.nvme_needed = nvme_needed
        self.tier = NVME if nvme_needed and tier is GPU else tier


@dataclass(frozen=True)
class UnitSize:
    index: int
    nbytes: int  # parameter bytes
    trainable_bytes: int  # bytes of parameters that get gradients and optimizer states
    # where 16-bit gradients are widened for fp32 masters: the 16-bit area they land in first, part
    # of an offloaded unit's gradient (at its home, or in a gradient buffer while in flight)
    landing_bytes: int = 0

    @property
    def reduced_bytes(self) -> int:
        """What a data-parallel reduction of the unit's gradients moves: 16-bit gradients widened
        for fp32 masters are reduced in 16 bits (as DDP reduces them), half their masters' bytes."""
        return self.trainable_bytes // 2 if self.landing_bytes else self.trainable_bytes


@dataclass(frozen=True)
class Placement:
    home: dict[int, str]  # unit index -> gpu | host | nvme
    device_slots: dict[int, int]  # streaming buffers in the GPU tier: slot bytes -> count
    staging_slots: dict[int, int]  # host buffers that NVMe units pass through: slot bytes -> count
    gpu_bytes: int  # what the plan uses of each tier
    host_bytes: int
    nvme_bytes: int
    notes: list[str] = field(default_factory=list)
    # host-homed units the GPU computes on in place, never copied in (MemFerry's DHA mode)
    dha: frozenset[int] = frozenset()
    # host buffers for the gradients of NVMe units, each held from a unit's first gradient to its
    # update (slot bytes -> count); empty when every offloaded unit keeps a gradient home
    gradient_slots: dict[int, int] = field(default_factory=dict)
    # NVMe units' gradients are written to NVMe between backward and the update (clipping by norm
    # needs every gradient first): their NVMe bytes are counted in ``nvme_bytes``
    gradients_spilled: bool = False
    # host units' gradients pass through ``gradient_slots`` too: host memory held every unit's
    # parameters and states only without a gradient home each
    host_gradients_in_flight: bool = False
    # under data parallelism, offloaded units another rank owns whose gradients pass through
    # ``gradient_slots`` too, each held until its reduction has sent it to the owner
    gradients_sent: frozenset[int] = frozenset()
    # under data parallelism on one machine, host-homed units' parameters are one copy in memory
    # every rank maps (``host_bytes`` counts this rank's share of it)
    host_homes_shared: bool = False
    # under data parallelism, every rank all-reduces and updates the persistent units (ProTrain
    # §3.1.1), keeping their optimizer states: none is sent after the step
    replicated_persistent: bool = False

    @property
    def offloaded(self) -> bool:
        return any(h != GPU for h in self.home.values())

    @property
    def update_staging_buffers(self) -> int:
        """The update worker's share of the largest staging class: two at least (parameters and
        states of the unit being updated) and, of the buffers added beyond the minimum, half (up to
        four), so it can read the next NVMe unit and write the last one back while it updates
        this one (LoHan Fig. 3b)."""
        spare = self._spare_staging
        return UPDATE_STAGING_BUFFERS + min(2 * UPDATE_STAGING_BUFFERS, spare - spare // 2)

    @property
    def host_copies(self) -> int:
        """NVMe units whose parameters the fetch path's staging buffers keep in host memory from
        forward into backward: its buffers beyond the minimum configuration's, so that backward
        reads those units from host memory, not the disk (10Cache Alg. 4)."""
        spare = self._spare_staging
        return spare - (self.update_staging_buffers - UPDATE_STAGING_BUFFERS)

    @property
    def spare_staging_bytes(self) -> int:
        """Host bytes the staging buffers beyond the minimum take: a cache, which activations
        kept in host memory come before (``place_units``'s ``host_reserve``)."""
        return self._spare_staging * max(self.staging_slots, default=0)

    @property
    def _spare_staging(self) -> int:
        """Buffers of the largest staging class beyond the minimum."""
        largest = max(self.staging_slots, default=None)
        return max(self.staging_slots[largest] - NVME_STAGING_BUFFERS, 0) if largest is not None else 0

    def replicated(self, index: int) -> bool:
        """Every rank all-reduces the unit's gradients and updates it (a persistent unit, where
        persistent units are replicated)."""
        return self.replicated_persistent and self.home[index] == GPU


_fmt = format_bytes


def _slot_minimums(units: Sequence[UnitSize], co_resident: Sequence[Sequence[int]], candidates: set[int], prefetch: bool = True) -> dict[int, int]:
    """The fewest streaming buffers that let every module run, plus (``prefetch``) one of the
    largest size to prefetch into: the cheaper of buffers of the largest unit's size only (any unit fits one), as
    many as the most units one group uses at once, and buffers of each unit's own size, as many of
    each size as one group uses at once (groups of many small units, such as a checkpointed block
    beside an embedding, need no buffer of the embedding's size per unit)."""
    if not candidates:
        return {}
    size = {u.index: align(u.nbytes, DEVICE_SLOT_ALIGNMENT) for u in units if u.index in candidates}
    largest = max(size.values())
    together = 1  # the most candidates one group uses at once
    by_size: Counter[int] = Counter()
    for group in co_resident:
        if len(group) == 1:  # most modules use one unit: a fast path for models of thousands
            if group[0] in size:
                by_size[size[group[0]]] = max(by_size[size[group[0]]], 1)
            continue
        members = {i for i in group if i in size}
        together = max(together, len(members))
        for s, n in Counter(size[i] for i in members).items():
            by_size[s] = max(by_size[s], n)
    spare = 1 if prefetch else 0
    uniform = {largest: together + spare}
    by_size[largest] += spare
    if sum(s * c for s, c in by_size.items()) < sum(s * c for s, c in uniform.items()):
        return dict(by_size)
    return uniform


def minimum_gpu_bytes(units: Sequence[UnitSize], co_resident: Sequence[Sequence[int]], prefetch: bool = True) -> int:
    """The least GPU tier any placement of ``units`` runs in: the streaming buffers of the fewest
    kind (without ``prefetch`` no buffer is kept for the next unit: each is fetched when asked for)."""
    return sum(size * count for size, count in _slot_minimums(units, co_resident, {u.index for u in units}, prefetch).items())


def place_units(
    units: Sequence[UnitSize],
    co_resident: Sequence[Sequence[int]],
    *,
    gpu_bytes: int,
    host_bytes: int,
    nvme_bytes: int,
    state_factor: float,
    all_on_gpu: bool = False,
    homes: Optional[Mapping[int, str]] = None,
    persistent: Optional[Collection[int]] = None,
    sharding: Optional[Sharding] = None,
    prefetch: bool = True,
    gradients_until_update: bool = False,
    spill_gradients: bool = False,
    buffer_per_unit: bool = False,
    host_reserve: int = 0,
) -> Placement:
    """Place ``units`` (in first-use order) within the three budgets.

    ``co_resident`` lists the unit indices each module uses together. ``state_factor`` is the
    optimizer's state bytes per trainable parameter byte (2 for Adam). A persistent unit costs
    its parameters, gradients and states in the GPU tier; an offloaded unit costs its gradients in
    host memory, and its parameters and states at home (host memory or NVMe). ``homes`` (from a
    plan file) fixes every unit's home instead of choosing it; ``persistent`` fixes only which
    units stay in the GPU tier (the planner's search); buffers are sized as usual and the budgets
    still hold. ``sharding``: under data parallelism with sharded states, which rank keeps each
    unit's optimizer states: an offloaded unit another rank owns needs room here for its
    parameters and gradients only (its gradients only in flight where ``sharding.gradients_sent``:
    through ``GRADIENT_BUFFERS`` buffers until sent to the owner, not a home each); every rank
    keeps the same units in the GPU tier, sized for the rank whose states there are largest.
    ``gradients_until_update``: every unit is updated as soon as its gradients are complete, so
    the gradients of NVMe units need host memory only while in flight (``GRADIENT_BUFFERS`` of the
    largest), not a home each; so do host units' where host memory holds every offloaded unit's
    parameters and states that way and not with a gradient home each. ``spill_gradients`` (with ``gradients_until_update``): the update
    waits for something that needs every gradient (the norm for clipping), so NVMe units'
    gradients pass through those buffers to NVMe and wait there: NVMe holds them too.
    ``buffer_per_unit``: every streamed unit gets a GPU-tier buffer of its own, so its parameters
    stay there through the whole step, fetched once per step (DeepSpeed's ZeRO-Offload).
    ``host_reserve``: host bytes the staging buffers beyond the minimum leave free (for the
    activations an activation layout keeps in host memory: LoHan Eq. 3 gives them what the model
    states leave, before any cache of parameters).
    """
    costs = _Costs(state_factor, sharding, gradients_until_update, gradients_until_update and spill_gradients)
    everything = _everything_on_gpu(units, costs, gpu_bytes, all_on_gpu, homes, persistent)
    if everything is not None:
        return everything
    # with a buffer per unit, no module waits for a buffer: the working set is every unit
    home, used = _persistent_homes(units, co_resident, costs, gpu_bytes, homes, persistent, prefetch, check_working_set=not buffer_per_unit)
    streaming = [u for u in units if u.index not in home]
    slots = _buffer_per_unit(streaming, gpu_bytes - used) if buffer_per_unit else _streaming_buffers(units, co_resident, streaming, gpu_bytes - used, prefetch)
    gpu_used = used + sum(s * c for s, c in slots.items())
    staging, host_used, in_flight = _host_and_nvme_homes(streaming, costs, home, host_bytes, nvme_bytes, homes)
    staging, host_used = _leave_host_reserve(staging, host_used, host_bytes - host_reserve)
    through_buffers = (streaming if in_flight else [u for u in streaming if home[u.index] == NVME]) if costs.transient_gradients else []
    sent = [u for u in streaming if costs.sends(u)]
    slot = costs.gradient_slot([*through_buffers, *sent])
    gradient_slots = {slot: GRADIENT_BUFFERS} if slot else {}
    nvme_used = sum(costs.at_home(u) + costs.spilled(u) for u in streaming if home[u.index] == NVME)
    if nvme_used > nvme_bytes:
        fix = "raise nvme_memory" if nvme_bytes else "give nvme_path (and nvme_memory)"
        raise PlacementError(
            f"{_fmt(nvme_used)} of parameters and optimizer states do not fit in gpu_memory={_fmt(gpu_bytes)} and host_memory={_fmt(host_bytes)} "
            f"and must go to NVMe, which grants {_fmt(nvme_bytes)}; {fix}, or raise host_memory.",
            nvme_needed=nvme_used,
        )
    shared = sharding is not None and sharding.shared_homes and any(h == HOST for h in home.values())
    return Placement(home, slots, staging, gpu_used, host_used, nvme_used, gradient_slots=gradient_slots, gradients_spilled=costs.spill_gradients,
                     host_gradients_in_flight=in_flight, gradients_sent=frozenset(u.index for u in sent), host_homes_shared=shared,
                     replicated_persistent=sharding is not None and sharding.replicated_persistent)


@dataclass(frozen=True)
class _Costs:
    """What a unit costs where it lives, for an optimizer keeping ``state_factor`` state bytes per
    trainable byte (``sharding``: which rank keeps each unit's states under sharded states;
    ``transient_gradients``: NVMe units' gradients pass through ``GRADIENT_BUFFERS`` buffers;
    ``spill_gradients``: and on to NVMe, where they wait for their update)."""

    state_factor: float
    sharding: Optional[Sharding]
    transient_gradients: bool = False
    spill_gradients: bool = False

    def sends(self, u: UnitSize) -> bool:
        """The unit's gradients go to the rank that owns it, from a gradient buffer."""
        sharding = self.sharding
        return sharding is not None and sharding.gradients_sent and not sharding.owns(u.index) and u.trainable_bytes > 0

    def home_gradient(self, u: UnitSize) -> int:
        """An offloaded unit's gradient home (0 where its gradients are only sent on)."""
        return 0 if self.sends(u) else self.gradient(u)

    def sent_pool(self, units: Sequence[UnitSize]) -> int:
        """The gradient buffers the sent units pass through (where host memory keeps every other
        unit's gradients at home; where NVMe units' or every unit's pass through buffers too,
        the pool counted for those holds them)."""
        sent = [u for u in units if self.sends(u)]
        return GRADIENT_BUFFERS * self.gradient_slot(sent) if sent else 0

    def gradient(self, u: UnitSize) -> int:
        """An offloaded unit's gradient home in host memory (with its 16-bit landing area)."""
        landing = align(u.landing_bytes, HOST_SLOT_ALIGNMENT) if u.landing_bytes and u.trainable_bytes else 0
        return align(u.trainable_bytes, HOST_SLOT_ALIGNMENT) + landing

    def spilled(self, u: UnitSize) -> int:
        """An NVMe unit's gradients written to NVMe until its update (not their 16-bit landing area)."""
        return align(u.trainable_bytes, HOST_SLOT_ALIGNMENT) if self.spill_gradients and u.trainable_bytes else 0

    def gradient_slot(self, units: Sequence[UnitSize]) -> int:
        """A gradient buffer that holds any of ``units``' gradients (0: none is trainable)."""
        return max((self.gradient(u) for u in units if u.trainable_bytes), default=0)

    def states(self, u: UnitSize) -> int:
        """The unit's optimizer states on this rank (none where another rank owns them)."""
        return 0 if self.sharding is not None and not self.sharding.owns(u.index) else self.all_states(u)

    def all_states(self, u: UnitSize) -> int:
        return int(u.trainable_bytes * self.state_factor)

    def at_home(self, u: UnitSize) -> int:
        """Offloaded to NVMe: parameters and states in this rank's files, each padded."""
        return align(u.nbytes, HOST_SLOT_ALIGNMENT) + align(self.states(u), HOST_SLOT_ALIGNMENT)

    def host_home(self, u: UnitSize) -> int:
        """Offloaded to host memory: parameters and states, each padded; where a machine's ranks
        share one copy of the parameters, this rank's share of it."""
        params = align(u.nbytes, HOST_SLOT_ALIGNMENT)
        if self.sharding is not None and self.sharding.shared_homes:
            params = -(-params // self.sharding.ranks_per_machine)
        return params + align(self.states(u), HOST_SLOT_ALIGNMENT)

    def rank_views(self) -> tuple[list["_Costs"], int]:
        """The costs as every rank sees them, and which is this rank's, where the ranks share one
        copy of host homes (every rank must then home the same units in host memory, so a unit
        goes there only where it fits on every rank); else this rank's alone."""
        sharding = self.sharding
        if sharding is None or not sharding.shared_homes:
            return [self], 0
        return [replace(self, sharding=sharding.as_rank(r)) for r in range(sharding.world_size)], sharding.rank

    def staging_slot(self, units: Sequence[UnitSize]) -> int:
        """A staging buffer that holds any of ``units``' parameters, or its states."""
        return max(max(align(u.nbytes, HOST_SLOT_ALIGNMENT), align(self.states(u), HOST_SLOT_ALIGNMENT)) for u in units)


class _PersistentBytes:
    """What persistent units take of the GPU tier (parameters, gradients, optimizer states) on the
    rank they cost the most. Every rank keeps the same units there, since their gradients are
    reduced on the GPU's process group and the others' on the host's; each keeps the states of
    the ones it owns, or, where persistent units are replicated, of all of them."""

    def __init__(self, costs: _Costs) -> None:
        self.costs = costs
        sharding = costs.sharding
        self.replicated = sharding is None or sharding.replicated_persistent
        self.shared = 0  # parameters and gradients (and replicated states), on every rank
        self.states = [0] * (sharding.world_size if sharding is not None else 1)  # per rank

    def _owner(self, u: UnitSize) -> int:
        return self.costs.sharding.owners[u.index] if self.costs.sharding is not None else 0

    def with_unit(self, u: UnitSize) -> int:
        """The bytes once ``u`` is kept too."""
        if self.replicated:
            return self.shared + u.nbytes + u.trainable_bytes + self.costs.all_states(u) + max(self.states)
        states = list(self.states)
        states[self._owner(u)] += self.costs.all_states(u)
        return self.shared + u.nbytes + u.trainable_bytes + max(states)

    def add(self, u: UnitSize) -> None:
        self.shared += u.nbytes + u.trainable_bytes
        if self.replicated:
            self.shared += self.costs.all_states(u)
        else:
            self.states[self._owner(u)] += self.costs.all_states(u)

    @property
    def used(self) -> int:
        return self.shared + max(self.states)


def _everything_on_gpu(
    units: Sequence[UnitSize], costs: _Costs, gpu_bytes: int, all_on_gpu: bool,
    homes: Optional[Mapping[int, str]], persistent: Optional[Collection[int]],
) -> Optional[Placement]:
    """The placement that keeps every unit in the GPU tier, where asked for or where it fits."""
    tier = _PersistentBytes(costs)
    for u in units:
        tier.add(u)
    total_gpu = tier.used
    if homes is not None and all(homes[u.index] == GPU for u in units):
        all_on_gpu = True
    if not (all_on_gpu or (homes is None and persistent is None and total_gpu <= gpu_bytes)):
        return None
    if total_gpu > gpu_bytes:
        raise PlacementError(
            f"the model needs {_fmt(total_gpu)} in the GPU tier (parameters, gradients and optimizer states) but "
            f"gpu_memory grants {_fmt(gpu_bytes)}; raise gpu_memory or use policy='auto' to offload."
        )
    replicated = costs.sharding is not None and costs.sharding.replicated_persistent
    return Placement({u.index: GPU for u in units}, {}, {}, total_gpu, 0, 0, ["everything fits in the GPU tier"], replicated_persistent=replicated)


def _persistent_homes(
    units: Sequence[UnitSize], co_resident: Sequence[Sequence[int]], costs: _Costs, gpu_bytes: int,
    homes: Optional[Mapping[int, str]], persistent: Optional[Collection[int]], prefetch: bool, check_working_set: bool = True,
) -> tuple[dict[int, str], int]:
    """Units kept in the GPU tier, by first use, while twice the streaming working set stays free
    (or as ``homes``/``persistent`` fix them); the bytes they use."""
    working_set = sum(s * c for s, c in _slot_minimums(units, co_resident, {u.index for u in units}, prefetch).items())
    if check_working_set and working_set > gpu_bytes:
        spare = " plus one prefetch buffer" if prefetch else " (prefetch off: no buffer for the next unit)"
        raise PlacementError(
            f"gpu_memory={_fmt(gpu_bytes)} cannot hold the largest set of parameters one module needs at once{spare} "
            f"({_fmt(working_set)}); raise gpu_memory to at least {_fmt(working_set, at_least=True)}."
        )
    home: dict[int, str] = {}
    tier = _PersistentBytes(costs)
    reserve = min(2 * working_set, gpu_bytes)
    for u in units:
        if homes is not None:
            keep = homes[u.index] == GPU
        elif persistent is not None:
            keep = u.index in persistent
        else:
            keep = tier.with_unit(u) + reserve <= gpu_bytes
        if keep:
            home[u.index] = GPU
            tier.add(u)
    used = tier.used
    streaming = {u.index for u in units if u.index not in home}
    if check_working_set and used + sum(s * c for s, c in _slot_minimums(units, co_resident, streaming, prefetch).items()) > gpu_bytes:
        raise PlacementError(
            f"the plan keeps {_fmt(used)} of units in the GPU tier, which leaves too little of gpu_memory={_fmt(gpu_bytes)} "
            f"for the streaming buffers; raise gpu_memory or dump a new plan for this budget."
        )
    return home, used


def _streaming_buffers(
    units: Sequence[UnitSize], co_resident: Sequence[Sequence[int]], streaming: Sequence[UnitSize], left: int, prefetch: bool,
) -> dict[int, int]:
    """GPU-tier buffers (size -> count) for the streaming units in ``left`` bytes: what every module
    needs, then 10Cache Alg. 1-2 over what is left, then more of the sizes used first."""
    minimum = _slot_minimums(units, co_resident, {u.index for u in streaming}, prefetch)
    counts = Counter(align(u.nbytes, DEVICE_SLOT_ALIGNMENT) for u in streaming)
    slots = dict(minimum)
    free = left - sum(s * c for s, c in slots.items())
    gpu_counts, _ = buffer_counts(counts, tensor_size_distribution(counts), max(free, 0), 0)
    for s, c in gpu_counts.items():
        floor = minimum.get(s, 0)  # may exceed the units of that size: smaller units use them too
        slots[s] = max(floor, min(counts[s], floor + c))
    # Spend what Algorithm 2's floors left over on more buffers of the sizes used first.
    spare = left - sum(s * c for s, c in slots.items())
    for u in streaming:
        s = align(u.nbytes, DEVICE_SLOT_ALIGNMENT)
        if slots.get(s, 0) < counts[s] and s <= spare:
            slots[s] = slots.get(s, 0) + 1
            spare -= s
    return {s: c for s, c in slots.items() if c}


def _buffer_per_unit(streaming: Sequence[UnitSize], left: int) -> dict[int, int]:
    """A GPU-tier buffer (size -> count) for every streamed unit: parameters stay in the GPU tier
    through the whole step, only gradients and optimizer states live elsewhere."""
    slots = Counter(align(u.nbytes, DEVICE_SLOT_ALIGNMENT) for u in streaming)
    need = sum(size * count for size, count in slots.items())
    if need > left:
        raise PlacementError(
            f"policy.placement='offload_states' keeps every parameter in the GPU tier for the whole step, as DeepSpeed's ZeRO-Offload "
            f"does: the parameters need {_fmt(need)} there and {_fmt(left)} is left for them; raise gpu_memory by at least "
            f"{_fmt(need - left, at_least=True)}, or stream the parameters from host memory (policy='zero3_offload', or the default policy)."
        )
    return dict(slots)


def _host_and_nvme_homes(
    streaming: Sequence[UnitSize], costs: _Costs, home: dict[int, str], host_bytes: int, nvme_bytes: int,
    homes: Optional[Mapping[int, str]],
) -> tuple[dict[int, int], int, bool]:
    """Homes of the streaming units (into ``home``): host memory holds every offloaded unit's
    gradients, then, by first use, the parameters and states of the units that fit; the others
    keep both on NVMe and pass through staging buffers (two for fetching units into the GPU tier,
    two for updating them). Where gradients live only until their update and host memory holds
    every unit that way but not with a gradient home each, every unit stays in host memory and its
    gradients pass through buffers. Where ranks share host homes, what must fit, fits on every
    rank. Returns the staging buffers (size -> count), the host bytes used, and whether host
    units' gradients are in flight only."""
    views, me = costs.rank_views()
    grads = [sum(c.home_gradient(u) for u in streaming) + c.sent_pool(streaming) for c in views]
    with_homes = [g + sum(c.host_home(u) for u in streaming) for c, g in zip(views, grads)]
    # every gradient through GRADIENT_BUFFERS buffers instead, where it lives only until its update
    in_flight = [w - g + GRADIENT_BUFFERS * costs.gradient_slot(streaming) for w, g in zip(with_homes, grads)]
    in_flight_allowed = costs.transient_gradients and not costs.spill_gradients
    all_host = homes is None or all(homes[u.index] == HOST for u in streaming)
    if all_host and max(with_homes) <= host_bytes:
        home.update({u.index: HOST for u in streaming})
        return {}, with_homes[me], False
    if all_host and in_flight_allowed and max(in_flight) <= host_bytes:
        home.update({u.index: HOST for u in streaming})
        return {}, in_flight[me], True
    if all_host and homes is not None:
        _check_plan_host(homes, max(with_homes), host_bytes, max(in_flight) if in_flight_allowed else None)  # refuses: they exceed it
    if homes is None and nvme_bytes == 0:
        least = min(max(with_homes), max(in_flight)) if in_flight_allowed else max(with_homes)
        raise PlacementError(
            f"host_memory={_fmt(host_bytes)} cannot hold the offloaded units' parameters, gradients and optimizer states "
            f"({_fmt(least)}) and there is no NVMe tier; raise host_memory to at least {_fmt(least, at_least=True)}, or give nvme_path "
            f"for an NVMe tier.",
            tier=HOST,
            nvme_needed=max(with_homes),
        )
    staging, host_used, in_flight_split = _split_host_and_nvme(streaming, views, me, home, host_bytes, grads, homes)
    _check_plan_host(homes, host_used, host_bytes)
    return staging, host_used, in_flight_split


def _check_plan_host(homes: Optional[Mapping[int, str]], host_used: int, host_bytes: int, in_flight: Optional[int] = None) -> None:
    """A plan file's homes were not chosen for this host budget: refused when they exceed it
    (``in_flight``: what every unit at home in host memory needs with gradients only in flight)."""
    if homes is not None and host_used > host_bytes:
        least = f" ({_fmt(in_flight)} with gradients only in flight, as this recipe allows)" if in_flight is not None and in_flight < host_used else ""
        raise PlacementError(
            f"the plan keeps {_fmt(host_used)} in host memory (gradients, staging buffers, and the units it homes there){least} but "
            f"host_memory grants {_fmt(host_bytes)}; raise host_memory or dump a new plan for this budget.",
            tier=HOST,
        )


def _leave_host_reserve(staging: dict[int, int], host_used: int, host_bytes: int) -> tuple[dict[int, int], int]:
    """Fewer staging buffers beyond the minimum, until ``host_used`` is within ``host_bytes``
    (or none is left beyond it)."""
    over = host_used - host_bytes
    if over <= 0 or not staging:
        return staging, host_used
    slot = max(staging)
    drop = min(staging[slot] - NVME_STAGING_BUFFERS, -(-over // slot))
    if drop <= 0:
        return staging, host_used
    return {**staging, slot: staging[slot] - drop}, host_used - drop * slot


def _split_host_and_nvme(
    streaming: Sequence[UnitSize], views: list[_Costs], me: int, home: dict[int, str], host_bytes: int, grads: list[int],
    homes: Optional[Mapping[int, str]],
) -> tuple[dict[int, int], int, bool]:
    """Host memory beside the gradients and the staging buffers, by first use; the rest on NVMe.
    The staging buffers then need only fit the units that went to NVMe, and host memory left
    over keeps more of them in staging buffers between their uses. Where gradients live only
    until their update, host units' pass through the gradient buffers as NVMe units' do (host
    memory is short: a gradient home each would send more units to NVMe); returned as the flag.
    ``views``: the costs as each rank sees them (one, unless ranks share host homes: a unit goes
    to host memory where it fits on every rank), ``me`` this rank's."""
    costs = views[me]
    slots = [c.staging_slot(streaming) for c in views]
    in_flight = costs.transient_gradients and not costs.spill_gradients and homes is None
    homed_gradients = costs.transient_gradients and not in_flight  # host units keep a gradient home beside the buffers
    # gradients: a home for every offloaded unit, or buffers for those in flight (host units' homes beside them)
    pools = [GRADIENT_BUFFERS * c.gradient_slot(streaming) if costs.transient_gradients else g for c, g in zip(views, grads)]
    host_used = [p + NVME_STAGING_BUFFERS * slot for p, slot in zip(pools, slots)]
    if max(host_used) > host_bytes:
        what = f"{GRADIENT_BUFFERS} gradient buffers" if costs.transient_gradients else "the gradients of the offloaded units"
        raise PlacementError(
            f"host_memory={_fmt(host_bytes)} cannot hold {what} plus {NVME_STAGING_BUFFERS} NVMe "
            f"staging buffers ({_fmt(max(host_used))}); raise host_memory to at least {_fmt(max(host_used), at_least=True)}.",
            tier=HOST,
        )
    for u in streaming:
        cost = [c.host_home(u) + (c.home_gradient(u) if homed_gradients else 0) for c in views]
        on_host = homes[u.index] == HOST if homes is not None else all(h + k <= host_bytes for h, k in zip(host_used, cost))
        home[u.index] = HOST if on_host else NVME
        if on_host:
            host_used = [h + k for h, k in zip(host_used, cost)]
    on_nvme = [u for u in streaming if home[u.index] == NVME]
    if not on_nvme:
        return {}, host_used[me] - NVME_STAGING_BUFFERS * slots[me] - (pools[me] if homed_gradients else 0), in_flight
    fitted = [c.staging_slot(on_nvme) for c in views]
    host_used = [h - NVME_STAGING_BUFFERS * (slot - f) for h, slot, f in zip(host_used, slots, fitted)]
    if homed_gradients:
        host_used = [h - GRADIENT_BUFFERS * (c.gradient_slot(streaming) - c.gradient_slot(on_nvme)) for h, c in zip(host_used, views)]
    extra = max(0, min(len(on_nvme), min((host_bytes - h) // f for h, f in zip(host_used, fitted))))
    return {fitted[me]: NVME_STAGING_BUFFERS + extra}, host_used[me] + extra * fitted[me], in_flight
