"""The planner object: its phases and decisions on cases small enough to work out by hand."""

import dataclasses

import pytest

from offload_strategy.config import PolicyConfig
from offload_strategy.planning.activations import BlockCost, Links
from offload_strategy.planning.placement import GPU, PlacementError, UnitSize
from offload_strategy.planning.cost_model import Machine
from offload_strategy.planning.planner import ModelUnits, Planner, TierBudgets
from offload_strategy.planning.profile import StepProfile, hold_spikes
from offload_strategy.planning.sharding import Sharding


def model(sizes=(100, 100, 100), blocks=()) -> ModelUnits:
    units = [UnitSize(i, n, n) for i, n in enumerate(sizes)]
    return ModelUnits(sizes=units, names=[f"u{i}" for i in range(len(units))], co_resident=[[i] for i in range(len(units))],
                      block_units=[list(b) for b in blocks], state_factor=2.0)


def test_placement_modes_fix_every_home_and_layerwise_takes_one_layer():
    budgets = TierBudgets(gpu=10_000, host=100_000, nvme=0)
    placement = Planner(PolicyConfig(placement="host"), budgets, has_nvme=False).place(model(), 10_000, [[0], [1], [2]], False)
    assert set(placement.home.values()) == {"host"}
    planner = Planner(PolicyConfig(placement="layerwise", prefetch=False), budgets, has_nvme=False)
    planner.place(model(), 10_000, [[0], [1], [2]], False)
    # one 100-byte unit at a time, without a spare buffer to prefetch into: one 512-byte-aligned slot
    assert planner.gpu_placed == 512
    with pytest.raises(ValueError, match="no nvme_path"):
        Planner(PolicyConfig(placement="nvme"), budgets, has_nvme=False).place(model(), 10_000, [[0]], False)


def test_a_refusal_under_a_fixed_placement_names_the_mode_and_the_way_out():
    planner = Planner(PolicyConfig(placement="host"), TierBudgets(gpu=10_000, host=50, nvme=0), has_nvme=False)
    with pytest.raises(PlacementError, match="placement='host' puts every unit's parameters in host memory.*'fill'"):
        planner.place(model(), 10_000, [[0], [1], [2]], False)


def test_checkpointed_blocks_are_placed_together():
    planner = Planner(PolicyConfig(placement="fill"), TierBudgets(gpu=10_000, host=100_000, nvme=0), has_nvme=False, model=model(blocks=([0, 1], [2])))
    assert planner.working_groups(["checkpoint", "keep"]) == [[0], [1], [2], [0, 1]]
    assert planner.working_groups(["keep", "keep"]) == [[0], [1], [2]]
    assert planner.working_groups(["keep", "keep"], every_block=True) == [[0], [1], [2], [0, 1], [2]]


def test_the_search_keeps_its_resident_units_only_when_they_change_something():
    planner = Planner(PolicyConfig(placement="search"), TierBudgets(gpu=4000, host=100_000, nvme=0), has_nvme=False)
    planner.place(model(), 4000, [[0], [1], [2]], False)
    order = [2, 0, 1]
    # the first unit in use order, with 1000 bytes of activations beside: 3000 bytes for the parameters
    chosen = planner.keep_resident(order, 1, current=set(), gpu_bytes=3000, placed=4000)
    assert chosen is not None and chosen.units == frozenset({2}) and chosen.gpu_bytes == 3000
    assert planner.keep_resident(order, 1, current={2}, gpu_bytes=3000, placed=2500) is None  # already so, and within 3000 bytes
    assert planner.keep_resident(order, 1, current={2}, gpu_bytes=3000, placed=3500) is not None  # the same units, but over 3000 bytes
    assert planner.keep_resident(order, 3, current=set(), gpu_bytes=4000, placed=4000) is None  # all resident: the first placement could
    # the profiling placement is replaced whatever the search keeps
    assert planner.keep_resident(order, 1, current={2}, gpu_bytes=3000, placed=2500, profiling=True) is not None
    # the searched units are placed again: unit 2 stays in the GPU tier, the others stream
    placement = planner.place(model(), 3000, [[0], [1], [2]], False)
    assert placement.home == {0: "host", 1: "host", 2: "gpu"}


def test_a_layout_that_does_not_fit_beside_the_parameters_names_their_smaller_share():
    planner = Planner(PolicyConfig(placement="search"), TierBudgets(gpu=100_000, host=100_000, nvme=0), has_nvme=False)
    assert planner.searching
    planner.place(model(), 100_000, [[0], [1], [2]], False)
    costs = [BlockCost(activation_bytes=1000, input_bytes=10, forward_seconds=1e-3)] * 2
    links = Links(d2h=1e9, h2d=1e9, nvme_write=0.0, nvme_read=0.0)
    plan, extra = planner.layout(costs, links, "auto", parameter_bytes=1000, host_bytes=0, block_policies=["keep", "keep"])
    assert extra is None and list(plan.layout) == ["keep", "keep"]
    # 500 bytes beside the parameters hold no layout (one block alone is 1000 bytes): the layout
    # is chosen beside the parameters' smallest share (two 512-byte streaming buffers), and the
    # parameters must be placed again in what it leaves
    plan, extra = planner.layout(costs, links, "auto", parameter_bytes=99_500, host_bytes=0, block_policies=["keep", "keep"])
    assert list(plan.layout) == ["keep", "keep"] and extra == 100_000 - plan.peak_bytes >= 1024
    assert not Planner(PolicyConfig(placement="search"), TierBudgets(1, 1, 0), False, plan=object()).searching  # a plan file fixes homes


def test_offload_states_gives_every_unit_a_gpu_buffer_of_its_own_or_refuses_with_the_shortfall():
    """DeepSpeed's ZeRO-Offload keeps every parameter in the GPU tier: units of 1000, 2000 and 100
    bytes take buffers of 1024, 2048 and 512 (512-byte aligned), 3584 bytes in all, homes in host."""
    budgets = TierBudgets(gpu=10_000, host=100_000, nvme=0)
    planner = Planner(PolicyConfig(placement="offload_states"), budgets, has_nvme=False)
    placement = planner.place(model((1000, 2000, 100)), 10_000, [[0], [1], [2]], False)
    assert set(placement.home.values()) == {"host"}
    assert placement.device_slots == {1024: 1, 2048: 1, 512: 1} and placement.gpu_bytes == 3584
    short = Planner(PolicyConfig(placement="offload_states"), TierBudgets(gpu=3583, host=100_000, nvme=0), has_nvme=False)
    with pytest.raises(PlacementError, match=r"whole step.*need 3\.50 KiB.*by at least 1 B.*zero3_offload"):
        short.place(model((1000, 2000, 100)), 3583, [[0], [1], [2]], False)


def test_a_stall_of_a_few_units_in_the_profiled_step_is_held_to_their_groups_median():
    # hand-worked: units 0-3 do the same work; 2 stalled (9.0 > 2 x the median 1.05); 4 is alone, 5-6 a pair
    seconds = {0: 1.0, 1: 1.1, 2: 9.0, 3: 0.9, 4: 5.0, 5: 1.0, 6: 7.0}
    groups = {0: "a", 1: "a", 2: "a", 3: "a", 4: "b", 5: "c", 6: "c"}
    assert hold_spikes(seconds, groups) == {0: 1.0, 1: 1.1, 2: 1.05, 3: 0.9, 4: 5.0, 5: 1.0, 6: 7.0}
    assert hold_spikes({0: 1.0, 1: 2.0, 2: 3.0}, dict.fromkeys(range(3), "a")) == {0: 1.0, 1: 2.0, 2: 3.0}  # 3.0 is not over 2 x 2.0


def _searched(work, forward):
    """The search over six equal units of 1000 bytes, each 1 ms of backward, with ``forward`` ms."""
    sizes = model(sizes=(1000,) * 6)
    units = ModelUnits(**{**sizes.__dict__, "work": work})
    planner = Planner(PolicyConfig(placement="search"), TierBudgets(gpu=3500, host=100_000, nvme=0), has_nvme=False)
    planner.place(units, 3500, [[i] for i in range(6)], False)
    timing = StepProfile(unit_names=units.names, unit_bytes=[1000] * 6, order=list(range(6)),
                         forward_seconds={i: f / 1e3 for i, f in enumerate(forward)}, backward_seconds={i: 1e-3 for i in range(6)})
    plan, _ = planner.search(timing, [True] * 6, Machine(h2d=1e6, d2h=1e6), direct_gradients=False)
    return plan


def test_the_plan_does_not_change_because_a_neighbour_stalled_the_profiled_step():
    clean = _searched(("layer",) * 6, [1.0] * 6)
    stalled = [1.0, 1.0, 40.0, 1.0, 1.0, 1.0]  # a neighbour process took the CPU while unit 2 ran
    held = _searched(("layer",) * 6, stalled)
    assert (held.parameters.persistent, held.parameters.buffers, held.seconds) == (clean.parameters.persistent, clean.parameters.buffers, clean.seconds)
    unguarded = _searched((), stalled)  # without knowing the units do equal work, the stall counts as compute
    assert unguarded.seconds > clean.seconds + 0.03


@pytest.mark.parametrize("count, update, copies", [(4, 2, 0), (7, 4, 1), (24, 6, 16)])
def test_staging_buffers_beyond_the_minimum_go_to_the_update_worker_and_to_host_copies(count, update, copies):
    """Of the largest staging class's buffers beyond the minimum four, half (up to four) let the
    update worker read ahead and write behind; the rest keep units in host memory from forward
    into backward: 3 spare give the worker 2 (of 3, rounded up) and keep 1; 20 spare give it 4
    and keep 16."""
    from offload_strategy.planning.placement import Placement

    placement = Placement(home={0: "nvme"}, device_slots={512: 2}, staging_slots={8192: count, 4096: 9}, gpu_bytes=0, host_bytes=0, nvme_bytes=0)
    assert (placement.update_staging_buffers, placement.host_copies) == (update, copies)


def test_a_layout_that_recomputes_nothing_is_laid_out_beside_each_modules_units_alone():
    """Four 1000-byte units (1024-byte buffers), two blocks of two: each module's units alone
    stream through two buffers (2048 bytes, one to prefetch into), a recomputed block's through
    three (3072). In a 4048-byte tier, beside 2048 the two blocks' activations (1000 bytes each)
    are kept (a 2000-byte peak); beside 3072 the 976 left hold no layout (checkpointing both
    peaks at 1010). So the parameters are placed again in 2048 bytes, not refused."""
    planner = Planner(PolicyConfig(placement="host"), TierBudgets(gpu=4048, host=10**6, nvme=0), has_nvme=False,
                      model=model(sizes=(1000, 1000, 1000, 1000), blocks=([0, 1], [2, 3])))
    keep = ["keep", "keep"]
    assert (planner.smallest_parameter_share(keep, recomputing=False), planner.smallest_parameter_share(keep)) == (2048, 3072)
    costs = [BlockCost(activation_bytes=1000, input_bytes=10, forward_seconds=1e-3)] * 2
    links = Links(d2h=1e9, h2d=1e9, nvme_write=0.0, nvme_read=0.0)
    plan, parameters = planner.layout(costs, links, "auto", parameter_bytes=4000, host_bytes=0, block_policies=["checkpoint", "checkpoint"])
    assert list(plan.layout) == ["keep", "keep"] and plan.peak_bytes == 2000 and parameters == 2048
    tighter = Planner(PolicyConfig(placement="host"), TierBudgets(gpu=4000, host=10**6, nvme=0), has_nvme=False, model=planner.model)
    # 1952 bytes beside each module's units: only checkpointing fits, which needs a block's units
    with pytest.raises(ValueError, match="no layout"):
        tighter.layout(costs, links, "auto", parameter_bytes=4000, host_bytes=0, block_policies=["checkpoint", "checkpoint"])


def test_the_layout_chosen_after_placing_again_recomputes_only_blocks_placed_together():
    """``ActivationControl.choose_layout_beside``: the parameters were placed again for a layout
    that recomputes blocks 1 and 2 (their units placed together). A new layout that recomputes
    block 0, whose units were not placed together, is not taken: the placed-for one stays; one
    that recomputes fewer blocks (only block 2) is taken."""
    from types import SimpleNamespace

    from offload_strategy.planning.activations import ActivationPlan
    from offload_strategy.session.activations import ActivationControl

    K, C = "keep", "checkpoint"
    placed_for = ActivationPlan((K, C, C), 3.0, 30)
    for offered, expected in (((C, K, K), placed_for), ((K, K, C), ActivationPlan((K, K, C), 2.0, 20))):
        planner = SimpleNamespace(layout_beside=lambda *args, offered=offered: ActivationPlan(offered, 2.0, 20))
        control = ActivationControl(SimpleNamespace(planner=planner))
        control.policies_in_use = SimpleNamespace(planner="auto")
        control.plan = placed_for
        control.links, control.gpu_parameter_bytes, control.host_left = (lambda: None), (lambda: 0), (lambda: 0)
        control.choose_layout_beside([])
        assert control.plan == expected, (offered, control.plan)


def test_the_least_share_of_the_gpu_tier_holds_on_every_rank_under_sharded_states():
    # Two ranks, rank 0 keeping the 4096-byte unit's states, rank 1 the three 1024-byte units'.
    # In 42000 bytes of host memory, rank 0 holds the rest of the parameters beside the fewest
    # buffers (8192 bytes of the GPU tier), rank 1 only with unit 1 resident (20892). Each rank
    # placed in its own least share before, and the two kept different units in the GPU tier
    # (whose gradients are all-reduced): both now place in the larger, alike.
    groups, placed = [[i] for i in range(4)], []
    for rank in (0, 1):
        units = dataclasses.replace(model((4096, 1024, 1024, 1024)), sharding=Sharding({0: 0, 1: 1, 2: 1, 3: 1}, rank, 2))
        planner = Planner(PolicyConfig(placement="search"), TierBudgets(gpu=1 << 20, host=42_000, nvme=0), has_nvme=False, model=units)
        share = planner.least_parameter_share(groups)
        placement = planner.place(units, share, groups, False)
        placed.append((share, {i for i, home in placement.home.items() if home == GPU}))
    assert placed[0] == placed[1] == (20892, {1}), placed


def test_searched_units_fall_back_to_the_first_use_placement_on_every_rank_alike():
    # The same ranks in 20000 bytes of host memory, the search keeping units 0 and 1 resident:
    # rank 0's host memory holds the rest beside them, rank 1's does not, and rank 1 alone fell
    # back to the first-use placement (every unit resident) before, rank 0 keeping two.
    placed = []
    for rank in (0, 1):
        units = dataclasses.replace(model((4096, 1024, 1024, 1024)), sharding=Sharding({0: 0, 1: 1, 2: 1, 3: 1}, rank, 2))
        planner = Planner(PolicyConfig(placement="search"), TierBudgets(gpu=1 << 20, host=20_000, nvme=0), has_nvme=False, model=units)
        planner.keep_resident([0, 1, 2, 3], 2, set(), 30_000, 0)
        placement = planner.place(units, 30_000, [[i] for i in range(4)], False)
        placed.append({i for i, home in placement.home.items() if home == GPU})
    assert placed[0] == placed[1] == {0, 1, 2, 3}, placed
