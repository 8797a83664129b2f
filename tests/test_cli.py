"""The ``offload-strategy`` command: ``estimate`` for a Hugging Face config.json or a Hydra model
config, ``report``; also as ``python -m offload_strategy``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from offload_strategy import estimate
from offload_strategy.cli import main
from offload_strategy.estimate.models import CausalLM

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


def test_estimate_of_a_config_file_is_the_estimate_of_that_model(tmp_path, capsys):
    import transformers

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    assert main(["estimate", str(tmp_path), "--batch-size", "2", "--seq-len", "16", "--hardware", "rtx4090", "--policy", "auto", "fill",
                 "--precision", "32-true", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert list(rows) == ["auto", "fill"]
    fields = dict(LLAMA)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = CausalLM(transformers.AutoModelForCausalLM.from_config(config))
    expected = estimate(model, torch.zeros(2, 16, dtype=torch.long), policy=["auto", "fill"], hardware="rtx4090")
    for name in rows:
        assert rows[name]["gpu_memory"] == expected[name].gpu_memory > 0
        assert rows[name]["host_memory"] == expected[name].host_memory


def test_estimate_of_a_hydra_model_prints_the_table(capsys):
    assert main(["estimate", "gpt2_tiny", "--hardware", "rtx4090", "--policy", "auto", "none", "--batch-size", "2", "--seq-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "| auto |" in out and "| none |" in out and "priced on rtx4090" in out and "64 tokens per step" in out


def test_an_unknown_model_names_the_configs(tmp_path):
    with pytest.raises(SystemExit, match="llama_70b"):
        main(["estimate", "llama_71b"])
    with pytest.raises(SystemExit, match="no such file"):
        main(["estimate", str(tmp_path / "missing.json")])


def test_report_checks_the_environment(tmp_path, capsys):
    assert main(["report", "--nvme-path", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = {line[:28].strip(): line[28:].strip() for line in out.splitlines()}
    assert lines["torch"] == torch.__version__
    assert lines["CUDA available"].startswith("yes" if torch.cuda.is_available() else "no")
    assert lines["O_DIRECT"].startswith(("yes", "no"))
    assert lines["NVMe path"] == str(tmp_path)
    assert any(name.startswith("cgroup") for name in lines)


def test_report_without_an_nvme_path_says_how_to_check_one(capsys):
    main(["report"])
    assert "--nvme-path DIR" in capsys.readouterr().out


@pytest.mark.slow  # a fresh interpreter imports Lightning: 20 s on two busy cores
def test_python_dash_m_runs_the_command():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "offload_strategy", "--help"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "estimate" in result.stdout and "report" in result.stdout


def test_the_package_names_no_script_it_does_not_ship():
    """Messages and docstrings name the commands (offload-strategy plan, consolidate, ...), not the
    scripts they were, which the wheel does not ship."""
    scripts = ("tools/plan.py", "tools/simulate.py", "tools/probe.py", "tools/consolidate.py")
    cited = [(str(path.relative_to(ROOT)), script) for path in (ROOT / "offload_strategy").rglob("*.py") for script in scripts if script in path.read_text()]
    assert cited == []


@pytest.mark.slow
def test_a_70b_llama_is_estimated_within_a_minute(capsys):
    started = time.perf_counter()
    main(["estimate", "llama_70b", "--hardware", "h100_80g", "--policy", "auto"])
    took = time.perf_counter() - started
    assert "68,976.6 M parameters" in capsys.readouterr().out
    assert took < 60, f"the 70B estimate took {took:.1f} s"
