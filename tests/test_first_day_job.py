"""`make train`'s job as a new user meets it: a short run validates at its end, the preset is a key of
its own, the last checkpoint is found by ``resume=last``, a sweep records a refused job and goes on,
and the summary is a few lines."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from hydra.utils import instantiate

from experiments.summary import format_short_summary
from experiments.train import hyperparameters, resolve_resume, trainer_options
from tests.test_hydra_configs import compose_as_hydra
from tests.test_train_job import ROOT, run


def test_a_run_shorter_than_the_validation_interval_validates_at_its_last_step(tmp_path):
    short = compose_as_hydra(["trainer.max_steps=30", "trainer.val_check_interval=100"], tmp_path)
    assert trainer_options(short) == {"val_check_interval": 30}
    assert trainer_options(compose_as_hydra(["trainer.max_steps=300", "trainer.val_check_interval=100"], tmp_path)) == {}
    assert trainer_options(compose_as_hydra(["trainer.max_steps=-1"], tmp_path)) == {}


def test_the_preset_is_a_key_of_its_own(tmp_path):
    cfg = compose_as_hydra(["policy=protrain"], tmp_path)
    assert hyperparameters(cfg, instantiate(cfg.hardware))["preset"] == "protrain"


def test_resume_last_finds_the_latest_jobs_last_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr("experiments.train.get_original_cwd", lambda: str(tmp_path))  # where the job was started
    with pytest.raises(FileNotFoundError, match="resume=last: no checkpoints/last.ckpt"):
        resolve_resume("last")
    older, newer = tmp_path / "outputs/d/1/checkpoints/last.ckpt", tmp_path / "multirun/d/2/0/checkpoints/last.ckpt"
    for path in (older, newer):
        path.parent.mkdir(parents=True)
        path.write_bytes(b"")
    now = time.time()
    os.utime(older, (now - 60, now - 60))
    assert resolve_resume("last") == str(newer)
    assert resolve_resume("a/b.ckpt") == "a/b.ckpt" and resolve_resume(None) is None


def test_the_short_summary_is_about_ten_lines_with_the_checkpoint():
    summary = {"model": "gpt2-tiny", "parameters": 3_290_000, "preset": "fill", "steps": 90, "wall_seconds": 101.0,
               "tokens_per_sec": 2700.0, "step_time_ms": 757.0, "train_loss_first": 5.5, "train_loss_last": 2.6, "val_loss": 2.7,
               "offload/units/gpu": 0, "offload/units/host": 19, "offload/units/nvme": 8, "offload/tier/gpu_peak_bytes": 3 << 20,
               "offload/tier/host_peak_bytes": 29 << 20, "offload/tier/nvme_bytes": 20 << 20, "peak_host_bytes": 900 << 20,
               "offload/cache/hit_rate": 0.93, "checkpoint": "outputs/x/checkpoints/last.ckpt"}
    lines = format_short_summary(summary, Path("outputs/x/metrics.json")).strip().splitlines()
    assert 8 <= len(lines) <= 12 and all(len(line) <= 120 for line in lines), lines
    text = "\n".join(lines)
    assert "gpu 0, host 19, nvme 8" in text and "outputs/x/checkpoints/last.ckpt" in text and "preset fill" in text
    assert "train 5.5 -> 2.6, val 2.7" in text and "2,700 tokens/s" in text


@pytest.mark.slow
def test_a_sweep_records_a_refused_job_and_goes_on_and_resume_last_continues(tmp_path):
    job = ["experiment=offload_cpu", "logger=csv", "data=synthetic", "data.num_tokens=20000", "data.batch_size=2", "data.seq_len=32",
           "trainer.max_steps=3", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "throughput_window=2"]
    sweep = tmp_path / "multirun" / "sweep"
    run([str(ROOT / "experiments/train.py"), "-m", *job, "strategy.host_memory=64KiB,30MiB", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    refused, trained = (json.loads((sweep / n / "metrics.json").read_text()) for n in ("0", "1"))
    assert refused["preset"] == "fill" and "host_memory" in refused["refused"] and "strategy.host_memory=64KiB" in refused["overrides"]
    assert trained["preset"] == "fill" and trained["steps"] == 3
    assert trained["val_loss"] is not None  # 3 steps, shorter than val_check_interval=100: validated at the end
    assert trained["checkpoint"] == str(sweep / "1" / "checkpoints" / "last.ckpt") and Path(trained["checkpoint"]).is_file()
    result = run([str(ROOT / "experiments/train.py"), *job, "strategy.host_memory=30MiB", "trainer.max_steps=5", "resume=last",
                  f"hydra.run.dir={tmp_path / 'outputs' / 'again'}"], cwd=tmp_path)
    resumed = json.loads((tmp_path / "outputs" / "again" / "metrics.json").read_text())
    assert resumed["steps"] == 5 and len(resumed["loss_curve"]) == 2  # two steps after the three resumed
    assert "Run summary" in result.stdout and "checkpoints/last.ckpt" in result.stdout


def test_compare_ranks_the_jobs_and_shows_what_explains_the_ranking(tmp_path, capsys):
    from tools.compare import main

    jobs = {"0": {"preset": "lohan", "tokens_per_sec": 900.0, "offload/cache/wait_total_ms": 40.0, "offload/units/nvme": 8},
            "1": {"preset": "fill", "tokens_per_sec": 2700.0, "offload/cache/wait_total_ms": 3.0, "offload/units/nvme": 0},
            "2": {"preset": "protrain", "refused": "gpu_memory=1KiB is less than the 64 KiB the largest unit needs"}}
    for name, metrics in jobs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps({**metrics, "overrides": [f"policy={metrics['preset']}"]}))
    assert main([str(tmp_path), "--png", str(tmp_path / "chart.png")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "ranked by tokens_per_sec, best first"
    header = lines[1].split()
    assert header[:3] == ["job", "overrides", "preset"] and "offload/cache/wait_total_ms" in header and header[-1] == "refused"
    assert [line.split()[0] for line in lines[3:6]] == ["1", "0", "2"]  # fastest first, the refused job last
    assert "the largest unit needs" in lines[5]
