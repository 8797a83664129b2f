"""The step-time model on small cases worked out by hand."""

from __future__ import annotations

import dataclasses

import pytest

from offload_strategy.planning.cost_model import GPU, HOST, NVME, Machine, UnitCost, simulate_step

LINK = Machine(h2d=100.0, d2h=100.0, nvme_read=100.0, nvme_write=300.0)


def test_one_buffer_serialises_copies_and_compute():
    units = [UnitCost(100, 2.0, 3.0), UnitCost(100, 2.0, 3.0)]  # a copy takes 1 s
    step = simulate_step(units, buffers=1, machine=LINK)
    # forward: copy u0 0-1, compute 1-3; copy u1 waits for the buffer: 3-4, compute 4-6
    assert step.forward_seconds == pytest.approx(6)
    # backward: u1 is still in its buffer: 6-9; u0 is copied again 9-10, computes 10-13
    assert step.seconds == pytest.approx(13) and step.compute_seconds == pytest.approx(10)
    assert step.exposed_seconds == pytest.approx(3) and step.h2d_bytes == 300


def test_a_second_buffer_hides_the_copies_behind_compute():
    units = [UnitCost(100, 2.0, 3.0), UnitCost(100, 2.0, 3.0)]
    step = simulate_step(units, buffers=2, machine=LINK)
    # forward: u0 copied 0-1, computes 1-3; u1 copied 1-2 meanwhile, computes 3-5; both stay for backward
    assert step.forward_seconds == pytest.approx(5) and step.seconds == pytest.approx(11)
    assert step.exposed_seconds == pytest.approx(1) and step.h2d_bytes == 200


def test_nvme_update_is_read_ahead_written_behind_and_ends_the_step():
    units = [
        UnitCost(0, 1.0, 1.0, home=GPU, update_seconds=0.5),
        UnitCost(100, 1.0, 1.0, home=NVME, gradient_bytes=100, state_bytes=200, update_seconds=1.0),
    ]
    step = simulate_step(units, buffers=1, machine=LINK)
    # forward: u0 0-1; u1 read from NVMe 0-1, copied 1-2, computes 2-3
    assert step.forward_seconds == pytest.approx(3)
    # backward: u1 resident 3-4, gradient to host 4-5, parameters and states read 5-8, update 8-9,
    # written 9-10; u0 4-5 and its GPU update 0.5 s after backward: backward ends at 5, the step at 10
    assert step.backward_seconds == pytest.approx(2)
    assert step.seconds == pytest.approx(10) and step.update_tail_seconds == pytest.approx(5)


def test_everything_in_the_gpu_tier_is_pure_compute():
    units = [UnitCost(100, 1.0, 2.0, home=GPU)] * 3
    step = simulate_step(units, buffers=0, machine=LINK)
    assert step.seconds == pytest.approx(9) and step.exposed_seconds == pytest.approx(0) and step.h2d_bytes == 0


def test_no_buffer_for_offloaded_units_is_refused():
    with pytest.raises(ValueError, match="2 units are offloaded but the GPU tier has 0 streaming buffers"):
        simulate_step([UnitCost(1, 1.0, 1.0, home=HOST)] * 2, buffers=0, machine=LINK)


def test_protrain_search_trades_persistent_units_for_buffers():
    from offload_strategy.planning.placement import UnitSize
    from offload_strategy.planning.searches.resident_count import search_persistent

    # four frozen units of 512 bytes (one buffer's alignment), each module uses one; a copy takes 1 s
    sizes = [UnitSize(i, 512, 0) for i in range(4)]
    costs = {i: UnitCost(512, 1.0, 2.0) for i in range(4)}
    machine = Machine(h2d=512.0, d2h=512.0)
    candidates = search_persistent(sizes, [[0], [1], [2], [3]], [0, 1, 2, 3], costs, machine, gpu_bytes=1536, host_bytes=10**6, nvme_bytes=0, state_factor=2.0)
    by_count = {c.persistent: c for c in candidates}
    # two persistent units leave 512 bytes, less than the streaming working set (two buffers): the search ends
    assert sorted(by_count) == [0, 1]
    # all streamed (2 or 3 buffers alike): u1 and u0 come back late in backward, 13 s for 12 of
    # compute; u0 resident: its forward hides u1's copy, the buffers the rest, 12 s and nothing exposed
    assert by_count[0].prediction.seconds == pytest.approx(13)
    assert by_count[1].prediction.seconds == pytest.approx(12) and by_count[1].buffers == 2
    assert candidates[0].persistent == 1 and by_count[1].prediction.exposed_seconds == pytest.approx(0)


def test_protrain_search_keeps_units_resident_where_host_memory_cannot_hold_them_all():
    """Four frozen units of 512 bytes, host memory for three (a home takes a 4 KiB page-aligned
    slot), a GPU tier of 1,536 bytes. Streamed, all four need four slots: refused. One resident
    leaves three at home beside 512 + two buffers (1,536) in the GPU tier: it fits. Two resident need 2,048 of the GPU
    tier, and all four too. The search ended at the first refusal, so it called the model too
    large for the machine."""
    from offload_strategy.planning.placement import PlacementError, UnitSize
    from offload_strategy.planning.searches.resident_count import search_persistent

    sizes = [UnitSize(i, 512, 0) for i in range(4)]
    costs = {i: UnitCost(512, 1.0, 2.0) for i in range(4)}
    machine = Machine(h2d=512.0, d2h=512.0)
    candidates = search_persistent(sizes, [[0], [1], [2], [3]], [0, 1, 2, 3], costs, machine, gpu_bytes=1536, host_bytes=3 * 4096,
                                   nvme_bytes=0, state_factor=2.0)
    assert [c.persistent for c in candidates] == [1]
    assert candidates[0].placement.host_bytes <= 3 * 4096 and candidates[0].placement.gpu_bytes <= 1536
    with pytest.raises(PlacementError, match="host_memory"):  # with host memory for two, no count fits: the first refusal
        search_persistent(sizes, [[0], [1], [2], [3]], [0, 1, 2, 3], costs, machine, gpu_bytes=1536, host_bytes=2 * 4096, nvme_bytes=0,
                          state_factor=2.0)


def test_data_parallel_reduces_at_home_updates_owned_units_and_shares_them():
    units = [
        UnitCost(100, 1.0, 1.0, home=HOST, gradient_bytes=100, update_seconds=1.0, owned=True),
        UnitCost(100, 1.0, 1.0, home=HOST, gradient_bytes=100, update_seconds=1.0, owned=False),
    ]
    two = Machine(h2d=100.0, d2h=100.0, world_size=2, network=100.0)
    step = simulate_step(units, buffers=2, machine=two)
    # forward: u0 copied 0-1, computes 1-2; u1 copied 1-2, computes 2-3; both stay for backward.
    # backward: u1 3-4, to the host 4-5, reduced there to its owner 5-5.5 (half its bytes), not
    # updated here; u0 4-5, to the host 5-6, reduced 6-6.5, updated 6.5-7.5; then the owners'
    # parameters arrive: half of 200 bytes, 7.5-8.5
    assert step.forward_seconds == pytest.approx(3) and step.backward_seconds == pytest.approx(2)
    assert step.seconds == pytest.approx(8.5)
    # gradients reduced in fp32 beside 16-bit parameters (200 bytes each): u1 reduced 5-6, u0 6-7,
    # updated 7-8, parameters 8-9
    widened = [dataclasses.replace(u, reduced_bytes=200) for u in units]
    assert simulate_step(widened, buffers=2, machine=two).seconds == pytest.approx(9)
    # host units' collectives run on host memory's (gloo), here at half the GPU tier's rate: u1
    # reduced 5-6, u0 6-7, updated 7-8, their parameters (100 bytes) 8-10
    gloo = dataclasses.replace(two, host_network=50.0)
    assert simulate_step(units, buffers=2, machine=gloo).seconds == pytest.approx(10)
    # each collective costing 0.25 s beyond its bytes, two tensors per unit (a reduction each):
    # u1 reduced 5-6 (0.5 + 0.5), u0 6-7, updated 7-8; the ranks agree on which parameters have
    # gradients 8-8.25; two broadcasts, 0.5 + 1.0: 8.25-9.75
    calls = [dataclasses.replace(u, tensors=2) for u in units]
    assert simulate_step(calls, buffers=2, machine=dataclasses.replace(two, collective_latency=0.25)).seconds == pytest.approx(9.75)
    # ranks sharing one copy of host homes, each collective costing 0.25 s: the owners' writes are
    # seen by every rank, so no parameters are sent after the step, only a barrier: u1 reduced
    # 5-5.75, u0 6-6.75, updated 6.75-7.75; the ranks agree on gradients 7.75-8, the barrier 8-8.25
    shared = dataclasses.replace(two, collective_latency=0.25, shared_homes=True)
    assert simulate_step(units, buffers=2, machine=shared).seconds == pytest.approx(8.25)
    # four ranks on two machines, a copy of host homes on each: reductions move 3/4 of the bytes,
    # u1 reduced 5-6 (0.25 + 0.75), u0 6-7, updated 7-8; the agreement 8-8.25, the barrier
    # 8.25-8.5; then each update goes to the other machine, the ranks of each local index sending
    # their half of the 200 bytes to 1 of 2 machines (50 bytes, 0.5 s) in one broadcast (0.25):
    # 8.5-9.25
    machines = dataclasses.replace(shared, world_size=4, machines=2)
    assert simulate_step(units, buffers=2, machine=machines).seconds == pytest.approx(9.25)
    assert simulate_step(units, buffers=2, machine=dataclasses.replace(machines, machines=1)).seconds == pytest.approx(8.5)
    # without sharding: all-reduces (all the bytes each), both units updated, nothing shared
    replicated = simulate_step(units, buffers=2, machine=Machine(h2d=100.0, d2h=100.0, world_size=2, network=100.0, shard_states=False))
    # u1 3-4, host 4-5, all-reduce 5-6, update 6-7; u0 4-5, host 5-6, all-reduce 6-7, update 7-8
    assert replicated.seconds == pytest.approx(8)
    # one rank: the single-device model
    single = simulate_step(units, buffers=2, machine=Machine(h2d=100.0, d2h=100.0))
    # u1 3-4, host 4-5, update 5-6; u0 4-5, host 5-6, update 6-7
    assert single.seconds == pytest.approx(7)


def test_replicated_persistent_units_are_all_reduced_updated_everywhere_and_not_sent():
    # One persistent unit another rank owns, two ranks at 100 bytes/s: forward 0-1, backward 1-2.
    # Sharded: reduced to its owner (half its 100 bytes) 2-2.5, not updated here, its parameters
    # received after the step (half of 100 bytes) 2.5-3. Replicated: all-reduced (all 100 bytes)
    # 2-3, updated here 3-4, nothing received.
    unit = [UnitCost(100, 1.0, 1.0, home=GPU, gradient_bytes=100, update_seconds=1.0, owned=False)]
    two = Machine(h2d=100.0, d2h=100.0, world_size=2, network=100.0)
    assert simulate_step(unit, buffers=0, machine=two).seconds == pytest.approx(3.0)
    assert simulate_step(unit, buffers=0, machine=dataclasses.replace(two, replicated_persistent=True)).seconds == pytest.approx(4.0)


def test_links_from_a_hardware_spec_with_fallbacks_for_what_it_does_not_know():
    from offload_strategy.hardware import known_hardware
    from offload_strategy.planning.cost_model import UNKNOWN_DISK, UNKNOWN_LINK, machine_from_spec

    spec = known_hardware("h100_80g")
    machine = machine_from_spec(spec, nvme=True)
    assert machine.h2d == spec.h2d_gbps * 1e9 and machine.nvme_read == (spec.nvme_read_gbps * 1e9 if spec.nvme_read_gbps else UNKNOWN_DISK)
    assert machine_from_spec(spec, nvme=False).nvme_write == 0.0  # no NVMe tier, no link to it
    unknown = machine_from_spec(None, nvme=True)
    assert (unknown.h2d, unknown.d2h, unknown.nvme_write) == (UNKNOWN_LINK, UNKNOWN_LINK, UNKNOWN_DISK)


def test_units_stream_through_their_own_size_class():
    # two large units (100 bytes) and a small one (10) between them; one buffer of each size
    units = [UnitCost(100, 1.0, 1.0), UnitCost(10, 1.0, 1.0), UnitCost(100, 1.0, 1.0)]
    classes = simulate_step(units, buffers={100: 1, 10: 1}, machine=LINK)
    # forward: u0 in 0-1, computes 1-2; u1 (small buffer) in 1-1.1, computes 2-3; u2 waits for
    # u0's buffer (free at 2), in 2-3, computes 3-4. Backward: u2 and u1 still resident (the last
    # of each class), u2 4-5, u1 5-6; u0 refetched when u2's buffer frees at 5: in 5-6, 6-7.
    assert classes.forward_seconds == pytest.approx(4)
    assert classes.backward_seconds == pytest.approx(3)
    # two buffers of any size: u2 need not wait for u0's (it takes the second), and u1 and u2
    # stay resident for backward, as above
    counted = simulate_step(units, buffers=2, machine=LINK)
    assert counted.forward_seconds == pytest.approx(4.0) and counted.h2d_bytes == classes.h2d_bytes == 310
    with pytest.raises(ValueError, match="no streaming buffer holds it"):
        simulate_step(units, buffers={10: 3}, machine=LINK)


def test_the_drive_serves_a_later_read_while_an_earlier_write_waits_for_its_data():
    """Reads and writes reach the drive from different threads: the fetch of the next unit in
    backward does not wait behind the write of a unit still being updated (a drive served in
    issue order would idle through the update)."""
    unit = UnitCost(100, 1.0, 1.0, home=NVME, gradient_bytes=100, state_bytes=200, update_seconds=1.0)
    step = simulate_step([unit, unit], buffers=1, machine=LINK)
    # forward: u0 read 0-1, copied 1-2, computes 2-3; u1 read 3-4, copied 4-5, computes 5-6
    # backward: u1 in its buffer 6-7, gradient home 7-8, parameters and states read 8-11, updated
    # 11-12, written 12-13. u0's buffer freed at 7: its read takes the drive's idle 7-8 (in issue
    # order it would wait for u1's write, 13-14), copied 8-9, computes 9-10, gradient home 10-11;
    # its 3 s read fills 11-12 and 13-15 around u1's write, updated 15-16, written 16-17
    assert step.forward_seconds == pytest.approx(6)
    assert step.backward_seconds == pytest.approx(4)
    assert step.seconds == pytest.approx(17)


@pytest.mark.parametrize("copies, seconds", [(0, 10.0), (1, 10.0), (2, 9.0)])
def test_units_kept_in_host_memory_since_forward_are_not_read_from_the_drive_again(copies, seconds):
    """Host staging buffers keep the last units forward read from NVMe (``Placement.host_copies``):
    backward copies those from host memory without a read."""
    frozen = UnitCost(100, 1.0, 1.0, home=NVME)
    step = simulate_step([frozen, frozen], buffers=1, machine=LINK, host_copies=copies)
    # forward as above, ends at 6; backward: u1 in its buffer 6-7; u0 read 7-8 (unless kept: u1
    # is the one copy a single buffer keeps), copied 8-9, computes 9-10; kept: copied 7-8, computes 8-9
    assert step.seconds == pytest.approx(seconds)
