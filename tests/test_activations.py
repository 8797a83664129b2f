"""Per-block activation policies: checkpointed blocks recompute in backward and train exactly like
plain training (dropout included), alone and with offloaded parameters, and keep fewer bytes."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from torch import nn

from offload_strategy.demos import CausalLM
from offload_strategy import TieredStrategy
from offload_strategy.planning.placement import PlacementError
from offload_strategy.runtime.activations.policies import ActivationPolicies, find_blocks
from tests.helpers import PARAMETERS_ONLY, assert_same_weights, train
from tests.test_offload import GPT2_4L, param_bytes

WITH_DROPOUT = {**GPT2_4L, "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}
# gpu_memory (times the parameters' bytes) where the first steps' layout (the first block kept,
# the others recomputed; with what the forward keeps outside the blocks, the logits' log-softmax
# and the head's input, and the backward's gradients: 619 KiB at the first block's forward) fits
# beside the fewest streaming buffers (119 KiB), and keeping every block does not
TIGHT = 3.2


def gpt2() -> CausalLM:
    return CausalLM(family="gpt2", config=WITH_DROPOUT, lr=1e-2, warmup_steps=2)


class Saved(L.Callback):
    def __init__(self) -> None:
        self.bytes = []

    def on_train_batch_end(self, trainer, *args):
        self.bytes.append(trainer.strategy.metrics()["activations/saved_bytes"])


# A layout the test fixes has its activations counted in the GPU tier (the first training step
# measures them): the parameters stream from host memory, every one through a buffer of 60% of
# their bytes, with room beside for what any fixed layout here holds (a kept GPT-2's 1.25 MiB).
STREAMED = {"placement": "host"}


def streamed(total: int) -> dict:
    return dict(gpu_memory=int(0.6 * total) + 2 * 2**20, host_memory="1GiB")


def test_blocks_are_found():
    model = gpt2()
    model.configure_model()
    blocks = find_blocks(model)
    assert [type(b).__name__ for b in blocks] == ["GPT2Block"] * 4
    assert find_blocks(model, "GPT2MLP") == [b.mlp for b in blocks]
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert find_blocks(flat) == []
    with pytest.raises(ValueError, match="needs repeated blocks, but the model has none"):
        ActivationPolicies(flat, "checkpoint")
    with pytest.raises(ValueError, match="lists 3 block policies but the model has 4 blocks"):
        ActivationPolicies(model, ["keep", "checkpoint", "keep"])
    with pytest.raises(ValueError, match=r"\['swap_sideways'\] is not a block policy"):
        ActivationPolicies(model, "swap_sideways")


@pytest.mark.parametrize("activations", ["checkpoint", ("checkpoint", "keep", "checkpoint", "keep")], ids=["all", "mixed"])
@pytest.mark.parametrize("offload", [False, True], ids=["in-gpu-tier", "offloaded"])
def test_checkpointed_blocks_match_plain_training(tmp_path, activations, offload):
    total = param_bytes(gpt2)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2)
    budget = streamed(total) if offload else {}
    strategy = TieredStrategy(policy={"name": "auto", **(STREAMED if offload else {}), "activations": activations}, **budget)
    losses, weights, trainer = train(strategy, tmp_path / "tiered", epochs=2, make_model=gpt2)
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    assert not any("forward" in vars(b) for b in find_blocks(trainer.lightning_module)), "the policies were not taken off"


def test_checkpointing_keeps_fewer_activation_bytes(tmp_path):
    total = param_bytes(gpt2)
    saved = {}
    for activations in ("keep", "checkpoint"):
        seen = Saved()
        strategy = TieredStrategy(**streamed(total), policy={"name": "auto", **STREAMED, "activations": activations})
        train(strategy, tmp_path / activations, epochs=1, make_model=gpt2, extra_callbacks=(seen,))
        saved[activations] = seen.bytes[-1]
    assert 0 < saved["checkpoint"] < saved["keep"] / 3, saved


class Swapped(L.Callback):
    def __init__(self) -> None:
        self.metrics = []

    def on_train_batch_end(self, trainer, *args):
        self.metrics.append(trainer.strategy.metrics())


SWAP_LAYOUTS = {
    "host": "swap_host",
    "nvme": "swap_nvme",
    "interleaved": ("swap_host", "checkpoint", "swap_nvme", "keep"),
}


@pytest.mark.parametrize("layout", list(SWAP_LAYOUTS))
@pytest.mark.parametrize("offload", [False, True], ids=["in-gpu-tier", "offloaded"])
def test_swapped_blocks_match_plain_training(tmp_path, layout, offload):
    total = param_bytes(gpt2)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2)
    budget = streamed(total) if offload else {}
    nvme = tmp_path / "nvme"
    seen = Swapped()
    strategy = TieredStrategy(policy={"name": "auto", **(STREAMED if offload else {}), "activations": SWAP_LAYOUTS[layout]}, nvme_path=nvme, **budget)
    losses, weights, trainer = train(strategy, tmp_path / "tiered", epochs=2, make_model=gpt2, extra_callbacks=(seen,))
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    last = seen.metrics[-1]
    assert (last["activations/swapped_host_bytes"] > 0) == (layout != "nvme")
    assert (last["activations/swapped_nvme_bytes"] > 0) == (layout != "host")
    # only the first swapped block backward reaches waits: each brings the next back ahead
    assert last["activations/swap_prefetched"] > 0 and last["activations/swap_waits"] == 1, last
    assert not any("forward" in vars(b) for b in find_blocks(trainer.lightning_module)), "the policies were not taken off"
    assert not nvme.exists() or not any(nvme.iterdir()), "swap files left behind"


def test_swapping_keeps_as_few_bytes_as_checkpointing(tmp_path):
    """keep > swap ~ checkpoint in what the GPU tier holds for backward, and swap moves what keep holds."""
    total = param_bytes(gpt2)
    metrics = {}
    for activations in ("keep", "swap_host", "checkpoint"):
        seen = Swapped()
        strategy = TieredStrategy(**streamed(total), policy={"name": "auto", **STREAMED, "activations": activations})
        train(strategy, tmp_path / activations, epochs=1, make_model=gpt2, extra_callbacks=(seen,))
        metrics[activations] = seen.metrics[-1]
    kept = {a: m["activations/saved_bytes"] for a, m in metrics.items()}
    recomputed = {a: m["activations/recomputed_flops"] for a, m in metrics.items()}
    assert recomputed["keep"] == recomputed["swap_host"] == 0 and recomputed["checkpoint"] > 0
    assert recomputed["checkpoint"] % 4 == 0  # four blocks, each counted as the first
    assert kept["swap_host"] < kept["keep"] / 3 and kept["checkpoint"] < kept["keep"] / 3, kept
    swapped = metrics["swap_host"]["activations/swapped_host_bytes"]
    assert swapped + kept["swap_host"] >= 0.9 * kept["keep"], (swapped, kept)


def test_checkpointed_blocks_whose_inputs_wait_in_host_memory_match_plain_training(tmp_path):
    """``checkpoint_host``: each block is recomputed in backward as under ``checkpoint``, from its
    input, which waits in host memory instead of the GPU tier. Losses and weights are plain
    training's bit for bit; the recomputation is checkpoint's; what the GPU tier holds for backward
    is checkpoint's less exactly the inputs host memory took; backward found all but the first
    of them brought back already (each block's prefetches the next)."""
    total = param_bytes(gpt2)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2)
    metrics = {}
    for activations in ("checkpoint", "checkpoint_host"):
        seen = Swapped()
        strategy = TieredStrategy(**streamed(total), policy={"name": "auto", **STREAMED, "activations": activations})
        losses, weights, _ = train(strategy, tmp_path / activations, epochs=2, make_model=gpt2, extra_callbacks=(seen,))
        assert losses == plain_losses, activations
        assert_same_weights(plain_weights, weights)
        metrics[activations] = seen.metrics[-1]
    ours, theirs = metrics["checkpoint_host"], metrics["checkpoint"]
    assert ours["activations/recomputed_flops"] == theirs["activations/recomputed_flops"] > 0
    assert ours["activations/blocks_checkpoint_host"] == 4 and "activations/swapped_host_bytes" not in theirs
    moved = ours["activations/swapped_host_bytes"]
    assert moved > 0 and ours["activations/saved_bytes"] + moved == theirs["activations/saved_bytes"], (ours, theirs)
    assert ours["activations/swap_waits"] == 1 and ours["activations/swap_prefetched"] == 3, str({k: v for k, v in ours.items() if "swap" in k})


class FirstStepPolicies(L.Callback):
    def __init__(self) -> None:
        self.policies: list[str] = []

    def on_train_batch_end(self, trainer, *args):
        if not self.policies:
            self.policies = [str(p) for p in trainer.strategy.tiered.activations.policies]


def test_the_first_steps_recompute_from_host_memory_where_their_inputs_would_not_fit_in_the_gpu_tier(tmp_path):
    """A 16-block GPT-2 in a GPU tier of 0.8x its parameters' bytes. The profiling steps keep the
    first block (226 KiB) and recompute the others from their inputs (8 KiB each): at the last
    block's backward the tier would hold the first block's activations, the last block's
    recomputed ones and 14 inputs (565 KiB), more than the 481 KiB the parameters' smallest
    share leaves, and the run was refused. With the inputs in host memory (the first block
    measured, the others not run yet) it holds the two blocks and one input coming back
    (459 KiB): the first steps run so, and training is plain training's."""
    make = functools.partial(CausalLM, family="gpt2", config={**GPT2_4L, "n_layer": 16}, lr=1e-2, warmup_steps=2)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=1, make_model=make)
    seen = FirstStepPolicies()
    strategy = TieredStrategy(gpu_memory=int(0.8 * param_bytes(make)), host_memory="1GiB")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=1, make_model=make, extra_callbacks=(seen,))
    assert seen.policies == ["keep"] + ["checkpoint_host"] * 15
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_swap_nvme_needs_an_nvme_path(tmp_path):
    strategy = TieredStrategy(policy={"name": "auto", "activations": "swap_nvme"})
    with pytest.raises(ValueError, match="swap_nvme but the strategy has no nvme_path"):
        train(strategy, tmp_path, epochs=1, make_model=gpt2)


class PlanSeen(L.Callback):
    def __init__(self) -> None:
        self.arenas: list[int] = []
        self.metrics: list[dict] = []

    def on_train_start(self, trainer, *args):
        self.arenas.append(_gpu_tier_taken(trainer.strategy.engine))

    def on_train_batch_end(self, trainer, *args):
        self.arenas.append(_gpu_tier_taken(trainer.strategy.engine))
        self.metrics.append(trainer.strategy.metrics())


def _gpu_tier_taken(engine) -> int:
    """What the parameters take of the GPU tier: the persistent units' region and the streaming buffers."""
    return engine.memory.persistent_region.numel() + engine.memory.arena.numel() if engine is not None else 0


def test_auto_plans_the_blocks_and_trains_like_plain_training(tmp_path):
    """A GPU tier too small for the kept activations: the profiling steps measure the blocks with
    the parameters streamed through the fewest buffers, the planner picks a layout and places the
    parameters in what it leaves (more than while profiling), and every number stays the same."""
    total = param_bytes(gpt2)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2)
    seen = PlanSeen()
    budget = int(TIGHT * total)
    strategy = TieredStrategy(gpu_memory=budget, host_memory="1GiB", policy={"name": "auto", "activations": "auto"})
    losses, weights, trainer = train(strategy, tmp_path / "tiered", epochs=2, make_model=gpt2, extra_callbacks=(seen,))
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    plan = strategy.activation_plan
    assert plan is not None and set(plan.layout) != {"keep"}, plan
    assert seen.arenas[0] < seen.arenas[-1], "the parameters were not placed for the activations the profiled steps measured"
    assert seen.arenas[-1] + plan.peak_bytes <= budget
    last = seen.metrics[-1]
    assert sum(last[f"activations/blocks_{p}"] for p in ("keep", "checkpoint", "swap_host", "swap_nvme")) == 4
    assert last["activations/blocks_keep"] < 4 and last["activations/predicted_peak_bytes"] == plan.peak_bytes


def test_auto_keeps_every_block_when_the_activations_fit(tmp_path):
    strategy = TieredStrategy(policy={"name": "auto", "activations": "auto"})
    train(strategy, tmp_path, epochs=1, make_model=gpt2)
    assert strategy.activation_plan.layout == ("keep",) * 4


def test_auto_with_accumulation_plans_between_optimizer_steps(tmp_path):
    total = param_bytes(gpt2)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2, accumulate_grad_batches=2)
    strategy = TieredStrategy(gpu_memory=int(TIGHT * total), host_memory="1GiB", policy={"name": "auto", "activations": "auto"})
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=2, make_model=gpt2, accumulate_grad_batches=2)
    assert strategy.activation_plan is not None and set(strategy.activation_plan.layout) != {"keep"}
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


@pytest.mark.parametrize("with_nvme", [False, True], ids=["no-nvme", "nvme"])
def test_swap_host_beyond_host_memory_goes_to_nvme_or_stays(tmp_path, with_nvme):
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=1, make_model=gpt2)
    seen = Swapped()
    nvme = {"nvme_path": tmp_path / "nvme"} if with_nvme else {}
    # everything fits in the GPU tier, so host memory is all for swapped activations: 256 KiB of them
    strategy = TieredStrategy(host_memory="256KiB", policy={"name": "auto", "activations": "swap_host"}, **nvme)
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=1, make_model=gpt2, extra_callbacks=(seen,))
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    last = seen.metrics[-1]
    assert 0 < last["activations/swapped_host_bytes"] <= 256 * 1024
    if with_nvme:
        assert last["activations/swapped_nvme_bytes"] > 0 and last["activations/swap_host_full_bytes"] == 0
    else:
        assert last["activations/swapped_nvme_bytes"] == 0 and last["activations/swap_host_full_bytes"] > 0


def test_the_default_policy_searches_placement_and_activations_together(tmp_path):
    """No policy given: the first step profiles, ProTrain's joint search places the parameters
    and lays out the blocks, and the run stays within the GPU tier and matches plain training."""
    total = param_bytes(gpt2)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2)
    seen = PlanSeen()
    budget = int(TIGHT * total)
    strategy = TieredStrategy(gpu_memory=budget, host_memory="1GiB")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=2, make_model=gpt2, extra_callbacks=(seen,))
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    searched, plan = strategy.placement_search, strategy.activation_plan
    assert searched is not None and searched.activations is not None
    assert plan is not None and set(plan.layout) != {"keep"}, plan
    assert strategy.tiered.activations.gpu_parameter_bytes() + plan.peak_bytes <= budget


def test_a_gpu_tier_smaller_than_a_checkpointed_block_is_refused_with_the_numbers(tmp_path):
    total = param_bytes(gpt2)
    with pytest.raises(PlacementError, match=r"raise gpu_memory to at least [\d.]+ KiB\. Checkpointed blocks recompute with all their "
                                             r"parameters in the GPU tier, [\d.]+ KiB for the largest block \(activations='auto'"):
        train(TieredStrategy(gpu_memory=int(0.3 * total), host_memory="1GiB"), tmp_path, epochs=1, make_model=gpt2)


class OneLinearBlocks(L.LightningModule):
    """Blocks that are single modules: a checkpointed block's recompute calls the module's own
    forward, so its parameters are read without its hooks."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
        self.head = nn.Linear(16, 256)

    def training_step(self, batch, batch_idx):
        x = self.embed(batch[:, :-1])
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_checkpointed_single_module_blocks_recompute_with_streamed_parameters(tmp_path):
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=OneLinearBlocks)
    # the smallest working set (two buffers of the head's 17 KiB): recomputing a block must not leave
    # its unit to a guard that holds parameters read outside their module's hooks
    # beside the checkpointed blocks' 203.44 KiB, counted in the tier since the first step measured them
    strategy = TieredStrategy(gpu_memory="238KiB", host_memory="1GiB", policy={**PARAMETERS_ONLY, "activations": "checkpoint"})
    seen = PlanSeen()
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=2, make_model=OneLinearBlocks, extra_callbacks=(seen,))
    assert seen.metrics[-1]["units/host"] > 0 and seen.metrics[-1]["activations/blocks_checkpoint"] == 4
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_the_parameters_are_placed_beside_the_layout_every_rank_runs(tmp_path):
    """Under data parallelism every rank runs rank 0's layout, but the parameters were placed in
    what the rank's own search's layout left of the GPU tier: ranks whose timings chose other
    layouts placed other host homes (two ranks sharing one copy of them stopped). Here the ranks'
    choice is rank 0's stand-in: a layout with a 4 KiB smaller peak than this rank's own."""
    from dataclasses import replace

    from offload_strategy.planning.activations import ActivationPlan

    budget = int(TIGHT * param_bytes(gpt2))
    strategy = TieredStrategy(gpu_memory=budget, host_memory="1GiB")
    chosen: list[ActivationPlan] = []

    def rank_zeros(choice):
        if isinstance(choice, ActivationPlan) and not chosen:
            chosen.append(replace(choice, peak_bytes=choice.peak_bytes - 4096))
            return chosen[0]
        return choice

    strategy.tiered.ranks.same_on_every_rank = rank_zeros
    train(strategy, tmp_path, epochs=1, make_model=gpt2)
    assert chosen and strategy.planner.resident is not None
    assert strategy.planner.resident.gpu_bytes == budget - chosen[0].peak_bytes


class QwenMoe(L.LightningModule):
    """Qwen2-MoE: its experts save the two halves of ``gate_up_proj``'s output (``chunk``: views
    with gaps between their rows), which come back from a swap contiguous unless their layout is
    kept; a shared expert beside them."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        config = Qwen2MoeConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=64, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4,
                                num_experts_per_tok=2, max_position_embeddings=32, decoder_sparse_step=1, output_router_logits=True)
        self.model = Qwen2MoeForCausalLM(config)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


@pytest.mark.parametrize("layout", ["swap_host", "swap_nvme"])
def test_swapped_views_with_gaps_come_back_as_they_were_saved(tmp_path, layout):
    """Qwen2-MoE with every block swapped trains bit-identically to plain training; before
    2026-11-27 the swapped halves of the experts' projections came back contiguous, and every
    weight of the first block and the embedding differed after the first step (by ~1e-8)."""
    pytest.importorskip("transformers.models.qwen2_moe")
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=1, make_model=QwenMoe)
    seen = Swapped()
    strategy = TieredStrategy(policy={"name": "auto", "activations": layout}, nvme_path=tmp_path / "nvme")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=1, make_model=QwenMoe, extra_callbacks=(seen,))
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    assert seen.metrics[-1][f"activations/swapped_{layout[5:]}_bytes"] > 0


def test_a_swap_brings_back_each_layout_and_copies_a_storage_once_for_its_views():
    """By hand: a (64, 96) fp32 product split in three as attention splits query, key and value
    (views with gaps, 24 KiB of storage), a transposed (32, 64) tensor (it covers its memory: 8 KiB),
    and a corner, 100 rows and 16 columns of a (256, 64) tensor (its span, 99 rows and 16 elements,
    is less than half its 64 KiB of storage). Each comes back with its strides and values. The three
    splits share one 24 KiB copy, the transposed tensor is its own 8 KiB, the corner its span
    (99 x 64 + 16 elements: 25,408 bytes): 58,176 bytes in all. A second backward through the kept
    graph fetches them again, and each copy is let go once all its views are unpacked."""
    from offload_strategy.hardware.device import make_device
    from offload_strategy.runtime.activations.swap import ActivationSwap

    product, square = torch.randn(64, 96), torch.randn(256, 64)
    q, k, v = product.split(32, dim=1)
    tensors = [q, k, v, torch.randn(64, 32).t(), square[:100, :16]]
    with make_device(torch.device("cpu"), capacity=1 << 20) as device:  # the suite's race check from the environment
        swap = ActivationSwap(device, None, is_parameter=lambda t: False)
        with swap.hooks(0, "swap_host"):
            packed = [swap._pack(0, "swap_host", t) for t in tensors]
        assert swap.stats.host_bytes == 64 * 96 * 4 + 32 * 64 * 4 + (99 * 64 + 16) * 4 == 58_176 and swap.stats.kept_bytes == 0
        assert packed[0].copy is packed[1].copy is packed[2].copy and len({id(p.copy) for p in packed}) == 3
        back = [swap._unpack(p) for p in reversed(packed)][::-1]
        assert all(p.copy.back is None for p in packed)  # each copy let go once its views are autograd's
        again = [swap._unpack(p) for p in reversed(packed)][::-1]  # a second backward through a kept graph
        assert all(p.copy.back is None for p in packed)
    for original, returned, second in zip(tensors, back, again):
        assert returned.stride() == second.stride() == original.stride() and torch.equal(returned, original) and torch.equal(second, original)
    assert back[0].untyped_storage().data_ptr() == back[2].untyped_storage().data_ptr()  # one copy, three views
