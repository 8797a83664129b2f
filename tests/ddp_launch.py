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
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "tests" / "ddp_job.py"


def _start(out: Path, command: list[str], envs: list[dict[str, str]], timeout: float) -> dict[int, dict]:
    """Start one process per environment, wait for all; return each rank's report."""
    out.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK")}
    started = [subprocess.Popen(command, cwd=out, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for env in envs]
    for index, process in enumerate(started):
        stdout, stderr = process.communicate(timeout=timeout)
        assert process.returncode == 0, f"process {index} ({envs[index]}): exit {process.returncode}\n{stdout[-3000:]}\n{stderr[-4000:]}"
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def _meeting_point() -> dict[str, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def launch(out: Path, *args: str) -> dict[int, dict]:
    """Run the job with every rank started at once, as ``torchrun`` starts them (the job's
    ``--devices`` ranks, two unless the arguments say otherwise); return each rank's report."""
    ranks = int(args[args.index("--devices") + 1]) if "--devices" in args else 2
    meet = _meeting_point()
    envs = [{**meet, "LOCAL_RANK": str(r), "NODE_RANK": "0"} for r in range(ranks)] if ranks > 1 else [{}]
    return _start(out, [sys.executable, str(JOB), "--out", str(out), *args], envs, timeout=300)


def launch_by_lightning(out: Path, *args: str) -> dict[int, dict]:
    """Run the job as ``python job.py`` runs: one process, which Lightning's launcher runs again
    for every other rank; return each rank's report."""
    return _start(out, [sys.executable, str(JOB), "--out", str(out), *args], [{}], timeout=300)


def launch_machines(out: Path, machines: int, *args: str) -> dict[int, dict]:
    """Run the job as ``machines`` machines would: one launch per machine, each with its
    ``NODE_RANK`` and the same address to meet at; Lightning starts each machine's other ranks.
    Return each rank's report."""
    meet = _meeting_point()
    command = [sys.executable, str(JOB), "--out", str(out), "--num-nodes", str(machines), *args]
    return _start(out, command, [{**meet, "NODE_RANK": str(m)} for m in range(machines)], timeout=400)


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
