"""TeraIO's lifetime-aware migration planning on small timelines worked out by hand."""

from __future__ import annotations

import pytest

from offload_strategy.planning.searches.migrations import HOST, SSD, TensorUses, plan_migrations

SECONDS = [1.0] * 6  # kernel k runs from k to k + 1
MEMORY = [5, 5, 15, 15, 12, 5]  # capacity 10: kernels 2, 3, 4 are over by 5, 5, 2


def test_best_ratio_first_and_io_aware_windows():
    tensors = [TensorUses("a", 3, (0, 5)), TensorUses("b", 3, (0, 5)), TensorUses("c", 8, (1, 5))]
    plan = plan_migrations(SECONDS, MEMORY, tensors, 10, ssd_write=30.0, ssd_read=30.0, host_bandwidth=0.0, host_limit=0)
    first, second = plan.migrations[:2]
    # a: out 1-1.1, back 4.9-5; away for kernels 2 and 3 (kernel 4 sees the prefetch): 3 + 3 over 0.2 s
    assert first.tensor == "a" and first.destination == SSD and first.kernels == (2, 3)
    assert first.offload == pytest.approx((1.0, 1.1)) and first.prefetch == pytest.approx((4.9, 5.0)) and first.urgent
    # b waits for the SSD: out 1.1-1.2, back 4.8-4.9; the pressure left at kernels 2 and 3 is 2 each
    assert second.tensor == "b" and second.offload == pytest.approx((1.1, 1.2)) and second.prefetch == pytest.approx((4.8, 4.9))
    # c leaves after kernel 1, so it cannot be away for all of kernel 2; nothing can cover kernel 4
    assert plan.memory == [5, 5, 9, 9, 12, 5] and plan.over_capacity == {4: 2}
    assert len(plan.migrations) == 2


def test_host_memory_when_the_ssd_cannot_take_the_moves_within_its_limit():
    tensors = [TensorUses("a", 3, (0, 5))]
    # an SSD of 1 B/s: out 1-4 and back 2-5 would overlap on its one channel
    slow = dict(ssd_write=1.0, ssd_read=1.0, host_bandwidth=30.0)
    plan = plan_migrations(SECONDS, MEMORY, tensors, 10, host_limit=3, **slow)
    assert [m.destination for m in plan.migrations] == [HOST] and plan.memory[2:4] == [12, 12]
    none = plan_migrations(SECONDS, MEMORY, tensors, 10, host_limit=2, **slow)
    assert none.migrations == [] and none.over_capacity == {2: 5, 3: 5, 4: 2}


def test_mismatched_timeline_is_refused():
    with pytest.raises(ValueError, match="6 kernel durations but 5 memory figures"):
        plan_migrations(SECONDS, MEMORY[:5], [], 10, ssd_write=1.0, ssd_read=1.0, host_bandwidth=1.0, host_limit=0)
