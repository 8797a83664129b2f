"""``tiered_ddp`` with two CPU processes (gloo) beside Lightning's ``DDPStrategy``: the same global
batch and seed give the same losses, weights and optimizer states, bit for bit. For two ranks this
is exact, not a tolerance: each rank halves its gradient (exact in binary floating point) and the
two halves are summed, in either order the same float, as DDP's reducer does.

Each run is ``tests/ddp_job.py`` started as a user starts it (``tests/ddp_launch.py``); the
``runs`` fixture lets Lightning start the second rank, the other runs start both at once, as
``torchrun`` does. ``test_ddp_shared_homes.py`` holds the ranks and machines that share host homes.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from offload_strategy.hardware.device import RACE_CHECK_ENV
from tests.ddp_job import GPT2_4L
from tests.ddp_launch import assert_same_optimizer_states, launch, launch_by_lightning, load, plain_ddp_runs
from tests.helpers import PARAMETERS_ONLY, assert_same_weights, train

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Plain DDP and tiered_ddp (host and NVMe tiers) on two ranks, and tiered on one, two epochs
    each (the checkpoints' resumed runs take two more)."""
    root = tmp_path_factory.mktemp("ddp")
    epochs = ("--epochs", "2")
    return {
        "ddp": (root / "ddp", launch_by_lightning(root / "ddp", "--strategy", "ddp", *epochs)),
        # less host memory than the single rank gets: each rank reserves room only for its own units' states
        "tiered_ddp": (root / "tiered_ddp", launch_by_lightning(root / "tiered_ddp", "--strategy", "tiered_ddp", "--nvme",
                                                                str(root / "tiered_ddp" / "nvme"), "--host-factor", "2.8", *epochs)),
        "tiered": (root / "tiered", launch(root / "tiered", "--strategy", "tiered", "--devices", "1", "--nvme", str(root / "tiered" / "nvme"), *epochs)),
    }


@pytest.fixture(scope="module")
def plain_ddp(tmp_path_factory):
    """Plain DDP runs several tests compare with, each run once (``plain_ddp_runs``)."""
    return plain_ddp_runs(tmp_path_factory)


def test_two_ranks_match_ddp_with_parameters_and_states_on_host_and_nvme(runs):
    plain_dir, plain = runs["ddp"]
    tiered_dir, tiered = runs["tiered_ddp"]
    assert set(plain) == set(tiered) == {0, 1}
    for rank in (0, 1):
        assert tiered[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
        metrics = tiered[rank]["metrics"]
        assert metrics["units/host"] > 0 and metrics["units/nvme"] > 0, metrics
        assert metrics["optimizer/nvme_state_bytes"] > 0, metrics
        assert metrics["race_checked"] == float(os.environ.get(RACE_CHECK_ENV, "0") not in ("", "0")), "the ranks inherit the suite's race check"
    assert plain[0]["losses"] != plain[1]["losses"], "both ranks saw the same batches"
    assert_same_weights(load(plain_dir / "weights.pt"), load(tiered_dir / "weights.pt"))
    # the checkpoint gathers every rank's states into DDP's own format
    a, b = load(plain_dir / "last.ckpt"), load(tiered_dir / "last.ckpt")
    assert_same_weights(a["state_dict"], b["state_dict"])
    assert_same_optimizer_states(a["optimizer_states"][0], b["optimizer_states"][0])


@pytest.mark.parametrize("shared", [(), ("--share-homes",)], ids=["copies", "shared_homes"])
def test_two_ranks_with_the_default_policy_search_the_same_plan_and_match_ddp(runs, tmp_path, shared):
    """Placement and activation layout searched from each rank's own timings: the ranks agree on
    one plan (rank 0's), place the parameters again between steps, and train as DDP does; with
    one copy of host homes too, mapped anew for each placement."""
    plain_dir, plain = runs["ddp"]
    out = tmp_path / "default"
    tiered = launch(out, "--strategy", "tiered_ddp", "--epochs", "2", "--default-policy", *shared)
    for rank in (0, 1):
        assert tiered[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
        assert (tiered[rank]["metrics"]["tier/host_shared_bytes"] > 0) == bool(shared)
    homes = [(tiered[rank]["metrics"]["units/gpu"], tiered[rank]["metrics"]["units/host"]) for rank in (0, 1)]
    assert homes[0] == homes[1] and homes[0][1] > 0, homes
    # the collectives the search priced the reductions at: measured at set-up, rank 0's on both
    rates = [tiered[rank]["metrics"]["link/collectives_host_gbps"] for rank in (0, 1)]
    assert rates[0] == rates[1] > 0, rates
    assert_same_weights(load(plain_dir / "weights.pt"), load(out / "weights.pt"))


def test_placing_again_hands_each_ranks_states_over_a_unit_at_a_time_and_matches_ddp(tmp_path, plain_ddp):
    """Placed again in part of the GPU tier, then in all of it: units leave the GPU tier (only
    their owner keeps their states now) and join it again (every rank needs their owner's). Each
    rank hands its own states to its next engine a unit at a time, those on NVMe read from the old
    files as they are taken, and a unit's states go from its owner to the other rank a unit at a
    time: nothing is gathered, and training goes on as DDP's, bit for bit. Before, every rank
    gathered every rank's states (here 1 MiB, the whole model's, pickled, in one collective), its
    own NVMe states read at once beside them."""
    plain_dir, plain = plain_ddp("--layers", "8", "--epochs", "2")
    out = tmp_path / "tiered_ddp"
    tiered = launch(out, "--strategy", "tiered_ddp", "--layers", "8", "--epochs", "2", "--nvme", str(out / "nvme"), "--host-factor", "1.2",
                    "--gpu-factor", "0.6", "--place-again", "2", "3", "--place-again-fraction", "0.5")
    for rank in (0, 1):
        assert tiered[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
    assert_same_weights(load(plain_dir / "weights.pt"), load(out / "weights.pt"))
    assert_same_optimizer_states(load(plain_dir / "last.ckpt")["optimizer_states"][0], load(out / "last.ckpt")["optimizer_states"][0])
    largest = max(placed["largest"] for report in tiered.values() for placed in report["placed_again"])  # one unit's states
    for rank, report in tiered.items():
        smaller, whole = report["placed_again"]
        assert smaller["gpu_units"] < whole["gpu_units"], report["placed_again"]
        for placed in (smaller, whole):
            assert placed["nvme"] > 4 * largest, placed  # this rank's NVMe states, read at once, would show
            # one unit's states read from the old file or received, and the buffer the new engine
            # writes them to NVMe from
            assert placed["loading"] <= 3 * largest, (rank, placed, largest)
            assert placed["collective"] <= largest, (rank, placed, largest)  # no collective carries more than one unit's states
        # the units that joined the GPU tier: their owner's states went to the other rank, one unit at a time
        moved = report["metrics"]
        assert moved["link/states_moved_bytes_total"] > moved["link/states_moved_largest_bytes"] > 0, moved
        assert moved["link/states_moved_largest_bytes"] <= largest, moved


def test_the_models_own_checkpointing_under_the_default_policy_matches_ddp(tmp_path):
    """transformers' checkpointing on every layer, the default policy on two ranks: every plan
    keeps each layer's units together (it stopped with no free GPU-tier buffer), and the ranks
    train as DDP does through the new placement."""
    plain = launch(tmp_path / "ddp", "--strategy", "ddp", "--hf-checkpointing", "--epochs", "2")
    tiered = launch(tmp_path / "tiered", "--strategy", "tiered_ddp", "--hf-checkpointing", "--epochs", "2", "--default-policy")
    for rank in (0, 1):
        assert tiered[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
        assert tiered[rank]["metrics"]["units/host"] > 0
    assert_same_weights(load(tmp_path / "ddp" / "weights.pt"), load(tmp_path / "tiered" / "weights.pt"))


def test_manual_optimization_accumulating_two_backward_calls_with_clipping_matches_ddp(tmp_path):
    """Manual optimization backwards twice before clipping and stepping. Each reduction was left
    in flight when the next training step began (the next backward added to the same tensors while
    gloo still wrote them; the run also aborted at exit), the reductions went to the owners alone
    (a rank then lost what it had accumulated for units it does not own), and the user's clipping
    read gradients whose reductions had not landed: the losses left DDP's at the first step."""
    plain = launch(tmp_path / "ddp", "--strategy", "ddp", "--manual", "--epochs", "2")
    for args in ((), ("--nvme", str(tmp_path / "nvme_run" / "nvme"))):
        out = tmp_path / ("nvme_run" if args else "host_run")
        tiered = launch(out, "--strategy", "tiered_ddp", "--manual", "--epochs", "2", *args)
        for rank in (0, 1):
            assert tiered[rank]["losses"] == plain[rank]["losses"], f"rank {rank} {args}"
        assert_same_weights(load(tmp_path / "ddp" / "weights.pt"), load(out / "weights.pt"))


def test_sharded_states_halve_each_ranks_share(runs):
    _, tiered = runs["tiered_ddp"]
    _, single = runs["tiered"]

    def state_bytes(report: dict) -> float:
        m = report["metrics"]
        return m["optimizer/gpu_state_bytes"] + m["optimizer/host_state_bytes"] + m["optimizer/nvme_state_bytes"]

    whole = state_bytes(single[0])
    shares = [state_bytes(tiered[rank]) / whole for rank in (0, 1)]
    assert all(0.35 < s < 0.65 for s in shares), shares
    assert abs(sum(shares) - 1.0) < 0.1, shares  # between them, every state once


def test_two_rank_checkpoint_resumes_on_one_rank_and_in_plain_training(runs, tmp_path):
    tiered_dir, _ = runs["tiered_ddp"]
    ckpt = tiered_dir / "last.ckpt"
    from tests.ddp_job import kept_peak, model_bytes
    from offload_strategy.demos import CausalLM
    from offload_strategy import TieredStrategy

    def gpt2_4l():
        return CausalLM(family="gpt2", config=GPT2_4L, lr=1e-2, warmup_steps=2)

    total = model_bytes()
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=4, resume=ckpt, make_model=gpt2_4l)
    # the kept layout's peak counted in the GPU tier beside the parameters' share
    strategy = TieredStrategy(policy=PARAMETERS_ONLY, gpu_memory=int(0.3 * total) + kept_peak(4), host_memory=int(4.2 * total), nvme_path=tmp_path / "nvme", nvme_memory="64MiB")
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=4, resume=ckpt, make_model=gpt2_4l)
    assert len(plain_losses) == 12, "the resumed run did not continue from epoch 2"
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_one_rank_checkpoint_resumes_on_two_ranks(runs, tmp_path):
    single_dir, _ = runs["tiered"]
    ckpt = single_dir / "last.ckpt"
    plain = launch(tmp_path / "ddp", "--strategy", "ddp", "--epochs", "4", "--resume", str(ckpt))
    # persistent units too, whose states every rank takes from the checkpoint
    tiered = launch(tmp_path / "tiered_ddp", "--strategy", "tiered_ddp", "--epochs", "4", "--resume", str(ckpt), "--nvme", str(tmp_path / "nvme"),
                    "--host-factor", "2.8", "--gpu-factor", "1.5")
    for rank in (0, 1):
        assert len(plain[rank]["losses"]) == 6  # two epochs of three batches per rank
        assert tiered[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
        assert tiered[rank]["metrics"]["units/gpu"] > 0
    assert_same_weights(load(tmp_path / "ddp" / "weights.pt"), load(tmp_path / "tiered_ddp" / "weights.pt"))
    assert_same_optimizer_states(load(tmp_path / "ddp" / "last.ckpt")["optimizer_states"][0], load(tmp_path / "tiered_ddp" / "last.ckpt")["optimizer_states"][0])


def test_accumulation_and_clipping_by_norm_match_ddp(tmp_path):
    """Accumulating micro-batches reduces once, on the last; clipping by norm needs every reduced
    gradient on every rank (all-reduce rather than reduce-to-owner)."""
    args = ("--accumulate", "2", "--clip-norm", "0.05", "--epochs", "2")
    plain = launch(tmp_path / "ddp", "--strategy", "ddp", *args)
    tiered = launch(tmp_path / "tiered_ddp", "--strategy", "tiered_ddp", *args)
    for rank in (0, 1):
        assert tiered[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
    assert_same_weights(load(tmp_path / "ddp" / "weights.pt"), load(tmp_path / "tiered_ddp" / "weights.pt"))


def test_parameters_unused_on_some_ranks_match_ddp_finding_unused_parameters(tmp_path):
    """A head used on rank 0 only (rank 1 contributes zeros, as DDP's reducer does) and one used
    on no rank (no gradient anywhere: not updated, no state)."""
    plain = launch(tmp_path / "ddp", "--strategy", "ddp_find_unused_parameters_true", "--rank-branch", "--epochs", "2")
    tiered = launch(tmp_path / "tiered_ddp", "--strategy", "tiered_ddp", "--rank-branch", "--epochs", "2")
    for rank in (0, 1):
        assert tiered[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
    a, b = load(tmp_path / "ddp" / "weights.pt"), load(tmp_path / "tiered_ddp" / "weights.pt")
    assert_same_weights(a, b)
    sa, sb = load(tmp_path / "ddp" / "last.ckpt"), load(tmp_path / "tiered_ddp" / "last.ckpt")
    assert_same_optimizer_states(sa["optimizer_states"][0], sb["optimizer_states"][0])


@pytest.mark.parametrize("clipping", [(), ("--clip-norm", "0.05")], ids=["plain", "clipping_by_norm"])
def test_other_ranks_units_keep_gradients_only_until_sent_and_match_ddp(tmp_path, plain_ddp, clipping):
    """Every backward reduces each unit's gradients to its owner: a rank holds the gradients of the
    units it does not own in a few buffers until sent, not a home each. In 3.8x the parameters'
    bytes of host memory per rank (a gradient home each would need 4.04x on rank 1), eight blocks
    train as DDP trains them, bit for bit, and no rank makes a buffer beyond the four planned.
    Under clipping by norm too: each owner takes its units' gradients' norms and the ranks
    exchange them, so that no rank needs every reduced gradient."""
    plain_dir, plain = plain_ddp("--layers", "8", "--epochs", "2", *clipping)
    tiered = launch(tmp_path / "tiered_ddp", "--strategy", "tiered_ddp", "--layers", "8", "--epochs", "2", "--host-factor", "3.8", *clipping)
    for rank in (0, 1):
        assert tiered[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
        metrics = tiered[rank]["metrics"]
        assert metrics["units/host"] > 0 and metrics["units/nvme"] == 0, metrics
        assert metrics["gradients/buffers_most_held"] > 0 and metrics["gradients/buffers_beyond_plan_total"] == 0, metrics
        assert metrics["tier/host_peak_bytes"] <= metrics["budget/host_bytes"], metrics  # what the rank held kept to its budget
    assert_same_weights(load(plain_dir / "weights.pt"), load(tmp_path / "tiered_ddp" / "weights.pt"))
    assert_same_optimizer_states(load(plain_dir / "last.ckpt")["optimizer_states"][0], load(tmp_path / "tiered_ddp" / "last.ckpt")["optimizer_states"][0])


@pytest.mark.parametrize("setting", [("--host-factor", "3.0"), ("--host-factor", "4.2", "--no-shard")], ids=["sharded", "replicated_states"])
def test_owned_units_gradients_too_live_only_until_their_update(tmp_path, plain_ddp, setting):
    """With one optimizer, no accumulation and nothing that reads every gradient first, each
    owner updates its units as their reductions come in, so its own units' gradients need a
    buffer only until then, as the others' need one until sent: eight blocks train in 3.0x the
    parameters' bytes of host memory per rank (a gradient home for each own unit needed 1.56 MiB,
    1.27 granted), bit-identically to DDP, within the budget and the four buffers planned. With
    every rank keeping every state, each updates every unit once its all-reduce is in (4.2x)."""
    plain_dir, plain = plain_ddp("--layers", "8", "--epochs", "2")
    tiered = launch(tmp_path / "tiered_ddp", "--strategy", "tiered_ddp", "--layers", "8", "--epochs", "2", *setting)
    for rank in (0, 1):
        assert tiered[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
        metrics = tiered[rank]["metrics"]
        assert metrics["units/host"] > 0 and metrics["gradients/buffers_beyond_plan_total"] == 0, metrics
        assert metrics["tier/host_peak_bytes"] <= metrics["budget/host_bytes"], metrics
    assert_same_weights(load(plain_dir / "weights.pt"), load(tmp_path / "tiered_ddp" / "weights.pt"))
    assert_same_optimizer_states(load(plain_dir / "last.ckpt")["optimizer_states"][0], load(tmp_path / "tiered_ddp" / "last.ckpt")["optimizer_states"][0])


def test_each_rank_keeps_the_fp32_masters_of_its_own_units_only(tmp_path):
    """Under bf16-true a host unit is updated through fp32 masters, which only its owner uses:
    the two ranks' masters together are those of every host unit, once (each rank kept all of
    them before, beyond what the placement planned)."""
    tiered = launch(tmp_path / "tiered_ddp", "--strategy", "tiered_ddp", "--epochs", "1", "--precision", "bf16-true")
    ranks = [tiered[rank]["metrics"] for rank in (0, 1)]
    assert ranks[0]["units/host"] == ranks[1]["units/host"] > 0 and ranks[0]["units/nvme"] == 0
    every = ranks[0]["all_host_masters_bytes"]
    assert every == ranks[1]["all_host_masters_bytes"] > 0
    held = [m["optimizer/host_master_bytes"] for m in ranks]
    assert all(0 < h < every for h in held) and sum(held) == every, (held, every)


def test_bf16_gradients_are_reduced_in_16_bits_as_ddp_reduces_them(tmp_path):
    """Under bf16-true the gradients of 16-bit parameters are reduced in bf16, as DDP reduces them,
    though accumulated in fp32 for their masters: half the bytes between ranks, and one SGD step
    (whose bf16 update rounds once from fp32, as an fp32 master's does) gives DDP's weights bit
    for bit. They were reduced in fp32 before, which rounded the sums differently. Host units
    here: the one step, which measures the kept layout, streams every unit through the fewest
    buffers (persistent units reduce in bf16 through the same path, checked once, 2026-11-26, as
    NVMe units narrow into the same landing areas)."""
    recipe = ["--epochs", "1", "--max-steps", "1", "--sgd", "--precision", "bf16-true"]
    plain = launch(tmp_path / "ddp", "--strategy", "ddp", *recipe)
    tiered = launch(tmp_path / "tiered_ddp", "--strategy", "tiered_ddp", *recipe)
    for rank in (0, 1):
        assert tiered[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
        metrics = tiered[rank]["metrics"]
        assert metrics["units/host"] > 0, metrics
    assert_same_weights(load(tmp_path / "ddp" / "weights.pt"), load(tmp_path / "tiered_ddp" / "weights.pt"))


def test_gradients_changed_in_on_after_backward_match_ddp(tmp_path):
    """``on_after_backward`` sees the reduced gradients on ``p.grad``, as after DDP's backward,
    and what it changes is what is stepped. Units on NVMe here; host units are exposed the same
    way (checked once, 2026-11-26)."""
    plain = launch(tmp_path / "ddp", "--strategy", "ddp", "--epochs", "2", "--after-backward")
    tiered = launch(tmp_path / "tiered_ddp", "--strategy", "tiered_ddp", "--epochs", "2", "--after-backward",
                    "--nvme", str(tmp_path / "nvme"), "--host-factor", "3.0")
    for rank in (0, 1):
        assert tiered[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
        assert tiered[rank]["metrics"]["units/nvme"] > 0
    assert_same_weights(load(tmp_path / "ddp" / "weights.pt"), load(tmp_path / "tiered_ddp" / "weights.pt"))


def test_a_loss_in_chunks_trains_as_under_ddp(tmp_path, plain_ddp):
    """The loss a chunk of 7 tokens at a time calls the tied head nine times in forward and
    again in backward; each unit's gradients are reduced once all have arrived: bit-identical to
    DDP with the same loss."""
    plain_dir, plain = plain_ddp("--epochs", "2", "--loss-chunk-tokens", "7")
    tiered = launch(tmp_path / "tiered_ddp", "--strategy", "tiered_ddp", "--epochs", "2", "--loss-chunk-tokens", "7")
    for rank in (0, 1):
        assert tiered[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
    assert_same_weights(load(plain_dir / "weights.pt"), load(tmp_path / "tiered_ddp" / "weights.pt"))


@pytest.mark.parametrize("clipping", [(), ("--clip-norm", "0.05")], ids=["plain", "clipping_by_norm"])
def test_persistent_units_are_all_reduced_and_updated_on_every_rank(tmp_path, runs, plain_ddp, clipping):
    """Persistent units are not sharded (ProTrain §3.1.1): every rank all-reduces their gradients,
    keeps their optimizer states and updates them, so none is sent after the step. With a GPU tier
    of 1.5x the parameters' bytes, 13 of 27 units stay there with the same optimizer states on both
    ranks, and training is bit-identical to DDP; under clipping by norm every rank takes the
    persistent gradients' norms itself and exchanges only its own offloaded units'."""
    # without clipping, the module's plain DDP run (two epochs; a rank's results do not depend on who started it)
    plain_dir, plain = plain_ddp("--epochs", "2", *clipping) if clipping else runs["ddp"]
    tiered = launch(tmp_path / "tiered_ddp", "--strategy", "tiered_ddp", "--epochs", "2", "--gpu-factor", "1.5", *clipping)
    ranks = [tiered[rank]["metrics"] for rank in (0, 1)]
    for rank in (0, 1):
        assert tiered[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
    assert ranks[0]["units/gpu"] == ranks[1]["units/gpu"] > 0 and ranks[0]["units/host"] > 0
    assert ranks[0]["optimizer/gpu_state_bytes"] == ranks[1]["optimizer/gpu_state_bytes"] > 0
    assert_same_weights(load(plain_dir / "weights.pt"), load(tmp_path / "tiered_ddp" / "weights.pt"))
    assert_same_optimizer_states(load(plain_dir / "last.ckpt")["optimizer_states"][0], load(tmp_path / "tiered_ddp" / "last.ckpt")["optimizer_states"][0])


def test_policy_none_under_16_true_updates_fp32_masters_as_every_placement(tmp_path):
    """Under policy 'none' plain DDP stepped the fp16 parameters themselves (NaN from the second
    step, AdamW's epsilon being 0 in fp16); it now keeps fp32 masters, every unit in the GPU tier,
    and trains as the host placement does, bit for bit."""
    recipe = ["--epochs", "1", "--max-steps", "2", "--precision", "16-true"]  # two steps: the second went to NaN
    none = launch(tmp_path / "none", "--strategy", "tiered_ddp", "--policy-none", *recipe)
    host = launch(tmp_path / "host", "--strategy", "tiered_ddp", *recipe)
    for rank in (0, 1):
        assert none[rank]["losses"] == host[rank]["losses"], f"rank {rank}"
        assert none[rank]["metrics"]["units/gpu"] > 0 and none[rank]["metrics"]["units/host"] == 0
        assert host[rank]["metrics"]["units/host"] > 0
    weights = load(tmp_path / "none" / "weights.pt")
    assert all(torch.isfinite(w).all() and w.dtype == torch.float16 for w in weights.values())
    assert_same_weights(load(tmp_path / "host" / "weights.pt"), weights)
