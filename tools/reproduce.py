"""The step model against figures the five papers published: each paper's setting reproduced with
Hydra overrides and the budgets of ``tools/simulate.py``, the published figure beside the model's.

    python tools/reproduce.py                 # every point, a markdown table
    python tools/reproduce.py --only LH PT-1  # points whose id starts so

The model prices *this* library's plan (the joint search of ``planning/auto.py``) on the paper's
machine, at the efficiency and link rates every other prediction uses: nothing here is tuned to a
point. Each paper's system keeps its model states as it says: ProTrain's mixed precision (fp32
parameters, gradients and Adam states at home, 16 bytes per parameter: ``bf16-mixed``), LoHan's
and 10Cache's 16-bit parameters with fp32 masters (``bf16-true``). The papers' systems and ours differ in what they keep where, so a ratio far from 1 says
either that the hardware is priced wrong or that the two systems decide differently; the notes
say which where it is known. Kinds of point:

- ``step_s``, ``tokens_per_s``: the auto plan's predicted step at the paper's batch (or the fastest
  over the batches given, where the paper reports its best batch), all ranks' tokens;
- ``tflops``: model FLOPs (forward, backward twice forward, attention included) per second;
- ``forward_s``: the GPU compute of one forward, without transfers;
- ``activations_gb``: what the blocks save for backward (bf16, each storage once);
- ``largest_b``: the largest model of the point's width the budgets hold (``simulate.largest_depth``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


LOHAN_13B = ("model=gpt3_175b", "model.config.n_embd=5120", "model.config.n_layer=40", "model.config.n_head=40",
             "model.config.n_positions=1024", "+model.config.activation_function=gelu_pytorch_tanh", "hardware=rtx4090", "data=synthetic",
             "data.seq_len=1024")
GPT2_W8192 = ("model=gpt2_xl", "model.config.n_embd=8192", "model.config.n_head=64", "data=synthetic", "data.seq_len=1024", "data.batch_size=1")
GPT2_10B = ("model=gpt2_xl", "model.config.n_embd=4096", "model.config.n_layer=48", "model.config.n_head=32", "data=synthetic", "data.seq_len=1024")
LLAMA_13B = ("model=llama_7b", "model.config.hidden_size=5120", "model.config.intermediate_size=13824", "model.config.num_hidden_layers=40",
             "model.config.num_attention_heads=40", "model.config.num_key_value_heads=40", "data=synthetic", "data.seq_len=1024")
A40 = ("hardware=l40s", "+hardware.gpu=NVIDIA_A40", "+hardware.gpu_memory=48GB", "+hardware.gpu_bf16_tflops=149.7",
       "+hardware.gpu_fp16_tflops=149.7", "+hardware.gpu_fp32_tflops=37.4")
RTX4080 = ("+hardware.gpu=NVIDIA_RTX_4080", "+hardware.gpu_memory=16GiB", "+hardware.gpu_bf16_tflops=97.5", "+hardware.gpu_fp16_tflops=97.5",
           "+hardware.gpu_fp32_tflops=48.7")


@dataclass(frozen=True)
class Point:
    ident: str
    source: str  # where in the paper
    kind: str  # see the module docstring
    published: float
    overrides: tuple[str, ...]
    gpu: str
    host: Optional[str] = None  # None: 80% of the machine's
    nvme: str = "0"
    ranks: int = 1
    network_gbps: Optional[float] = None
    batches: tuple[int, ...] = ()  # the paper's best batch: the fastest of these per rank
    precision: str = "bf16-true"  # how the paper's system keeps its model states (see POINTS)
    note: str = ""
    # a ``forward_s`` point whose published compute time sets the GPU's achieved share of its peak
    # on that machine (then that point calibrates and is not counted)
    rate_from: Optional[str] = None


POINTS = (
    Point("LH-15", "LoHan §V-C: 135 TFLOPS, 13B, batch 32, RTX 4090, 12 SSDs", "tflops", 135.0,
          (*LOHAN_13B, "data.batch_size=32"), "22GiB", nvme="40TB", rate_from="LH-11"),
    Point("LH-11", "LoHan §III-C: forward compute 5.96 s, 13B, batch 32", "forward_s", 5.96, (*LOHAN_13B, "data.batch_size=32"), "22GiB", nvme="40TB"),
    Point("LH-9", "LoHan §III-B: 213 GB of activations, 13B, batch 32", "activations_gb", 213.0, (*LOHAN_13B, "data.batch_size=32"), "22GiB",
          nvme="40TB"),
    Point("LH-1", "LoHan abstract: 276B trains on an RTX 4090 with 768 GB", "largest_b", 276.0,
          ("model=gpt3_175b", "model.config.n_embd=14336", "model.config.n_layer=112", "model.config.n_head=112", "model.config.n_positions=1024",
           "hardware=rtx4090", "data=synthetic", "data.seq_len=1024", "data.batch_size=1"), "22GiB", nvme="40TB"),
    Point("LH-3", "LoHan abstract: 175B trains on an RTX 4080 with 256 GB (a lower bound)", "largest_b", 175.0,
          ("model=gpt3_175b", "model.config.n_positions=1024", "hardware=rtx4090", *RTX4080, "data=synthetic", "data.seq_len=1024",
           "data.batch_size=1"), "15GiB", host="256GB", nvme="40TB", note="host budget the machine's whole 256 GB"),
    Point("PT-1a", "ProTrain Table 2: 34B on one RTX 3090 (384 GB)", "largest_b", 34.0, (*GPT2_W8192, "model.config.n_layer=42", "hardware=rtx3090"),
          "22GiB", precision="bf16-mixed"),
    Point("PT-1b", "ProTrain Table 2: 37B on four RTX 3090 (384 GB)", "largest_b", 37.0, (*GPT2_W8192, "model.config.n_layer=46", "hardware=rtx3090"),
          "22GiB", host="77GB", ranks=4, note="host per rank: a quarter of 80% of 384 GB", precision="bf16-mixed"),
    Point("PT-1c", "ProTrain Table 2: 75B on one A100 80GB (1 TB)", "largest_b", 75.0, (*GPT2_W8192, "model.config.n_layer=93", "hardware=a100_80g"),
          "72GiB", precision="bf16-mixed"),
    Point("PT-1d", "ProTrain Table 2: 87B on four A100 80GB (1 TB)", "largest_b", 87.0, (*GPT2_W8192, "model.config.n_layer=108", "hardware=a100_80g"),
          "72GiB", host="200GB", ranks=4, note="host per rank: a quarter of 80% of 1 TB", precision="bf16-mixed"),
    Point("PT-6a", "ProTrain Table 3: Mistral-7B, 4 A100, best batch", "tokens_per_s", 11060.92,
          ("model=mistral_7b", "hardware=a100_80g", "data=synthetic", "data.seq_len=1024"), "72GiB", host="200GB", ranks=4, network_gbps=300,
          batches=(8, 16, 32), precision="bf16-mixed"),
    Point("PT-6b", "ProTrain Table 3: GPT-2 10B, 4 A100, best batch", "tokens_per_s", 8266.40, (*GPT2_10B, "hardware=a100_80g"), "72GiB",
          host="200GB", ranks=4, network_gbps=300, batches=(8, 16, 32), precision="bf16-mixed"),
    Point("PT-6c", "ProTrain Table 3: LLaMA-13B, 4 A100, batch 228", "tokens_per_s", 6471.32, (*LLAMA_13B, "hardware=a100_80g", "data.batch_size=57"),
          "72GiB", host="200GB", ranks=4, network_gbps=300, precision="bf16-mixed"),
    Point("PT-6d", "ProTrain Table 3: GPT-2 20B, 4 A100, best batch", "tokens_per_s", 5043.75,
          ("model=gpt2_xl", "model.config.n_embd=8192", "model.config.n_layer=24", "model.config.n_head=64", "data=synthetic", "data.seq_len=1024",
           "hardware=a100_80g"), "72GiB", host="200GB", ranks=4, network_gbps=300, batches=(8, 16, 32), precision="bf16-mixed"),
    Point("PT-14", "ProTrain §5.3.1: GPT-2 10B, 4 RTX 3090, 2,493 tokens/s", "tokens_per_s", 2493.0, (*GPT2_10B, "hardware=rtx3090"), "22GiB",
          host="77GB", ranks=4, batches=(4, 8, 16), precision="bf16-mixed"),
    Point("PT-22", "ProTrain §5.4: GPT 175B, 16 A100 (4 nodes, 100 Gb/s), batch 256", "tokens_per_s", 2218.70,
          ("model=gpt3_175b", "model.config.n_positions=1024", "hardware=a100_80g", "data=synthetic", "data.seq_len=1024", "data.batch_size=16"),
          "72GiB", host="200GB", ranks=16, network_gbps=12.5, precision="bf16-mixed"),
    Point("TC-1", "10Cache Table 5: BERT, batch 128, A40, CPU-GPU: 381.70 ms", "step_s", 0.3817,
          ("model=gpt2_small", "model.config.vocab_size=30522", "model.config.n_positions=512", *A40, "data=synthetic", "data.seq_len=128",
           "data.batch_size=128"), "44GB", host="200GB", note="BERT-base's shapes as a 12 x 768 GPT-2; sequence length not stated (128 taken)"),
)


def run(point: Point, sim: Any, efficiency: float) -> tuple[float, str]:
    """The model's figure for ``point`` and what the plan was."""
    batches = point.batches or (None,)
    results = [_one(point, sim, efficiency, batch) for batch in batches]
    if point.kind in ("tokens_per_s", "tflops"):
        return max(results, key=lambda r: r[0] if not math.isnan(r[0]) else -1.0)
    return results[0]


def _one(point: Point, sim: Any, efficiency: float, batch: Optional[int]) -> tuple[float, str]:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from offload_strategy import parse_size
    from offload_strategy.planning.sharding import assign_owners

    overrides = [*point.overrides, "logger=none", *([f"data.batch_size={batch}"] if batch else [])]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    hardware = instantiate(cfg.hardware)
    model = sim.build(cfg, hardware, point.precision == "bf16-true", efficiency, dtype="bf16")
    gpu = parse_size(point.gpu)
    host = parse_size(point.host) if point.host else int(0.8 * hardware.host_memory)
    nvme = parse_size(point.nvme)
    if point.kind == "largest_b":
        depth, parameters = sim.largest_depth(model, gpu, host, nvme, ranks=point.ranks)
        return parameters / 1e9, f"{depth} blocks"
    if point.kind == "activations_gb":
        return sum(b.activation_bytes for b in model.blocks) / 1e9, f"{len(model.blocks)} blocks"
    if point.kind == "forward_s":
        return sum(b.forward_seconds for b in model.blocks) + sum(c.forward_seconds for c in model.costs if not _in_blocks(model, c)), ""
    network = None if point.network_gbps is None else point.network_gbps * 1e9
    machine = sim.machine_of(hardware, nvme, ranks=point.ranks, network=network, shard_states=True)
    owners = assign_owners([s.trainable_bytes for s in model.sizes], point.ranks)
    owned = {i for i, o in enumerate(owners) if o == 0} if point.ranks > 1 else None
    auto = sim.compare_policies(model, machine, gpu, host, nvme, owned, owners)[-1]
    plan = f"batch {model.batch_size}/rank, units {auto.homes}, blocks {auto.layout}" if auto.fits else auto.note[:90]
    if not auto.fits:
        return float("nan"), plan
    if point.kind == "step_s":
        return auto.seconds, plan
    if point.kind == "tokens_per_s":
        return model.tokens * point.ranks / auto.seconds, plan
    flops = 3 * (sum(b.forward_seconds for b in model.blocks) + sum(c.forward_seconds for c in model.costs if not _in_blocks(model, c)))
    return flops * hardware.peak_flops("bf16") * efficiency / auto.seconds / 1e12, plan


def _in_blocks(model: Any, cost: Any) -> bool:
    """Units inside a block: their compute is in the block's forward time already."""
    inside = {model.costs[i].name for units in model.block_units for i in units}
    return cost.name in inside


def calibrations(points: list[Point], sim: Any, efficiency: float) -> dict[str, float]:
    """The share of the GPU's dense peak each calibrating point's published forward time implies:
    the model's forward FLOPs over that time (the model's forward at ``efficiency`` scaled)."""
    rates = {}
    calibrating = {p.rate_from for p in POINTS if p.rate_from}
    for ident in {p.rate_from for p in points if p.rate_from} | {p.ident for p in points if p.ident in calibrating}:
        point = next(p for p in POINTS if p.ident == ident)
        ours, _ = run(point, sim, efficiency)
        rates[ident] = efficiency * ours / point.published
    return rates


def command(point: Point) -> str:
    flags = [f"--gpu-memory {point.gpu}"]
    flags += [f"--host-memory {point.host}"] if point.host else []
    flags += [f"--nvme-memory {point.nvme}"] if point.nvme != "0" else []
    flags += [f"--ranks {point.ranks}"] if point.ranks > 1 else []
    flags += [f"--network-gbps {point.network_gbps:g}"] if point.network_gbps else []
    flags += [f"--precision {point.precision}"] if point.precision != "bf16-true" else []
    return "python tools/simulate.py " + " ".join([*point.overrides, *flags])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=(), help="point ids, or their prefixes (LH, PT-1)")
    parser.add_argument("--efficiency", type=float, default=0.5, help="model FLOPs utilisation of the GPU's dense peak, as tools/simulate.py")
    parser.add_argument("--commands", action="store_true", help="print each point's tools/simulate.py command after the table")
    args = parser.parse_args(argv)
    points = [p for p in POINTS if not args.only or any(p.ident.startswith(o) for o in args.only)]
    if not points:
        raise SystemExit(f"--only {' '.join(args.only)}: no point matches; the ids are {', '.join(p.ident for p in POINTS)}")
    from tools import simulate as sim

    print("| point | published | setting | published figure | model | model / published | plan |")
    print("|---|---|---|---|---|---|---|")
    within, counted = 0, 0
    rates = calibrations(points, sim, args.efficiency)
    for point in points:
        started = time.perf_counter()
        efficiency = rates.get(point.rate_from or "", args.efficiency)
        ours, plan = run(point, sim, efficiency)
        ratio = ours / point.published
        calibrating = point.ident in rates
        counted += not math.isnan(ratio) and not calibrating
        within += abs(ratio - 1) <= 0.2 and not calibrating
        note = f"; {point.note}" if point.note else ""
        note += f"; the GPU at {efficiency:.1%} of its peak, from {point.rate_from}" if point.rate_from else ""
        note += f"; calibrates the GPU's rate ({rates[point.ident]:.1%} of its dense peak), not counted" if calibrating else ""
        print(f"| {point.ident} | {point.source} | {point.kind}{note} | {point.published:,.4g} | {ours:,.4g} | {ratio:.2f} | {plan} "
              f"({time.perf_counter() - started:.0f} s) |", flush=True)
    print(f"\n{within} of {counted} points within ±20% of the published figure.")
    if args.commands:
        print()
        for point in points:
            print(f"{point.ident}: {command(point)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
