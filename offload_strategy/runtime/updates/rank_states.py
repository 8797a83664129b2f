"""Optimizer states between data-parallel ranks when the units are placed again (sharded states).

Each rank's next engine loads the states its old engine handed over (``UnitOptimizers.hand_over``):
its own units', those of NVMe units read from the old files as they are taken; nothing is
gathered. What the new placement needs on a rank that did not keep it (a unit that joins the GPU
tier, whose states every rank keeps; a unit another rank owns now) is sent by a rank that kept it,
a unit at a time (``planning.sharding.states_moves``), when the receiving rank's load reaches it.
The ranks first exchange which state-dict indices each holds and needs (numbers only), then run
every move in the one order they all computed, each a broadcast on one process group, so that
the broadcasts match on every rank whatever each rank loads between them; a rank that needs
nothing of a move takes its bytes and lets them go at once (with two ranks, none does).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ...planning.sharding import StatesMove, states_moves
from .optimizers import UnitOptimizers


@dataclass
class StatesMoved:
    """Optimizer-state bytes this rank sent or received at placements, since the start, and the
    most in one move (one unit's)."""

    total: int = 0
    largest: int = 0

    def add(self, nbytes: int) -> None:
        self.total += nbytes
        self.largest = max(self.largest, nbytes)


@dataclass(frozen=True)
class _Tensor:
    """A tensor's place in a move's layout: its bytes follow in a broadcast of their own."""

    dtype: torch.dtype
    shape: tuple[int, ...]


def state_indices(
    facade: torch.optim.Optimizer, units: Sequence[Sequence[torch.Tensor]], taken: Optional[UnitOptimizers],
) -> tuple[list[list[int]], frozenset[int]]:
    """The facade's state-dict indices of each unit's parameters (then those of no unit, each
    alone), and those the next engine's optimizers over it take (``taken``; every index where it
    has none)."""
    order = [p for group in facade.param_groups for p in group["params"]]
    index_of = {id(p): i for i, p in enumerate(order)}
    groups = [[index_of[id(p)] for p in params if id(p) in index_of] for params in units]
    placed = {i for group in groups for i in group}
    groups += [[i] for i in range(len(order)) if i not in placed]
    if taken is None:
        return groups, frozenset(range(len(order)))
    return groups, frozenset(index_of[id(p)] for slot in taken.all_slots() for p in slot.params if id(p) in index_of)


def load_across_ranks(
    facade: torch.optim.Optimizer, state: dict[str, Any], units: list[list[int]], needs: frozenset[int], group: Any, moved: StatesMoved,
) -> None:
    """``facade.load_state_dict`` of this rank's ``state`` (its ``state`` read entry by entry, as
    ``StatesToMove`` is), with what ``needs`` names that other ranks hold brought from them a unit
    (``units``, state-dict indices) at a time. Every rank of ``group`` calls it, in one order."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, (sorted(int(k) for k in state["state"]), sorted(needs)), group=group)
    moves = states_moves(units, [frozenset(held) for held, _ in every], [frozenset(need) for _, need in every])
    states = StatesFromRanks(state["state"], moves, rank, needs, group, moved)
    facade.load_state_dict({**state, "state": states})
    states.finish()


class StatesFromRanks(Mapping):
    """A state dict's ``state`` for one rank's load: its own entries as handed over, and those it
    receives, each unit's when the load first asks for one of them. Reaching a move runs every
    move before it too (each is a broadcast every rank takes part in, in order); :meth:`finish`
    runs those left, so that every rank has run them all."""

    def __init__(self, own: Mapping, moves: Sequence[StatesMove], rank: int, needs: frozenset[int], group: Any, moved: StatesMoved) -> None:
        self.own, self.moves, self.rank, self.needs, self.group, self.moved = own, moves, rank, needs, group, moved
        self.own_key = {int(k): k for k in own}
        self.done = 0  # moves run
        # the move each index this rank sends or receives is in
        self.move_of = {i: n for n, m in enumerate(moves) if rank == m.source or rank in m.receivers for i in m.indices}
        self.ready: dict[int, dict[str, Any]] = {}  # moved entries this rank keeps, until taken
        received = {i for m in moves if rank in m.receivers for i in m.indices}
        self.indices = [*self.own_key, *sorted(received - set(self.own_key))]

    def __getitem__(self, index: Any) -> dict[str, Any]:
        index = int(index)
        if index in self.move_of:
            self._run_through(self.move_of[index])
        if index in self.ready:
            return self.ready.pop(index)
        return self.own[self.own_key[index]]

    def __contains__(self, index: object) -> bool:
        return isinstance(index, int) and (index in self.own_key or index in self.move_of)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)

    def finish(self) -> None:
        self._run_through(len(self.moves) - 1)

    def _run_through(self, last: int) -> None:
        while self.done <= last:
            move = self.moves[self.done]
            self.done += 1
            if move.source == self.rank:
                values = {i: self.own[self.own_key[i]] for i in move.indices}
                nbytes = _send(values, move.source, self.group)
            else:
                values, nbytes = _receive(move.source, self.group)
            self.moved.add(nbytes)
            if move.source == self.rank or self.rank in move.receivers:
                self.ready.update((i, v) for i, v in values.items() if i in self.needs)


def _send(values: dict[int, dict[str, Any]], source: int, group: Any) -> int:
    """Broadcast one unit's entries: their layout, then each tensor's bytes (from host memory);
    the bytes sent."""
    layout = [(i, {k: _Tensor(v.dtype, tuple(v.shape)) if torch.is_tensor(v) else v for k, v in entry.items()}) for i, entry in values.items()]
    dist.broadcast_object_list([layout], src=source, group=group)
    nbytes = 0
    for entry in values.values():
        for v in entry.values():
            if torch.is_tensor(v) and v.numel():
                t = v.detach().to("cpu").contiguous()
                dist.broadcast(t.view(-1).view(torch.uint8), src=source, group=group)
                nbytes += t.nbytes
    return nbytes


def _receive(source: int, group: Any) -> tuple[dict[int, dict[str, Any]], int]:
    """What :func:`_send` broadcasts from ``source``: each tensor into one of its own, in host memory; the bytes received."""
    got: list[Any] = [None]
    dist.broadcast_object_list(got, src=source, group=group)
    values: dict[int, dict[str, Any]] = {}
    nbytes = 0
    for index, layout in got[0]:
        entry = {}
        for key, v in layout.items():
            if isinstance(v, _Tensor):
                t = torch.empty(v.shape, dtype=v.dtype)
                if t.numel():
                    dist.broadcast(t.view(-1).view(torch.uint8), src=source, group=group)
                nbytes += t.nbytes
                v = t
            entry[key] = v
        values[index] = entry
    return values, nbytes
