"""The auto policy's joint search (planning/auto.py) on cases worked out by hand, its budgets as a
property, and its speed on a 48-block model."""

from __future__ import annotations

import random
import time

import pytest
import torch

from offload_strategy.planning.activations import BlockCost, Links, layout_frontier
from offload_strategy.planning.auto import plan_auto
from offload_strategy.planning.cost_model import Machine, UnitCost
from offload_strategy.planning.placement import PlacementError, UnitSize

# Parameters as in the ProTrain search test: four frozen units of 512 bytes, one per module, a
# copy takes 1 s. All streamed (two buffers, 1024 bytes, at least) the step takes 13 s; with the
# first unit resident (1536 bytes) 12 s.
SIZES = [UnitSize(i, 512, 0) for i in range(4)]
CO_RESIDENT = [[0], [1], [2], [3]]
COSTS = {i: UnitCost(512, 1.0, 2.0) for i in range(4)}
MACHINE = Machine(h2d=512.0, d2h=512.0)
# Two blocks saving 1000 bytes each, 100 of input: kept, both hold 2000 bytes (6 s under LoHan's
# model: 2 s forward, 4 s backward); the first checkpointed, 1100 at most (its input and the kept
# block, then the recomputed block), and 1 s of recompute.
BLOCKS = [BlockCost(1000, 100, 1.0)] * 2
LINKS = Links(d2h=512.0, h2d=512.0)


def plan(gpu_bytes: int):
    return plan_auto(SIZES, CO_RESIDENT, [0, 1, 2, 3], COSTS, MACHINE, gpu_bytes=gpu_bytes, host_bytes=10**6, nvme_bytes=0, state_factor=2.0,
                     blocks=BLOCKS, links=LINKS, activation_host_bytes=10**6)


def test_the_front_of_layouts_for_two_blocks():
    front = layout_frontier(BLOCKS, LINKS, 10**6)
    assert [(p.layout, p.peak_bytes, p.seconds) for p in front] == [(("checkpoint", "keep"), 1100, 7.0), (("keep", "keep"), 2000, 6.0)]


def test_swaps_the_model_prices_as_free_are_not_chosen_over_keeping():
    """Three blocks over a link fast enough that swapping costs nothing in the model: S S K takes
    the same 9 s as K K K with a peak of 2000 bytes instead of 3000, so K K K was off the front and
    a GPU tier that held every block's activations (and every unit) swapped two of them: bytes
    moved for nothing. Ties on the front go to fewer blocks managed, as choose_layout breaks them."""
    fast, blocks = Links(d2h=1e12, h2d=1e12), [BlockCost(1000, 100, 1.0)] * 3
    front = layout_frontier(blocks, fast, 10**6)
    assert front[-1].layout == ("keep", "keep", "keep") and front[-1].seconds == pytest.approx(9.0) and front[-1].peak_bytes == 3000
    best = plan_auto(SIZES, CO_RESIDENT, [0, 1, 2, 3], COSTS, MACHINE, gpu_bytes=10**6, host_bytes=10**6, nvme_bytes=0, state_factor=2.0,
                     blocks=blocks, links=fast, activation_host_bytes=10**6)
    assert best.activations.layout == ("keep", "keep", "keep")


def test_room_for_both_keeps_the_blocks_and_a_resident_unit():
    best = plan(1536 + 2000)
    assert best.activations.layout == ("keep", "keep") and best.parameters.persistent >= 1 and best.seconds == pytest.approx(12)


def test_too_little_room_to_keep_both_checkpoints_one_and_still_keeps_a_unit_resident():
    # kept blocks would leave 636 bytes, less than two buffers; a checkpoint leaves 1536: 12 s + 1 s
    best = plan(1536 + 1100)
    assert best.activations.layout == ("checkpoint", "keep") and best.parameters.persistent == 1 and best.seconds == pytest.approx(13)


def test_equal_splits_cost_the_same():
    # kept blocks and every unit streamed (13 s), or a checkpoint and a resident unit (12 + 1 s)
    assert plan(1024 + 2000).seconds == pytest.approx(13)


def test_nothing_fits_says_what_would():
    with pytest.raises(PlacementError, match=r"the least is 2,124 bytes \(1,100 for the activations laid out C K"):
        plan(1024 + 1000)


def test_every_plan_stays_within_its_budgets():
    rng = random.Random(0)
    for _ in range(25):
        n = rng.randint(2, 6)
        sizes = [UnitSize(i, 512 * rng.randint(1, 3), 0) for i in range(n)]
        costs = {i: UnitCost(sizes[i].nbytes, rng.uniform(0.5, 2), rng.uniform(1, 4)) for i in range(n)}
        blocks = [BlockCost(rng.randint(200, 3000), rng.randint(10, 200), rng.uniform(0.2, 2)) for _ in range(rng.randint(1, 4))]
        gpu = rng.randint(2000, 12000)
        try:
            best = plan_auto(sizes, [[i] for i in range(n)], list(range(n)), costs, MACHINE, gpu_bytes=gpu, host_bytes=10**6, nvme_bytes=0,
                             state_factor=2.0, blocks=blocks, links=LINKS, activation_host_bytes=10**6)
        except PlacementError:
            continue
        assert best.parameters.placement.gpu_bytes + best.activations.peak_bytes <= gpu
        assert best.parameters.placement.host_bytes <= 10**6


def test_a_48_block_model_is_planned_within_a_second():
    from offload_strategy.demos import CausalLM
    from offload_strategy.hardware import known_hardware
    from offload_strategy.estimate.analytic import analytic_units
    from offload_strategy.runtime.units import build_units

    config = dict(vocab_size=50257, n_positions=1024, n_embd=1600, n_layer=48, n_head=25)  # GPT-2 XL's shapes
    module = CausalLM(family="gpt2", config=config)
    with torch.device("meta"):
        module.configure_model()
    units, users = build_units(module)
    hardware = known_hardware("rtx4090")
    analytic = analytic_units(units, users, 8 * 1024, hardware, dtype="fp16")
    sizes = [UnitSize(u.index, u.nbytes, c.trainable_bytes) for u, c in zip(units, analytic)]
    costs = {u.index: UnitCost(u.nbytes, c.forward_seconds, c.backward_seconds, gradient_bytes=u.nbytes, update_seconds=c.update_seconds)
             for u, c in zip(units, analytic)}
    blocks = [BlockCost(300 * 2**20, 25 * 2**20, 0.01)] * 48
    machine = Machine(h2d=25e9, d2h=25e9)
    times = []
    for _ in range(2):  # the lesser of two: the first also pays for lazy imports, and a loaded machine's stalls come and go
        start = time.process_time()  # its own CPU time: the suite's other worker shares the cores
        best = plan_auto(sizes, [[u.index for u in used] for used in users.values()], [u.index for u in units], costs, machine,
                         gpu_bytes=20 * 2**30, host_bytes=200 * 2**30, nvme_bytes=0, state_factor=2.0, blocks=blocks,
                         links=Links(d2h=25e9, h2d=25e9), activation_host_bytes=100 * 2**30)
        times.append(time.process_time() - start)
    assert min(times) < 1.0, f"{min(times):.2f} s of CPU time at the least of {times}"
    assert best.parameters.placement.gpu_bytes + best.activations.peak_bytes <= 20 * 2**30


def test_a_checkpointed_block_needs_its_units_resident_together():
    # blocks using units (0, 1) and (2, 3): recomputing one needs both of its units and a prefetch
    # buffer (1536 bytes), so a resident unit (512 more) no longer fits beside the checkpoint's
    # 1100: every unit streamed, 13 s, and 1 s of recompute
    best = plan_auto(SIZES, CO_RESIDENT, [0, 1, 2, 3], COSTS, MACHINE, gpu_bytes=1536 + 1100, host_bytes=10**6, nvme_bytes=0, state_factor=2.0,
                     blocks=BLOCKS, links=LINKS, activation_host_bytes=10**6, block_units=[[0, 1], [2, 3]])
    assert best.activations.layout == ("checkpoint", "keep") and best.parameters.persistent == 0 and best.seconds == pytest.approx(14)


def test_host_swaps_and_streamed_units_share_host_memory_within_its_budget():
    """A layout priced with host room for its swaps is not paired with a placement whose streamed
    units take that room. Hand-worked: three frozen units of 512 bytes (1 s forward, 2 s backward
    each), three blocks saving 2000 bytes, swaps nearly free, a 5100-byte GPU tier. Swapping two
    blocks (S S K, peak 4000) leaves 1100 bytes: every unit streamed through two buffers, their
    page-aligned homes 3 x 4096 = 12288 bytes of host memory, 10 s. With host memory 13312 the
    4000 swapped bytes do not fit beside those homes, so the search takes C C K (peak 2200, every
    unit resident, nothing in host memory, 11 s)."""
    sizes, costs = [UnitSize(i, 512, 0) for i in range(3)], {i: UnitCost(512, 1.0, 2.0) for i in range(3)}
    blocks, fast = [BlockCost(2000, 100, 1.0)] * 3, Links(d2h=1e6, h2d=1e6)

    def best(host: int):
        return plan_auto(sizes, [[0], [1], [2]], [0, 1, 2], costs, MACHINE, gpu_bytes=5100, host_bytes=host, nvme_bytes=0, state_factor=2.0,
                         blocks=blocks, links=fast, activation_host_bytes=10**6)

    roomy = best(10**6)
    assert roomy.activations.layout == ("swap_host", "swap_host", "keep") and roomy.parameters.placement.host_bytes == 12288
    assert roomy.seconds == pytest.approx(10.0)
    tight = best(12288 + 1024)
    assert tight.activations.layout == ("checkpoint", "checkpoint", "keep") and tight.parameters.persistent == 3
    assert tight.parameters.placement.host_bytes == 0 and tight.seconds == pytest.approx(11.0)


def test_a_search_short_of_host_memory_says_so_instead_of_asking_for_more_gpu_memory():
    # four frozen units of 512 bytes streamed need 16 KiB of page-aligned host homes; 3 KiB is short.
    # Beside both blocks checkpointed (a peak of 1,100 bytes) 1,536 bytes hold one unit resident and
    # two streaming buffers, not the units resident that would leave host memory nothing to hold
    with pytest.raises(PlacementError, match=r"^host_memory=2.98 KiB cannot hold the offloaded units' parameters") as refused:
        plan_auto(SIZES, CO_RESIDENT, [0, 1, 2, 3], COSTS, MACHINE, gpu_bytes=1536 + 1100, host_bytes=3048, nvme_bytes=0, state_factor=2.0,
                  blocks=BLOCKS, links=LINKS, activation_host_bytes=10**6)
    assert refused.value.tier == "host"


def test_a_search_short_of_host_memory_keeps_units_resident_where_the_gpu_tier_holds_them():
    """The same host memory with 2,436 bytes of the GPU tier beside both blocks checkpointed: all
    four units resident (2,048 bytes) leave nothing for host memory. The search refused it, as it
    stopped at the first count of resident units host memory could not hold (none)."""
    plan = plan_auto(SIZES, CO_RESIDENT, [0, 1, 2, 3], COSTS, MACHINE, gpu_bytes=1536 + 2000, host_bytes=3048, nvme_bytes=0, state_factor=2.0,
                     blocks=BLOCKS, links=LINKS, activation_host_bytes=10**6)
    assert plan.parameters.persistent == 4 and plan.parameters.placement.host_bytes == 0
    assert plan.parameters.placement.gpu_bytes + plan.activations.peak_bytes <= 1536 + 2000


def test_a_layout_adds_its_recomputes_and_the_link_time_its_swaps_share_with_the_parameters():
    """Worked by hand: the parameters' step has forward 1 s, backward 2 s and copies 25 bytes in,
    10 of them the streamed units' forward copies, so 15 are backward's refetches; links carry 10
    bytes/s. Three blocks of 5 activation bytes and 0.5 s forward each."""
    from offload_strategy.planning.activations import CHECKPOINT, KEEP, SWAP_HOST
    from offload_strategy.planning.auto import layout_added_seconds
    from offload_strategy.planning.cost_model import StepPrediction

    def parameters(h2d_bytes: int) -> StepPrediction:
        return StepPrediction(seconds=3.0, forward_seconds=1.0, backward_seconds=2.0, compute_seconds=3.0, update_tail_seconds=0.0, h2d_bytes=h2d_bytes)

    blocks = [BlockCost(activation_bytes=5, input_bytes=1, forward_seconds=0.5)] * 3
    links = Links(h2d=10, d2h=10)
    # S C K: forward max(1, 5/10) = 1; backward max(2 + 0.5 recompute, (15 + 5)/10) = 2.5
    assert layout_added_seconds(parameters(25), 10, blocks, [SWAP_HOST, CHECKPOINT, KEEP], links) == pytest.approx(0.5)
    # 30 bytes refetched: backward is the link's, (30 + 5)/10 = 3.5, not the 2.5 of compute
    assert layout_added_seconds(parameters(40), 10, blocks, [SWAP_HOST, CHECKPOINT, KEEP], links) == pytest.approx(1.5)
    # S S K over a 2 bytes/s link out: forward max(1, 10/2) = 5; backward max(2, (15 + 10)/10) = 2.5
    assert layout_added_seconds(parameters(25), 10, blocks, [SWAP_HOST, SWAP_HOST, KEEP], Links(h2d=10, d2h=2)) == pytest.approx(4.0 + 0.5)
    # keeping every block adds nothing, whatever the parameters copy
    assert layout_added_seconds(parameters(40), 10, blocks, [KEEP] * 3, links) == 0.0


def test_nvme_swaps_and_nvme_units_share_the_nvme_budget():
    """As host swaps share host memory with streamed units, swaps to NVMe share the NVMe budget
    with the units' files. The units of the host-memory test above; no host room for
    swaps, so swapped blocks go to NVMe. With a roomy NVMe the search swaps two blocks there
    (S S K, 4000 bytes); with 3000 bytes of NVMe it cannot, and checkpoints them (C C K)."""
    sizes, costs = [UnitSize(i, 512, 0) for i in range(3)], {i: UnitCost(512, 1.0, 2.0) for i in range(3)}
    blocks, fast = [BlockCost(2000, 100, 1.0)] * 3, Links(d2h=1e6, h2d=1e6, nvme_read=1e6, nvme_write=1e6)

    def best(nvme: int):
        return plan_auto(sizes, [[0], [1], [2]], [0, 1, 2], costs, MACHINE, gpu_bytes=5100, host_bytes=10**6, nvme_bytes=nvme, state_factor=2.0,
                         blocks=blocks, links=fast, activation_host_bytes=0)

    roomy = best(10**6)
    assert roomy.activations.layout == ("swap_nvme", "swap_nvme", "keep")
    tight = best(3000)
    assert "swap_nvme" not in tight.activations.layout and tight.activations.layout == ("checkpoint", "checkpoint", "keep")


def test_the_search_keeps_nvme_units_gradients_only_as_long_as_the_runtime_does():
    """Six trainable units of 4 KiB on NVMe. Updated as their gradients complete, the runtime passes
    those gradients through four host buffers (48 KiB of host memory with the staging buffers,
    ``place_units``); the search reserved a gradient home for every unit instead and refused 48 KiB."""
    sizes = [UnitSize(i, 4096, 4096) for i in range(6)]
    costs = {i: UnitCost(4096, 1.0, 2.0) for i in range(6)}

    def search(until_update: bool):
        return plan_auto(sizes, [[i] for i in range(6)], list(range(6)), costs, MACHINE, gpu_bytes=3 * 4096, host_bytes=48 * 1024,
                         nvme_bytes=10**7, state_factor=2.0, gradients_until_update=until_update)

    with pytest.raises(PlacementError, match="cannot hold the gradients"):
        search(until_update=False)
    found = search(until_update=True)
    assert set(found.parameters.placement.home.values()) == {"nvme"} and found.parameters.placement.gradient_slots


def test_swaps_a_placement_leaves_no_host_room_for_go_to_nvme_instead_of_being_dropped():
    """The units and blocks of the host-memory test above, with a fast NVMe link and room on it.
    The caller's host room for swaps (1 MB) is more than the 1024 bytes the streamed units' homes
    leave of 13312, so S S K, split for host memory, was dropped, and the search settled for C C K
    (11 s); a layout whose every swap went that way raised "gpu_memory cannot hold the activations"
    with a least GPU tier below the budget (a 13B model at batch 32 on an RTX 4090, once the GPU's
    peak was set). The layouts are now split again for the room left: S S K with both swaps on
    NVMe, 10 s."""
    sizes, costs = [UnitSize(i, 512, 0) for i in range(3)], {i: UnitCost(512, 1.0, 2.0) for i in range(3)}
    blocks, fast = [BlockCost(2000, 100, 1.0)] * 3, Links(d2h=1e6, h2d=1e6, nvme_read=1e6, nvme_write=1e6)
    best = plan_auto(sizes, [[0], [1], [2]], [0, 1, 2], costs, MACHINE, gpu_bytes=5100, host_bytes=12288 + 1024, nvme_bytes=10**6,
                     state_factor=2.0, blocks=blocks, links=fast, activation_host_bytes=10**6)
    assert best.activations.layout == ("swap_nvme", "swap_nvme", "keep") and best.parameters.placement.host_bytes == 12288
    assert best.seconds == pytest.approx(10.0)
