"""LoHan's activation swapping strategy (Algorithm 1) on cases worked out by hand."""

from __future__ import annotations

import pytest

from offload_strategy.planning.activations import CHECKPOINT, KEEP, SWAP_HOST, SWAP_NVME, BlockCost, Links
from offload_strategy.planning.searches.swap_or_recompute import FALLING, RISING, TURNING, lohan_layout, lohan_search, offloading_order

BIG = 10**9


def test_blocks_go_in_order_of_offloading_benefit():
    # Eq. 6: recompute seconds per activation byte, here 0.1, 0.4, 0.2, 0.2, 0.1; ties keep forward order
    costs = [BlockCost(10, 1, 1.0), BlockCost(10, 1, 4.0), BlockCost(20, 1, 4.0), BlockCost(10, 1, 2.0), BlockCost(5, 1, 0.5)]
    assert offloading_order(costs) == [1, 2, 3, 0, 4]


def test_case_2_compute_bound_swaps_everything():
    # two blocks of 10 bytes, 10 s of forward each, a 10 B/s link. Swapping block 0: forward
    # max(20, 10/10) = 20, backward 2*20 + 10 (block 1 recomputed) = 50, 70 s; both: 20 + 40 = 60 s.
    costs = [BlockCost(10, 1, 10.0), BlockCost(10, 1, 10.0)]
    search = lohan_search(costs, Links(d2h=10.0, h2d=10.0), gpu_bytes=BIG, host_bytes=BIG)
    assert search.curve == ((10, 70.0), (20, 60.0))
    assert search.case == FALLING and search.plan.layout == (SWAP_HOST, SWAP_HOST) and search.plan.seconds == 60.0


def test_case_1_pcie_bound_swaps_the_least():
    # 0.1 s of forward each: swapping block 0 moves 10 bytes each way (1 s per pass), 2 s; both
    # move 20 bytes (2 s per pass), 4 s. The time only rises: one block is swapped, one recomputed.
    costs = [BlockCost(10, 1, 0.1), BlockCost(10, 1, 0.1)]
    search = lohan_search(costs, Links(d2h=10.0, h2d=10.0), gpu_bytes=BIG, host_bytes=BIG)
    assert [t for _, t in search.curve] == pytest.approx([2.0, 4.0])
    assert search.case == RISING and search.plan.layout == (SWAP_HOST, CHECKPOINT)


def test_case_3_stops_at_the_turn():
    # blocks in forward order C, A, B with forward 1, 4, 2 s and 10 bytes each: benefit order A, B, C.
    # 3 B/s link, forward compute 7 s.
    #   {A}:      forward max(7, 10/3) = 7, backward max(14 + 3 recomputed, 10/3) = 17  -> 24
    #   {A, B}:   forward 7, backward max(14 + 1, 20/3) = 15                             -> 22
    #   {A, B, C}: forward max(7, 30/3) = 10, backward max(14, 10) = 14                  -> 24
    costs = [BlockCost(10, 1, 1.0), BlockCost(10, 1, 4.0), BlockCost(10, 1, 2.0)]
    search = lohan_search(costs, Links(d2h=3.0, h2d=3.0), gpu_bytes=BIG, host_bytes=BIG)
    assert search.order == (1, 2, 0)
    assert [t for _, t in search.curve] == pytest.approx([24.0, 22.0, 24.0])
    assert search.case == TURNING and search.plan.layout == (CHECKPOINT, SWAP_HOST, SWAP_HOST)
    assert search.plan.seconds == pytest.approx(22.0)
    # host memory for one block (Eq. 3): the other swapped block goes to the SSD
    nvme = Links(d2h=3.0, h2d=3.0, nvme_write=1000.0, nvme_read=1000.0)
    assert lohan_search(costs, nvme, gpu_bytes=BIG, host_bytes=10).plan.layout == (CHECKPOINT, SWAP_HOST, SWAP_NVME)


def test_swapping_goes_on_past_the_turn_until_the_layout_is_safe():
    # case 1's blocks: {0} peaks at 11 bytes in the GPU tier (block 1's input and block 0's
    # activations on their way out); every layout peaks at 11 or more
    costs = [BlockCost(10, 1, 0.1), BlockCost(10, 1, 0.1)]
    links = Links(d2h=10.0, h2d=10.0)
    assert lohan_search(costs, links, gpu_bytes=11, host_bytes=BIG).plan.peak_bytes == 11
    with pytest.raises(ValueError, match="at least 11 bytes"):
        lohan_search(costs, links, gpu_bytes=10, host_bytes=BIG)


def test_everything_kept_when_it_fits():
    costs = [BlockCost(10, 1, 0.1), BlockCost(10, 1, 0.1)]
    assert lohan_layout(costs, Links(d2h=10.0, h2d=10.0), gpu_bytes=20, host_bytes=BIG).layout == (KEEP, KEEP)
    assert lohan_layout(costs, Links(d2h=10.0, h2d=10.0), gpu_bytes=19, host_bytes=BIG).layout == (SWAP_HOST, CHECKPOINT)


def test_a_walk_that_ends_over_budget_takes_the_fastest_prefix_that_fits():
    # case 2's blocks: swapping both (60 s) peaks at 20 bytes (block 0 coming back while block
    # 1's activations are still there); swapping block 0 (70 s) at 11, recomputing both (80 s) at 11
    costs = [BlockCost(10, 1, 10.0), BlockCost(10, 1, 10.0)]
    search = lohan_search(costs, Links(d2h=10.0, h2d=10.0), gpu_bytes=15, host_bytes=BIG)
    assert search.plan.layout == (SWAP_HOST, CHECKPOINT) and search.plan.seconds == 70.0 and search.plan.peak_bytes == 11


def test_the_recomputed_blocks_inputs_go_to_host_memory_where_no_set_fits_with_them_in_the_gpu_tier():
    """Four blocks of 10 bytes with inputs of 4, 0.1 s forward each, 10 B/s links. With inputs in
    the GPU tier no set peaks under 20 (two swapped blocks: one back, the next coming; with one
    swapped, three inputs and the swap leaving, 22). In 15 bytes LoHan's walk starts again with
    the inputs in host memory (its inter-block activations offloaded): all recomputed peaks at 14
    (a block's 10 and the input below coming back), forward max(0.4 s, 16 B out / 10) = 1.6 s,
    backward max(0.8 + 0.4 s, 16 B back / 10) = 1.6 s; swapping block 0 as well adds its 10 bytes
    each way (4.4 s), so the walk stops there. 13 bytes: refused, naming the 14."""
    from offload_strategy.planning.activations import CHECKPOINT_HOST

    costs = [BlockCost(10, 4, 0.1)] * 4
    links = Links(d2h=10.0, h2d=10.0)
    assert lohan_search(costs, links, gpu_bytes=21, host_bytes=BIG).plan.layout == (SWAP_HOST, SWAP_HOST, CHECKPOINT, CHECKPOINT)
    search = lohan_search(costs, links, gpu_bytes=15, host_bytes=BIG)
    assert search.plan.layout == (CHECKPOINT_HOST,) * 4 and search.plan.peak_bytes == 14
    assert search.plan.seconds == pytest.approx(3.2) and search.curve[0][1] == pytest.approx(4.4)
    with pytest.raises(ValueError, match="at least 14 bytes"):
        lohan_search(costs, links, gpu_bytes=13, host_bytes=BIG)
