"""Run part of Lightning's own test suite with ``tiered`` in place of the default strategy.

Every single-device CPU ``Trainer`` the tests build without naming a strategy gets
``TieredStrategy`` with every unit streamed from host memory through a 64 MiB GPU tier; the same
tests are run first under Lightning's default, and the table shows what passes under each and
which tests pass only under the default.

Lightning's tests are not shipped with the package: check out its repository at the tag of the
installed version (``git clone --branch 2.6.5 https://github.com/Lightning-AI/pytorch-lightning``)
and give the path of its ``tests`` directory. Tests that need packages missing here (tensorboard,
scipy) fail under both and cancel out.

    .venv/bin/python tools/lightning_suite.py /path/to/pytorch-lightning/tests
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

SELECTION = [
    "tests_pytorch/trainer/optimization",
    "tests_pytorch/core/test_lightning_optimizer.py",
    "tests_pytorch/core/test_lightning_module.py",
    "tests_pytorch/callbacks/test_finetuning_callback.py",
    "tests_pytorch/callbacks/test_lr_monitor.py",
    "tests_pytorch/callbacks/test_stochastic_weight_avg.py",
    "tests_pytorch/callbacks/test_weight_averaging.py",
    "tests_pytorch/callbacks/test_gradient_accumulation_scheduler.py",
    "tests_pytorch/callbacks/test_model_checkpoint_manual_opt.py",
    "tests_pytorch/loops/optimization",
    "tests_pytorch/loops/test_training_loop.py",
    "tests_pytorch/loops/test_training_loop_flow_dict.py",
    "tests_pytorch/loops/test_training_loop_flow_scalar.py",
    "tests_pytorch/models/test_hooks.py",
    "tests_pytorch/trainer/test_trainer.py",
]


def pytest_configure(config: object) -> None:
    """Loaded as a pytest plugin (``-p lightning_suite``): inject the strategy when asked to."""
    if os.environ.get("TIERED_INJECT") != "1":
        return
    import lightning.pytorch as pl

    original = pl.Trainer.__init__

    def init(self: object, *args: object, **kwargs: object) -> None:
        single_cpu = (
            not args and kwargs.get("strategy", "auto") == "auto" and kwargs.get("accelerator", "auto") in ("auto", "cpu")
            and kwargs.get("devices", "auto") in ("auto", 1, "1") and kwargs.get("num_nodes", 1) == 1
        )
        if single_cpu:
            from offload_strategy import TieredStrategy

            kwargs["strategy"] = TieredStrategy(policy={"placement": "host", "activations": "keep"}, gpu_memory="64MiB", host_memory="2GiB")
            kwargs.setdefault("accelerator", "cpu")
        original(self, *args, **kwargs)

    pl.Trainer.__init__ = init


def run(tests: Path, inject: bool) -> dict[str, str]:
    env = dict(os.environ, TIERED_INJECT="1" if inject else "0")
    env["PYTHONPATH"] = os.pathsep.join([str(tests), str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "lightning_suite", "-o", "addopts=",
               "-W", "ignore::DeprecationWarning", *SELECTION]
    out = subprocess.run(command, cwd=tests, env=env, capture_output=True, text=True).stdout
    return dict((m.group(2), m.group(1)) for m in re.finditer(r"^(PASSED|FAILED|ERROR|SKIPPED) (\S+)", out, re.M))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tests", type=Path, help="the tests/ directory of a Lightning checkout")
    args = parser.parse_args()
    if not (args.tests / "tests_pytorch").is_dir():
        raise SystemExit(f"{args.tests} has no tests_pytorch/ directory: give the tests/ directory of a Lightning checkout.")
    plain, tiered = run(args.tests, inject=False), run(args.tests, inject=True)
    passed_plain = {t for t, r in plain.items() if r == "PASSED"}
    passed_both = {t for t in passed_plain if tiered.get(t) == "PASSED"}
    print(f"| strategy | tests run | passed |\n|---|---|---|\n| default | {len(plain)} | {len(passed_plain)} |\n| tiered | {len(tiered)} | {len(passed_both)} of those |")
    print("\npassing under the default only:")
    for test in sorted(passed_plain - passed_both):
        print(f"  {test}")


if __name__ == "__main__":
    main()
