"""`make train`'s job as a new user meets it, run as a user runs it (subprocesses of
experiments/train.py and tools/compare.py): a short run validates at its end, the preset is a key
of its own, the logger records the job's configuration and its summary, the summary on stdout is
a few lines, a model that cannot read the data is refused before anything is built, the last
checkpoint is found by ``resume=last``, and a sweep records a refused job and goes on."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from tests.test_train_job import ROOT, run

BLOCK, HEADER = 32 * 1024, 7  # the W&B transaction log: LevelDB's log format, 32 KiB blocks, 7-byte record headers


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of an offline W&B run's ``.wandb`` file, as ``wandb sync`` reads them."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, pending = 7, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending += data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4) and pending:  # a full record, or a record's last fragment
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_run(job: Path) -> dict[str, Any]:
    """An offline W&B run's config, summary (each value as JSON) and the keys of its history."""
    (path,) = job.glob("wandb/offline-run-*/*.wandb")
    found: dict[str, Any] = {"config": {}, "summary": {}, "history": set()}
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind in ("config", "summary"):
            found[kind].update({item.key: json.loads(item.value_json) for item in getattr(record, kind).update})
        elif kind == "history":
            found["history"].update(item.key for item in record.history.item)
    return found


def test_a_short_sweep_validates_reports_logs_its_configuration_and_refuses_a_model_that_cannot_read_the_data(tmp_path):
    """One sweep, one process: two jobs of 3 steps (CSV and offline W&B loggers), shorter than the
    validation interval, then a job whose sequences are longer than the model's positions, which
    stops the sweep before anything is built."""
    sweep = tmp_path / "multirun"
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "experiments/train.py"), "-m", "data.seq_len=32,512", "logger=csv,wandb_offline", "policy=lohan", "hardware=rtx4090",
         "strategy.gpu_memory=16MiB", "data=synthetic", "data.num_tokens=20000", "data.batch_size=2", "trainer.max_steps=3",
         "trainer.val_check_interval=100", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "throughput_window=2", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode != 0 and "data.seq_len=512 exceeds the gpt2-tiny context of 256 positions; lower data.seq_len." in done.stderr, done.stderr[-3000:]
    assert not (sweep / "2" / "metrics.json").exists() and not list((sweep / "2").glob("csv/*/metrics.csv"))
    jobs = {name: json.loads((sweep / name / "metrics.json").read_text()) for name in ("0", "1")}
    for metrics in jobs.values():
        assert metrics["preset"] == "lohan" and metrics["steps"] == 3 and metrics["strategy"] == "TieredStrategy"
        assert metrics["val_loss"] is not None  # 3 steps, shorter than val_check_interval=100: validated at the end
        assert metrics["hardware"]["gpu"] == "NVIDIA GeForce RTX 4090"

    # the short summary: about ten lines, each figure as metrics.json has it
    summaries = done.stdout.split("Run summary")[1:]
    assert len(summaries) == 2
    lines = summaries[0].strip().splitlines()[:8]
    csv_job = jobs["0"]
    # the lines that end in a path are as long as the path (pytest's under xdist is 10 characters longer)
    figures = [line for line in lines if not line.rstrip().endswith((".json", ".ckpt"))]
    assert all(len(line) <= 120 for line in figures) and lines[-1].split()[-1] == str(sweep / "0" / "metrics.json"), lines
    text = "\n".join(lines)
    assert f"preset lohan, 3 steps in {csv_job['wall_seconds']:.0f} s" in text and f"checkpoint      {sweep / '0' / 'checkpoints' / 'last.ckpt'}" in text
    units = ", ".join(f"{tier} {int(csv_job[f'offload/units/{tier}'])}" for tier in ("gpu", "host", "nvme"))
    assert f"units per tier  {units}" in text and f"train {csv_job['train_loss_first']:,.4g} -> {csv_job['train_loss_last']:,.4g}" in text

    # the logged configuration: plain values (no _target_), the overrides, the hardware and the preset
    (hparams,) = (sweep / "0").glob("csv/*/hparams.yaml")
    logged = yaml.safe_load(hparams.read_text())
    config = wandb_run(sweep / "1")
    for values, logger in ((logged, "csv"), (config["config"], "wandb_offline")):
        assert "_target_" not in json.dumps(values) and "hydra" not in values
        assert values["overrides"][:3] == ["data.seq_len=32", f"logger={logger}", "policy=lohan"] and values["preset"] == "lohan"
        assert values["hardware"]["gpu"] == "NVIDIA GeForce RTX 4090" and values["model"]["config"]["n_layer"] == 4
        assert values["policy"]["activations"] == "lohan"
    # the run's summary: W&B keeps it as the run's summary, not in its history; CSV as one last row
    assert config["summary"]["summary/steps"] == 3 and not any(key.startswith("summary/") for key in config["history"])
    (rows,) = (sweep / "0").glob("csv/*/metrics.csv")
    last = list(csv.DictReader(rows.open()))[-1]
    assert float(last["summary/steps"]) == 3 and float(last["summary/train_loss_last"]) == pytest.approx(csv_job["train_loss_last"])


@pytest.mark.slow
def test_a_sweep_records_a_refused_job_and_goes_on_and_resume_last_continues_the_latest(tmp_path):
    # a GPU tier that leaves the parameters 8.3 MiB beside the kept blocks' 7.7 MiB at this batch
    # (offload_cpu's 256 MiB holds them all here: host memory would never be asked for)
    job = ["experiment=offload_cpu", "strategy.gpu_memory=16MiB", "logger=csv", "data=synthetic", "data.num_tokens=20000", "data.batch_size=2", "data.seq_len=32",
           "trainer.max_steps=3", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "throughput_window=2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    nothing = subprocess.run([sys.executable, str(ROOT / "experiments/train.py"), *job, "resume=last", f"hydra.run.dir={tmp_path / 'outputs' / 'none'}"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert nothing.returncode != 0 and f"resume=last: no checkpoints/last.ckpt under {tmp_path / 'outputs'}" in nothing.stderr, nothing.stderr[-2000:]
    sweep = tmp_path / "multirun" / "sweep"
    run([str(ROOT / "experiments/train.py"), "-m", *job, "strategy.host_memory=64KiB,30MiB", f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    refused, trained = (json.loads((sweep / n / "metrics.json").read_text()) for n in ("0", "1"))
    assert refused["preset"] == "fill" and "host_memory" in refused["refused"] and "strategy.host_memory=64KiB" in refused["overrides"]
    assert trained["preset"] == "fill" and trained["steps"] == 3
    assert trained["val_loss"] is not None  # 3 steps, shorter than val_check_interval=100: validated at the end
    assert trained["checkpoint"] == str(sweep / "1" / "checkpoints" / "last.ckpt") and Path(trained["checkpoint"]).is_file()
    older = tmp_path / "outputs" / "earlier" / "checkpoints" / "last.ckpt"  # an earlier job's: not a checkpoint, so taking it fails
    older.parent.mkdir(parents=True)
    older.write_bytes(b"")
    os.utime(older, (time.time() - 60, time.time() - 60))
    result = run([str(ROOT / "experiments/train.py"), *job, "strategy.host_memory=30MiB", "trainer.max_steps=5", "resume=last",
                  f"hydra.run.dir={tmp_path / 'outputs' / 'again'}"], cwd=tmp_path)
    resumed = json.loads((tmp_path / "outputs" / "again" / "metrics.json").read_text())
    assert resumed["steps"] == 5 and len(resumed["loss_curve"]) == 2  # two steps after the three resumed
    assert "Run summary" in result.stdout and "checkpoints/last.ckpt" in result.stdout


def test_compare_ranks_the_jobs_and_shows_what_explains_the_ranking(tmp_path):
    jobs = {"0": {"preset": "lohan", "tokens_per_sec": 900.0, "offload/cache/wait_total_ms": 40.0, "offload/units/nvme": 8},
            "1": {"preset": "fill", "tokens_per_sec": 2700.0, "offload/cache/wait_total_ms": 3.0, "offload/units/nvme": 0},
            "2": {"preset": "protrain", "refused": "gpu_memory=1KiB is less than the 64 KiB the largest unit needs"}}
    for name, metrics in jobs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps({**metrics, "overrides": [f"policy={metrics['preset']}"]}))
    result = run([str(ROOT / "tools/compare.py"), str(tmp_path), "--png", str(tmp_path / "chart.png")], cwd=tmp_path)
    lines = result.stdout.splitlines()
    assert lines[0] == "ranked by tokens_per_sec, best first"
    header = lines[1].split()
    assert header[:3] == ["job", "overrides", "preset"] and "offload/cache/wait_total_ms" in header and header[-1] == "refused"
    assert [line.split()[0] for line in lines[3:6]] == ["1", "0", "2"]  # fastest first, the refused job last
    assert "the largest unit needs" in lines[5]
    assert (tmp_path / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
