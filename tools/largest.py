"""Train a GPT-2 whose training state is larger than the host budget, through the NVMe tier, and
say where the process's memory goes, phase by phase.

    python tools/largest.py --layers 24 --width 1024 --nvme-path /tmp/offload-largest
    python tools/largest.py --layers 4 --width 256 --steps 2 --nvme-path /tmp/x --weights DIR   # from local weights

The model is built in ``configure_model`` (under the strategy: without memory for its
parameters), every unit is homed on NVMe with its optimizer states (``placement="nvme"``), and
the host budget is what the gradients and staging buffers need (``--placement search``: the
default policy, which places the units again after its profiled steps, a phase of its own). The
table gives the parameters, the training state (fp32 parameters, gradients and AdamW's two states),
the peak resident set of each phase (the kernel's high-water mark, reset between phases through ``/proc/self/clear_refs``),
seconds per step, the NVMe bytes read and written per step, and the step time the raw disk
bandwidth (measured here as ``offload-strategy probe`` does) allows for that traffic. With
``--checkpoint`` a sharded checkpoint of the trained state is written after the last step (its
own phase, its seconds and bytes), from the tiers, without gathering the model.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from offload_strategy.hardware.resident import Phases, proc_status, reset_peak  # noqa: E402

GiB = 1024**3


def make_callback(phases: Phases, steps: list[float], traffic: list[tuple[float, float]], checkpoint: Optional[Path], saves: list[float]) -> Any:
    import lightning as L

    class Watch(L.Callback):
        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            if checkpoint is not None:  # a sharded checkpoint of the trained state, written from the tiers
                phases.begin("sharded checkpoint save")
                start = time.perf_counter()
                trainer.save_checkpoint(checkpoint)
                saves.append(time.perf_counter() - start)
                phases.end("sharded checkpoint save")
            phases.begin("teardown")

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            phases.begin("steps")

        def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
            phases.end("construction and placement")

        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            self._start = time.perf_counter()
            store = trainer.strategy.engine.store if trainer.strategy.engine is not None else None
            self._io = (store.bytes_read, store.bytes_written) if store is not None else (0, 0)

        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            steps.append(time.perf_counter() - self._start)
            store = trainer.strategy.engine.store if trainer.strategy.engine is not None else None
            if store is not None:
                traffic.append((store.bytes_read - self._io[0], store.bytes_written - self._io[1]))
            phases.end("first step" if len(steps) == 1 else f"step {len(steps)}")

    return Watch()


def raw_disk_gbps(path: Path, size: int) -> tuple[float, float]:
    """Raw sequential write and read bandwidth of the disk under ``path`` (GB/s), as offload-strategy probe measures."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    from offload_strategy.memory.bandwidth import raw_io

    buf = mmap.mmap(-1, size)
    buf.write(os.urandom(1024) * (size // 1024))
    file = path / "raw-probe.bin"
    try:
        with ThreadPoolExecutor(4) as pool:
            write = min(raw_io(file, memoryview(buf), pool, True, hasattr(os, "O_DIRECT")) for _ in range(2))
            read = min(raw_io(file, memoryview(buf), pool, False, hasattr(os, "O_DIRECT")) for _ in range(2))
    finally:
        file.unlink(missing_ok=True)
    return size / write / 1e9, size / read / 1e9


def compute_alone(args: argparse.Namespace, repeats: int = 3) -> tuple[float, float]:
    """Seconds of one step's compute with everything in memory, no NVMe: forward and backward of
    one block of the model's width at the run's batch, and the optimizer's step over its
    parameters (AdamW, as the model's), each the median of ``repeats``, times the blocks."""
    import torch
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from offload_strategy.demos import gpt2_config

    block = GPT2Block(GPT2Config(**gpt2_config(1, args.width, positions=args.seq_len)))
    optimizer = torch.optim.AdamW(block.parameters(), lr=1e-4)
    x = torch.randn(args.batch_size, args.seq_len, args.width, requires_grad=True)
    passes, steps = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        out = block(x)
        (out[0] if isinstance(out, tuple) else out).sum().backward()
        middle = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        passes.append(middle - start)
        steps.append(time.perf_counter() - middle)
    median = lambda values: sorted(values)[len(values) // 2]  # noqa: E731
    return median(passes) * args.layers, median(steps) * args.layers


def watch_placing_again(phases: Phases) -> None:
    """Placing the units again between steps (the default policy's search after its profiled
    steps) is a phase of its own: its peak is not the step's around it."""
    from offload_strategy.lightning.core import TieredCore

    place_again = TieredCore._replace_engine

    def watched(core: Any, *args: Any, **kwargs: Any) -> None:
        reset_peak()  # the step's high-water mark so far is the step's
        phases.begin("placing again")
        try:
            place_again(core, *args, **kwargs)
        finally:
            phases.end("placing again")
            phases.begin("steps")

    TieredCore._replace_engine = watched  # type: ignore[method-assign]


def policy(placement: str, activations: Optional[str] = None) -> dict[str, Any]:
    """Every unit on NVMe with its states (``nvme``; every block's activations kept unless
    ``activations`` says otherwise), or the default policy's search (``search``)."""
    chosen = activations or ("keep" if placement == "nvme" else None)
    return {"placement": placement, **({"activations": chosen} if chosen else {})}


def run(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L

    from offload_strategy import TieredStrategy, load_weights
    from offload_strategy.demos import CausalLM, SyntheticTokens, gpt2_config

    config = gpt2_config(args.layers, args.width, positions=args.seq_len)

    class Model(CausalLM):
        def configure_model(self) -> None:
            if self.model is None:
                phases.begin("construction")
                super().configure_model()
                if args.weights:
                    load_weights(self.model, args.weights)
                phases.begin("setup")

    if args.gradients_at_home:
        class Model(Model):  # type: ignore[no-redef]
            def on_before_optimizer_step(self, optimizer: Any) -> None:
                pass  # a hook that may read every gradient: each offloaded unit keeps a gradient home in host memory

    phases = Phases()
    phases.peaks["before fit (imports, interpreter)"] = proc_status("VmRSS")
    watch_placing_again(phases)
    reset_peak()
    L.seed_everything(0, verbose=False)
    module = Model(family="gpt2", config=config, lr=1e-4)
    strategy = TieredStrategy(
        policy=policy(args.placement, args.activations), gpu_memory=args.gpu_memory, host_memory=args.host_memory, nvme_memory=args.nvme_memory,
        nvme_path=str(args.nvme_path), hardware="auto", state_dict_type="sharded",
    )
    checkpoint = args.nvme_path / "largest.ckpt" if args.checkpoint else None
    saves: list[float] = []
    data = SyntheticTokens(seq_len=args.seq_len, batch_size=args.batch_size, num_tokens=args.seq_len * max(args.batch_size * (args.steps + 2) * 2, 40))
    steps: list[float] = []
    traffic: list[tuple[float, float]] = []
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=1, max_steps=args.steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[make_callback(phases, steps, traffic, checkpoint, saves)], default_root_dir=str(args.nvme_path),
        gradient_clip_val=args.gradient_clip_val,
    )
    before = proc_status("RssAnon")  # what the process holds before fit: the growth is held against the budget
    trainer.fit(module, datamodule=data)
    phases.end("teardown")
    phases.begin("after fit")
    gc.collect()
    time.sleep(args.after_fit_seconds)  # sampled while the process holds what fit left
    phases.stop()
    parameters = sum(p.numel() for p in module.parameters())
    written = sum(f.stat().st_size for f in checkpoint.iterdir()) if checkpoint is not None and checkpoint.is_dir() else 0
    return {
        "parameters": parameters, "phases": phases.peaks, "anonymous": phases.anonymous, "before": before, "steps": steps, "traffic": traffic,
        "budgets": strategy.budgets, "saves": saves, "written": written,
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--gpu-memory", default="512MiB", help="the emulated GPU tier")
    parser.add_argument("--host-memory", default=None, help="host budget (default: all that is free)")
    parser.add_argument("--nvme-memory", default=None, help="NVMe budget (default: all that is free)")
    parser.add_argument("--nvme-path", type=Path, default=None, help="directory for the NVMe tier (default: a temporary one)")
    parser.add_argument("--weights", type=Path, default=None, help="a local Hugging Face directory or weights file to start from")
    parser.add_argument("--checkpoint", action="store_true", help="write a sharded checkpoint after the last step and report its phase")
    parser.add_argument("--gradient-clip-val", type=float, default=None, help="clip gradients by norm (Lightning's gradient_clip_val)")
    parser.add_argument("--gradients-at-home", action="store_true", help="a hook before the step: every offloaded unit keeps a host gradient home")
    parser.add_argument("--probe-bytes", type=int, default=GiB, help="bytes written and read to measure the raw disk")
    parser.add_argument("--placement", default="nvme", help="the policy's placement: nvme (every unit on NVMe) or search (the default policy)")
    parser.add_argument("--activations", default=None, help="the policy's activations (default: keep under --placement nvme, else the default policy's)")
    parser.add_argument("--after-fit-seconds", type=float, default=1.0, help="how long the resident set is sampled after fit returns")
    parser.add_argument("--skip-probes", action="store_true", help="measure neither the raw disk nor compute alone (the memory table only)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="offload-largest-") as scratch:
        args.nvme_path = args.nvme_path or Path(scratch)
        args.nvme_path.mkdir(parents=True, exist_ok=True)
        result = run(args)
        disk = None if args.skip_probes else raw_disk_gbps(args.nvme_path, args.probe_bytes)
    print_memory(result)
    if disk is not None:
        print_times(args, result, *disk)
    return 0


def memory_bound(budgets: Any) -> int:
    """What the process may grow by beyond what it held before ``fit``: the host budget, the
    emulated GPU tier's (host memory too, on a machine without a GPU) and the runtime's allowance."""
    import torch

    from offload_strategy import RUNTIME_HOST_ALLOWANCE

    return budgets.host + (0 if torch.cuda.is_available() else budgets.gpu) + RUNTIME_HOST_ALLOWANCE


def print_memory(result: dict[str, Any]) -> None:
    from offload_strategy import RUNTIME_HOST_ALLOWANCE, format_bytes

    n = result["parameters"]
    state = 16 * n  # fp32 parameters, gradients, AdamW's exp_avg and exp_avg_sq
    budgets, before = result["budgets"], result["before"]
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    bound = memory_bound(budgets)
    print(f"\nGPT-2 {n / 1e6:.0f}M parameters on {os.cpu_count()} cores, {format_bytes(ram)} of RAM; budgets: GPU tier "
          f"{format_bytes(budgets.gpu)} (emulated), host {format_bytes(budgets.host)}, NVMe {format_bytes(budgets.nvme)}\n")
    print("| quantity | value |\n|---|---|")
    print(f"| parameters | {n:,} |")
    print(f"| training state (fp32 parameters, gradients, 2 AdamW states) | {format_bytes(state)} ({state / ram:.2f}x RAM, {state / budgets.host:.1f}x the host budget) |")
    print(f"| seconds per step | {', '.join(f'{t:.2f}' for t in result['steps'])} |")
    for phase, peak in result["phases"].items():
        print(f"| peak RSS (high-water mark), {phase} | {format_bytes(peak)} ({peak / ram:.2f}x RAM) |")
    print(f"\nAnonymous resident set (RssAnon, sampled every 5 ms) over the {format_bytes(before)} held before fit, against the bound "
          f"{format_bytes(bound)} = host {format_bytes(budgets.host)} + emulated GPU tier {format_bytes(budgets.gpu)} + "
          f"allowance {format_bytes(RUNTIME_HOST_ALLOWANCE)}:\n")
    print("| phase | peak anonymous RSS | growth over before fit | of the bound |\n|---|---|---|---|")
    for phase, peak in result["anonymous"].items():
        if phase != "before fit":
            print(f"| {phase} | {format_bytes(peak)} | {format_bytes(peak - before)} | {(peak - before) / bound:.2f}x |")


def print_times(args: argparse.Namespace, result: dict[str, Any], write_gbps: float, read_gbps: float) -> None:
    from offload_strategy import format_bytes

    passes, updates = compute_alone(args)
    steady = result["steps"][1:] or result["steps"]
    seconds = sorted(steady)[len(steady) // 2]
    read, written = result["traffic"][-1] if result["traffic"] else (0, 0)
    bound = read / (read_gbps * 1e9) + written / (write_gbps * 1e9)
    print("\n| quantity | value |\n|---|---|")
    print(f"| seconds per step (median after the first) | {seconds:.2f} |")
    print(f"| NVMe read / written per step | {format_bytes(read)} / {format_bytes(written)} |")
    print(f"| raw disk read / write (GB/s) | {read_gbps:.2f} / {write_gbps:.2f} |")
    print(f"| NVMe-bound step time from raw bandwidth | {bound:.2f} s ({seconds / bound:.2f}x of it measured) |" if bound else "| NVMe-bound step | - |")
    compute = passes + updates
    print(f"| compute alone, in memory (one block measured, times {args.layers}) | {compute:.2f} s: forward + backward {passes:.2f}, "
          f"AdamW {updates:.2f} |")
    print(f"| measured step / max(NVMe-bound, compute) | {seconds / max(bound, compute):.2f}x (both serial: {bound + compute:.2f} s, "
          f"{seconds / (bound + compute):.2f}x) |")
    if result["saves"]:
        save = result["saves"][0]
        print(f"| sharded checkpoint save | {save:.1f} s, {format_bytes(result['written'])} written "
              f"({result['written'] / save / 1e9:.2f} GB/s; raw disk write {write_gbps:.2f} GB/s) |")


if __name__ == "__main__":
    sys.exit(main())
