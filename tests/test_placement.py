"""The GPU → host → NVMe allocator and the prefetch table, on small cases worked out by hand."""

import pytest

from offload_strategy.planning.placement import GPU, HOST, NVME, PlacementError, UnitSize, minimum_gpu_bytes, place_units
from offload_strategy.planning.sharding import Sharding
from offload_strategy.runtime.params.scheduler import PrefetchTable

# Four units of 1024, 2048, 1024 and 512 bytes, all trainable, each used by its own module.
UNITS = [UnitSize(0, 1024, 1024), UnitSize(1, 2048, 2048), UnitSize(2, 1024, 1024), UnitSize(3, 512, 512)]
GROUPS = [[0], [1], [2], [3]]


def test_everything_fits():
    # GPU cost = parameters + gradients + 2x Adam states = 4 x 4608 bytes = 18432
    placement = place_units(UNITS, GROUPS, gpu_bytes=18432, host_bytes=0, nvme_bytes=0, state_factor=2)
    assert set(placement.home.values()) == {GPU} and placement.gpu_bytes == 18432 and not placement.offloaded


def test_streaming_buffers_and_host_homes():
    # Smallest working set: one module at a time, so 1 buffer of the largest size (2048) + 1 to
    # prefetch into = 4096. Reserving twice that (8192) leaves nothing persistent in 6144 bytes.
    # Algorithm 2 over the 2048 bytes left gives floor(0.44*2048/1024) = floor(0.44*2048/2048)
    # = floor(0.11*2048/512) = 0 buffers; the spare 2048 bytes buy two 1024-byte buffers for
    # units 0 and 2, the first two that fit.
    # Host, each part rounded to pages: gradients 4 x 4096, parameter homes 4 x 4096, Adam
    # states 4 x 4096 (unit 1's 4096 bytes of states fill exactly one page): 49152 in all.
    placement = place_units(UNITS, GROUPS, gpu_bytes=6144, host_bytes=49152, nvme_bytes=0, state_factor=2)
    assert placement.home == {0: HOST, 1: HOST, 2: HOST, 3: HOST}
    assert placement.device_slots == {2048: 2, 1024: 2}
    assert placement.gpu_bytes == 6144 and placement.host_bytes == 49152 and placement.staging_slots == {}


def test_smallest_working_set_by_buffer_sizes():
    # One module at a time: one buffer of the largest unit (2048) and one to prefetch into, 4096;
    # a buffer of each unit's own size would cost more (1024 + 2 x 2048 + 512 = 5632).
    assert minimum_gpu_bytes(UNITS, GROUPS) == 4096
    # A checkpointed block of units 0, 2 and 3 (1024, 1024, 512) recomputes with all three
    # resident: four buffers of 2048 cost 8192, but one per size in use, two of 1024, one of 512,
    # one of 2048 for unit 1 alone and one of 2048 to prefetch into, cost 6656.
    assert minimum_gpu_bytes(UNITS, [*GROUPS, [0, 2, 3]]) == 6656
    placement = place_units(UNITS, [*GROUPS, [0, 2, 3]], gpu_bytes=6656, host_bytes=1 << 20, nvme_bytes=0, state_factor=2)
    assert placement.device_slots == {2048: 2, 1024: 2, 512: 1}
    with pytest.raises(PlacementError, match=r"raise gpu_memory to at least 6.50 KiB"):
        place_units(UNITS, [*GROUPS, [0, 2, 3]], gpu_bytes=6655, host_bytes=1 << 20, nvme_bytes=0, state_factor=2)


def test_nvme_takes_what_host_memory_cannot():
    # 45000 < 49152: gradients (16384) and four staging pages (two to fetch through, two for the
    # update worker: 16384) make 32768; unit 0's home and states (8192) bring it to 40960; unit 1's
    # would pass 45000, and so would 2's and 3's: those three keep parameters and states on NVMe
    # (3 x 8192). The 4040 bytes left do not buy another staging page.
    placement = place_units(UNITS, GROUPS, gpu_bytes=6144, host_bytes=45000, nvme_bytes=1 << 20, state_factor=2)
    assert placement.home == {0: HOST, 1: NVME, 2: NVME, 3: NVME}
    assert placement.staging_slots == {4096: 4}
    assert placement.host_bytes == 40960 and placement.nvme_bytes == 3 * 8192
    # 4096 more bytes buy a fifth page, which keeps an NVMe unit in host memory between its uses
    assert place_units(UNITS, GROUPS, gpu_bytes=6144, host_bytes=49100, nvme_bytes=1 << 20, state_factor=2).staging_slots == {4096: 5}



def test_staging_buffers_beyond_the_minimum_leave_the_host_reserve():
    """With every unit on NVMe and 1 MiB of host memory, the gradients (16384 in flight) and the
    four staging pages of the minimum leave room for a page per NVMe unit beyond them: 8 pages,
    16384 + 8 x 4096 = 49152 bytes. Reserving all but 40000 bytes for activations leaves one extra
    page (16384 + 5 x 4096 = 36864; a sixth page would make 40960). A reserve beyond what the
    minimum takes drops every extra page, never the minimum's."""
    homes = {u.index: NVME for u in UNITS}

    def place(reserve: int):
        return place_units(UNITS, GROUPS, gpu_bytes=6144, host_bytes=1 << 20, nvme_bytes=1 << 20, state_factor=2, homes=homes, host_reserve=reserve)

    assert place(0).staging_slots == {4096: 8} and place(0).host_bytes == 49152 and place(0).spare_staging_bytes == 4 * 4096
    assert place((1 << 20) - 40000).staging_slots == {4096: 5} and place((1 << 20) - 40000).host_bytes == 36864
    assert place(1 << 20).staging_slots == {4096: 4} and place(1 << 20).spare_staging_bytes == 0

def test_host_units_gradients_pass_through_buffers_when_a_home_each_does_not_fit():
    """Eight trainable units of 1024 bytes, streamed through a 2048-byte GPU tier. A home each in
    host memory is a page of gradients, a page of parameters and a page of Adam states (2048 bytes):
    8 x 3 x 4096 = 98304 bytes. Updated as their gradients complete, the gradients need only four
    buffers of a page while in flight: 4 x 4096 + 8 x 2 x 4096 = 81920, which 90000 bytes hold;
    the search refused them before ("raise host_memory to at least 96.00 KiB")."""
    units, groups = [UnitSize(i, 1024, 1024) for i in range(8)], [[i] for i in range(8)]

    def place(until_update: bool):
        return place_units(units, groups, gpu_bytes=2048, host_bytes=90000, nvme_bytes=0, state_factor=2, gradients_until_update=until_update)

    placement = place(until_update=True)
    assert set(placement.home.values()) == {HOST} and placement.host_gradients_in_flight
    assert placement.gradient_slots == {4096: 4} and placement.host_bytes == 81920
    # gradients that wait for the step (accumulation, clipping by norm) need their homes
    with pytest.raises(PlacementError, match=r"raise host_memory to at least 96.00 KiB"):
        place(until_update=False)
    # with room for the homes, they keep them
    roomy = place_units(units, groups, gpu_bytes=2048, host_bytes=98304, nvme_bytes=0, state_factor=2, gradients_until_update=True)
    assert not roomy.host_gradients_in_flight and roomy.gradient_slots == {} and roomy.host_bytes == 98304


def test_the_16_bit_landing_area_goes_with_a_gradient_not_with_the_states():
    """Eight units of 8192 bf16 parameters (16384 bytes) with fp32 masters: an fp32 gradient of 32768
    bytes that lands in 16 bits first (16384), fp32 master and two Adam states (3 x 32768). A home
    each: 8 x (49152 + 16384 + 98304) = 1310720 bytes. In flight, the landing area travels with
    the gradient into the buffers: 4 x 49152 + 8 x (16384 + 98304) = 1114112, which 1150000 bytes
    hold. Counted with the states (as a factor of 3.5) it was charged for every unit, buffers of
    the gradient alone beside it: 1179648, refused."""
    units = [UnitSize(i, 16384, 32768, landing_bytes=16384) for i in range(8)]
    placement = place_units(units, [[i] for i in range(8)], gpu_bytes=2 * 16384, host_bytes=1150000, nvme_bytes=0, state_factor=3,
                            gradients_until_update=True)
    assert placement.host_gradients_in_flight and placement.gradient_slots == {49152: 4} and placement.host_bytes == 1114112
    roomy = place_units(units, [[i] for i in range(8)], gpu_bytes=2 * 16384, host_bytes=1310720, nvme_bytes=0, state_factor=3,
                        gradients_until_update=True)
    assert not roomy.host_gradients_in_flight and roomy.host_bytes == 1310720


def test_sharded_states_reserve_room_only_for_the_units_this_rank_owns():
    # As above with 45000 bytes, but this rank keeps the states of units 1 and 3 only: homes cost
    # 4096 (+ 4096 of states for 1 and 3). Gradients 16384 + units 0 (4096), 1 (8192), 2 (4096)
    # and 3 (8192) = 40960 fit on the host, where all four units' states pushed three to NVMe.
    odd = Sharding({0: 0, 1: 1, 2: 0, 3: 1}, rank=1, world_size=2)
    placement = place_units(UNITS, GROUPS, gpu_bytes=6144, host_bytes=45000, nvme_bytes=1 << 20, state_factor=2, sharding=odd)
    assert placement.home == {0: HOST, 1: HOST, 2: HOST, 3: HOST}
    assert placement.host_bytes == 40960 and placement.nvme_bytes == 0
    # every rank keeps the same persistent units, each rank the states of those it owns: the GPU
    # tier is sized for the rank whose states there are largest. Parameters and gradients
    # 2 x 4608 = 9216 on each rank; states 2 x 2048 = 4096 on rank 1 (unit 1), 2 x 2560 = 5120
    # on rank 0 (units 0, 2, 3): 14336, where one rank holding them all needs 18432
    one = Sharding({0: 0, 1: 1, 2: 0, 3: 0}, rank=1, world_size=2)
    everything = place_units(UNITS, GROUPS, gpu_bytes=14336, host_bytes=0, nvme_bytes=0, state_factor=2, sharding=one)
    assert everything.gpu_bytes == 14336 and not everything.offloaded
    with pytest.raises(PlacementError):
        place_units(UNITS, GROUPS, gpu_bytes=14336 - 1, host_bytes=0, nvme_bytes=0, state_factor=2, sharding=one, all_on_gpu=True)


def test_persistent_units_by_first_use():
    # 16384 bytes, 8192 reserved for streaming: unit 0 costs 4096 (0 + 4096 + 8192 <= 16384:
    # persistent); unit 1 costs 8192 (4096 + 8192 + 8192 > 16384: offloaded); unit 2 costs 4096
    # (4096 + 4096 + 8192 = 16384: persistent); unit 3 costs 2048 (8192 + 2048 + 8192 > 16384).
    placement = place_units(UNITS, GROUPS, gpu_bytes=16384, host_bytes=1 << 20, nvme_bytes=0, state_factor=2)
    assert placement.home == {0: GPU, 1: HOST, 2: GPU, 3: HOST}


@pytest.mark.parametrize(
    "budgets, message",
    [
        (dict(gpu_bytes=4000, host_bytes=1 << 20, nvme_bytes=0), r"gpu_memory=3.91 KiB cannot hold .* \(4.00 KiB\); raise gpu_memory to at least 4.00 KiB"),
        (dict(gpu_bytes=6144, host_bytes=20000, nvme_bytes=1 << 20), r"host_memory=19.53 KiB cannot hold the gradients .* 4 NVMe staging buffers .* at least 32.00 KiB"),
        (dict(gpu_bytes=6144, host_bytes=45000, nvme_bytes=0), r"host_memory=43.95 KiB cannot hold the offloaded units' parameters, gradients and optimizer states \(.*\) and there is no NVMe tier; raise host_memory to at least .*, or give nvme_path"),
    ],
)
def test_refusals_name_the_numbers(budgets, message):
    with pytest.raises(PlacementError, match=message):
        place_units(UNITS, GROUPS, state_factor=2, **budgets)


def test_prefetch_table_cursor_and_belady_choice():
    table = PrefetchTable()
    table.start_recording()
    for unit in [0, 1, 1, 2, 1, 0]:  # the repeated 1 is one use
        table.record(unit)
    table.freeze()
    assert table.order == [0, 1, 2, 1, 0]
    table.restart()
    assert table.record(0) and table.cursor == 1
    assert table.next_use(2) == 1 and table.next_use(1) == 0 and table.next_use(0) == 3
    assert table.farthest([0, 1, 2]) == 0
    assert table.record(2) and table.cursor == 3  # skipped ahead over a missed use of 1
    assert table.record(2)  # the same module called again
    assert not table.record(7) and table.cursor == 3  # unknown use: counted by the caller, cursor stays
    assert list(table.upcoming(10)) == [1, 0]
    assert table.next_use(2) is None and table.farthest([2, 1]) == 2  # never used again this step


def test_other_ranks_units_keep_gradients_only_until_sent():
    # Twelve units of 16 KiB under two ranks, this one owning the even ones; 32 KiB of GPU tier
    # holds one buffer to compute in and one to prefetch into, so every unit streams from host.
    # A gradient home each: parameters 12 x 16 + gradients 12 x 16 + Adam states of the six
    # owned 6 x 32 = 576 KiB. When every backward reduces to the owners, the six others' gradients
    # pass through four 16 KiB buffers instead: 192 + 6 x 16 + 4 x 16 + 192 = 544 KiB.
    units = [UnitSize(i, 16384, 16384) for i in range(12)]
    groups = [[i] for i in range(12)]
    even = Sharding({i: i % 2 for i in range(12)}, rank=0, world_size=2)
    sends = Sharding(even.owners, rank=0, world_size=2, gradients_sent=True)
    kib = 1024
    with pytest.raises(PlacementError, match="host_memory"):
        place_units(units, groups, gpu_bytes=32 * kib, host_bytes=544 * kib, nvme_bytes=0, state_factor=2, sharding=even)
    homes = place_units(units, groups, gpu_bytes=32 * kib, host_bytes=576 * kib, nvme_bytes=0, state_factor=2, sharding=even)
    assert homes.host_bytes == 576 * kib and not homes.gradients_sent and homes.gradient_slots == {}
    sent = place_units(units, groups, gpu_bytes=32 * kib, host_bytes=544 * kib, nvme_bytes=0, state_factor=2, sharding=sends)
    assert set(sent.home.values()) == {HOST} and sent.host_bytes == 544 * kib
    assert sent.gradients_sent == frozenset(range(1, 12, 2)) and sent.gradient_slots == {16384: 4}
    # where each unit is updated as its gradients come in, the sent units' buffers are still
    # counted when host memory keeps the owned units' gradients at home
    updating = place_units(units, groups, gpu_bytes=32 * kib, host_bytes=544 * kib, nvme_bytes=0, state_factor=2, sharding=sends,
                           gradients_until_update=True)
    assert updating.host_bytes == 544 * kib and not updating.host_gradients_in_flight and updating.gradient_slots == {16384: 4}
    # ... and with less, the owned units' gradients pass through the same four buffers: 192 + 64 + 192
    in_flight = place_units(units, groups, gpu_bytes=32 * kib, host_bytes=448 * kib, nvme_bytes=0, state_factor=2, sharding=sends,
                            gradients_until_update=True)
    assert in_flight.host_bytes == 448 * kib and in_flight.host_gradients_in_flight and in_flight.gradient_slots == {16384: 4}
    # one process, or states not sharded: every unit is its own (192 + 192 + 12 x 32), nothing is sent
    alone = place_units(units, groups, gpu_bytes=32 * kib, host_bytes=768 * kib, nvme_bytes=0, state_factor=2)
    assert not alone.gradients_sent and alone.gradient_slots == {}


def test_every_rank_keeps_the_same_units_in_the_gpu_tier():
    # Two ranks owning units {0, 2} and {1, 3}, 12288 bytes, 8192 reserved for streaming. The GPU
    # tier must hold the same units on both, since a persistent unit's gradients are reduced on the
    # GPU's process group and an offloaded unit's on the host's; it is sized for the rank whose
    # states there are largest. Unit 0: parameters and gradients 2048, its states 2048 on rank 0:
    # 4096 + 8192 fits. Unit 1: 6144 and 4096 of states on rank 1: 10240 + 8192 does not; nor unit
    # 2 (4096, rank 0's states 4096) or 3 (5120 with rank 0's 2048). Counting only its own states,
    # rank 1 would have kept unit 2 as well (2048 + 2048 + 8192), and rank 0 not.
    owners = {0: 0, 1: 1, 2: 0, 3: 1}
    ranks = [place_units(UNITS, GROUPS, gpu_bytes=12288, host_bytes=1 << 20, nvme_bytes=0, state_factor=2, sharding=Sharding(owners, rank, 2))
             for rank in (0, 1)]
    assert ranks[0].home == ranks[1].home == {0: GPU, 1: HOST, 2: HOST, 3: HOST}
    assert ranks[0].host_bytes != ranks[1].host_bytes  # each holds the states of the offloaded units it owns


def test_replicated_persistent_units_cost_every_rank_their_states():
    # The owners above, a GPU tier of 13312 bytes, 8192 of them for streaming: 5120 for persistent
    # units. Sharded, unit 0 costs 2048 (parameters, gradients) + rank 0's 2048 of states: 4096;
    # unit 3 adds 1024 and rank 1's 1024, the largest rank's states still 2048: 5120, kept.
    # Replicated (ProTrain: every rank keeps and updates them), unit 0 costs 4096 on every rank,
    # and unit 3's 2048 more do not fit: only unit 0 stays.
    owners = {0: 0, 1: 1, 2: 0, 3: 1}

    def place(replicated):
        return place_units(UNITS, GROUPS, gpu_bytes=13312, host_bytes=1 << 20, nvme_bytes=0, state_factor=2,
                           sharding=Sharding(owners, 0, 2, replicated_persistent=replicated))

    sharded, replicated = place(False), place(True)
    assert [i for i, h in sharded.home.items() if h == GPU] == [0, 3] and not sharded.replicated_persistent
    assert [i for i, h in replicated.home.items() if h == GPU] == [0] and replicated.replicated_persistent
    assert replicated.replicated(0) and not replicated.replicated(1) and not sharded.replicated(0)


def test_ranks_sharing_host_homes_pay_a_share_of_the_parameters():
    # The twelve units of the test above, gradients only sent on: with one copy of the parameters
    # on the machine for both ranks, each pays half of them, 96 + 6 x 16 + 4 x 16 + 192 = 448 KiB,
    # where a copy each needs 544.
    units = [UnitSize(i, 16384, 16384) for i in range(12)]
    groups = [[i] for i in range(12)]
    owners = {i: i % 2 for i in range(12)}
    kib = 1024
    with pytest.raises(PlacementError, match="host_memory"):
        place_units(units, groups, gpu_bytes=32 * kib, host_bytes=448 * kib, nvme_bytes=0, state_factor=2,
                    sharding=Sharding(owners, rank=0, world_size=2, gradients_sent=True))
    shared = place_units(units, groups, gpu_bytes=32 * kib, host_bytes=448 * kib, nvme_bytes=0, state_factor=2,
                         sharding=Sharding(owners, rank=0, world_size=2, gradients_sent=True, shared_homes=True))
    assert set(shared.home.values()) == {HOST} and shared.host_bytes == 448 * kib and shared.host_homes_shared


def test_each_machines_ranks_pay_their_share_of_its_copy_of_host_homes():
    # Four ranks, on one machine or on two: the twelve 16 KiB units' parameters are one copy per
    # machine, so each rank pays a quarter of each (4 KiB) or a half (8 KiB): 12 x 4 KiB more on
    # two machines, all else alike.
    units = [UnitSize(i, 16384, 16384) for i in range(12)]
    owners = {i: i % 4 for i in range(12)}
    kib = 1024

    def place(machines):
        return place_units(units, [[i] for i in range(12)], gpu_bytes=32 * kib, host_bytes=1 << 20, nvme_bytes=0, state_factor=2,
                           sharding=Sharding(owners, 0, 4, gradients_sent=True, shared_homes=True, machines=machines))

    one, two = place(1), place(2)
    assert set(one.home.values()) == set(two.home.values()) == {HOST}
    assert two.host_bytes - one.host_bytes == 12 * 4 * kib
    with pytest.raises(ValueError, match="4 ranks cannot be spread evenly over 3 machines"):
        Sharding(owners, 0, 4, machines=3)


def test_ranks_sharing_host_homes_home_the_same_units_there():
    # Eight units of 16 KiB streamed through 32 KiB of GPU tier; rank 0 owns units 0-5, rank 1
    # units 6 and 7; a gradient home each (16 KiB), Adam states 32 KiB on the owner, 320 KiB of
    # host and an NVMe tier. Both ranks start from their gradients (128) and four 32 KiB staging
    # buffers: 256. With one copy of the parameters (8 KiB each of a unit's 16), unit 0 costs rank
    # 0 40 and rank 1 8: 296 / 264; units 1-5 would take rank 0 to 336: NVMe on both; unit 6
    # costs rank 0 8 and rank 1 40: 304 / 304; unit 7 would take rank 1 to 344: NVMe.
    owners = {i: 0 if i < 6 else 1 for i in range(8)}
    kib = 1024
    units = [UnitSize(i, 16384, 16384) for i in range(8)]

    def place(rank, shared):
        return place_units(units, [[i] for i in range(8)], gpu_bytes=32 * kib, host_bytes=320 * kib, nvme_bytes=1 << 20, state_factor=2,
                           sharding=Sharding(owners, rank, 2, shared_homes=shared))

    ranks = [place(rank, True) for rank in (0, 1)]
    assert ranks[0].home == ranks[1].home == {i: HOST if i in (0, 6) else NVME for i in range(8)}
    assert ranks[0].host_bytes == ranks[1].host_bytes == 304 * kib and ranks[0].staging_slots == {32 * kib: 4}
    # a copy each, every rank choosing for itself: rank 0 would home units 0 and 6 in host memory,
    # rank 1 every unit (gradients 128, parameters 128, its states 64: 320)
    assert [i for i, h in place(0, False).home.items() if h == HOST] == [0, 6]
    assert set(place(1, False).home.values()) == {HOST}


def test_a_reduction_moves_16_bit_gradients_in_16_bits():
    """A unit of 100 bf16 parameters with fp32 masters keeps 400 bytes of fp32 gradients and a
    200-byte landing area; its reduction moves the 200 bytes of bf16 the runtime reduces. Without
    fp32 masters it moves its gradients as they are."""
    assert UnitSize(0, nbytes=200, trainable_bytes=400, landing_bytes=200).reduced_bytes == 200
    assert UnitSize(0, nbytes=400, trainable_bytes=400).reduced_bytes == 400
    assert UnitSize(0, nbytes=200, trainable_bytes=0, landing_bytes=0).reduced_bytes == 0
