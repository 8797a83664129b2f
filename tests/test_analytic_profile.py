"""Costs from shapes alone, worked out by hand, and the what-if tool on a model that is not built."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from offload_strategy import HardwareSpec
from offload_strategy.profiling.analytic import CPU_PARAMS_PER_S_PER_CORE, analytic_units
from offload_strategy.runtime.units import build_units

ROOT = Path(__file__).resolve().parent.parent
# 1,000 FLOP/s of bf16: times come out in whole seconds
TOY = HardwareSpec(name="toy", gpu="toy", gpu_memory="1GiB", gpu_bf16_tflops=1e-9, gpu_fp16_tflops=1e-9, h2d_gbps=1.0, d2h_gbps=1.0, host_memory="4GiB", cpu_cores=2)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4, bias=True)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # the output head multiplies by the embedding


def test_flops_and_times_by_hand():
    units, users = build_units(Tied())
    costs = analytic_units(units, users, tokens=5, hardware=TOY, efficiency=0.5)
    by_name = {c.name: c for c in costs}
    # the embedding's unit: no FLOPs as a lookup, 2 x 40 x 5 = 400 as the head's matrix
    assert by_name["embed"].forward_flops == 400 and by_name["embed"].forward_seconds == pytest.approx(400 / 500)
    # body: 2 x 16 x 5 = 160 (the bias is not a matrix); backward twice forward
    assert by_name["body"].forward_flops == 160 and by_name["body"].backward_seconds == pytest.approx(2 * 160 / 500)
    assert by_name["body"].update_seconds == pytest.approx(20 / (2 * CPU_PARAMS_PER_S_PER_CORE))
    assert "head" not in by_name  # its only parameter belongs to the embedding's unit
    with pytest.raises(ValueError, match=r"efficiency=0 must lie in \(0, 1\]"):
        analytic_units(units, users, tokens=5, hardware=TOY, efficiency=0)


@pytest.mark.slow
def test_simulate_predicts_a_model_that_is_never_built(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools/simulate.py"), "model=llama_7b", "hardware=rtx4090", "--gpu-memory", "4GiB", "16GiB", "--nvme-memory", "1TB"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "GiB |" in line]
    assert len(rows) == 2, result.stdout
    steps = [float(row.split("|")[7]) for row in rows]
    assert all(s > 0 for s in steps) and steps[1] <= steps[0]  # more GPU tier, no slower
    assert "6.74 B parameters" in result.stdout
