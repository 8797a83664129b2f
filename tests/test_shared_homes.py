"""The shared-memory file behind host homes the machine's ranks share: refusals leave nothing behind."""

import errno
import os

import pytest

from offload_strategy.runtime import shared_homes


def test_a_full_shared_memory_file_system_is_refused_with_the_numbers_and_no_file_left(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shared_homes.os, "posix_fallocate", full)
    path, error = shared_homes._create(tmp_path, 3 * 2**30, world_size=4)
    assert path == ""
    assert "need 3.00 GiB in" in error and "machine's 4 ranks" in error and "--shm-size=4g" in error and "share_host_homes=False" in error
    assert list(tmp_path.iterdir()) == []


def test_the_file_is_made_with_its_pages_reserved(tmp_path):
    path, error = shared_homes._create(tmp_path, 1 << 20, world_size=2)
    assert error == "" and os.path.getsize(path) == 1 << 20
    assert os.stat(path).st_mode & 0o777 == 0o600  # this user's processes only


def _ranks(world_size, processes, shard_states=True, share=True):
    from types import SimpleNamespace

    from offload_strategy.lightning.ddp import DataParallelRanks

    return DataParallelRanks(SimpleNamespace(world_size=world_size, num_processes=processes), None, shard_states, share)


def test_host_homes_are_shared_by_each_machines_ranks():
    available = shared_homes.shared_memory_available()
    assert _ranks(2, 2).homes_shared() == available
    assert _ranks(4, 2).homes_shared() == available and _ranks(4, 2).machines == 2  # two machines of two: a copy on each
    assert not _ranks(2, 2, share=False).homes_shared()
    assert not _ranks(1, 1).homes_shared()  # one process: nothing to share
    with pytest.warns(UserWarning, match="each machine runs one rank"):
        assert not _ranks(2, 1).homes_shared()  # two machines of one
    with pytest.warns(UserWarning, match="needs shard_states=True"):
        assert not _ranks(2, 2, shard_states=False).homes_shared()


def test_a_machine_without_shared_memory_keeps_a_copy_per_rank(monkeypatch):
    from offload_strategy.lightning import ddp as strategy_ddp

    monkeypatch.setattr(strategy_ddp, "shared_memory_unavailable", lambda: "/dev/shm does not exist or is not a directory")
    with pytest.warns(UserWarning, match="/dev/shm does not exist"):
        assert not _ranks(4, 2).homes_shared()


def test_machines_and_peers_follow_each_ranks_machine_not_its_number():
    from offload_strategy.lightning.ddp import machines_and_peers

    # machine by machine (torchrun): ranks 0-1 on machine 0, 2-3 on machine 1
    assert machines_and_peers([(0, 0), (0, 1), (1, 0), (1, 1)]) == ([(0, 1), (2, 3)], [(0, 2), (1, 3)])
    # round-robin (a scheduler's cyclic distribution): ranks 0 and 2 on machine 0
    assert machines_and_peers([(0, 0), (1, 0), (0, 1), (1, 1)]) == ([(0, 2), (1, 3)], [(0, 1), (2, 3)])
