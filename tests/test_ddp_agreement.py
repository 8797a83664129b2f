"""``tiered_ddp``: decisions every rank must take alike, though each takes them from its own
budgets. Each rank keeps only its own units' optimizer states, so the host memory a placement
leaves differs from rank to rank; the units in the GPU tier must be the same on every rank all the
same (their gradients are all-reduced, the others' reduced to their owners)."""

from __future__ import annotations

import multiprocessing
import os
import socket
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from offload_strategy.lightning.ddp import DataParallelRanks
from tests.ddp_launch import launch, load
from tests.helpers import assert_same_weights

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


@pytest.mark.slow
def test_ranks_place_the_same_units_in_the_gpu_tier_when_their_host_memory_holds_different_states(tmp_path):
    """bf16-true AdamW under the default policy with an NVMe tier and 2.2x the parameters' bytes of
    host memory: beside rank 0's own units' states host memory held the rest of the parameters
    only with one unit resident, beside rank 1's with none, and each rank placed the profiled
    steps in its own least share of the GPU tier. Rank 0 then waited for the all-reduce of a
    unit rank 1 streamed from NVMe, and rank 1 in that unit's broadcast: the first step hung.
    The least share is now the one that holds on every rank. The run trains as the same ranks
    do in host memory enough for every unit (no NVMe), bit for bit."""
    recipe = ("--strategy", "tiered_ddp", "--default-policy", "--precision", "bf16-true", "--epochs", "1", "--max-steps", "2")
    tight = launch(tmp_path / "tight", *recipe, "--host-factor", "2.2", "--nvme", str(tmp_path / "nvme"), timeout=120)
    roomy = launch(tmp_path / "roomy", *recipe)
    for rank in (0, 1):
        assert len(tight[rank]["losses"]) == 2
        assert tight[rank]["losses"] == roomy[rank]["losses"], f"rank {rank}"
    metrics = [tight[rank]["metrics"] for rank in (0, 1)]
    assert metrics[0]["units/gpu"] == metrics[1]["units/gpu"] > 0 and metrics[0]["units/nvme"] + metrics[1]["units/nvme"] > 0, metrics
    assert_same_weights(load(tmp_path / "roomy" / "weights.pt"), load(tmp_path / "tight" / "weights.pt"))


def _check_on_rank(rank: int, port: int, choices: tuple, errors: "multiprocessing.Queue[str]") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=30))
    strategy = SimpleNamespace(global_rank=rank, world_size=2, root_device=torch.device("cpu"), _timeout=timedelta(seconds=30))
    ranks = DataParallelRanks(strategy, None, shard_states=True)  # type: ignore[arg-type]
    try:
        ranks.check_same_on_every_rank("the units in the GPU tier", choices[rank])
        errors.put("")
    except RuntimeError as error:
        errors.put(str(error))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("choices", [((0, 1), (0, 1)), ((0,), ())], ids=["alike", "different"])
def test_ranks_that_place_differently_fail_at_once_naming_both_choices(choices):
    """A placement that still differed between ranks fails on every rank, naming each one's
    choice, rather than leaving the ranks waiting in collectives the others never enter."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = multiprocessing.get_context("fork")
    errors = context.Queue()
    processes = [context.Process(target=_check_on_rank, args=(rank, port, choices, errors)) for rank in (0, 1)]
    for process in processes:
        process.start()
    said = [errors.get(timeout=60) for _ in processes]
    for process in processes:
        process.join(timeout=30)
    if choices[0] == choices[1]:
        assert said == ["", ""]
        return
    for error in said:
        assert "the ranks disagree on the units in the GPU tier" in error and "rank 0 chose (0,), rank 1 ()" in error, error
