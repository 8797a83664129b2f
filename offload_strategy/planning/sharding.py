"""Which rank owns each unit's masters and optimizer states under data parallelism.

ZeRO-2-style sharding by unit (ProTrain §3.1.1 partitions the non-persistent chunks across ranks
the same way): the owner receives the unit's reduced gradient, updates the unit on its own CPU (or
in its GPU tier for a persistent unit), keeps its states in its own host memory or NVMe files, and
sends the updated parameters to the other ranks. Whole units rather than slices of every unit, so
that a unit's update stays one optimizer step on one CPU worker, which is what lets it overlap
backward (LoHan §IV-C).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace


def assign_owners(state_bytes: Sequence[int], world_size: int) -> list[int]:
    """The owning rank of each unit, balancing the optimizer-state bytes each rank holds.

    Longest processing time first: units in decreasing size, each to the rank holding the fewest
    bytes so far (the lowest rank on a tie), which is within 4/3 of the best balance. Pure and
    deterministic, so every rank computes the same owners without exchanging them.
    """
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: data parallelism needs at least one rank.")
    load = [0] * world_size
    owners = [0] * len(state_bytes)
    for index in sorted(range(len(state_bytes)), key=lambda i: (-state_bytes[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owners[index] = rank
        load[rank] += state_bytes[index]
    return owners


@dataclass(frozen=True)
class Sharding:
    """Data-parallel ranks each keeping the optimizer states of the units it owns, as the placement
    of one rank sees them: every unit's owner (what every rank must place alike, the GPU tier, is
    sized for the rank it costs the most), and whether every backward reduces each unit's gradients
    to its owner alone, so that the other ranks need them only until sent."""

    owners: Mapping[int, int]  # unit index -> the rank keeping its states
    rank: int  # the rank being placed
    world_size: int
    gradients_sent: bool = False
    # the host-homed units' parameters are one copy per machine, in memory that machine's ranks
    # share (each unit's owner writes its update, and sends it to one rank of every other
    # machine): each rank pays 1/ranks_per_machine of them, and every rank must home the same
    # units in host memory
    shared_homes: bool = False
    # persistent units are not sharded (ProTrain §3.1.1): every rank all-reduces their gradients,
    # keeps their optimizer states and updates them, so nothing is sent for them after the step
    replicated_persistent: bool = False
    machines: int = 1  # the ranks span this many machines, as many ranks on each

    def __post_init__(self) -> None:
        if self.machines < 1 or self.world_size % self.machines:
            raise ValueError(f"{self.world_size} ranks cannot be spread evenly over {self.machines} machines; give a machine count that divides them.")

    @property
    def ranks_per_machine(self) -> int:
        return self.world_size // self.machines

    @classmethod
    def balanced(
        cls, indices: Sequence[int], state_bytes: Sequence[int], world_size: int, rank: int, gradients_sent: bool = False, shared_homes: bool = False,
        replicated_persistent: bool = False, machines: int = 1,
    ) -> "Sharding":
        """Owners by :func:`assign_owners` over the units ``indices`` with their state bytes."""
        owners = assign_owners(state_bytes, world_size)
        return cls(dict(zip(indices, owners)), rank, world_size, gradients_sent, shared_homes, replicated_persistent, machines)

    def as_rank(self, rank: int) -> "Sharding":
        """The same ranks as ``rank`` sees them."""
        return replace(self, rank=rank)

    def owns(self, index: int) -> bool:
        return self.owners[index] == self.rank

    @property
    def owned(self) -> frozenset[int]:
        return frozenset(i for i, r in self.owners.items() if r == self.rank)


@dataclass(frozen=True)
class StatesMove:
    """One unit's optimizer states sent, when the units are placed again, from a rank that kept
    them to the ranks the new placement needs them on and that did not keep them."""

    unit: int  # the unit's position in the units given to ``states_moves``
    source: int
    indices: tuple[int, ...]  # the optimizer's state-dict indices moved
    receivers: frozenset[int]


def states_moves(units: Sequence[Sequence[int]], holds: Sequence[frozenset[int]], needs: Sequence[frozenset[int]]) -> list[StatesMove]:
    """The moves that give each rank ``r`` the states it needs (``needs[r]``, state-dict indices)
    from those the ranks hold (``holds[r]``): a unit (its indices in ``units``) at a time, in the
    units' order, each index from the lowest rank holding it to every rank that needs it without
    holding it. An index no rank holds (a parameter never updated) moves nowhere. Pure and
    deterministic, so every rank computes the same moves from the same lists."""
    moves = []
    for position, indices in enumerate(units):
        by_source: dict[int, tuple[list[int], set[int]]] = {}
        for index in indices:
            wanting = {r for r, need in enumerate(needs) if index in need and index not in holds[r]}
            holders = [r for r, held in enumerate(holds) if index in held]
            if wanting and holders:
                moved, receivers = by_source.setdefault(holders[0], ([], set()))
                moved.append(index)
                receivers.update(wanting)
        moves += [StatesMove(position, source, tuple(moved), frozenset(receivers)) for source, (moved, receivers) in sorted(by_source.items())]
    return moves
