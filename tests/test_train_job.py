"""The experiment entry point as a user runs it: subprocesses of experiments/train.py."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.mark.slow
def test_single_job_trains_and_reports(tmp_path):
    result = run(
        [str(ROOT / "experiments/train.py"), f"hydra.run.dir={tmp_path}", "logger=csv", "data.max_bytes=1000000",
         "trainer.max_steps=20", "trainer.val_check_interval=10", "trainer.limit_val_batches=4", "trainer.log_every_n_steps=5", "throughput_window=5",
         "model.warmup_steps=5"],  # a short warm-up: the loss falls within the 20 steps
        cwd=tmp_path,
    )
    assert "Run summary" in result.stdout and "tokens/s" in result.stdout
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["steps"] == 20 and metrics["strategy"] == "TieredStrategy"
    assert metrics["train_loss_last"] < metrics["train_loss_first"] - 0.3, "the loss did not fall"
    assert metrics["tokens_per_sec"] > 0 and metrics["step_time_ms"] > 0
    assert metrics["val_loss"] is not None
    assert metrics["offload/memory/process_peak_rss_bytes"] > 0
    # OffloadMonitor's metrics reach the chosen logger
    logged = next(tmp_path.rglob("metrics.csv"))
    header = next(csv.reader(logged.open()))
    assert "offload/budget/host_bytes" in header and "train/device/items_per_sec" in header


@pytest.mark.slow
def test_multirun_writes_separate_jobs_and_wandb_runs(tmp_path):
    sweep = tmp_path / "sweep"
    run(
        [str(ROOT / "experiments/train.py"), "-m", "logger=wandb_offline", "data=synthetic", "data.num_tokens=20000",
         "+trainer.fast_dev_run=true", "policy=auto,none", "strategy.gpu_memory=16MiB", "data.batch_size=2", "data.seq_len=64",
         f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
    )
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert [j.name for j in jobs] == ["0", "1"]
    run_ids = set()
    for job, policy in zip(jobs, ["auto", "none"]):
        metrics = json.loads((job / "metrics.json").read_text())
        assert f"policy={policy}" in metrics["overrides"]
        offline_runs = list((job / "wandb").glob("offline-run-*"))
        assert len(offline_runs) == 1, offline_runs
        assert list(offline_runs[0].glob("*.wandb")), "the offline run has no data file"
        run_ids.add(offline_runs[0].name.rsplit("-", 1)[-1])
    assert len(run_ids) == 2, "both jobs logged into one W&B run"

    # tools/compare.py turns the sweep into one table, a CSV and a chart
    result = run([str(ROOT / "tools/compare.py"), str(sweep), "--metric", "steps"], cwd=tmp_path)
    assert "policy=auto" in result.stdout and "policy=none" in result.stdout
    assert "data.num_tokens=20000" not in result.stdout  # every job's: it tells none apart
    assert "offload/units/host" in result.stdout.splitlines()[1]  # the tiered runtime's columns, under the ranking line
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    refused = subprocess.run([sys.executable, str(ROOT / "tools/compare.py"), str(sweep), "--columns", "tokens_per_secs"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "no job reports 'tokens_per_secs'" in refused.stderr and "tokens_per_sec," in refused.stderr
    rows = list(csv.DictReader((sweep / "comparison.csv").open()))
    assert [r["job"] for r in rows] == ["0", "1"]
    png = sweep / "comparison_steps.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_offload_preset_trains_with_host_and_nvme_tiers(tmp_path):
    run([str(ROOT / "experiments/train.py"), "experiment=offload_cpu", f"hydra.run.dir={tmp_path}", "logger=wandb_offline", "data.max_bytes=1000000",
         "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.limit_val_batches=2", "trainer.log_every_n_steps=3", "throughput_window=3"],
        cwd=tmp_path)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["offload/units/nvme"] > 0 and metrics["offload/units/host"] > 0
    assert metrics["offload/tier/gpu_reserved_bytes"] <= 10 * 2**20  # what the kept blocks' 246 MiB leave of the 256 MiB tier
    assert metrics["offload/link/nvme_read_bytes_total"] > 0
    assert 0.0 <= metrics["offload/cache/hit_rate"] <= 1.0 and "offload/cache/wait_p99_ms" in metrics
    assert metrics["train_loss_last"] < metrics["train_loss_first"]
    assert not (tmp_path / "nvme").exists() or not any((tmp_path / "nvme").iterdir()), "NVMe files were left behind"
    assert list((tmp_path / "wandb").glob("offline-run-*/*.wandb"))


@pytest.mark.slow
def test_plan_tool_makes_a_plan_that_the_job_runs_again(tmp_path):
    plan = tmp_path / "plan.json"
    result = run(["-m", "offload_strategy", "plan", "--out", str(plan), "data=synthetic", "data.batch_size=4", "data.seq_len=64",
                  "strategy.gpu_memory=24MiB", "policy.activations=auto"], cwd=tmp_path)
    assert "| unit | name | bytes | home |" in result.stdout and "activations per block:" in result.stdout
    written = json.loads(plan.read_text())
    assert {u["home"] for u in written["units"]} >= {"host"} and len(written["activations"]) == 4
    # the planner's layout, not the profiling steps' (the first block kept, the others recomputed)
    assert written["activations"] != ["keep", "checkpoint", "checkpoint", "checkpoint"], written["activations"]
    assert "tiered: activation layout" in result.stdout + result.stderr
    shown = run(["-m", "offload_strategy", "plan", "--show", str(plan)], cwd=tmp_path)
    assert shown.stdout.count("| model.transformer.") == len(written["units"])
    result = run([str(ROOT / "experiments/train.py"), f"hydra.run.dir={tmp_path / 'job'}", "logger=none", "data=synthetic", "data.batch_size=4",
                  "data.seq_len=64", "strategy.gpu_memory=24MiB", f"strategy.plan_file={plan}", "trainer.max_steps=4",
                  "trainer.limit_val_batches=0"], cwd=tmp_path)
    metrics = json.loads((tmp_path / "job" / "metrics.json").read_text())
    assert metrics["steps"] == 4


@pytest.mark.slow
def test_plan_tool_resolves_the_paths_a_job_writes_under_its_output_directory(tmp_path):
    """experiment=offload_cpu puts the NVMe tier at ${hydra:runtime.output_dir}/nvme: outside a
    Hydra job the plan tool resolves it under the plan's directory."""
    plan = tmp_path / "plans" / "plan.json"
    plan.parent.mkdir()
    # (a GPU tier that leaves the parameters 8.3 MiB beside the kept blocks' 7.7 MiB at this batch)
    run(["-m", "offload_strategy", "plan", "--out", str(plan), "--steps", "1", "experiment=offload_cpu", "strategy.gpu_memory=16MiB", "data=synthetic", "data.batch_size=2",
         "data.seq_len=32", "data.num_tokens=20000"], cwd=tmp_path)
    assert {u["home"] for u in json.loads(plan.read_text())["units"]} >= {"nvme"}


@pytest.mark.slow
def test_resume_from_a_checkpoint_the_job_wrote(tmp_path):
    """Lightning names checkpoints ``epoch=0-step=4.ckpt``: quoted, Hydra takes the path, and the
    checkpoint loads with torch's weights-only reader (plain containers in the hyperparameters)."""
    job = ["logger=none", "data=synthetic", "data.batch_size=4", "data.seq_len=32", "trainer.limit_val_batches=0", "strategy.gpu_memory=16MiB"]
    run([str(ROOT / "experiments/train.py"), f"hydra.run.dir={tmp_path / 'first'}", *job, "trainer.max_steps=4"], cwd=tmp_path)
    (checkpoint,) = (tmp_path / "first").rglob("epoch=*-step=4.ckpt")
    run([str(ROOT / "experiments/train.py"), f"hydra.run.dir={tmp_path / 'second'}", *job, "trainer.max_steps=6", "trainer.log_every_n_steps=1",
         f'resume="{checkpoint}"'], cwd=tmp_path)
    metrics = json.loads((tmp_path / "second" / "metrics.json").read_text())
    assert metrics["steps"] == 6 and len(metrics["loss_curve"]) == 2  # two more steps after the four resumed


@pytest.mark.slow
def test_a_plan_from_shapes_runs_in_the_job_it_was_made_for(tmp_path):
    """Planned from the model's shapes and the hardware spec, running nothing: the job accepts the
    plan (every unit's name and bytes, the block count) and trains with it."""
    plan = tmp_path / "plan.json"
    job = ["data=synthetic", "data.batch_size=4", "data.seq_len=64", "strategy.gpu_memory=16MiB"]
    result = run(["-m", "offload_strategy", "plan", "--from-shapes", "--out", str(plan), *job, "hardware=rtx4090"], cwd=tmp_path)
    assert "built on the meta device" in result.stdout and "| unit | name | bytes | home |" in result.stdout
    written = json.loads(plan.read_text())
    assert {u["home"] for u in written["units"]} >= {"host"} and len(written["activations"]) == 4
    assert written["budgets"]["gpu"] == 16 * 2**20 and written["prediction"]["step_seconds"] > 0
    p = written["prediction"]  # the parts add up to the step, the activation layout's share included
    parts = p["forward_seconds"] + p["backward_seconds"] + p["update_tail_seconds"] + p.get("layout_seconds", 0.0)
    assert parts == pytest.approx(p["step_seconds"])
    run([str(ROOT / "experiments/train.py"), f"hydra.run.dir={tmp_path / 'job'}", "logger=none", *job, f"strategy.plan_file={plan}",
         "trainer.max_steps=3", "trainer.limit_val_batches=0"], cwd=tmp_path)
    assert json.loads((tmp_path / "job" / "metrics.json").read_text())["steps"] == 3


def test_a_7b_plan_from_shapes_takes_seconds_and_no_memory_for_parameters(tmp_path):
    """Llama-2-7B (27 GB of fp32 parameters) on an RTX 4090 spec, planned on this machine: the
    process's peak resident set stays far below one copy of the parameters."""
    plan = tmp_path / "plan.json"
    wrapper = ("import resource, sys\nfrom offload_strategy.cli import main\nassert main(sys.argv[1:]) == 0\n"
               "print('peak', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    started = time.perf_counter()
    result = run(["-c", wrapper, "plan", "--from-shapes", "--out", str(plan), "model=llama_7b", "hardware=rtx4090",
                  "trainer=gpu"], cwd=tmp_path)
    elapsed = time.perf_counter() - started
    peak = int(result.stdout.split("peak ")[-1])
    written = json.loads(plan.read_text())
    assert sum(u["bytes"] for u in written["units"]) > 25 * 2**30  # fp32 parameters under bf16-mixed
    assert peak < 3 * 2**30, f"peak resident set {peak / 2**30:.2f} GiB"
    assert elapsed < 120 and len(written["activations"]) == 32


@pytest.mark.slow
def test_ddp_preset_trains_two_ranks_and_reports_once(tmp_path):
    run([str(ROOT / "experiments/train.py"), "experiment=ddp_cpu", f"hydra.run.dir={tmp_path}", "logger=csv", "data.max_bytes=1000000",
         "trainer.max_steps=6", "trainer.val_check_interval=3", "trainer.limit_val_batches=2", "trainer.log_every_n_steps=3", "throughput_window=3"],
        cwd=tmp_path)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["strategy"] == "TieredDDPStrategy" and metrics["steps"] == 6
    assert metrics["offload/units/nvme"] > 0 and metrics["offload/units/host"] > 0
    assert metrics["offload/optimizer/host_state_bytes"] > 0
    assert list(tmp_path.glob("metrics*.json")) == [tmp_path / "metrics.json"], "a rank other than 0 wrote a summary"


@pytest.mark.slow
def test_a_sweep_over_every_policy_preset_runs(tmp_path):
    """The sweep of docs/reference.md, "Hydra configuration": every preset, at the budgets it names, trains."""
    presets = sorted(p.stem for p in (ROOT / "conf" / "policy").glob("*.yaml"))
    sweep = tmp_path / "sweep"
    run([str(ROOT / "experiments/train.py"), "-m", "experiment=offload_cpu", "policy=glob(*)", "logger=csv", "data=synthetic",
         "data.num_tokens=40000", "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=1",
         "data.batch_size=2", "data.seq_len=64", "strategy.gpu_memory=32MiB", "strategy.host_memory=80MiB", f"hydra.sweep.dir={sweep}"], cwd=tmp_path, timeout=600)
    jobs = sorted((p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    assert len(jobs) == len(presets)
    for job, name in zip(jobs, presets):
        metrics = json.loads((job / "metrics.json").read_text())
        assert f"policy={name}" in metrics["overrides"] and metrics["steps"] == 3, (name, metrics["overrides"])
