"""Models built under ``tiered`` take no memory for their parameters until each is placed, and the
values computed in their homes are, to the bit, those of plain construction."""

from __future__ import annotations

import gc
import os
import threading

import lightning as L
import pytest
import torch
from torch import nn

from offload_strategy.demos import build_causal_lm
from offload_strategy import TieredStrategy
from offload_strategy.construction.deferred import DeferredParameters
from tests.ddp_launch import assert_same_optimizer_states
from tests.test_recipes import Net, assert_like_plain, fit, tiered


class Custom(nn.Module):
    """What models do to parameters while they are built, beside ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 6)
        self.e = nn.Embedding(10, 4, padding_idx=1)  # reset writes zeros through a view
        self.ln = nn.LayerNorm(6)
        self.w = nn.Parameter(torch.randn(3, 3))  # a random factory: replayed
        self.s = nn.Parameter(torch.randn(5) * 0.1)  # computed before it is a parameter: kept as it is
        with torch.no_grad():
            self.a.weight.data[0].mul_(0.5)  # through .data and a view
            nn.init.normal_(self.ln.weight, std=0.1)  # the user's own initialisation
            self.a.bias[2:4].fill_(3.0)


def values(module: nn.Module, registry: DeferredParameters) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        if p in registry:
            target = torch.empty(p.shape, dtype=p.dtype)
            registry.fill(p, target)
            out[name] = target
        else:
            out[name] = p.detach()
    return out


def build_both(make):
    torch.manual_seed(0)
    plain = make()
    plain_next = torch.rand(4)  # what the generator gives after construction
    registry = DeferredParameters()
    torch.manual_seed(0)
    with registry.recording():
        deferred = make()
    registry.adopt(deferred)
    return plain, plain_next, deferred, torch.rand(4), registry


def test_replayed_values_equal_plain_construction_and_the_generator_continues_the_same():
    plain, plain_next, deferred, deferred_next, registry = build_both(Custom)
    # every parameter made by a factory is deferred; `s` was computed before registration
    assert {n for n, p in deferred.named_parameters() if p in registry} == {"a.weight", "a.bias", "e.weight", "ln.weight", "ln.bias", "w"}
    assert torch.equal(plain_next, deferred_next)
    got = values(deferred, registry)
    for name, p in plain.named_parameters():
        assert torch.equal(got[name], p), name
    assert torch.equal(got["e.weight"][1], torch.zeros(4))  # the padding row, written through a view
    assert torch.equal(got["a.bias"][2:4], torch.full((2,), 3.0))
    assert len(registry) == 0  # each filled once, then forgotten


@pytest.mark.parametrize("family,config", [
    ("gpt2", dict(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=2, bos_token_id=None, eos_token_id=None)),
    ("llama", dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)),
    ("opt", dict(vocab_size=256, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=2,
                 max_position_embeddings=64, word_embed_proj_dim=32)),
])
def test_hugging_face_models_are_deferred_whole_and_replay_exactly(family, config):
    plain, plain_next, deferred, deferred_next, registry = build_both(lambda: build_causal_lm(family, config))
    # every parameter (the output head tied to the embedding counts once), buffers kept as built
    assert len(registry) == len(list(deferred.parameters())) > 0
    assert all(torch.equal(a, b) for a, b in zip(plain.buffers(), deferred.buffers()))
    assert torch.equal(plain_next, deferred_next)
    got = values(deferred, registry)
    for name, p in plain.named_parameters():
        assert torch.equal(got[name], p), name


def test_a_value_read_while_building_is_computed_exactly_there():
    class ReadsWhileBuilding(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            with torch.no_grad():
                self.b.weight.copy_(self.a.weight * 2)  # reads a: a is computed now
            self.norm = float(self.a.weight.norm())

    plain, _, deferred, _, registry = build_both(ReadsWhileBuilding)
    assert deferred.norm == plain.norm
    assert deferred.a.weight not in registry and type(deferred.a.weight) is nn.Parameter
    got = values(deferred, registry)
    for name, p in plain.named_parameters():
        assert torch.equal(got[name], p), name


def test_a_read_after_building_computes_the_parameter():
    plain, _, deferred, _, registry = build_both(Custom)
    assert torch.equal(deferred.a.weight.sum(), plain.a.weight.sum())  # any read, through the parameter's class
    assert deferred.a.weight not in registry
    assert torch.equal(deferred.a.weight, plain.a.weight)
    moved = deferred.e.weight.to("cpu")  # where it is already: nothing computed
    assert moved is deferred.e.weight and deferred.e.weight in registry


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_building_a_large_model_allocates_none_of_its_parameters():
    registry = DeferredParameters()
    before = rss_bytes()
    with registry.recording():
        model = nn.Sequential(*(nn.Linear(4096, 4096) for _ in range(16)))  # 1 GiB of fp32 parameters
    grown = rss_bytes() - before
    assert registry.deferred_bytes() == sum(p.numel() * 4 for p in model.parameters()) > 2**30
    # each parameter lives only while its initialiser runs once on a scratch copy (64 MiB)
    assert grown < 160 * 2**20, f"building grew the process by {grown / 2**20:.0f} MiB"


class BuiltInConfigure(Net):
    """``Net``'s layers, built in ``configure_model`` with a custom initialisation."""

    def __init__(self) -> None:
        L.LightningModule.__init__(self)
        self.built = False

    def configure_model(self) -> None:
        if self.built:
            return
        self.built = True
        self.embed = nn.Embedding(256, 32)
        self.blocks = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 256)
        with torch.no_grad():
            self.head.weight.mul_(0.1)


class CountFills(L.Callback):
    def __init__(self) -> None:
        self.filled = 0

    def setup(self, trainer, pl_module, stage) -> None:
        strategy = trainer.strategy
        if not isinstance(strategy, TieredStrategy):
            return
        fill = strategy.deferred.fill
        self.filled = 0

        def counted(p, target):
            done = fill(p, target)
            self.filled += done
            return done

        strategy.deferred.fill = counted

    def on_train_start(self, trainer, pl_module) -> None:
        # set-up's placement (placing again beside the kept layout measured in the first step reads
        # the NVMe units' values from the old files through the same call)
        self.at_start = self.filled


@pytest.mark.parametrize("placement", ["host", "nvme"])
def test_a_model_built_in_configure_model_is_computed_in_its_homes_and_trains_like_plain(tmp_path, placement):
    counter = CountFills()
    plain, model = assert_like_plain(tmp_path, placement, BuiltInConfigure, callbacks=lambda: (counter,))
    # every parameter was computed in its home (none materialized on the way)
    assert counter.at_start == len(list(model.parameters())) == 13


def test_init_module_builds_without_memory_and_trains_like_plain(tmp_path):
    def run(strategy):
        L.seed_everything(7, verbose=False)
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                            default_root_dir=tmp_path)
        with trainer.init_module():
            model = Net()
        deferred = len(trainer.strategy.deferred) if isinstance(trainer.strategy, TieredStrategy) else 0
        from tests.helpers import tiny_data
        trainer.fit(model, datamodule=tiny_data())
        return deferred, {k: v.detach().clone() for k, v in model.state_dict().items()}

    _, plain = run("auto")
    deferred, weights = run(tiered("nvme", tmp_path))
    assert deferred == 13
    for name in plain:
        assert torch.equal(plain[name], weights[name]), name


def test_everything_fitting_computes_the_parameters_where_they_are(tmp_path):
    strategy = TieredStrategy(gpu_memory="1GiB")
    losses, weights, model = fit(strategy, tmp_path / "tiered", BuiltInConfigure, steps=3)
    plain_losses, plain_weights, _ = fit("auto", tmp_path / "plain", BuiltInConfigure, steps=3)
    assert strategy.engine is None and len(strategy.deferred) == 0
    assert losses == plain_losses
    assert all(torch.equal(plain_weights[k], weights[k]) for k in plain_weights)


def test_units_too_large_to_bring_back_stay_on_nvme_after_training_and_read_exactly(tmp_path, monkeypatch, caplog):
    import offload_strategy.checkpoint.states as states_module

    class HostFills(L.Callback):
        """Host memory looks nearly full when training ends."""

        def on_train_end(self, trainer, pl_module) -> None:
            monkeypatch.setattr(states_module, "host_available", lambda: 2**10)

    plain_losses, plain_weights, plain_model = fit("auto", tmp_path / "plain", Net)
    plain_states = plain_model.trainer.optimizers[0].state_dict()
    # (stores of earlier tests in this process close with their own objects: only this run's count)
    earlier = {t for t in threading.enumerate() if t.name.startswith("nvme_")}
    strategy = tiered("nvme", tmp_path)
    L.seed_everything(7, verbose=False)
    model = Net()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=6, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                        default_root_dir=tmp_path, callbacks=[HostFills()])
    from tests.helpers import tiny_data
    with caplog.at_level("INFO"):
        trainer.fit(model, datamodule=tiny_data())
    assert any("7 of the 7 units at home on NVMe stay there" in r.getMessage() for r in caplog.records)
    assert [n for n, p in model.named_parameters() if p not in strategy.deferred] == []  # nothing was read back into memory
    state = trainer.optimizers[0].state
    assert len(state.held) == 0 and len(state) == len(plain_model.trainer.optimizers[0].state)  # every state still on NVMe
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}  # each read from its file now
    for name in plain_weights:
        assert torch.equal(plain_weights[name], weights[name]), name
    assert len(strategy.deferred) == 0
    assert_same_optimizer_states(plain_states, trainer.optimizers[0].state_dict())  # each read from its unit's file now
    assert len(state.pending) == 0
    del model, trainer, strategy
    gc.collect()  # the kept store closes with the last parameter that reads from it
    assert not [t.name for t in threading.enumerate() if t.name.startswith("nvme_") and t not in earlier]
