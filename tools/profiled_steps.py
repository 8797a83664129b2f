"""The profiled steps where every parameter fits the GPU tier, under two trees of the package side
by side: their time, and what they hold of the tier.

    python tools/profiled_steps.py --before /tmp/old       # this tree against the one at /tmp/old

For each tree (``--before``'s and this one), each run in a fresh process on this machine's CPU
(the emulated GPU tier): a GPT-2 of ``--layers`` x ``--width``, batch ``--batch-size`` x
``--seq-len``, 32-true, ``--steps`` steps,

* under each ``--timed`` policy (``default``: the strategy's default, activations ``auto``;
  ``keep``: the default placement search beside every block kept, a layout the user fixes) in
  ``--large`` of GPU tier, where every parameter, gradient, state and activation fits: each
  step's wall and CPU seconds (every thread's: a busy machine shakes them less; the first three
  steps are the profiled ones, a re-placement between steps is in the next step's time), the
  mean of the steps after the fourth, and the whole ``fit``; ``--threads`` torch threads (one by
  default: under other jobs, a second thread's waits dwarf the work);
* under each ``--held`` policy in ``--small`` of GPU tier (every parameter with its gradients and
  states fits, not beside the activations): each step's count of the tier as ``tools/gpu_memory.py``
  takes it (the parameters as placed with their gradients and states, the activations kept and
  the backward's gradients as planned), the parameters beside the layout's peak as the planner
  counts it (a fixed layout's, measured in its first step; the planner's, once chosen), and the
  most bytes the step's operations held at once (``LiveBytes``, on this machine the stand-in for
  CUDA's allocated-bytes peak, host-side storages of the updates included) beside the parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Union

ROOT = Path(__file__).resolve().parent.parent
POLICIES: dict[str, Union[str, dict[str, str]]] = {"default": "auto", "keep": {"activations": "keep"}, "checkpoint": {"activations": "checkpoint"}}


def _child(args: argparse.Namespace) -> dict[str, Any]:
    """One run in this process, with whichever package the path gives."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import lightning as L

    from offload_strategy import TieredStrategy
    from offload_strategy.config import parse_size
    from offload_strategy.demos import gpt2_config
    from offload_strategy.estimate.live_bytes import LiveBytes
    from tools.common import StepTimer, fit

    class Held(L.Callback):
        def __init__(self, live: bool) -> None:
            self.steps: list[tuple[int, int, Optional[int], bool, Optional[int]]] = []
            self.cpu: list[float] = []  # every thread's CPU seconds in the step: less shaken than wall time by a busy machine
            self._live = LiveBytes() if live else None
            self._cpu = 0.0

        def on_train_batch_start(self, trainer: L.Trainer, *rest: Any) -> None:
            self._cpu = time.process_time()
            if self._live is not None:
                self._live = LiveBytes()
                self._live.__enter__()

        def on_train_batch_end(self, trainer: L.Trainer, *rest: Any) -> None:
            self.cpu.append(time.process_time() - self._cpu)
            if self._live is not None:
                self._live.__exit__(None, None, None)
            tiered: Any = trainer.strategy  # a TieredStrategy
            core = tiered.tiered
            saved = int(tiered.metrics(reset=False).get("activations/saved_bytes", 0))
            layout = core.activations.fixed if core.activations.fixed is not None else core.activations.plan
            self.steps.append((core.activations.gpu_parameter_bytes(), saved + core.activations.beside.gradients,
                               self._live.peak if self._live is not None else None, core.engine is not None,
                               layout.peak_bytes if layout is not None else None))

    args.accelerator = "cpu"
    held, timer = Held(args.live), StepTimer()
    strategy = TieredStrategy(gpu_memory=parse_size(args.gpu_memory), host_memory="2GiB", policy=POLICIES[args.policy])
    with tempfile.TemporaryDirectory() as root:
        start, cpu = time.perf_counter(), time.process_time()
        fit(strategy, gpt2_config(args.layers, args.width, positions=args.seq_len), args, root, timer, args.steps, callbacks=[held])
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"times": timer.times, "cpu": held.cpu, "fit": seconds, "fit_cpu": cpu, "steps": held.steps}


def _run(tree: Path, args: argparse.Namespace, policy: str, gpu_memory: str, live: bool) -> dict[str, Any]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "--policy", policy, "--gpu-memory", gpu_memory, "--layers", str(args.layers),
               "--width", str(args.width), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--steps", str(args.steps)]
    if live:
        command.append("--live")
    # the tree's package and tools first; this script only runs its fit
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=str(args.threads))
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"the run under {tree} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _mib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, help="a tree of the package to compare with (git archive COMMIT | tar -x -C DIR)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--large", default="1GiB")
    parser.add_argument("--small", default="100MiB")
    parser.add_argument("--timed", nargs="*", default=["default", "keep"], choices=list(POLICIES))
    parser.add_argument("--held", nargs="*", default=["default", "checkpoint"], choices=list(POLICIES))
    parser.add_argument("--repeat", type=int, default=1, help="each timed run this many times, the trees alternating")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads in each run (one: a busy machine's other jobs do not stall its waits)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--policy", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--gpu-memory", default="1GiB", help=argparse.SUPPRESS)
    parser.add_argument("--live", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args)))
        return 0
    trees = ([("before", args.before)] if args.before is not None else []) + [("now", ROOT)]
    print(f"GPT-2 {args.layers} x {args.width}, batch {args.batch_size} x {args.seq_len}, 32-true, {args.steps} steps, CPU (emulated GPU tier), "
          f"{args.threads} torch thread(s)\n")
    print(f"gpu_memory={args.large}: each step's wall seconds / CPU seconds (every thread's; 1-3 profiled), the mean of steps 5-{args.steps}, "
          "the whole fit (set-up and teardown in it)")
    print("| policy | tree | " + " | ".join(f"step {k + 1}" for k in range(args.steps)) + f" | steps 5-{args.steps} | fit |")
    print("|---|---|" + "---|" * (args.steps + 2), flush=True)
    for policy in args.timed:
        for _ in range(args.repeat):
            for name, tree in trees:
                run = _run(tree, args, policy, args.large, live=False)
                steps = [f"{t:.2f} / {c:.2f}" for t, c in zip(run["times"], run["cpu"])]
                steady = [sum(x[4:]) / max(len(x[4:]), 1) for x in (run["times"], run["cpu"])]
                print(f"| {policy} | {name} | " + " | ".join(steps) + f" | {steady[0]:.2f} / {steady[1]:.2f} | {run['fit']:.1f} / {run['fit_cpu']:.1f} |",
                      flush=True)
    print(f"\ngpu_memory={args.small}: each step's parameters as placed + activations kept and backward's gradients (MiB); "
          "the layout's peak as counted (a fixed layout's measured in its first step; the planner's once chosen) + the parameters; "
          "the step's LiveBytes peak + the parameters; an engine?")
    print("| policy | tree | step | parameters | activations | count | layout's peak + parameters | LiveBytes peak + parameters | engine |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for policy in args.held:
        for name, tree in trees:
            run = _run(tree, args, policy, args.small, live=True)
            for k, (parameters, activations, live, engine, peak) in enumerate(run["steps"]):
                print(f"| {policy} | {name} | {k + 1} | {_mib(parameters)} | {_mib(activations)} | {_mib(parameters + activations)} | "
                      f"{_mib(None if peak is None else peak + parameters)} | {_mib(None if live is None else live + parameters)} | "
                      f"{'yes' if engine else 'no'} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
