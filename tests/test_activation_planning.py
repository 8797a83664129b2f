"""The activation planner on small cases worked out by hand."""

from __future__ import annotations

import pytest

from offload_strategy.planning.activations import (
    CHECKPOINT,
    CHECKPOINT_HOST,
    KEEP,
    SWAP_HOST,
    SWAP_NVME,
    BesideBlocks,
    BlockCost,
    Links,
    choose_layout,
    interleaved_layout,
    peak_bytes,
    split_swaps,
    step_seconds,
)

S, C, K, N, H = SWAP_HOST, CHECKPOINT, KEEP, SWAP_NVME, CHECKPOINT_HOST


def test_interleaved_layout_is_protrain_figure_2():
    # ProTrain Fig. 2: 8 blocks, blocks 1 and 4 swapped, 2 3 5 6 checkpointed, 7 8 kept
    assert interleaved_layout(8, 2, 4) == [S, C, C, S, C, C, K, K]
    assert interleaved_layout(5, 2, 3) == [S, C, C, S, C]  # the remainder goes to the earlier group
    assert interleaved_layout(4, 0, 2) == [C, C, K, K]
    assert interleaved_layout(3, 3, 0) == [S, S, S]
    with pytest.raises(ValueError, match="do not fit in 4 blocks"):
        interleaved_layout(4, 3, 2)


def test_host_takes_swaps_in_forward_order_the_rest_go_to_nvme():
    costs = [BlockCost(10, 1, 1.0)] * 3
    assert split_swaps(costs, [S, S, K], host_bytes=15) == [S, N, K]
    assert split_swaps(costs, [S, S, S], host_bytes=20) == [S, S, N]


def test_peak_and_step_time_by_hand():
    costs = [BlockCost(activation_bytes=100, input_bytes=10, forward_seconds=1.0)] * 4
    # end of forward: 0 + 10 + 100 + 100 held, plus the swapped block's 100 still leaving
    assert peak_bytes(costs, [S, C, K, K]) == 310
    assert peak_bytes(costs, [K] * 4) == 400
    # backward at the top block: 30 below it + 100 recomputed
    assert peak_bytes(costs, [C] * 4) == 130
    # backward at block 1: block 1 back (100) and block 0 prefetched behind it (100)
    assert peak_bytes(costs, [S, S, K, K]) == 200 + 100  # end of forward: 200 kept + 100 leaving
    # end of forward 20 + 100 leaving; backward at block 1: 100 back + 100 prefetched
    assert peak_bytes(costs, [S, S, C, C]) == 200
    links = Links(d2h=100.0, h2d=100.0)
    # forward max(4 s compute, 100 B / 100 B/s); backward max(2*4 + 1 s recompute, 1 s swap-in)
    assert step_seconds(costs, [S, C, K, K], links) == pytest.approx(4 + 9)
    slow = Links(d2h=10.0, h2d=10.0, parameter_backward_seconds=5.0)
    # the swap takes 10 s each way; in backward it queues behind 5 s of parameter copies
    assert step_seconds(costs, [S, C, K, K], slow) == pytest.approx(10 + 15)
    assert step_seconds(costs, [N, K, K, K], Links(d2h=100.0, h2d=100.0)) == float("inf")  # no SSD link
    assert step_seconds(costs, [N, K, K, K], Links(100.0, 100.0, nvme_write=20.0, nvme_read=50.0)) == pytest.approx(5 + 8)


def test_blocks_recomputed_from_inputs_in_host_memory_by_hand():
    """``checkpoint_host``: a checkpoint whose input waits in host memory. The GPU tier holds no
    input between forward and backward; a block's backward holds its recomputed activations and
    the next such block's input coming back; the inputs cross the link both ways and take host
    memory before the swaps that follow them."""
    costs = [BlockCost(activation_bytes=100, input_bytes=10, forward_seconds=1.0)] * 4
    # end of forward: nothing held but the last input still leaving (10); backward at a block:
    # its 100 recomputed and the input below coming back (10)
    assert peak_bytes(costs, [H] * 4) == 110
    assert peak_bytes(costs, [C] * 4) == 130  # the inputs in the GPU tier: 30 below the top block's 100
    # end of forward: the two kept blocks' 200 and an input leaving; a kept block prefetches nothing
    assert peak_bytes(costs, [H, H, K, K]) == 210
    # forward max(4 s compute, 40 B out at 10 B/s); backward max(8 s + 4 s recomputing, 40 B back)
    assert step_seconds(costs, [H] * 4, Links(d2h=10.0, h2d=10.0)) == pytest.approx(4 + 12)
    assert step_seconds(costs, [H] * 4, Links(d2h=2.0, h2d=2.0)) == pytest.approx(20 + 20)  # the copies take longer
    inputs = [BlockCost(10, 6, 1.0)] * 3
    assert split_swaps(inputs, [H, S, S], host_bytes=15) == [H, N, N]  # 6 for the input, 10 more does not fit
    assert split_swaps(inputs, [H, S, S], host_bytes=16) == [H, S, N]


def test_lohans_iteration_time_with_the_model_states_on_the_ssd():
    """LoHan Eq. 2 and 5 for 10 parameters (20 bytes at 16 bits) whose states live on an SSD that
    reads 10 B/s and writes 5 B/s, over a 20 B/s link each way. Forward: copies 20 B in (1 s), the
    SSD reads them (2 s) and, simplex, also writes the blocks swapped to it; backward: 20 B in again,
    20 B of gradients out (1 s each), the SSD reads 140 B (14 s) and writes 140 B (28 s) of states."""
    links = Links.lohan(Links(h2d=20.0, d2h=20.0, nvme_read=10.0, nvme_write=5.0), parameters=10)
    assert (links.parameter_forward_seconds, links.gradient_backward_seconds) == (1.0, 1.0)
    assert (links.nvme_forward_seconds, links.nvme_backward_seconds) == (2.0, 42.0)
    costs = [BlockCost(activation_bytes=10, input_bytes=1, forward_seconds=1.0)] * 4
    # nothing swapped: forward max(4 s compute, 1, 2) = 4; backward max(8 + 4 s recompute, 1, 1, 42) = 42
    assert step_seconds(costs, [C] * 4, links) == pytest.approx(4 + 42)
    # one block to the SSD: forward max(4, 0.5 out, 1, 2 + 10 B / 5 B/s) = 4; backward max(8 + 3, 1, 1 + 0.5, 42 + 1) = 43
    assert step_seconds(costs, [N, C, C, C], links) == pytest.approx(4 + 43)
    # without an SSD the states stay in host memory: the link terms alone
    host_only = Links.lohan(Links(h2d=20.0, d2h=20.0), parameters=10)
    assert (host_only.nvme_forward_seconds, host_only.nvme_backward_seconds) == (0.0, 0.0)
    assert step_seconds(costs, [C] * 4, host_only) == pytest.approx(4 + 12)


def test_what_the_head_holds_counts_at_the_end_of_forward_alone():
    """The loss's log-softmax and its two gradients are held at the head's backward, right after
    the forward, and freed before any block's backward: counted at that moment only."""
    costs = [BlockCost(activation_bytes=100, input_bytes=10, forward_seconds=1.0)] * 4
    # every block recomputed: the end of forward holds 40, block 3's backward 30 + 100
    assert peak_bytes(costs, [C] * 4) == 130
    assert peak_bytes(costs, [C] * 4, head=90) == 130  # 40 + 90 at the head's backward
    assert peak_bytes(costs, [C] * 4, head=100) == 140
    # 300 outside the blocks (250 of it after them), 400 of gradients at the head's, 100 at a block's
    beside = BesideBlocks(outside=300, gradients=400, after=250, block_gradients=100)
    assert (beside.bytes, beside.in_blocks, beside.head) == (700, 150, 550)
    # planned beside the blocks: at the head 40 + 700, at block 3's backward 130 + 150
    assert peak_bytes(costs, [C] * 4, beside.head) + beside.in_blocks == 740
    # not measured apart: all of it at every moment, as before the split
    assert (BesideBlocks(300, 400).in_blocks, BesideBlocks(300, 400).head) == (700, 0)
    assert BesideBlocks(300, 400, 250, 100).scaled(2.0) == BesideBlocks(600, 800, 500, 200)
    assert BesideBlocks(300, 400, 250, 100).largest(BesideBlocks(310, 300)) == BesideBlocks(310, 400, 250, 300)


def test_a_layout_that_fits_only_once_the_head_s_bytes_leave_before_the_blocks_backward():
    """A tier of 800 with 700 beside the blocks: planned at every moment, 100 were left for the
    blocks and nothing fit (the least peak, every block recomputed, is 130). Counted where they
    are held, the blocks have 650 beside the 150 at their backward, of which the head's 550 take
    all but 100 at the end of forward: every block recomputed (end of forward 40 + 550 + 150 =
    740, block 3's backward 130 + 150); one block kept would hold 680 + 150 there."""
    costs = [BlockCost(100, 10, 1.0)] * 4
    beside = BesideBlocks(outside=300, gradients=400, after=250, block_gradients=100)
    with pytest.raises(ValueError, match=r"the smallest peak is 130 bytes"):
        choose_layout(costs, Links(50.0, 50.0), gpu_bytes=800 - beside.bytes, host_bytes=0)
    plan = choose_layout(costs, Links(50.0, 50.0), gpu_bytes=800 - beside.in_blocks, host_bytes=0, head=beside.head)
    assert plan.layout == (C, C, C, C) and plan.peak_bytes + beside.in_blocks == 740


def test_slow_link_checkpoints_fast_link_swaps():
    costs = [BlockCost(100, 10, 1.0)] * 3
    # Budget 250: keep-all (300) does not fit. Slow link (a block's swap takes 2 s each way):
    # C K K takes 3 + (6 + 1) s, as do S C K (3 + 7) and S S K (4 + 6); fewest managed blocks wins.
    slow = choose_layout(costs, Links(d2h=50.0, h2d=50.0), gpu_bytes=250, host_bytes=10**6)
    assert slow.layout == (C, K, K) and slow.seconds == pytest.approx(10) and slow.peak_bytes == 210
    # fast link (0.5 s per block): S S K hides both swaps behind compute, 3 + 6 s (S S S ties, more blocks)
    fast = choose_layout(costs, Links(d2h=200.0, h2d=200.0), gpu_bytes=250, host_bytes=10**6)
    assert fast.layout == (S, S, K) and fast.seconds == pytest.approx(9) and fast.peak_bytes == 200
    # nothing to manage when everything fits
    assert choose_layout(costs, Links(50.0, 50.0), gpu_bytes=300, host_bytes=0).layout == (K, K, K)


def test_swaps_beyond_host_memory_go_to_nvme_or_are_not_chosen():
    costs = [BlockCost(100, 10, 1.0)] * 3
    links = Links(d2h=200.0, h2d=200.0, nvme_write=1000.0, nvme_read=1000.0)
    plan = choose_layout(costs, links, gpu_bytes=250, host_bytes=150)
    assert plan.layout == (S, N, K)
    without_ssd = choose_layout(costs, Links(d2h=200.0, h2d=200.0), gpu_bytes=250, host_bytes=150)
    assert without_ssd.layout == (C, K, K)


def test_no_layout_fits_names_the_smallest_peak():
    costs = [BlockCost(100, 10, 1.0)] * 3
    # every block recomputed, the inputs in host memory: a block's 100 and the next input 10
    with pytest.raises(ValueError, match=r"the smallest peak is 110 bytes"):
        choose_layout(costs, Links(50.0, 50.0), gpu_bytes=100, host_bytes=10**6)
    # host memory holds one input only: two recomputed blocks keep theirs, 20 below the top block's 100
    with pytest.raises(ValueError, match=r"the smallest peak is 120 bytes"):
        choose_layout(costs, Links(50.0, 50.0), gpu_bytes=100, host_bytes=15)


def test_the_checkpoints_inputs_go_to_host_memory_only_where_nothing_fits_with_them_in_the_gpu_tier():
    """Three blocks of 100 bytes with inputs of 10, 1 s forward each, links of 50 B/s, host
    memory for everything. In 120 bytes the fastest layout recomputes two blocks with their
    inputs in the GPU tier (C C K: 3 + 6 + 2 = 11 s, peak 20 + 100); in 115, where no layout
    with the inputs in the GPU tier fits, the same with them in host memory (H H K: 0.4 s of
    copies each way, hidden: 11 s; peak 110, a block's 100 with the input below coming back).
    The frontier the joint search walks has the latter below the smallest peak of the former."""
    from offload_strategy.planning.activations import layout_frontier

    costs = [BlockCost(100, 10, 1.0)] * 3
    links = Links(50.0, 50.0)
    plan = choose_layout(costs, links, gpu_bytes=120, host_bytes=10**6)
    assert plan.layout == (C, C, K) and plan.peak_bytes == 120 and plan.seconds == pytest.approx(11.0)
    plan = choose_layout(costs, links, gpu_bytes=115, host_bytes=10**6)
    assert plan.layout == (H, H, K) and plan.peak_bytes == 110 and plan.seconds == pytest.approx(11.0)
    front = layout_frontier(costs, links, host_bytes=10**6)
    assert front[0].layout == (H, H, K) and all(H not in p.layout for p in front[1:]) and front[1].peak_bytes == 120, front


def test_teraio_offloads_the_fewest_blocks_that_bring_every_kernel_under_capacity():
    from offload_strategy.planning.activations import teraio_layout

    # four blocks of 1000 bytes: forward kernels hold 1000 ... 4000, backward 4000 ... 1000. With
    # 3000 bytes, one block's worth stays reserved for the copy in flight, so TeraIO plans for 2000:
    # the kernels around the turn are 2000 over, which takes the first two blocks out for their
    # gaps (the last block's two uses are adjacent: it never leaves): S S K K, peak 2000 held + 1000
    # on its way out
    costs = [BlockCost(1000, 100, 1.0)] * 4
    with_ssd = teraio_layout(costs, Links(d2h=1e6, h2d=1e6, nvme_write=1e6, nvme_read=1e6), gpu_bytes=3000, host_bytes=10**6)
    assert with_ssd.layout == ("swap_nvme", "swap_nvme", "keep", "keep") and with_ssd.peak_bytes == 3000  # the SSD first
    host_only = teraio_layout(costs, Links(d2h=1e6, h2d=1e6), gpu_bytes=3000, host_bytes=10**6)
    assert host_only.layout == ("swap_host", "swap_host", "keep", "keep")
    # room for everything: nothing moves
    assert teraio_layout(costs, Links(d2h=1e6, h2d=1e6), gpu_bytes=4000, host_bytes=10**6).layout == ("keep",) * 4
    # TeraIO never recomputes: below what offloading alone reaches, it says so
    with pytest.raises(ValueError, match="TeraIO's offloads leave"):
        teraio_layout(costs, Links(d2h=1e6, h2d=1e6), gpu_bytes=1500, host_bytes=10**6)


def test_the_searches_one_pass_pricing_gives_the_three_functions_numbers_to_the_bit():
    """The layout searches price each layout in one pass over the blocks (``_Pricer``): the swaps
    split, the peak and the step seconds equal ``split_swaps``, ``peak_bytes`` and
    ``step_seconds`` exactly, over random blocks, links and host room; a layout whose swaps need
    NVMe with no link to it is dropped, as the search drops it."""
    import random

    from offload_strategy.planning.activations import _Pricer

    rng = random.Random(1)
    dropped = 0
    for _ in range(600):
        n = rng.randint(1, 12)
        costs = [BlockCost(rng.randint(0, 1000), rng.randint(0, 300), rng.random()) for _ in range(n)]
        links = Links(h2d=rng.choice([0.0, 10.0, 1e3]), d2h=rng.choice([0.0, 10.0, 1e3]), nvme_read=rng.choice([0.0, 5.0]),
                      nvme_write=rng.choice([0.0, 5.0]), parameter_forward_seconds=rng.random(), parameter_backward_seconds=rng.random(),
                      gradient_backward_seconds=rng.random(), nvme_forward_seconds=rng.random(), nvme_backward_seconds=rng.random())
        host = rng.choice([0, 500, 3000, 10**9])
        n_swap = rng.randint(0, n)
        interleaved = interleaved_layout(n, n_swap, rng.randint(0, n - n_swap))
        if rng.random() < 0.5:  # the checkpoints' inputs in host memory
            interleaved = [H if p == C else p for p in interleaved]
        split = split_swaps(costs, interleaved, host)
        head = rng.choice([0, rng.randint(0, 3000)])  # what the head's backward holds beyond the blocks' moments
        priced = _Pricer(costs, links, host, head)(interleaved)
        if N in split and links.nvme_write <= 0:
            assert priced is None
            dropped += 1
            continue
        assert priced == (split, peak_bytes(costs, split, head), step_seconds(costs, split, links))
    assert dropped > 0
