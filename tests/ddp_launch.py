"""Starting ``tests/ddp_job.py`` as users start a data-parallel job, for the tests that compare
``tiered_ddp`` with Lightning's ``DDPStrategy`` (``test_ddp.py``, ``test_ddp_shared_homes.py``).

``launch`` starts every rank at once, as ``torchrun`` does (``LOCAL_RANK`` set: Lightning starts
none itself), so the ranks import their libraries side by side; ``launch_by_lightning`` starts one
process and lets Lightning start the other ranks, as ``python job.py`` does; ``launch_machines``
starts one process a machine, each with its ``NODE_RANK``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "ddp_job.py"


def _start(out: Path, args: tuple[str, ...], envs: list[dict[str, str]], timeout: float) -> dict[int, dict]:
    """Start the job once per environment and wait for all; return each rank's report. A process
    that fails stops the others at once (ranks left waiting in a collective would otherwise hold
    the test until its timeout, and hide the error)."""
    out.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    command = [sys.executable, str(JOB), "--out", str(out), *args]
    logs = [out / f"process{index}.log" for index in range(len(envs))]
    handles = [log.open("w") for log in logs]
    started = [subprocess.Popen(command, cwd=out, env={**base, **env}, stdout=handle, stderr=subprocess.STDOUT) for env, handle in zip(envs, handles)]
    deadline = time.monotonic() + timeout
    try:
        while any(process.poll() is None for process in started):
            failed = [index for index, process in enumerate(started) if process.poll() not in (None, 0)]
            assert not failed and time.monotonic() < deadline, "timed out" if not failed else "failed"
            time.sleep(0.1)
        failed = [index for index, process in enumerate(started) if process.returncode != 0]
        assert not failed, "failed"
    except AssertionError as e:
        index = failed[0] if failed else 0
        raise AssertionError(f"process {index} ({envs[index]}) {e}, exit {started[index].poll()}:\n{logs[index].read_text()[-6000:]}") from None
    finally:
        _stop(started, handles)
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def _meeting_point() -> dict[str, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def launch(out: Path, *args: str, timeout: float = 300) -> dict[int, dict]:
    """Run the job with every rank started at once, as ``torchrun`` starts them (the job's
    ``--devices`` ranks, two unless the arguments say otherwise); return each rank's report
    (an assertion error, with the first rank's log, past ``timeout`` seconds)."""
    ranks = int(args[args.index("--devices") + 1]) if "--devices" in args else 2
    meet = _meeting_point()
    envs = [{**meet, "LOCAL_RANK": str(r), "NODE_RANK": "0"} for r in range(ranks)] if ranks > 1 else [{}]
    return _start(out, args, envs, timeout=timeout)


def launch_by_lightning(out: Path, *args: str) -> dict[int, dict]:
    """Run the job as ``python job.py`` runs: one process, which Lightning's launcher runs again
    for every other rank; return each rank's report."""
    return _start(out, args, [{}], timeout=300)


def launch_machines(out: Path, machines: int, *args: str) -> dict[int, dict]:
    """Run the job as ``machines`` machines would: one launch per machine, each with its
    ``NODE_RANK`` and the same address to meet at; Lightning starts each machine's other ranks.
    Return each rank's report."""
    meet = _meeting_point()
    return _start(out, ("--num-nodes", str(machines), *args), [{**meet, "NODE_RANK": str(m)} for m in range(machines)], timeout=400)


def launch_until_one_fails(out: Path, wait: float, *args: str) -> tuple[int, float, str]:
    """Run the job with every rank started at once until one rank exits with an error (within
    ``wait`` seconds of the start, else an assertion error); stop the others. Return that rank,
    the seconds from ``<out>/hung.txt``'s time (written by the job's ``--hang`` rank) to its exit,
    and its log."""
    out.mkdir(parents=True, exist_ok=True)
    meet, base = _meeting_point(), {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK")}
    logs = [out / f"process{rank}.log" for rank in range(2)]
    handles = [log.open("w") for log in logs]
    started = [subprocess.Popen([sys.executable, str(JOB), "--out", str(out), *args], cwd=out, env={**base, **meet, "LOCAL_RANK": str(rank), "NODE_RANK": "0"},
                                stdout=handle, stderr=subprocess.STDOUT) for rank, handle in enumerate(handles)]
    deadline = time.monotonic() + wait
    try:
        while not (failed := [r for r, process in enumerate(started) if process.poll() not in (None, 0)]):
            assert time.monotonic() < deadline, f"no rank failed within {wait} s:\n{logs[0].read_text()[-3000:]}"
            time.sleep(0.05)
        ended = time.time()
    finally:
        _stop(started, handles)
    hung = out / "hung.txt"
    assert hung.exists(), f"no rank stopped responding:\n{logs[failed[0]].read_text()[-3000:]}"
    return failed[0], ended - float(hung.read_text()), logs[failed[0]].read_text()


def _stop(started: list, handles: list) -> None:
    """Every process still running killed, every log closed."""
    for process, handle in zip(started, handles):
        if process.poll() is None:
            process.kill()
            process.wait()
        handle.close()


def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)


def assert_same_optimizer_states(a: dict, b: dict) -> None:
    assert a["param_groups"] == b["param_groups"]
    assert sorted(a["state"]) == sorted(b["state"]), "the checkpoints hold states of different parameters"
    for index, values in a["state"].items():
        for key, value in values.items():
            other = b["state"][index][key]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), f"state {index}/{key} differs"


def plain_ddp_runs(tmp_path_factory) -> Callable[..., tuple[Path, dict[int, dict]]]:
    """Plain DDP runs that several tests of a module compare with, each run once:
    ``plain_ddp(*options)`` gives its directory and each rank's report (options are flag-value
    pairs, in any order)."""
    done: dict[tuple, tuple[Path, dict[int, dict]]] = {}

    def run(*options: str) -> tuple[Path, dict[int, dict]]:
        assert len(options) % 2 == 0, options
        key = tuple(sorted(zip(options[::2], options[1::2])))
        if key not in done:
            out = tmp_path_factory.mktemp("plain_ddp")
            done[key] = (out, launch(out, "--strategy", "ddp", *options))
        return done[key]

    return run
