"""The resident set during the steps against the bound, and the seconds per step, for this
checkout and others (an older commit, the same under environment settings), side by side: runs
``tools/largest.py`` of each in turn, interleaved over rounds (the machine may be shared).

    git archive 99090e8 | tar -x -C /tmp/old
    python tools/host_steps.py --variant "new|." --variant "old|/tmp/old" \\
        --variant "old, MALLOC_MMAP_THRESHOLD_=131072|/tmp/old|MALLOC_MMAP_THRESHOLD_=131072" --rounds 2 -- \\
        --layers 8 --width 1024 --seq-len 32 --steps 4 --gpu-memory 64MiB --host-memory 200MiB

A variant is NAME|DIR or NAME|DIR|VAR=VALUE,...; what follows ``--`` goes to each ``tools/largest.py``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Variant:
    name: str
    root: Path
    env: dict[str, str]
    steps: list[float] = field(default_factory=list)  # peak growth during the steps / the bound, per run
    seconds: list[list[float]] = field(default_factory=list)  # seconds of each step, per run
    cpu: list[float] = field(default_factory=list)  # the process's CPU seconds, per run


def parse_variant(text: str) -> Variant:
    parts = text.split("|")
    if len(parts) not in (2, 3) or not parts[0]:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: give NAME|DIR or NAME|DIR|VAR=VALUE,...")
    env = dict(pair.split("=", 1) for pair in (parts[2] if len(parts) == 3 else "").split(",") if pair)
    return Variant(parts[0], Path(parts[1]).resolve(), env)


def run_once(variant: Variant, largest_args: list[str]) -> None:
    env = {**os.environ, **variant.env, "PYTHONPATH": str(variant.root)}
    start = time.perf_counter()
    done = subprocess.run(
        ["/usr/bin/time", "-f", "cpu %U %S", sys.executable, str(variant.root / "tools/largest.py"), "--skip-probes", *largest_args],
        capture_output=True, text=True, env=env, cwd=variant.root,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{variant.name}: tools/largest.py failed:\n{done.stderr[-3000:]}")
    steps = re.search(r"^\| steps \| [^|]+\| [^|]+\| ([0-9.]+)x \|", done.stdout, re.M)
    seconds = re.search(r"^\| seconds per step \| ([^|]+) \|", done.stdout, re.M)
    cpu = re.search(r"cpu ([0-9.]+) ([0-9.]+)", done.stderr)
    assert steps and seconds, done.stdout
    variant.steps.append(float(steps.group(1)))
    variant.seconds.append([float(s) for s in seconds.group(1).split(",")])
    variant.cpu.append(float(cpu.group(1)) + float(cpu.group(2)) if cpu else float("nan"))
    print(f"  {variant.name}: steps {variant.steps[-1]:.2f}x the bound, seconds per step {seconds.group(1)}, "
          f"{time.perf_counter() - start:.0f} s", file=sys.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", type=parse_variant, action="append", required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("largest", nargs=argparse.REMAINDER, help="after --: tools/largest.py's arguments")
    args = parser.parse_args()
    largest_args = [a for a in args.largest if a != "--"]
    for round_ in range(args.rounds):
        print(f"round {round_ + 1}", file=sys.stderr)
        for variant in args.variant:
            run_once(variant, largest_args)
    print("\n| variant | peak growth during the steps / bound, each run | seconds per step after the first (median), each run | process CPU seconds, each run |")
    print("|---|---|---|---|")
    for v in args.variant:
        medians = [sorted(s[1:] or s)[len(s[1:] or s) // 2] for s in v.seconds]
        print(f"| {v.name} | {', '.join(f'{x:.2f}x' for x in v.steps)} | {', '.join(f'{m:.2f}' for m in medians)} | {', '.join(f'{c:.0f}' for c in v.cpu)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
