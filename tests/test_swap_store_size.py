"""The activation swap's NVMe store asks for no more than the disk has when it is made: the NVMe
budget of "all that is free" is read at set-up, and other processes may fill the disk before the
swap's store is made (before, it asked for the whole budget and stopped with NvmeSpaceError)."""

from __future__ import annotations

import pytest

import offload_strategy.memory.nvme as nvme_module
import offload_strategy.session.activations as session_activations
from offload_strategy import TieredStrategy
from offload_strategy.hardware import disk_free
from tests.helpers import assert_same_weights, train
from tests.test_activations import Swapped, gpt2
from tests.test_activations import STREAMED, streamed
from tests.test_offload import param_bytes


@pytest.mark.slow
def test_a_disk_filled_after_set_up_leaves_the_swap_store_room(tmp_path, monkeypatch):
    total = param_bytes(gpt2)
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=1, make_model=gpt2)
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    at_set_up = disk_free(str(nvme))
    strategy = TieredStrategy(
        policy={"name": "auto", **STREAMED, "activations": "swap_host"}, nvme_path=nvme, **streamed(total),
    )
    filled = at_set_up // 2  # what other processes leave free once the budgets are read

    def after_set_up(path: str) -> int:
        return filled if strategy.budgets is not None else disk_free(path)

    monkeypatch.setattr(nvme_module, "disk_free", after_set_up)
    monkeypatch.setattr(session_activations, "disk_free", after_set_up, raising=False)
    seen = Swapped()
    losses, weights, _ = train(strategy, tmp_path / "tiered", epochs=1, make_model=gpt2, extra_callbacks=(seen,))
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)
    assert strategy.budgets.nvme > filled  # the budget was read before the disk filled
    assert seen.metrics[-1]["activations/swapped_host_bytes"] > 0
