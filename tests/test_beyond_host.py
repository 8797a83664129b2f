"""A training state several times the host budget, end to end in the processes a user would run:
weights from a sharded safetensors directory, training with every unit on NVMe, a sharded
checkpoint, a bit-identical resume, and a single file plain Lightning loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch

from offload_strategy.demos import build_causal_lm
from offload_strategy import RUNTIME_HOST_ALLOWANCE
from tests.beyond_host_job import CONFIG, GPU_MEMORY, HOST_MEMORY, Pretrained
from tests.helpers import assert_same_weights, train

ROOT = Path(__file__).resolve().parents[1]
# What the process may grow by beyond its budgets while it trains (offload_strategy.RUNTIME_HOST_ALLOWANCE):
# measured at 130-145 MiB on the development machine for this model and for one twice as large
# (so not the model's). Gathering the model for a checkpoint (its parameters and AdamW's states,
# 145 MiB here) still exceeds it, as did the two lendings this test was written against (~465 MiB).
FIXED_GROWTH = RUNTIME_HOST_ALLOWANCE


def job(*args: str) -> dict:
    run = subprocess.run([sys.executable, str(ROOT / "tests/beyond_host_job.py"), *args], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.nvme
def test_a_state_four_times_the_host_budget_trains_checkpoints_resumes_and_converts(tmp_path):
    L.seed_everything(3, verbose=False)
    build_causal_lm("gpt2", CONFIG).save_pretrained(tmp_path / "weights", max_shard_size="8MB")  # seven shards and an index
    parameters = sum(p.numel() * 4 for p in build_causal_lm("gpt2", CONFIG).parameters())
    state = 4 * parameters  # fp32 parameters, gradients and AdamW's two states
    assert state >= 4 * HOST_MEMORY

    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", make_model=lambda: Pretrained(str(tmp_path / "weights")))
    first = job(str(tmp_path / "a"), "--weights", str(tmp_path / "weights"), "--stop-after-epochs", "1")
    checkpoint = tmp_path / "a" / "ckpt" / "epoch=0.ckpt"
    assert checkpoint.is_dir()
    second = job(str(tmp_path / "b"), "--weights", str(tmp_path / "weights"), "--resume", str(checkpoint))
    assert first["losses"] + second["losses"] == plain_losses  # loaded exactly, trained and resumed bit for bit
    for run in (first, second):
        assert run["peak_growth"] <= HOST_MEMORY + GPU_MEMORY + FIXED_GROWTH, f"grew by {run['peak_growth'] / 2**20:.0f} MiB"

    single = tmp_path / "final.ckpt"
    convert = subprocess.run([sys.executable, "-m", "offload_strategy", "consolidate", str(tmp_path / "b" / "ckpt" / "epoch=1.ckpt"), str(single)],
                             capture_output=True, text=True, cwd=ROOT)
    assert convert.returncode == 0, convert.stderr
    weights = torch.load(single, weights_only=True)["state_dict"]
    assert_same_weights(plain_weights, weights)
