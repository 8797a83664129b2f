"""Unit ownership under sharded optimizer states, on cases worked out by hand."""

from __future__ import annotations

import pytest

from offload_strategy.planning.sharding import Sharding, StatesMove, assign_owners, states_moves


def test_largest_first_to_the_least_loaded_rank():
    # 5 -> r0 (5|0); 3 -> r1 (5|3); 3 -> r1 (5|6); 2 -> r0 (7|6); 2 -> r1 (7|8); 1 -> r0 (8|8)
    assert assign_owners([5, 3, 3, 2, 2, 1], 2) == [0, 1, 1, 0, 1, 0]


def test_order_of_units_does_not_change_the_balance():
    # same sizes, shuffled: equal sizes go by unit index, so each rank ends with 8
    owners = assign_owners([1, 2, 3, 5, 2, 3], 2)
    load = [sum(b for b, o in zip([1, 2, 3, 5, 2, 3], owners) if o == r) for r in (0, 1)]
    assert load == [8, 8] and owners[3] == 0


def test_one_rank_owns_everything_and_frozen_units_still_get_an_owner():
    assert assign_owners([4, 0, 2], 1) == [0, 0, 0]
    assert assign_owners([0, 0, 0], 3) == [0, 0, 0]  # no states to hold: rank 0, the first of the least loaded


def test_no_ranks_is_refused():
    with pytest.raises(ValueError, match="world_size=0"):
        assign_owners([1], 0)


def test_a_ranks_sharding_names_every_units_owner():
    # units 10, 11, 12 with 5, 3 and 3 bytes of states over two ranks: 5 -> r0, 3 -> r1, 3 -> r1
    sharding = Sharding.balanced([10, 11, 12], [5, 3, 3], world_size=2, rank=1)
    assert sharding.owners == {10: 0, 11: 1, 12: 1} and sharding.owned == {11, 12}
    assert sharding.owns(11) and not sharding.owns(10) and not sharding.gradients_sent


def test_a_unit_joining_the_gpu_tier_goes_from_its_owner_to_the_others_and_nothing_else_moves():
    # unit 0 (indices 0, 1) was rank 0's and is now replicated; unit 1 stays rank 1's; unit 2 left
    # the GPU tier (both held it, rank 0 keeps it); index 5 was never updated
    units = [[0, 1], [2, 3], [4], [5]]
    holds = [frozenset({0, 1, 4}), frozenset({2, 3, 4})]
    needs = [frozenset({0, 1, 4}), frozenset({0, 1, 2, 3, 5})]
    assert states_moves(units, holds, needs) == [StatesMove(0, 0, (0, 1), frozenset({1}))]


def test_units_that_change_owner_move_each_from_its_old_owner_in_the_units_order():
    units = [[0, 1], [2], [3]]
    holds = [frozenset({0, 1}), frozenset({2}), frozenset({3})]
    needs = [frozenset({2}), frozenset({0, 1, 3}), frozenset()]
    assert states_moves(units, holds, needs) == [
        StatesMove(0, 0, (0, 1), frozenset({1})), StatesMove(1, 1, (2,), frozenset({0})), StatesMove(2, 2, (3,), frozenset({1})),
    ]


def test_the_lowest_rank_holding_a_unit_sends_it_to_every_rank_lacking_it():
    holds = [frozenset(), frozenset({7}), frozenset({7}), frozenset()]
    needs = [frozenset({7})] * 4
    assert states_moves([[7]], holds, needs) == [StatesMove(0, 1, (7,), frozenset({0, 3}))]
