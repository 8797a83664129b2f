import itertools
import random

import pytest

from offload_strategy.planning.searches.access_modes import gradient_offload_plan


def brute_force(sizes, dha, gpu, reserve):
    capacity = reserve * sum(sizes)
    best_gain = 0.0
    for r in range(len(sizes) + 1):
        for kept in itertools.combinations(range(len(sizes)), r):
            if sum(sizes[i] for i in kept) <= capacity + 1e-9:
                best_gain = max(best_gain, sum(dha[i] - gpu[i] for i in kept))
    return best_gain


def gain(plan, dha, gpu):
    return sum(dha[i] - gpu[i] for i in plan)


def test_hand_worked_case():
    # sizes 4, 3, 2, 1 (total 10), reserve 0.5: at most 5 units of space stay in the GPU tier.
    # gains 4, 5, 3, 1: {0} 4, {1} 5, {1, 2} 8 (space 5), {0, 3} 5, {2, 3} 4, {0, 1} too big.
    plan = gradient_offload_plan([4, 3, 2, 1], [5.0, 6.0, 4.0, 2.0], [1.0, 1.0, 1.0, 1.0], 0.5)
    assert plan == {1, 2}


def test_extremes():
    assert gradient_offload_plan([4, 3], [2.0, 2.0], [1.0, 1.0], 0.0) == frozenset()
    assert gradient_offload_plan([4, 3], [2.0, 2.0], [1.0, 1.0], 1.0) == {0, 1}
    assert gradient_offload_plan([4, 3], [1.0, 2.0], [1.0, 1.0], 1.0) == {1}  # no gain: leave it to the host
    with pytest.raises(ValueError, match="must lie in"):
        gradient_offload_plan([1], [1.0], [1.0], 1.5)


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_on_random_instances(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    sizes = [rng.randint(1, 60) for _ in range(n)]
    gpu = [rng.uniform(0.1, 2.0) for _ in range(n)]
    dha = [g + rng.uniform(-0.5, 3.0) for g in gpu]
    reserve = rng.choice([0.1, 0.25, 0.5, 0.75, 0.9])
    plan = gradient_offload_plan(sizes, dha, gpu, reserve)
    assert sum(sizes[i] for i in plan) <= reserve * sum(sizes) + 1e-9
    assert gain(plan, dha, gpu) == pytest.approx(brute_force(sizes, dha, gpu, reserve))


def test_large_sizes_stay_within_the_reserve():
    rng = random.Random(0)
    sizes = [rng.randint(1, 1 << 30) for _ in range(200)]
    plan = gradient_offload_plan(sizes, [s * 1e-9 for s in sizes], [0.0] * 200, 0.3)
    kept = sum(sizes[i] for i in plan)
    assert kept <= 0.3 * sum(sizes) and kept >= 0.29 * sum(sizes)


def test_forward_modes_by_hand():
    from offload_strategy.planning.searches.access_modes import DHA, GFGB, forward_modes

    # unit 0: DHA (3 s) beats copy + GPU (4 + 1 s); its 3 s hide unit 1's 2 s copy
    modes, total = forward_modes([4.0, 2.0], [1.0, 1.0], [3.0, 5.0])
    assert modes == [DHA, GFGB] and total == pytest.approx(4.0)
    # backtracking (Fig. 7): unit 2's 4 s copy cannot hide behind 1.5 s of reserve; turning unit 1
    # to DHA gives its 0.5 s copy back and 3 s of DHA compute: 6 s instead of 6.5 s. By hand:
    # GFGB copy 0-1, compute 1-2; unit 1 DHA 2-5 while unit 2 copies 1-5; unit 2 computes 5-6.
    modes, total = forward_modes([1.0, 0.5, 4.0], [1.0, 1.0, 1.0], [2.5, 3.0, 6.0])
    assert modes == [GFGB, DHA, GFGB] and total == pytest.approx(6.0)
    # compute between units adds to both the time and the reserve
    modes, total = forward_modes([2.0, 2.0], [1.0, 1.0], [9.0, 9.0], between_seconds=[2.0, 0.0])
    # unit 0 waits for its copy (0-2, compute 2-3), 2 s between; unit 1's copy ran 2-4: hidden (reserve 3 > 2)
    assert modes == [GFGB, GFGB] and total == pytest.approx(6.0)
    with pytest.raises(ValueError, match="one entry per unit"):
        forward_modes([1.0], [1.0, 2.0], [1.0])


def test_backward_modes_fill_the_idle_window_by_seconds_saved_per_byte():
    from offload_strategy.planning.searches.access_modes import DFGB, DHA, GFGB, backward_modes

    modes = [DHA, DHA, GFGB, DHA, DHA]
    nbytes = [100, 200, 100, 100, 50]
    transfer = [1.0, 2.0, 1.0, 1.0, 0.5]
    gpu_bp = [1.0, 1.0, 1.0, 1.0, 1.0]
    dha_bp = [3.0, 5.0, 4.0, 2.0, 1.0]
    # saved per byte: unit 0 0.02, unit 1 0.02, unit 3 0.01; unit 4 saves nothing; unit 2 is not DHA.
    # Ties go to the later unit: 1 (2 s of copy), then 0 (1 s) fill a 3.5 s window; 3 does not fit.
    assert backward_modes(modes, nbytes, transfer, gpu_bp, dha_bp, idle_seconds=3.5, gpu_bytes_free=10**6) == [DFGB, DFGB, GFGB, DHA, DHA]
    # 250 bytes of GPU memory: unit 1 (200) fits, unit 0 (100) no longer does, unit 3 (100) neither
    assert backward_modes(modes, nbytes, transfer, gpu_bp, dha_bp, idle_seconds=10.0, gpu_bytes_free=250) == [DHA, DFGB, GFGB, DHA, DHA]
    # a 1.5 s window: unit 1 does not fit and is skipped; unit 0 does
    assert backward_modes(modes, nbytes, transfer, gpu_bp, dha_bp, idle_seconds=1.5, gpu_bytes_free=10**6) == [DFGB, DHA, GFGB, DHA, DHA]
