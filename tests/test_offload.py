"""Training with parameters offloaded to host memory and NVMe matches plain Lightning bit for bit
(fp32, CPU, emulated GPU tier), and the scheduler keeps what it needs resident."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn

from offload_strategy.demos import CausalLM
from offload_strategy import OffloadMonitor, TieredStrategy
from offload_strategy.planning.placement import PlacementError
from tests.helpers import PARAMETERS_ONLY, assert_same_weights, train

# Four blocks, so that the embedding (tied to the output head) is a small part of the model.
GPT2_4L = dict(vocab_size=256, n_positions=32, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)


def param_bytes(make) -> int:
    L.seed_everything(0, verbose=False)
    model = make()
    if hasattr(model, "configure_model"):
        model.configure_model()
    return sum(p.numel() * p.element_size() for p in model.parameters())


def gpt2_4l() -> CausalLM:
    return CausalLM(family="gpt2", config=GPT2_4L, lr=1e-2, warmup_steps=2)


class Recorder(L.Callback):
    """The strategy's metrics after every step, and the placement it ran."""

    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []
        self.homes: dict[str, int] = {}

    def on_train_batch_end(self, trainer, *args) -> None:
        engine = trainer.strategy.engine
        if engine is None and trainer.global_step == 1:
            return  # the first step's tier holds the kept layout's room too: offloading starts after it
        assert engine is not None, "nothing was offloaded"
        self.homes = {h: sum(1 for s in engine.states if s.home == h) for h in ("gpu", "host", "nvme")}
        self.metrics.append(trainer.strategy.metrics())


class StatesOnNvme(L.Callback):
    """Checks, during training, that the optimizer holds no memory for the states of NVMe units."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_end(self, trainer, *args) -> None:
        engine = trainer.strategy.engine
        if engine is None:
            return
        slots = engine.updater.optimizers[id(trainer.optimizers[0])].slots
        for s in engine.states:
            if s.home == "nvme":
                slot = slots[s.unit.index]
                for master in slot.masters:
                    tensors = [t for t in slot.inner.state[master].values() if torch.is_tensor(t) and t.dim() > 0]
                    assert tensors and all(0 in t.stride() for t in tensors), s.unit.name
                    self.checked += 1


# the kept layout's peak in the GPU tier (4 x 32-wide blocks, batch 4 x 32), measured in the first
# training forward: 902 KiB in the blocks, 82 KiB outside them, 128 KiB of the backward's gradients
KEPT_PEAK = 1_138_308  # (the bytes, so that the parameters' share is exactly the old tier: prefetching depends on it)


QUIRKY_PEAK, CHECKPOINTED_PEAK, FUNCTIONAL_PEAK = 17 * 1024, 243 * 1024, 279 * 1024  # the other models' kept layouts, measured alike


def beside_kept(fraction: float, total: int, peak: int = KEPT_PEAK) -> int:
    """A GPU tier that leaves the parameters ``fraction`` of their bytes once they are placed again
    beside the kept layout's ``peak`` after the first step (in the first, the whole tier holds them)."""
    return int(fraction * total) + peak


def nvme_gpu_memory(total: int) -> int:
    """A GPU tier whose share for the parameters, once they are placed again beside the kept
    layout after the first step, is 0.3 of them: the rest on host memory and NVMe."""
    return beside_kept(0.3, total)


def nvme_strategy(total: int, path: Path) -> TieredStrategy:
    return TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=nvme_gpu_memory(total), host_memory=int(4.2 * total), nvme_path=path, nvme_memory="64MiB")


def test_gpu_host_and_nvme_tiers_train_identically(tmp_path):
    total = param_bytes(gpt2_4l)
    plain_losses, plain_weights, plain_trainer = train("auto", tmp_path / "plain", epochs=4, make_model=gpt2_4l)
    nvme = tmp_path / "nvme"
    strategy = nvme_strategy(total, nvme)
    recorder, states = Recorder(), StatesOnNvme()
    losses, weights, trainer = train(strategy, tmp_path / "tiered", epochs=4, make_model=gpt2_4l, extra_callbacks=(recorder, states))
    assert recorder.homes["host"] > 0 and recorder.homes["nvme"] > 0, recorder.homes
    assert states.checked > 0
    assert len(losses) == 24
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    # after fit the optimizer holds its true states again, equal to plain training's
    ours, theirs = trainer.optimizers[0].state_dict()["state"], plain_trainer.optimizers[0].state_dict()["state"]
    assert ours.keys() == theirs.keys()
    for index in theirs:
        for key in theirs[index]:
            assert torch.equal(ours[index][key], theirs[index][key]), (index, key)
    last = recorder.metrics[-1]
    assert last["tier/gpu_peak_bytes"] <= nvme_gpu_memory(total)
    assert last["link/nvme_read_bytes_total"] > 0 and last["link/nvme_write_bytes_total"] > 0
    # the directory was made for the run, so it goes with its files
    assert strategy.engine is None and not nvme.exists(), "the run's NVMe files were not removed"


def test_resume_with_units_and_states_on_nvme(tmp_path):
    total = param_bytes(gpt2_4l)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2_4l)
    train(nvme_strategy(total, tmp_path / "nvme-a"), tmp_path / "part", epochs=2, stop_after_epochs=1, save_every_epoch=True, make_model=gpt2_4l)
    checkpoint = tmp_path / "part" / "ckpt" / "epoch=0.ckpt"
    saved = torch.load(checkpoint, weights_only=True)["optimizer_states"][0]["state"]
    assert all(torch.isfinite(t).all() for state in saved.values() for t in state.values() if torch.is_tensor(t))
    for name, strategy in (("tiered", nvme_strategy(total, tmp_path / "nvme-b")), ("plain", "auto")):
        resumed, resumed_weights, _ = train(strategy, tmp_path / name, epochs=2, resume=checkpoint, make_model=gpt2_4l)
        assert resumed == plain_losses[len(plain_losses) - len(resumed) :], name
        assert_same_weights(plain_weights, resumed_weights)


def test_gradient_accumulation_and_resume_match(tmp_path):
    total = param_bytes(gpt2_4l)

    def offloading() -> TieredStrategy:
        return TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=beside_kept(0.3, total), host_memory="1GiB")

    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2_4l, accumulate_grad_batches=2)
    losses, weights, _ = train(offloading(), tmp_path / "full", epochs=2, make_model=gpt2_4l, accumulate_grad_batches=2)
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)

    # a checkpoint written by the offloading run resumes identically, in either strategy
    train(offloading(), tmp_path / "part", epochs=2, stop_after_epochs=1, save_every_epoch=True, make_model=gpt2_4l, accumulate_grad_batches=2)
    checkpoint = tmp_path / "part" / "ckpt" / "epoch=0.ckpt"
    for strategy in (offloading(), "auto"):
        resumed, resumed_weights, _ = train(strategy, tmp_path / f"resumed-{strategy}", epochs=2, resume=checkpoint, make_model=gpt2_4l, accumulate_grad_batches=2)
        assert resumed == plain_losses[len(plain_losses) - len(resumed) :]
        assert_same_weights(plain_weights, resumed_weights)


class Quirky(L.LightningModule):
    """A module called twice per forward, frozen parameters, buffers (batch-norm statistics)."""

    def __init__(self, shuffle: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 24)
        self.shared = nn.Linear(24, 24)
        self.frozen = nn.Linear(24, 24)
        self.frozen.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Linear(24, 24) for _ in range(4))
        self.norm = nn.BatchNorm1d(24)
        self.head = nn.Linear(24, 256)
        self.shuffle = shuffle
        self.calls = 0

    def training_step(self, batch, batch_idx):
        x = self.embed(batch[:, :-1]).mean(dim=1)
        x = torch.tanh(self.shared(x))
        x = torch.tanh(self.shared(x))  # the same module again
        x = self.frozen(x)
        order = list(range(len(self.blocks)))
        if self.shuffle:  # a different execution order every step, the same in both runs
            generator = torch.Generator().manual_seed(self.calls)
            order = torch.randperm(len(self.blocks), generator=generator).tolist()
        self.calls += 1
        for i in order:
            x = torch.tanh(self.blocks[i](x))
        logits = self.head(self.norm(x))
        return nn.functional.cross_entropy(logits, batch[:, -1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("shuffle", [False, True], ids=["fixed-order", "shuffled-order"])
def test_reused_modules_frozen_parameters_buffers_and_changing_order(tmp_path, shuffle):
    make = lambda: Quirky(shuffle)  # noqa: E731
    total = param_bytes(make)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=4, make_model=make)
    recorder = Recorder()
    strategy = TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=beside_kept(0.85, total, QUIRKY_PEAK), host_memory="1GiB")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=4, make_model=make, extra_callbacks=(recorder,))
    assert recorder.homes["host"] > 0
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)  # includes the batch-norm buffers and frozen weights
    steady = recorder.metrics[2:]
    if shuffle:
        assert sum(m["cache/out_of_order"] for m in steady) > 0, "a changed order must be noticed"
        assert sum(m["cache/miss_rate"] + m["cache/late_hit_rate"] for m in steady) > 0


def test_steady_state_hit_rate_with_host_offload(tmp_path):
    total = param_bytes(gpt2_4l)
    recorder = Recorder()
    strategy = TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=beside_kept(0.4, total), host_memory="1GiB")
    train(strategy, tmp_path / "tiered", epochs=4, make_model=gpt2_4l, extra_callbacks=(recorder,))
    steady = recorder.metrics[3:]  # each step's own counts
    prefetched = 1 - sum(m["cache/miss_rate"] * m["cache/requests"] for m in steady) / sum(m["cache/requests"] for m in steady)
    assert recorder.homes["host"] > 0
    # the step's first unit is fetched when its forward asks for it (what the training step writes
    # at home before its forward must be in the copy), so it is a miss; the others were prefetched
    assert prefetched >= 0.95, f"steady-state share of requests prefetched {prefetched:.3f}"


def test_metrics_reach_the_logger(tmp_path):
    total = param_bytes(gpt2_4l)
    monitor = OffloadMonitor(every_n_steps=1)
    train(TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=beside_kept(0.3, total), host_memory="1GiB"), tmp_path, epochs=1, make_model=gpt2_4l, extra_callbacks=(monitor,))
    for key in ("cache/hit_rate", "cache/wait_p99_ms", "cache/wait_under_0.01ms_fraction", "link/h2d_bytes_total", "tier/gpu_peak_bytes", "tier/host_bytes"):
        assert f"offload/{key}" in monitor.last, key
    assert monitor.last["offload/link/h2d_bytes_total"] > 0


def test_too_small_gpu_budget_is_refused_before_training(tmp_path):
    with pytest.raises(PlacementError, match=r"gpu_memory=.* cannot hold the largest set of parameters one module needs at once"):
        train(TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory="4KiB", host_memory="1GiB"), tmp_path, epochs=1, make_model=gpt2_4l)


def test_units_on_nvme_need_an_nvme_path(tmp_path):
    total = param_bytes(gpt2_4l)
    with pytest.raises(PlacementError, match=r"there is no NVMe tier; raise host_memory to at least .*, or give nvme_path"):
        train(TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=int(0.3 * total), host_memory=int(4.2 * total)), tmp_path, epochs=1, make_model=gpt2_4l)


def test_chunks_train_identically(tmp_path):
    total = param_bytes(gpt2_4l)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2_4l)
    per_module, chunked = Recorder(), Recorder()
    train(TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=beside_kept(0.5, total), host_memory="1GiB"), tmp_path / "units", epochs=1, make_model=gpt2_4l, extra_callbacks=(per_module,))
    strategy = TieredStrategy(gpu_memory=beside_kept(0.5, total), host_memory="1GiB", policy={**PARAMETERS_ONLY, "chunk_size": "40KiB"})
    losses, weights, _ = train(strategy, tmp_path / "chunks", epochs=2, make_model=gpt2_4l, extra_callbacks=(chunked,))
    assert sum(chunked.homes.values()) < sum(per_module.homes.values()) / 2
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_engine_with_units_computed_in_place_at_home():
    """DHA units never move: the model computes on their host home. Checked without Lightning,
    against a plain training loop."""
    from offload_strategy.hardware.device import make_device
    from offload_strategy.planning.placement import HOST, UnitSize, place_units
    from offload_strategy.runtime.engine import TieredEngine
    from offload_strategy.runtime.units import build_units

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(64, 16), nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 64))

    plain, tiered = make(), make()
    units, users = build_units(tiered)
    sizes = [UnitSize(u.index, u.nbytes, u.nbytes) for u in units]
    placement = place_units(sizes, [[u.index for u in used] for used in users.values()], gpu_bytes=18000, host_bytes=2**20, nvme_bytes=0, state_factor=2)
    norms = frozenset(i for i, u in enumerate(units) if isinstance(dict(tiered.named_modules())[u.name], nn.LayerNorm))
    assert all(placement.home[i] == HOST for i in norms)
    placement = dataclasses.replace(placement, dha=norms)
    engine = TieredEngine(tiered, units, users, placement, make_device(torch.device("cpu"), capacity=18000))
    try:
        opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
        opt_tiered = torch.optim.AdamW(tiered.parameters(), lr=1e-2)
        tokens = torch.randint(0, 64, (8, 5), generator=torch.Generator().manual_seed(1))
        for step in range(6):
            loss_plain = nn.functional.cross_entropy(plain(tokens).flatten(0, 1), tokens.flatten())
            loss_plain.backward()
            opt_plain.step()
            opt_plain.zero_grad()
            engine.begin_step(profile=step == 0)
            with engine.saved_tensor_hooks():
                loss_tiered = nn.functional.cross_entropy(tiered(tokens).flatten(0, 1), tokens.flatten())
            loss_tiered.backward()
            engine.step(opt_tiered)
            opt_tiered.zero_grad()
            assert torch.equal(loss_plain, loss_tiered), step
            for i in norms:  # never copied in: bound to the home all along
                assert all(p.data.data_ptr() == h.data_ptr() for p, h in zip(units[i].params, engine.states[i].home_views))
        assert not any(i in norms for i in engine.ctx.table.order)
    finally:
        engine.close(materialize=True)
        engine.device.close()
    for a, b in zip(plain.parameters(), tiered.parameters()):
        assert torch.equal(a, b)


def test_profile_records_order_sizes_and_times(tmp_path):
    total = param_bytes(gpt2_4l)
    profiles = []

    class Keep(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.strategy.engine is None:
                return  # the first step, before the parameters are placed again beside the kept layout
            profiles.append(trainer.strategy.engine.timer.profile)

    train(TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=beside_kept(0.3, total), host_memory="1GiB"), tmp_path, epochs=1, make_model=gpt2_4l, extra_callbacks=(Keep(),))
    profile = profiles[-1]
    n = len(profile.unit_names)
    assert sum(profile.unit_bytes) >= total
    # forward uses every unit once in registration order, then the tied head reuses the embedding;
    # backward walks the blocks in reverse
    assert profile.order[:n] == list(range(n))
    assert profile.order[n] == 0
    backward = profile.order[n + 1 :]
    assert backward == sorted(backward, reverse=True) and len(backward) >= n // 2
    assert all(profile.forward_seconds[i] > 0 for i in range(n))
    assert profile.backward_seconds and all(t > 0 for t in profile.backward_seconds.values())
    from offload_strategy.planning.profile import StepProfile

    assert StepProfile.from_json(profile.to_json()) == profile


def test_nvme_units_are_kept_in_host_memory_between_uses(tmp_path):
    total = param_bytes(gpt2_4l)
    recorder = Recorder()
    # host memory for 4 gradient buffers and the 4 staging buffers, no more: the update gets its minimum
    strategy = TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=beside_kept(0.3, total), host_memory=int(1.8 * total), nvme_path=tmp_path / "nvme", nvme_memory="64MiB")
    train(strategy, tmp_path / "run", epochs=2, make_model=gpt2_4l, extra_callbacks=(recorder,))
    assert recorder.homes["nvme"] > 0
    assert sum(m["cache/nvme_reads_avoided"] for m in recorder.metrics[1:]) > 0


def test_bf16_mixed_with_offload_matches_plain_bf16_mixed(tmp_path):
    total = param_bytes(gpt2_4l)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2_4l, precision="bf16-mixed")
    losses, weights, _ = train(TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=beside_kept(0.3, total), host_memory="1GiB"), tmp_path / "tiered", epochs=2,
                               make_model=gpt2_4l, precision="bf16-mixed")
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_an_exception_mid_training_leaves_no_files_and_real_parameters(tmp_path):
    class Boom(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:
                raise RuntimeError("boom")

    total = param_bytes(gpt2_4l)
    nvme = tmp_path / "nvme"
    holder = {}

    def make():
        holder["model"] = gpt2_4l()
        return holder["model"]

    with pytest.raises(RuntimeError, match="boom"):
        train(nvme_strategy(total, nvme), tmp_path / "run", epochs=2, make_model=make, extra_callbacks=(Boom(),))
    assert not nvme.exists(), "the run's NVMe files were left behind"
    for name, p in holder["model"].named_parameters():  # every parameter holds real, finite values again
        assert 0 not in p.stride(), name  # not a placeholder
        assert torch.isfinite(p).all(), name


class CheckpointedGPT2(CausalLM):
    """transformers' own activation checkpointing (non-reentrant) on every block."""

    def configure_model(self) -> None:
        super().configure_model()
        self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def test_activation_checkpointing_recomputes_with_offloaded_parameters(tmp_path):
    """Backward recomputes each block's forward, which fetches its units again; the recomputed graph
    holds plain views of their buffers, so they stay until their gradients are in."""
    make = lambda: CheckpointedGPT2(family="gpt2", config=GPT2_4L, lr=1e-2, warmup_steps=2)  # noqa: E731
    total = param_bytes(make)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=make)
    recorder = Recorder()
    losses, weights, _ = train(TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=beside_kept(0.6, total, CHECKPOINTED_PEAK), host_memory="1GiB"), tmp_path / "tiered", epochs=2,
                               make_model=make, extra_callbacks=(recorder,))
    assert recorder.homes["host"] > 0
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    # a GPU tier too small for a whole recomputed block (and a buffer to prefetch into) is refused
    # at set-up with the reason: the layers' gradient_checkpointing flag says the model recomputes them
    with pytest.raises(PlacementError, match="The model checkpoints 4 of its layers itself"):
        train(TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=int(0.5 * total), host_memory="1GiB"), tmp_path / "small", epochs=1, make_model=make)


class Functional(L.LightningModule):
    """Parameters used outside their module's forward: the head through ``F.linear``, the embedding
    matrix again as an output projection, read as attributes in ``training_step``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.up = nn.Linear(16, 64)
        self.blocks = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.head = nn.Linear(64, 16)

    def training_step(self, batch, batch_idx):
        x = self.up(self.embed(batch[:, :-1]))
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        x = nn.functional.linear(x, self.head.weight, self.head.bias)  # the head module is never called
        logits = x @ self.embed.weight.t()
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("tiers", ["host", "nvme"])
def test_parameters_used_outside_their_module(tmp_path, tiers):
    total = param_bytes(Functional)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=Functional)
    host = "1GiB" if tiers == "host" else int(3.5 * total)
    strategy = TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=beside_kept(0.5, total, FUNCTIONAL_PEAK), host_memory=host, nvme_path=tmp_path / "nvme", nvme_memory="64MiB")
    recorder = Recorder()
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=2, make_model=Functional, extra_callbacks=(recorder,))
    assert recorder.homes[tiers] > 0, recorder.homes
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_checksums_policy_verifies_nvme_reads(tmp_path):
    total = param_bytes(gpt2_4l)
    plain_losses, _, _ = train("auto", tmp_path / "plain", epochs=1, make_model=gpt2_4l)
    seen = {}

    class Check(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.strategy.engine is None:
                return  # the first step, before the parameters are placed again beside the kept layout
            seen["checksums"] = trainer.strategy.engine.store.checksums

    strategy = TieredStrategy(gpu_memory=beside_kept(0.3, total), host_memory=int(4.2 * total), nvme_path=tmp_path / "nvme", nvme_memory="64MiB",
                              policy={**PARAMETERS_ONLY, "checksums": True})
    losses, _, _ = train(strategy, tmp_path / "tiered", epochs=1, make_model=gpt2_4l, extra_callbacks=(Check(),))
    assert seen["checksums"] is True and losses == plain_losses


def test_keyboard_interrupt_leaves_no_threads_or_files(tmp_path):
    import threading

    class Interrupt(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:
                raise KeyboardInterrupt

    total = param_bytes(gpt2_4l)
    before = {t.ident for t in threading.enumerate()}
    nvme = tmp_path / "nvme"
    strategy = nvme_strategy(total, nvme)
    with pytest.raises(SystemExit):  # Lightning tears down, then exits on a keyboard interrupt
        train(strategy, tmp_path / "run", epochs=2, make_model=gpt2_4l, extra_callbacks=(Interrupt(),))
    assert strategy.engine is None
    leftover = [t.name for t in threading.enumerate() if t.ident not in before]
    assert not leftover, f"threads left running: {leftover}"
    assert not nvme.exists() or not any(nvme.iterdir()), "NVMe files left behind"


def test_nvme_updates_read_ahead_and_write_behind(tmp_path):
    """LoHan Fig. 3b on the worker: a unit's parameters and states are read from NVMe when its
    gradients complete, and its writes are left in flight while the next unit updates."""
    total = param_bytes(gpt2_4l)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2_4l)
    seen = {}

    class Pipeline(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.strategy.engine is None:
                return  # the first step, before the parameters are placed again beside the kept layout
            engine = trainer.strategy.engine
            seen.update(engine.updater.pipeline_counts(), buffers=engine.memory.update_buffers)

    # 4x the parameters: ten units on NVMe (at 4.6x every unit fits in host memory once gradients are only in flight)
    strategy = TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=beside_kept(0.3, total), host_memory=int(4.0 * total), nvme_path=tmp_path / "nvme", nvme_memory="64MiB")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=2, make_model=gpt2_4l, extra_callbacks=(Pipeline(),))
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    assert seen["buffers"] > 2 and seen["reads_ahead"] > 0 and seen["writes_behind"] > 0, seen


def test_nvme_read_ahead_never_starves_the_worker_of_update_buffers(tmp_path, monkeypatch):
    """With only the two update buffers the worker needs, a read ahead that the training thread is
    still starting must not make the worker's update fail: slow read submissions widen the window
    between taking the buffers and listing them as a read ahead."""
    import time

    from offload_strategy.memory.nvme import NvmeStore

    total = param_bytes(gpt2_4l)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=1, make_model=gpt2_4l)
    original = NvmeStore.read

    def slow_read(self, key, dst):
        time.sleep(0.002)
        return original(self, key, dst)

    monkeypatch.setattr(NvmeStore, "read", slow_read)
    seen = {}

    class Pipeline(L.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.strategy.engine is None:
                return  # the first step, before the parameters are placed again beside the kept layout
            seen.update(trainer.strategy.engine.updater.pipeline_counts(), buffers=trainer.strategy.engine.memory.update_buffers)

    # host memory for 4 gradient buffers and the 4 staging buffers, no more: the update gets its minimum
    strategy = TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=beside_kept(0.3, total), host_memory=int(1.8 * total), nvme_path=tmp_path / "nvme", nvme_memory="64MiB")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=1, make_model=gpt2_4l, extra_callbacks=(Pipeline(),))
    assert seen["buffers"] == 2, seen
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
