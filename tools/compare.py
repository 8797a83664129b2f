"""Compare the jobs of a Hydra multirun: one table, a CSV and a bar chart of one metric.

    python tools/compare.py multirun/2026-11-22/10-00-00 --metric tokens_per_sec

Each job directory holds the ``metrics.json`` written by ``experiments/train.py``; its overrides
label the job. Writes ``comparison.csv`` and ``comparison_<metric>.png`` into the multirun
directory unless told otherwise.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, Optional

from offload_strategy.config import format_bytes

DEFAULT_COLUMNS = (
    "preset", "steps", "tokens_per_sec", "step_time_ms", "val_loss",
    # what explains a ranking: where the units lived and how often they were in place, how long the step waited
    # for them and for the updates, the blocks it recomputed or swapped, what it read from NVMe, the memory it took
    "offload/units/gpu", "offload/units/host", "offload/units/nvme", "offload/cache/hit_rate", "offload/cache/wait_total_ms",
    "offload/optimizer/exposed_ms", "offload/activations/blocks_checkpoint", "offload/activations/swapped_host_bytes",
    "offload/link/nvme_read_bytes_total", "peak_gpu_bytes", "peak_host_bytes",
    "refused",  # a job of the sweep whose budgets were refused: why
)
# metrics of which less is better; the table ranks the jobs by --metric, best first
LOWER_IS_BETTER = ("_ms", "_loss", "loss", "_bytes", "wall_seconds")


def ranked(jobs: list[dict[str, Any]], metric: str) -> list[dict[str, Any]]:
    """The jobs best first by ``metric``; those without a number for it (refused jobs) last."""
    lower = metric.endswith(LOWER_IS_BETTER)

    def key(job: dict[str, Any]) -> tuple[int, float]:
        value = job.get(metric)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            return (1, 0.0)
        return (0, value if lower else -value)

    return sorted(jobs, key=key)


def load_jobs(root: Path) -> list[dict[str, Any]]:
    """Every job under ``root`` with a metrics.json, in job order, labelled by its overrides."""
    jobs = []
    for path in sorted(root.rglob("metrics.json"), key=lambda p: _job_sort_key(p.parent, root)):
        try:
            metrics = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            print(f"skipping {path}: not valid JSON ({err})", file=sys.stderr)
            continue
        job = {"job": str(path.parent.relative_to(root)) or ".", "overrides": " ".join(metrics.get("overrides") or [])}
        job.update({k: v for k, v in metrics.items() if _is_scalar(v)})
        jobs.append(job)
    return jobs


def distinguishing_labels(jobs: list[dict[str, Any]]) -> list[str]:
    """Each job's overrides less those every job shares: what tells the jobs apart."""
    sets = [job["overrides"].split() for job in jobs]
    shared = set.intersection(*(set(s) for s in sets)) if len(sets) > 1 else set()
    return [" ".join(o for o in overrides if o not in shared) or job["job"] for overrides, job in zip(sets, jobs)]


def _job_sort_key(job_dir: Path, root: Path) -> tuple:
    parts = job_dir.relative_to(root).parts
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts)


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (int, float, str, bool))


def _cell(key: str, value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    if key.endswith("_bytes") and isinstance(value, (int, float)):
        return format_bytes(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(jobs: list[dict[str, Any]], columns: list[str]) -> str:
    """One row per job, labelled by the overrides that tell it from the others."""
    header = ["job", "overrides"] + columns
    labelled = [{**job, "overrides": label} for job, label in zip(jobs, distinguishing_labels(jobs))]
    rows = [[_cell(c, job.get(c)) for c in header] for job in labelled]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in rows])


def write_csv(jobs: list[dict[str, Any]], path: Path) -> None:
    keys: list[str] = []
    for job in jobs:
        keys += [k for k in job if k not in keys]
    tmp = path.with_suffix(".csv.tmp")
    with tmp.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=keys)
        writer.writeheader()
        writer.writerows(jobs)
    os.replace(tmp, path)


def plot(jobs: list[dict[str, Any]], metric: str, path: Path) -> bool:
    """Bar chart of ``metric`` per job; False when no job has a number for it."""
    points = [(label, job.get(metric)) for label, job in zip(distinguishing_labels(jobs), jobs)]
    points = [(label, value) for label, value in points if isinstance(value, (int, float)) and not math.isnan(value)]
    if not points:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values = zip(*points)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(values) + 2), 4.5))
    bars = ax.bar(range(len(values)), values, color="#4C72B0")
    ax.bar_label(bars, labels=[f"{v:.4g}" for v in values], fontsize=8)
    ax.set_xticks(range(len(values)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per job")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("multirun_dir", type=Path, help="a multirun directory (or any directory holding metrics.json files)")
    parser.add_argument("--metric", default="tokens_per_sec", help="metric for the bar chart (default: tokens_per_sec)")
    parser.add_argument("--columns", nargs="*", help="columns of the table (default: the main figures)")
    parser.add_argument("--csv", type=Path, help="CSV path (default: <dir>/comparison.csv)")
    parser.add_argument("--png", type=Path, help="chart path (default: <dir>/comparison_<metric>.png)")
    args = parser.parse_args(argv)

    if not args.multirun_dir.is_dir():
        parser.error(f"{args.multirun_dir} is not a directory")
    jobs = load_jobs(args.multirun_dir)
    if not jobs:
        parser.error(f"no metrics.json under {args.multirun_dir}; run `python experiments/train.py -m ...` first")
    known = {key for job in jobs for key in job}
    unknown = [c for c in [*(args.columns or []), args.metric] if c not in known]
    if unknown:
        parser.error(f"no job reports {', '.join(map(repr, unknown))}; the jobs report: {', '.join(sorted(known - {'job', 'overrides'}))}")
    columns = args.columns or [c for c in DEFAULT_COLUMNS if c in known]
    if args.metric not in columns:
        columns.append(args.metric)
    print(f"ranked by {args.metric}, best first")
    print(format_table(ranked(jobs, args.metric), columns))

    csv_path = args.csv or args.multirun_dir / "comparison.csv"
    write_csv(jobs, csv_path)
    print(f"\nCSV: {csv_path}")
    png_path = args.png or args.multirun_dir / f"comparison_{args.metric.replace('/', '_')}.png"
    if plot(jobs, args.metric, png_path):
        print(f"chart: {png_path}")
    else:
        print(f"no job reports a number for {args.metric!r}: no chart written", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
