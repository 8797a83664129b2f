"""Gradients of NVMe units live only from their first gradient to their update (LoHan §IV-C):
host memory holds the units in flight, not the model's gradients, and training is unchanged."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch import nn

from offload_strategy.planning.placement import GRADIENT_BUFFERS, NVME, PlacementError, UnitSize, place_units
from offload_strategy.runtime.grads.buffers import GradientBuffers, gradient_bytes
from offload_strategy.runtime.grads.path import GradientRecord
from offload_strategy.runtime.state import UnitState
from offload_strategy.runtime.units import TransferUnit
from tests.test_recipes import Net, assert_like_plain

MiB = 2**20


def test_the_host_budget_holds_four_gradient_buffers_instead_of_every_gradient():
    # 16 units of 1 MiB, all trainable, AdamW (2 state bytes per byte): a staging buffer holds the
    # 2 MiB of a unit's states. Every gradient at home: 16 MiB + 4 staging buffers = 24 MiB.
    # Gradients until the update: 4 gradient buffers of 1 MiB + the staging = 12 MiB.
    units = [UnitSize(i, MiB, MiB) for i in range(16)]
    groups = [[i] for i in range(16)]
    budget = dict(gpu_bytes=2 * MiB + 4096, host_bytes=13 * MiB, nvme_bytes=1024 * MiB, state_factor=2.0)
    with pytest.raises(PlacementError, match=r"cannot hold the gradients of the offloaded units plus 4 NVMe staging buffers \(24.00 MiB\)"):
        place_units(units, groups, **budget)
    placement = place_units(units, groups, **budget, gradients_until_update=True)
    assert all(h == NVME for h in placement.home.values())  # a unit at home in host memory would cost 4 MiB more
    assert placement.gradient_slots == {MiB: GRADIENT_BUFFERS}
    assert placement.host_bytes == 12 * MiB
    with pytest.raises(PlacementError, match=r"cannot hold 4 gradient buffers plus 4 NVMe staging buffers \(12.00 MiB\)"):
        place_units(units, groups, **{**budget, "host_bytes": 11 * MiB}, gradients_until_update=True)


def unit_state(index: int) -> UnitState:
    unit = TransferUnit(index, f"u{index}", [nn.Parameter(torch.zeros(1024))], [f"u{index}.w"])
    s = UnitState(unit=unit, home=NVME, master_dtypes=[torch.float32], transient_gradients=True)
    s.grads = [GradientRecord()]
    return s


def test_backward_waits_for_the_worker_when_every_buffer_is_taken_and_never_when_none_will_come_back():
    states = [unit_state(i) for i in range(4)]
    buffers = GradientBuffers([torch.empty(gradient_bytes(states[0]), dtype=torch.uint8) for _ in range(2)])
    first, second = buffers.acquire(states[0]), buffers.acquire(states[1])
    assert first.data_ptr() != second.data_ptr()
    # nothing submitted holds a buffer: a buffer of its own, rather than waiting forever
    buffers.acquire(states[2])
    assert buffers.extra == 1
    buffers.release(states[2])
    buffers.submitted_for_update(states[0])
    released = []

    def worker() -> None:
        time.sleep(0.2)
        released.append(time.perf_counter())
        buffers.release(states[0])  # the update is done

    thread = threading.Thread(target=worker)
    thread.start()
    buffers.acquire(states[3])  # waits for the worker's release
    acquired = time.perf_counter()
    thread.join()
    assert released and acquired >= released[0] and buffers.extra == 1
    assert not buffers.holds(states[0]) and buffers.holds(states[3])


class Watch:
    """The engine's gradient buffers after every step."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, int, int]] = []

    def __call__(self):
        import lightning as L

        watch = self

        class Callback(L.Callback):
            def on_train_batch_end(self, trainer, *args) -> None:
                engine = getattr(trainer.strategy, "engine", None)
                if engine is not None:
                    b = engine.gradients.buffers
                    transient = sum(s.transient_gradients for s in engine.states)
                    watch.seen.append((len(engine.memory.gradient_slots), b.extra, b.most_held, transient))

        return (Callback(),)


def test_nvme_units_train_like_plain_with_their_gradients_only_in_flight(tmp_path):
    watch = Watch()
    assert_like_plain(tmp_path, "nvme", Net, callbacks=watch)
    slots, extra, most, transient = watch.seen[-1]
    assert slots == GRADIENT_BUFFERS and transient == 7  # every unit: embedding, 4 blocks, norm, head
    assert extra == 0 and 1 <= most <= GRADIENT_BUFFERS


class WatchSpills(Watch):
    """Also the gradients written to NVMe to wait for their update, after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.spilled_bytes: list[int] = []

    def __call__(self):
        (callback,) = super().__call__()
        watch, end = self, callback.on_train_batch_end

        def on_train_batch_end(trainer, *args) -> None:
            end(trainer, *args)
            engine = getattr(trainer.strategy, "engine", None)
            if engine is None:
                return
            store = engine.store
            keys = [engine.ctx.gradient_key(s) for s in engine.states]
            watch.spilled_bytes.append(sum(store._entries[k].length for k in keys if k in store._entries))

        callback.on_train_batch_end = on_train_batch_end
        return (callback,)


@pytest.mark.parametrize("recipe", [{"gradient_clip_val": 0.5}, {"accumulate_grad_batches": 2}, {"gradient_clip_val": 0.05, "accumulate_grad_batches": 3}])
def test_gradients_that_must_wait_for_the_step_wait_on_nvme_not_in_host_memory(tmp_path, recipe):
    """Clipping by norm needs every gradient before any update, accumulation more micro-batches:
    NVMe units' gradients pass through the four buffers on to NVMe, where they wait (and come
    back to be added to, or for the update); the norm is taken on the way. Bit for bit as plain."""
    watch = WatchSpills()
    assert_like_plain(tmp_path, "nvme", Net, callbacks=watch, **recipe)
    slots, extra, most, transient = watch.seen[-1]
    assert slots == GRADIENT_BUFFERS and transient == 7 and extra == 0 and most <= GRADIENT_BUFFERS
    assert max(watch.spilled_bytes) > 0  # every trainable unit's gradients went to NVMe at some step


def test_clipping_by_norm_that_clips_matches_plain_on_host_and_nvme(tmp_path):
    """A threshold far below the gradients' norm: every step multiplies every gradient, in
    memory or waiting on NVMe, by the same coefficient as torch's clip_grad_norm_."""
    for placement in ("host", "nvme"):
        assert_like_plain(tmp_path / placement, placement, Net, gradient_clip_val=1e-3)


def test_a_hook_before_the_step_keeps_every_gradient_at_home(tmp_path):
    """User code that reads the gradients before the step needs all of them in memory."""

    class Hooked(Net):
        def on_before_optimizer_step(self, optimizer) -> None:
            self.seen_norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None])

    watch = Watch()
    assert_like_plain(tmp_path, "nvme", Hooked, callbacks=watch, gradient_clip_val=0.5)
    slots, extra, _, transient = watch.seen[-1]
    assert slots == 0 and transient == 0 and extra == 0


def test_a_failed_worker_never_leaves_backward_waiting_for_a_buffer():
    states = [unit_state(i) for i in range(2)]
    buffers = GradientBuffers([torch.empty(gradient_bytes(states[0]), dtype=torch.uint8)])
    buffers.acquire(states[0])
    buffers.submitted_for_update(states[0])  # its update will be skipped: the worker failed
    buffers.worker_failed = lambda: True
    buffers.acquire(states[1])  # returns, with a buffer of its own (the step then reports the failure)
    assert buffers.extra == 1 and buffers.holds(states[1])


def test_the_run_says_once_why_updates_wait_for_the_end_of_backward(tmp_path, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        assert_like_plain(tmp_path, "nvme", Net, gradient_clip_val=0.5)
    said = [r.getMessage() for r in caplog.records if "updates cannot overlap backward" in r.getMessage()]
    assert len(said) == 1 and "clipping by norm" in said[0] and "waiting on NVMe" in said[0]


@pytest.mark.parametrize("placement", ["host", "nvme", "fill"])
def test_each_placement_is_described_as_a_table(tmp_path, caplog, placement):
    """Units and bytes per tier, where gradients and optimizer states live, the blocks' activations."""
    import logging

    from offload_strategy import TieredStrategy
    from tests.test_recipes import fit, tiered

    total = sum(p.numel() * p.element_size() for p in Net().parameters())
    if placement == "fill":  # the first units in the GPU tier, the rest in host memory
        # (with the kept blocks' 234 KiB beside, counted in the tier)
        strategy = TieredStrategy(policy={"placement": "fill", "activations": "keep"}, gpu_memory=3 * total + 240 * 1024, host_memory="1GiB")
    else:
        strategy = tiered(placement, tmp_path)
    with caplog.at_level(logging.INFO):
        fit(strategy, tmp_path / "run", Net)
    # the placement after the first step, which measured the kept blocks through the fewest buffers
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tiered: placement")][-1]
    rows = line.splitlines()
    assert rows[1].split() == ["tier", "|", "units", "|", "bytes"] and all(len(row) <= 120 for row in rows), rows
    if placement == "fill":
        assert [row.split()[0] for row in rows[2:4]] == ["gpu", "host"] and "at each offloaded unit's home in host memory" in line
    else:
        from offload_strategy import format_bytes

        assert rows[2].split() == [placement, "|", "7", "|", *format_bytes(total).split()]
        assert ("through 4 host buffers" in line) == (placement == "nvme")
    assert "optimizer states with their unit's parameters" in rows[0] and "activations per block: K" in rows[-1]


class Deep(Net):
    """Forty small blocks: four gradient buffers of the largest unit are far less than a home each."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(40))


def test_host_units_train_like_plain_with_gradients_only_in_flight_when_host_memory_needs_it(tmp_path):
    """Every unit streamed from host memory, 1.25 MiB of it: parameters, states and a gradient home
    each need 1.37 MiB, and the run was refused; with the gradients passing through four buffers
    until their update (as NVMe units' do) they need 1.12 MiB, and the run trains bit for bit."""
    from offload_strategy import TieredStrategy
    from tests.helpers import assert_same_weights
    from tests.test_recipes import fit

    watch = Watch()
    plain_losses, plain_weights, _ = fit("auto", tmp_path / "plain", Deep)
    strategy = TieredStrategy(policy={"placement": "host", "activations": "keep"}, gpu_memory="1MiB", host_memory="1.25MiB")
    losses, weights, _ = fit(strategy, tmp_path / "tiered", Deep, callbacks=watch())
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    slots, extra, most, transient = watch.seen[-1]
    assert slots == GRADIENT_BUFFERS and transient == 43  # every unit: embedding, 40 blocks, norm, head
    assert extra == 0 and 1 <= most <= GRADIENT_BUFFERS


def test_host_and_nvme_units_share_the_gradient_buffers_when_host_memory_is_split(tmp_path):
    """Host memory (700 KiB) holds some units' parameters and states, NVMe the others'. Host
    units kept a gradient home each, which sent more units to NVMe; with every gradient in flight
    through the same four buffers, host units' too, ten units stay in host memory and training is
    unchanged bit for bit."""
    from offload_strategy import TieredStrategy
    from tests.helpers import assert_same_weights
    from tests.test_recipes import fit

    watch = Watch()
    plain_losses, plain_weights, _ = fit("auto", tmp_path / "plain", Deep)
    # 200 KiB for the parameters beside the kept blocks' 504 KiB, counted in the tier from the first step
    strategy = TieredStrategy(policy={"placement": "fill", "activations": "keep"}, gpu_memory="704KiB", host_memory="700KiB",
                              nvme_path=str(tmp_path / "nvme"), nvme_memory="1GiB")
    losses, weights, _ = fit(strategy, tmp_path / "tiered", Deep, callbacks=watch())
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    metrics = strategy.metrics()
    host, nvme = int(metrics["units/host"]), int(metrics["units/nvme"])
    assert host > 0 and nvme > 0
    slots, extra, most, transient = watch.seen[-1]
    assert transient == host + nvme and slots == GRADIENT_BUFFERS and extra == 0


def test_in_flight_host_gradients_under_bf16_true_match_a_gradient_home_each(tmp_path):
    """Under bf16-true a gradient arrives in 16 bits and is widened for its fp32 master: through a
    buffer (1.3 MiB of host memory) it trains to the bit what a home each (1 GiB) trains."""
    from offload_strategy import TieredStrategy
    from tests.helpers import assert_same_weights
    from tests.test_recipes import fit

    runs, watch = [], Watch()
    for host in ("1GiB", "1.3MiB"):
        strategy = TieredStrategy(policy={"placement": "host", "activations": "keep"}, gpu_memory="1MiB", host_memory=host)
        runs.append(fit(strategy, tmp_path / host, Deep, precision="bf16-true", callbacks=watch() if host != "1GiB" else ()))
    (homes_losses, homes_weights, _), (losses, weights, _) = runs
    assert losses == homes_losses
    assert_same_weights(homes_weights, weights)
    assert watch.seen[-1][3] == 43, "the gradients did not pass through the buffers"


def test_bf16_mixed_holds_a_model_bf16_true_cannot_in_the_same_host_memory(tmp_path):
    """What the largest-model points of tools/reproduce.py rest on: under bf16-mixed a host unit
    keeps its fp32 parameters and Adam's states (12 bytes a parameter) with its gradients in flight,
    under bf16-true a 16-bit copy beside each fp32 master too (14, and a 16-bit landing area). At
    1.2 MiB of host memory the first trains bit for bit as plain Lightning does; the second is
    refused, saying how much it needs."""
    from offload_strategy import TieredStrategy
    from tests.helpers import assert_same_weights
    from tests.test_recipes import fit

    plain_losses, plain_weights, _ = fit("auto", tmp_path / "plain", Deep, precision="bf16-mixed")
    strategy = TieredStrategy(policy={"placement": "host", "activations": "keep"}, gpu_memory="1MiB", host_memory="1.2MiB")
    losses, weights, _ = fit(strategy, tmp_path / "mixed", Deep, precision="bf16-mixed")
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    with pytest.raises(PlacementError, match=r"1\.23 MiB with gradients only in flight.* host_memory grants 1\.20 MiB"):
        strategy = TieredStrategy(policy={"placement": "host", "activations": "keep"}, gpu_memory="1MiB", host_memory="1.2MiB")
        fit(strategy, tmp_path / "true", Deep, precision="bf16-true")
