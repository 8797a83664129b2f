"""``tiered_ddp`` when a rank fails: a rank that stops responding fails the others within the
strategy's ``timeout``, and the shared-homes file of a run killed during set-up is removed by the
next run on the machine."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest
import torch.distributed as dist

from offload_strategy.runtime import shared_homes
from tests.ddp_launch import ROOT, launch_until_one_fails

TIMEOUT_S = 5.0


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_a_rank_that_stops_responding_fails_the_other_within_the_timeout(tmp_path):
    """Rank 1 sleeps before its third step; rank 0 fails in its next collective on the strategy's
    own gloo groups after the 5 s timeout given to ``TieredDDPStrategy`` (they waited half an
    hour, ``new_group``'s default, where Lightning's default group honours the timeout)."""
    rank, seconds, log = launch_until_one_fails(tmp_path, 120, "--strategy", "tiered_ddp", "--timeout", str(TIMEOUT_S), "--hang", "1", "2")
    assert rank == 0
    # gloo says "Timed out" at a wait, or "Application timeout caused pair closure" at a send
    assert re.search(r"Timed out|timeout caused", log), log[-3000:]
    assert TIMEOUT_S <= seconds < TIMEOUT_S + 25, f"rank 0 failed {seconds:.1f} s after rank 1 stopped"


_CREATE_AND_WAIT = """
import sys, time
from pathlib import Path
from offload_strategy.runtime import shared_homes
path, error = shared_homes._create(Path(sys.argv[1]), 1 << 20, 2)
print(path, flush=True)
time.sleep(600)
"""


def _run_holding_a_file(directory) -> tuple[subprocess.Popen, str]:
    """A process that made a shared-homes file in ``directory`` as set-up does, and waits."""
    process = subprocess.Popen([sys.executable, "-c", _CREATE_AND_WAIT, str(directory)], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    return process, process.stdout.readline().strip()


def test_the_shared_homes_file_of_a_run_killed_during_set_up_is_removed_by_the_next_run(tmp_path):
    """A run SIGKILLed after it reserved the shared host homes, before every rank mapped them,
    leaves its file (its pages held); the next run that makes one removes it, and leaves the file
    of a run still alive."""
    dead, dead_path = _run_holding_a_file(tmp_path)
    alive, alive_path = _run_holding_a_file(tmp_path)
    try:
        dead.send_signal(signal.SIGKILL)
        dead.wait()
        assert os.path.exists(dead_path) and os.path.exists(alive_path)
        path, error = shared_homes._create(tmp_path, 1 << 20, world_size=2)
        assert error == "" and os.path.exists(path)
        assert not os.path.exists(dead_path), "the killed run's file was left"
        assert os.path.exists(alive_path), "a live run's file was removed"
    finally:
        alive.kill()
        alive.wait()
