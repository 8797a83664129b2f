"""Optimizer offload figures, side by side in one run.

    python tools/bench_optimizer.py

1. Throughput: the per-unit orchestration (one fused AdamW per unit behind the facade, over master
   tensors at home, as the engine runs it) against one standalone ``AdamW(fused=True)`` over the same
   tensors, in parameters per second.
2. Exposed optimizer time: training with units updated during backward (LoHan's active gradient
   offloading), the time the optimizer step still waits after backward, against the time all the
   unit updates take.
3. States on NVMe: step time with every unit's parameters and optimizer states in host memory
   against about half of them on NVMe.
4. Clipping by norm: the exposed optimizer time without clipping, with a threshold no step's norm
   reaches (units updated during backward ahead of the norm, every update kept), and with one
   every step's norm exceeds (the first step's updates redone, the later ones after backward, as
   before updates could run ahead of clipping).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import lightning as L  # noqa: E402
import torch  # noqa: E402

from offload_strategy import TieredStrategy, format_bytes  # noqa: E402
from offload_strategy.runtime.updates.optimizers import UnitOptimizers, grads_on  # noqa: E402
from offload_strategy.runtime.units import build_units, merge_into_chunks  # noqa: E402
from offload_strategy.demos import PARAMETERS_ONLY, CausalLM, SyntheticTokens  # noqa: E402


def gpt2(layers: int, width: int) -> dict[str, Any]:
    return dict(vocab_size=256, n_positions=256, n_embd=width, n_layer=layers, n_head=max(1, width // 64),
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)


class FusedAdamW(CausalLM):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)


def throughput(config: dict[str, Any], repeats: int, steps: int, chunk_bytes: Optional[int] = None) -> tuple[int, int, float, float]:
    """Parameters/s of standalone fused AdamW and of the per-unit orchestration, interleaved."""
    L.seed_everything(0, verbose=False)
    model = CausalLM(family="gpt2", config=config)
    model.configure_model()
    units, users = build_units(model)
    if chunk_bytes:
        units, _ = merge_into_chunks(units, users, chunk_bytes)
    tensors = [[p.detach().clone() for p in u.trainable] for u in units]
    grads = [[torch.randn_like(t) for t in ts] for ts in tensors]
    flat, flat_grads = [t for ts in tensors for t in ts], [g for gs in grads for g in gs]
    n = sum(t.numel() for t in flat)

    alone = [t.clone() for t in flat]  # its own tensors: the orchestrated run attaches and clears grads on `flat`
    standalone = torch.optim.AdamW(alone, lr=1e-4, fused=True)
    for t, g in zip(alone, flat_grads):
        t.grad = g
    facade_params = [torch.nn.Parameter(t.clone()) for t in flat]
    facade = torch.optim.AdamW(facade_params, lr=1e-4, fused=True)
    per_unit, k = [], 0
    for index, ts in enumerate(tensors):
        per_unit.append((index, facade_params[k : k + len(ts)], ts))
        k += len(ts)
    orchestrated = UnitOptimizers(facade, per_unit)

    def run_standalone() -> None:
        standalone.step()

    def run_units() -> None:
        for index, ts in enumerate(tensors):
            slot = orchestrated.slots[index]
            with grads_on(slot.masters, grads[index]):
                orchestrated.step(index)
        orchestrated.count_step()

    times: dict[str, list[float]] = {"standalone": [], "units": []}
    for _ in range(repeats):
        for name, fn in (("standalone", run_standalone), ("units", run_units)):
            fn()  # warm
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append((time.perf_counter() - start) / steps)
    return n, len(units), n / statistics.median(times["standalone"]), n / statistics.median(times["units"])


class Metrics(L.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)
        self.rows.append(trainer.strategy.metrics())


def train(strategy: TieredStrategy, config: dict[str, Any], steps: int, batch: int, seq: int, clip: Optional[float] = None) -> Metrics:
    L.seed_everything(0, verbose=False)
    metrics = Metrics()
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[metrics], gradient_clip_val=clip)
    trainer.fit(FusedAdamW(family="gpt2", config=config), datamodule=SyntheticTokens(seq_len=seq, batch_size=batch, num_tokens=seq * batch * (steps + 2) * 2))
    return metrics


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clip-link-gbps", type=float, default=0.2, help="part 4: the emulated link's GB/s each way")
    parser.add_argument("--clip-batch", type=int, nargs=2, default=[2, 64], help="part 4: batch size and sequence length")
    args = parser.parse_args(argv)
    config = gpt2(args.layers, args.width)

    print(f"\n## 1. CPU optimizer throughput (fused AdamW, median of {args.repeats}; GPT-2 shapes, one unit per module)\n")
    print("| model | parameters | units | mean unit | standalone AdamW(fused=True), one call | per-unit orchestration | ratio |\n|---|---|---|---|---|---|---|")
    for layers, width, chunk in ((args.layers, args.width, None), (args.layers, args.width, 8 << 20), (4, 1024, None)):
        n, count, standalone, units = throughput(gpt2(layers, width), args.repeats, 10, chunk)
        label = f"{layers} x {width}" + (f", chunk_size={format_bytes(chunk)}" if chunk else "")
        print(f"| {label} | {n / 1e6:.2f} M | {count} | {n / count / 1e6:.2f} M | {standalone / 1e9:.3f} G/s | {units / 1e9:.3f} G/s | {units / standalone:.3f} |")

    L.seed_everything(0, verbose=False)
    probe = CausalLM(family="gpt2", config=config)
    probe.configure_model()
    total = sum(p.numel() * p.element_size() for p in probe.parameters())
    gpu = int(0.25 * total)
    clipped = {"no clipping": None, "clip, never reached": 1e9, "clip, always exceeded": 1e-9}
    # a small batch over a slow link: backward waits for copies as on a GPU machine, where the cores
    # are free for updates meanwhile (here they compute too, so no setting frees them entirely)
    throttled = {**PARAMETERS_ONLY, "throttle": True}
    link = {"name": "throttled", "gpu": "emulated", "gpu_memory": "80GiB", "gpu_bf16_tflops": None, "gpu_fp16_tflops": None,
            "h2d_gbps": args.clip_link_gbps, "d2h_gbps": args.clip_link_gbps, "host_memory": "16GiB", "cpu_cores": os.cpu_count() or 1}
    with tempfile.TemporaryDirectory(dir=".", prefix="bench-opt-nvme-") as nvme:
        runs: dict[str, list[Metrics]] = {"host": [], "nvme": [], **{name: [] for name in clipped}}
        for _ in range(args.repeats):
            runs["host"].append(train(TieredStrategy(gpu_memory=gpu, host_memory="8GiB", policy=PARAMETERS_ONLY), config, args.steps, args.batch_size, args.seq_len))
            runs["nvme"].append(train(TieredStrategy(gpu_memory=gpu, host_memory=int(3.2 * total), nvme_path=nvme, nvme_memory="4GiB", policy=PARAMETERS_ONLY),
                                      config, args.steps, args.batch_size, args.seq_len))
            for name, clip in clipped.items():
                runs[name].append(train(TieredStrategy(gpu_memory=gpu, host_memory="8GiB", hardware=link, policy=throttled), config, args.steps,
                                        *args.clip_batch, clip=clip))

    def summary(name: str) -> tuple[float, float, float, str]:
        rows = [r for m in runs[name] for r in m.rows[args.warmup :]]
        times = [t for m in runs[name] for t in m.times[args.warmup :]]
        last = runs[name][-1].rows[-1]
        homes = "/".join(str(int(last[f"units/{h}"])) for h in ("gpu", "host", "nvme"))
        return (statistics.median(times) * 1e3, statistics.median(r["optimizer/update_ms"] for r in rows),
                statistics.median(r["optimizer/exposed_ms"] for r in rows), homes)

    host = summary("host")
    nvme = summary("nvme")
    print(f"\n## 2. Exposed optimizer time (GPT-2 {args.layers} x {args.width}, {format_bytes(total)} fp32, batch {args.batch_size} x {args.seq_len}, "
          f"gpu_memory 25%, medians over {args.repeats} x {args.steps - args.warmup} steps)\n")
    print("| placement (units gpu/host/nvme) | step (ms) | all unit updates (ms) | left after backward (ms) | exposed share |\n|---|---|---|---|---|")
    for name, (step, update, exposed, homes) in (("host", host), ("nvme", nvme)):
        print(f"| {name} ({homes}) | {step:.1f} | {update:.1f} | {exposed:.1f} | {exposed / update:.1%} |")
    print(f"\n## 3. States on NVMe: step time {nvme[0]:.1f} ms with {nvme[3].split('/')[2]} units' parameters and states on NVMe "
          f"vs {host[0]:.1f} ms with all in host memory ({nvme[0] / host[0]:.3f}x)")
    print(f"\n## 4. Clipping by norm (host placement as in 2, batch {args.clip_batch[0]} x {args.clip_batch[1]}, copies throttled to "
          f"{args.clip_link_gbps} GB/s each way; gradient_clip_val set so that no step's norm reaches it, or every step's exceeds it)\n")
    print("| recipe | step (ms) | all unit updates (ms) | left after backward (ms) | exposed share | units updated ahead of the norm "
          "(last step) | redone steps |\n|---|---|---|---|---|---|---|")
    for name in clipped:
        step, update, exposed, _ = summary(name)
        last = runs[name][-1].rows[-1]
        ahead = f"{int(last['optimizer/speculated_units'])}" if "optimizer/speculated_units" in last else "-"
        redone = f"{int(last['optimizer/speculation_redone_steps'])}" if "optimizer/speculation_redone_steps" in last else "-"
        print(f"| {name} | {step:.1f} | {update:.1f} | {exposed:.1f} | {exposed / update:.1%} | {ahead} | {redone} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
