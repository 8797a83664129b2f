"""``tiered_ddp`` with ``share_host_homes``: the ranks of a machine map one copy of the host units'
16-bit parameters, beside Lightning's ``DDPStrategy`` or the same ranks keeping a copy each; the
same global batch and seed give the same losses, weights and optimizer states, bit for bit. Two
machines of two ranks are emulated on this one, each machine with its own copy
(``tests/ddp_launch.py``: ``launch_machines``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from tests.ddp_launch import assert_same_optimizer_states, launch, launch_machines, load, plain_ddp_runs
from tests.helpers import assert_same_weights

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no shared-memory file system"),
]


@pytest.fixture(scope="module")
def plain_ddp(tmp_path_factory):
    """Plain DDP runs several tests compare with, each run once (``plain_ddp_runs``)."""
    return plain_ddp_runs(tmp_path_factory)


def _shared_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("offload_strategy-homes-*")} if Path("/dev/shm").is_dir() else set()


@pytest.mark.parametrize(
    "setting",
    [("--layers", "8", "--host-factor", "2.5"), ("--host-factor", "2.2", "--nvme", "NVME"), ("--layers", "8", "--host-factor", "3.0", "--clip-norm", "0.05")],
    ids=["host_only", "host_and_nvme", "clipping_by_norm"],
)
def test_ranks_sharing_one_copy_of_host_homes_match_ddp(tmp_path, plain_ddp, setting):
    """``share_host_homes``: the two ranks map one copy of the host units' parameters, each owner
    writes its updates there and nothing is broadcast for them. Eight blocks train in 2.5x the
    parameters' bytes of host memory per rank, which a copy each cannot (1.24 MiB needed, 1.06
    granted), bit-identically to DDP; with an NVMe tier, both ranks home the same units in host
    memory (a copy each, rank 0 homes 4 there and rank 1 13). The shared file's name is gone
    once the ranks have mapped it. Under clipping by norm the owners update after backward, and
    write the one copy before the barrier all the same."""
    before = _shared_files()
    args = [str(tmp_path / "nvme") if a == "NVME" else a for a in setting]
    model_and_recipe = [a for k, a in enumerate(setting) if a in ("--layers", "--clip-norm") or setting[k - 1] in ("--layers", "--clip-norm")]
    plain_dir, plain = plain_ddp("--epochs", "2", *model_and_recipe)
    tiered = launch(tmp_path / "tiered_ddp", "--strategy", "tiered_ddp", "--epochs", "2", "--share-homes", *args)
    assert not _shared_files() - before
    ranks = [tiered[rank]["metrics"] for rank in (0, 1)]
    for rank, metrics in enumerate(ranks):
        assert tiered[rank]["losses"] == plain[rank]["losses"], f"rank {rank}"
        assert metrics["tier/host_shared_bytes"] > 0 and metrics["tier/host_peak_bytes"] <= metrics["budget/host_bytes"], metrics
    assert ranks[0]["units/host"] == ranks[1]["units/host"] > 0 and ranks[0]["tier/host_shared_bytes"] == ranks[1]["tier/host_shared_bytes"]
    assert (ranks[0]["units/nvme"] > 0) == ("NVME" in setting)
    assert_same_weights(load(plain_dir / "weights.pt"), load(tmp_path / "tiered_ddp" / "weights.pt"))
    assert_same_optimizer_states(load(plain_dir / "last.ckpt")["optimizer_states"][0], load(tmp_path / "tiered_ddp" / "last.ckpt")["optimizer_states"][0])


def test_sharing_host_homes_changes_no_result_under_bf16_true(tmp_path):
    """Under bf16-true each owner writes its units' 16-bit parameters from their fp32 masters into
    the one copy: the run is bit-identical to the ranks keeping a copy each (in host memory
    enough for every unit). The default policy with an NVMe tier: the profiled steps stream every
    unit, each step after the first reading what the owners wrote at the last, and the searched
    placement after them moves units from NVMe into the shared homes and from host memory into
    the GPU tier. Only the first rank writes the homes' values; before, on the other rank the
    value still to be read from its old file was given a tensor of its own off the home once the
    engine was built, which the engine took for a value user code gave the parameter: the fp32
    masters of the units that rank owns were taken again from their bf16 values, and the step
    after the search came out a bf16 ulp off."""
    recipe = ("--strategy", "tiered_ddp", "--epochs", "2", "--max-steps", "4", "--precision", "bf16-true", "--default-policy")
    shared = launch(tmp_path / "shared", *recipe, "--share-homes", "--host-factor", "2.2", "--nvme", str(tmp_path / "nvme"))
    copies = launch(tmp_path / "copies", *recipe)
    for rank in (0, 1):
        assert len(shared[rank]["losses"]) == 4  # three profiled steps, one placed by the search
        assert shared[rank]["losses"] == copies[rank]["losses"], f"rank {rank}"
        metrics = shared[rank]["metrics"]
        assert metrics["tier/host_shared_bytes"] > 0 == copies[rank]["metrics"]["tier/host_shared_bytes"]
        assert metrics["units/nvme"] > 0 and metrics["units/gpu"] > 0, metrics
    assert_same_weights(load(tmp_path / "copies" / "weights.pt"), load(tmp_path / "shared" / "weights.pt"))


def test_each_machine_keeps_one_copy_of_host_homes_and_the_owners_send_updates_across(tmp_path):
    """Two machines of two ranks with ``share_host_homes``: each machine's ranks map their own
    copy of the host units' parameters; each owner writes its update to its machine's copy and
    sends it to the rank of its local index on the other machine, which writes it there. The
    run is bit-identical to the same four ranks keeping a copy each (without the sending, the
    losses part in the second step). Each rank holds half its machine's copy (0.60 MiB) and stays
    within 2.5x the parameters' bytes (1.06 MiB), which a copy each is refused (1.21 MiB
    needed): the copies run gets 3x, and holds at least the other half beyond."""
    recipe = ("--epochs", "2", "--layers", "8", "--devices", "2")
    before = _shared_files()
    shared = launch_machines(tmp_path / "shared", 2, "--strategy", "tiered_ddp", "--share-homes", "--host-factor", "2.5", *recipe)
    assert not _shared_files() - before
    copies = launch(tmp_path / "copies", "--strategy", "tiered_ddp", "--host-factor", "3.0", *recipe[:-1], "4")
    assert sorted(shared) == sorted(copies) == [0, 1, 2, 3] and shared[0]["world_size"] == 4
    for rank in range(4):
        assert shared[rank]["losses"] == copies[rank]["losses"], f"rank {rank}"
        ours, theirs = shared[rank]["metrics"], copies[rank]["metrics"]
        assert ours["tier/host_shared_bytes"] > 0 == theirs["tier/host_shared_bytes"]
        assert ours["tier/host_peak_bytes"] <= ours["budget/host_bytes"], ours
        # the other half of the machine's copy is what a copy each holds beyond
        assert theirs["tier/host_peak_bytes"] - ours["tier/host_peak_bytes"] >= ours["tier/host_shared_bytes"] / 2, (ours, theirs)
    assert len({shared[rank]["metrics"]["units/host"] for rank in range(4)}) == 1
    assert_same_weights(load(tmp_path / "copies" / "weights.pt"), load(tmp_path / "shared" / "weights.pt"))
    assert_same_optimizer_states(load(tmp_path / "copies" / "last.ckpt")["optimizer_states"][0],
                                 load(tmp_path / "shared" / "last.ckpt")["optimizer_states"][0])


def test_machines_sharing_host_homes_with_an_nvme_tier_clipping_and_bf16_true(tmp_path):
    """The same two machines of two with an NVMe tier (every rank homes the same units in host
    memory, the rest in its own files), clipping by norm (the owners update after backward, then
    send) and bf16-true (each owner writes its units' 16-bit parameters from their fp32 masters
    into its machine's copy): bit-identical to the four ranks keeping a copy each."""
    recipe = ("--epochs", "2", "--devices", "2", "--layers", "8", "--host-factor", "2.0", "--clip-norm", "0.05", "--precision", "bf16-true")
    shared = launch_machines(tmp_path / "shared", 2, "--strategy", "tiered_ddp", "--share-homes", "--nvme", str(tmp_path / "nvme_shared"), *recipe)
    copies = launch(tmp_path / "copies", "--strategy", "tiered_ddp", "--nvme", str(tmp_path / "nvme_copies"), *recipe[:3], "4", *recipe[4:])
    for rank in range(4):
        assert shared[rank]["losses"] == copies[rank]["losses"], f"rank {rank}"
        assert shared[rank]["metrics"]["tier/host_shared_bytes"] > 0 and shared[rank]["metrics"]["units/nvme"] > 0
    assert len({shared[rank]["metrics"]["units/host"] for rank in range(4)}) == 1
    assert_same_weights(load(tmp_path / "copies" / "weights.pt"), load(tmp_path / "shared" / "weights.pt"))


def test_machines_sharing_host_homes_resume_a_checkpoint(tmp_path):
    """A one-rank checkpoint resumed on two machines of two sharing host homes: the values each
    machine's copy starts from are the checkpoint's, as on four ranks keeping a copy each."""
    launch(tmp_path / "tiered", "--strategy", "tiered", "--devices", "1", "--nvme", str(tmp_path / "tiered" / "nvme"), "--epochs", "2")
    ckpt = tmp_path / "tiered" / "last.ckpt"
    resume = ("--epochs", "4", "--resume", str(ckpt), "--host-factor", "2.8")
    shared = launch_machines(tmp_path / "shared", 2, "--strategy", "tiered_ddp", "--share-homes", "--devices", "2", *resume)
    copies = launch(tmp_path / "copies", "--strategy", "tiered_ddp", "--devices", "4", *resume)
    for rank in range(4):
        assert len(copies[rank]["losses"]) == 2  # two epochs of one batch per rank
        assert shared[rank]["losses"] == copies[rank]["losses"], f"rank {rank}"
        assert shared[rank]["metrics"]["tier/host_shared_bytes"] > 0
    assert_same_weights(load(tmp_path / "copies" / "weights.pt"), load(tmp_path / "shared" / "weights.pt"))
