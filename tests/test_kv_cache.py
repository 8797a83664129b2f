"""Hugging Face's key/value cache under blocks recomputed in backward. GPT-2's and Llama's configs
turn ``use_cache`` on, in training too, so every block appends its keys and values to the cache
the model hands it; PEFT's prefix tuning puts its prefix there. A recomputed block used to append
them again: eager attention failed on its mask's shape, and prefix tuning failed under any
attention."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from offload_strategy.demos import CausalLM
from offload_strategy import TieredStrategy
from offload_strategy.runtime.activations.kv_cache import CacheReplay, caches_in

transformers = pytest.importorskip("transformers")


def test_a_recomputation_sees_the_cache_as_the_forward_found_it_and_leaves_it_as_it_was():
    """By hand, on a two-layer cache whose layer 0 holds a prefix of one key (3s): the block's
    forward appends a key of 1s to it (two keys); a later block appends 2s to layer 1; the
    recomputation sees layer 0 with the prefix alone (appending gives two keys, not three), and
    afterwards both layers hold what they held."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=transformers.GPT2Config(n_layer=2))
    ones, twos, threes = torch.ones(1, 1, 1, 4), torch.full((1, 1, 1, 4), 2.0), torch.full((1, 1, 1, 4), 3.0)
    cache.update(threes, threes, 0)
    assert caches_in((ones, cache), {"mask": None}) == [cache]
    replay = CacheReplay([cache])
    with replay.forward():
        keys, _ = cache.update(ones, ones, 0)
    assert keys.shape[-2] == 2 and cache.layers[0].keys is keys  # a prefix: kept with what was appended
    cache.update(twos, twos, 1)  # a later block, not recomputed
    with replay.recomputing():
        again, _ = cache.update(ones, ones, 0)
        assert torch.equal(again, keys)
    assert cache.layers[0].keys is keys and torch.equal(cache.layers[1].keys, twos)


def test_what_a_block_appends_to_an_empty_layer_is_forgotten_after_its_forward():
    """The cache ``use_cache`` makes for each forward: a checkpointed or swapped block's keys and
    values would stay in the GPU tier for the whole step. Its layer is empty again after the
    forward; its recomputation appends them once, and leaves the layer empty."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=transformers.GPT2Config(n_layer=2))
    ones = torch.ones(1, 1, 1, 4)
    replay = CacheReplay([cache])
    with replay.forward():
        keys, _ = cache.update(ones, ones, 0)
        assert keys.shape[-2] == 1
    assert cache.get_seq_length(0) == 0
    with replay.recomputing():
        again, _ = cache.update(ones, ones, 0)
        assert torch.equal(again, keys)
    assert cache.get_seq_length(0) == 0


def _fit(strategy, build, steps=3):
    torch.manual_seed(0)
    tokens = torch.randint(0, 512, (8 * steps, 33))
    model = build()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(tokens, batch_size=8))
    return [float(x) for x in model.losses], model.state_dict()


class Logged(CausalLM):
    def on_fit_start(self) -> None:
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss.detach())
        return loss


class PrefixTuned(Logged):
    def configure_model(self) -> None:
        if self.model is None:
            from peft import PrefixTuningConfig, get_peft_model

            super().configure_model()
            self.model = get_peft_model(self.model, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=5))


CONFIG = {"vocab_size": 512, "n_positions": 64, "n_embd": 64, "n_layer": 4, "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


@pytest.mark.parametrize(("make", "attention", "policy"),
                         [(Logged, "eager", "checkpoint"), (Logged, "eager", "swap_host"), (PrefixTuned, "sdpa", "checkpoint"),
                          (PrefixTuned, "eager", "checkpoint")],
                         ids=["gpt2_eager", "gpt2_eager_swapped", "prefix_tuning_sdpa", "prefix_tuning_eager"])
def test_blocks_recomputed_under_a_key_value_cache_train_as_plain(tmp_path, make, attention, policy):
    if make is PrefixTuned:
        pytest.importorskip("peft")
    config = {**CONFIG, "_attn_implementation": attention}

    def build():
        return make(family="gpt2", config=config, lr=1e-2)

    plain_losses, plain_weights = _fit("auto", build)
    losses, weights = _fit(TieredStrategy(policy={"activations": policy}, gpu_memory="64MiB", host_memory="1GiB"), build)
    assert losses == plain_losses
    assert all(torch.equal(weights[k], v) for k, v in plain_weights.items())


class HeldAtForwardEnd(L.Callback):
    """The bytes the training step's operations made and still hold when its forward returns."""

    def __init__(self) -> None:
        self.held: list[int] = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        from offload_strategy.estimate.live_bytes import LiveBytes

        self.mode = LiveBytes()
        self.mode.__enter__()

    def on_before_backward(self, trainer, module, loss):
        self.held.append(self.mode.bytes)
        self.mode.__exit__(None, None, None)


def test_checkpointed_blocks_leave_no_keys_and_values_in_the_cache_use_cache_makes():
    """With the cache on, the forward used to end holding every checkpointed block's keys and
    values (outside the activations the plan measures): now what it holds with the cache off."""
    held = {}
    for use_cache in (True, False):
        def build():
            return Logged(family="gpt2", config={**CONFIG, "use_cache": use_cache}, lr=1e-2)

        seen = HeldAtForwardEnd()
        torch.manual_seed(0)
        trainer = L.Trainer(strategy=TieredStrategy(policy={"activations": "checkpoint"}, gpu_memory="64MiB", host_memory="1GiB"),
                            accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, callbacks=[seen])
        trainer.fit(build(), DataLoader(torch.randint(0, 512, (16, 33)), batch_size=8))
        held[use_cache] = seen.held
    assert held[True] == held[False]


def test_an_attribute_a_forward_turns_from_a_dict_into_a_list_differs():
    """A cache object's attribute that was a dict before the block's forward and is a list of as
    many items after it has changed: the recomputation sees the dict, and the list is back after it
    (comparing them read the list as a dict, and failed)."""

    class Part:
        pass

    part, key = Part(), torch.ones(2)
    part.seen = {"layer0": key}
    replay = CacheReplay([part])
    with replay.forward():
        part.seen = [key]
    with replay.recomputing():
        assert part.seen == {"layer0": key}
    assert part.seen == [key]
