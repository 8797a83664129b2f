"""`tiered` beside the other ways to train a model larger than the GPU, side by side in one run, on
one GPU capped to the same memory.

    python tools/compare_peers.py --model gpt2_xl --cap 16GiB                 # every row (minutes each)
    python tools/compare_peers.py --model llama_3b --cap 16GiB --rows tiered deepspeed_offload
    python tools/compare_peers.py --model gpt2_tiny --accelerator cpu --seq-len 128 --rows lightning tiered   # a dry run

Each row runs in a process of its own (a crash or an out-of-memory error is that row's result, and
the cap, ``torch.cuda.set_per_process_memory_fraction``, holds for everything the process puts on
the GPU): the same model (``conf/model/<name>.yaml``, random weights, dropout off), the same random
tokens, the same AdamW hyperparameters, bf16-mixed, ``--steps`` steps of which the first
``--warmup`` are left out. Rows:

- ``lightning``: plain Lightning with no cap (where the model fits), the reference;
- ``tiered`` (the default policy) and ``tiered_<preset>`` for any preset, ``gpu_memory`` the cap
  less ``--reserve`` (CUDA's context and cuBLAS's workspace are outside the tiers);
- ``fsdp_offload``: Lightning's ``FSDPStrategy(cpu_offload=True)``, one FSDP unit per block;
- ``torchao_offload``: plain Lightning with torchao's ``CPUOffloadOptimizer`` (fused AdamW on the
  CPU, gradients offloaded);
- ``deepspeed_offload`` (ZeRO-2, optimizer on the CPU), ``deepspeed_zero3_offload`` (ZeRO-3,
  parameters and optimizer on the CPU) and ``deepspeed_infinity`` (ZeRO-3, both on NVMe under
  ``--nvme-path``), through Lightning's ``DeepSpeedStrategy`` with DeepSpeed's own CPU Adam.

The peers keep every block's activations unless ``--peers-checkpoint`` (the default) has Hugging
Face recompute every block in backward, as their users do when activations do not fit: GPT-2 XL at
batch 4 x 1024 keeps about 36 GB of activations, so without it every peer runs out of memory at
16 GiB (measured on an H200). ``tiered`` chooses per block. A row that fails prints the end of its
error output before the table.

Printed: median step, tokens/s, model TFLOP/s (6 x parameters + 12 x layers x width x sequence per
token), peak GPU memory (the allocator's), peak host memory, and the step's ratio to the ``tiered`` row's (2.0: tiered is twice as fast).
Where a row fails, its line says why.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import yaml  # noqa: E402

from offload_strategy import format_bytes, parse_size  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("lightning", "tiered", "tiered_protrain", "tiered_zero_offload", "tiered_zero3_offload", "fsdp_offload", "torchao_offload",
         "deepspeed_offload", "deepspeed_zero3_offload", "deepspeed_infinity")


def model_spec(name: str) -> dict[str, Any]:
    path = ROOT / "conf" / "model" / f"{name}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))
        raise SystemExit(f"--model {name}: no conf/model/{name}.yaml; choose one of {', '.join(known)}.")
    spec = yaml.safe_load(path.read_text())
    config = dict(spec["config"])
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout", "dropout"):
        if key in config:
            config[key] = 0.0
    return {"family": spec["family"], "config": config}


# -- one row, in its own process ---------------------------------------------------------------------


def _optimizer_factory(row: str) -> Optional[Callable[[Any, float, tuple], Any]]:
    """The peer's own optimizer where it has one (the fairest configuration of it)."""
    if row == "torchao_offload":
        def torchao(groups: Any, lr: float, betas: tuple) -> Any:
            import torch
            from torchao.optim import CPUOffloadOptimizer

            return CPUOffloadOptimizer(groups, torch.optim.AdamW, offload_gradients=True, fused=True, lr=lr, betas=betas)
        return torchao
    if row.startswith("deepspeed"):
        def deepspeed(groups: Any, lr: float, betas: tuple) -> Any:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, lr=lr, betas=betas, adamw_mode=True)
        return deepspeed
    return None


def _strategy(row: str, args: argparse.Namespace, family: str, nvme: str) -> Any:
    if row in ("lightning", "torchao_offload"):
        return "auto"
    if row.startswith("tiered"):
        from offload_strategy import TieredStrategy

        policy = row.removeprefix("tiered").removeprefix("_") or "auto"
        gpu = parse_size(args.cap, "--cap") - parse_size(args.reserve, "--reserve") if args.accelerator == "gpu" else None
        return TieredStrategy(policy=policy, gpu_memory=gpu, nvme_path=nvme if policy == "zero_infinity" else None)
    if row == "fsdp_offload":
        from lightning.pytorch.strategies import FSDPStrategy
        from transformers.models import gpt2, llama, mistral, opt

        blocks = {"gpt2": gpt2.modeling_gpt2.GPT2Block, "llama": llama.modeling_llama.LlamaDecoderLayer,
                  "opt": opt.modeling_opt.OPTDecoderLayer, "mistral": mistral.modeling_mistral.MistralDecoderLayer}
        return FSDPStrategy(cpu_offload=True, auto_wrap_policy={blocks[family]})
    from lightning.pytorch.strategies import DeepSpeedStrategy

    if row == "deepspeed_offload":
        return DeepSpeedStrategy(stage=2, offload_optimizer=True)
    if row == "deepspeed_zero3_offload":
        return DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True)
    if row == "deepspeed_infinity":
        return DeepSpeedStrategy(stage=3, offload_optimizer=True, offload_parameters=True, remote_device="nvme",
                                 offload_params_device="nvme", offload_optimizer_device="nvme", nvme_path=nvme)
    raise SystemExit(f"--row {row}: not a row; choose one of {', '.join(PEERS)} or tiered_<preset>.")


def run_row(args: argparse.Namespace) -> dict[str, Any]:
    import lightning as L
    import torch

    from offload_strategy.demos import CausalLM, SyntheticTokens
    from offload_strategy.hardware import process_peak_rss
    from tools.common import StepTimer

    if args.accelerator == "gpu" and args.row != "lightning":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, parse_size(args.cap, "--cap") / total), 0)
    spec = model_spec(args.model)
    factory = _optimizer_factory(args.row)

    recompute = args.peers_checkpoint and not args.row.startswith("tiered") and args.row != "lightning"

    class Model(CausalLM):
        def configure_model(self) -> None:
            super().configure_model()
            if recompute:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

        def configure_optimizers(self) -> Any:
            if factory is None:
                return super().configure_optimizers()
            decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
            rest = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
            groups = [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": rest, "weight_decay": 0.0}]
            return factory(groups, self.hparams.lr, tuple(self.hparams.betas))

    L.seed_everything(0, verbose=False)
    model = Model(family=spec["family"], config=spec["config"], lr=1e-4)
    tokens = args.seq_len * (args.batch_size * (args.steps + 2) * 2 + 40)  # and a validation window the data module splits off
    data = SyntheticTokens(seq_len=args.seq_len, batch_size=args.batch_size, num_tokens=tokens, vocab_size=int(spec["config"]["vocab_size"]))
    timer = StepTimer()
    with tempfile.TemporaryDirectory(dir=args.nvme_path) as nvme, tempfile.TemporaryDirectory() as root:
        trainer = L.Trainer(strategy=_strategy(args.row, args, spec["family"], nvme), accelerator=args.accelerator, devices=1, max_steps=args.steps,
                            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer], default_root_dir=root, precision=args.precision)
        trainer.fit(model, datamodule=data)
    parameters = sum(p.numel() for p in model.parameters())
    steps = timer.times[args.warmup :] or timer.times
    last = timer.metrics[-1] if timer.metrics else {}
    return {
        "step": statistics.median(steps), "parameters": parameters, "flops_per_token": model.flops_per_token(args.seq_len),  # PaLM's MFU count
        "gpu_peak": torch.cuda.max_memory_allocated() if args.accelerator == "gpu" else 0, "host_peak": process_peak_rss(),
        "predicted_ms": last.get("plan/predicted_step_ms"), "hit_rate": last.get("cache/hit_rate"),
    }


# -- the table ----------------------------------------------------------------------------------------


def _launch(row: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--row", row, "--out", str(out), "--model", args.model, "--cap", args.cap,
            "--reserve", args.reserve, "--accelerator", args.accelerator, "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size), "--precision", args.precision,
            "--peers-checkpoint" if args.peers_checkpoint else "--no-peers-checkpoint"]
    if args.nvme_path:
        argv += ["--nvme-path", args.nvme_path]
    print(f"{row} ...", file=sys.stderr, flush=True)
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=args.row_timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"over --row-timeout {args.row_timeout} s"}
    if done.returncode != 0 or not out.is_file():
        lines = [x for x in done.stderr.strip().splitlines() if x.strip()]
        print(f"{row} failed (exit {done.returncode}); the end of its error output:", *lines[-25:], sep="\n  ", file=sys.stderr, flush=True)
        why = next((x for x in reversed(lines) if "Error" in x or "error" in x), lines[-1] if lines else f"exit {done.returncode}")
        return {"error": why.strip()[:160]}
    return json.loads(out.read_text())


def _line(row: str, r: dict[str, Any], args: argparse.Namespace, base: Optional[float]) -> str:
    if "error" in r:
        return f"| {row} | failed: {r['error']} | - | - | - | - | - | - |"
    tokens = args.batch_size * args.seq_len / r["step"]
    predicted = f"{r['predicted_ms']:.0f}" if r.get("predicted_ms") else "-"
    ratio = f"{r['step'] / base:.2f}" if base else "-"
    return (f"| {row} | {r['step'] * 1e3:.0f} | {tokens:,.0f} | {r['flops_per_token'] * tokens / 1e12:.1f} | {format_bytes(int(r['gpu_peak']))} | "
            f"{format_bytes(int(r['host_peak']))} | {predicted} | {ratio} |")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2_xl", help="a conf/model name")
    parser.add_argument("--cap", default="16GiB", help="GPU memory every row but plain Lightning may use")
    parser.add_argument("--reserve", default="2GiB", help="of the cap, left outside tiered's gpu_memory (CUDA context, cuBLAS workspace)")
    parser.add_argument("--rows", nargs="*", default=list(PEERS))
    parser.add_argument("--accelerator", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--nvme-path", default=None, help="directory for the NVMe rows (default: the temporary directory)")
    parser.add_argument("--row-timeout", type=int, default=600)
    parser.add_argument("--peers-checkpoint", action=argparse.BooleanOptionalAction, default=True,
                        help="the capped peers recompute every block in backward (Hugging Face's gradient checkpointing)")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row is not None:
        Path(args.out).write_text(json.dumps(run_row(args)))
        return 0
    config = model_spec(args.model)["config"]  # an unknown name stops here, naming the known ones
    positions = config.get("n_positions", config.get("max_position_embeddings"))
    if positions is not None and args.seq_len > positions:  # an unknown name stopped above, naming the known ones
        raise SystemExit(f"--seq-len {args.seq_len} is longer than {args.model}'s {positions} positions; pass --seq-len {positions} or less.")
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        for k, row in enumerate(args.rows):
            results[row] = _launch(row, args, Path(scratch) / f"{k}.json")
    base = results.get("tiered", {}).get("step")
    print(f"\n{args.model}, batch {args.batch_size} x {args.seq_len}, {args.precision}, {args.accelerator}; every row but lightning capped at "
          f"{args.cap} (tiered's gpu_memory {args.cap} less {args.reserve}; the peers {'recompute every block' if args.peers_checkpoint else 'keep every activation'}); median step of {args.steps - args.warmup} after {args.warmup} warm-up\n")
    print("| row | step (ms) | tokens/s | model TFLOP/s | peak GPU memory | peak host memory | tiered's prediction (ms) | step / tiered's |")
    print("|---|---|---|---|---|---|---|---|")
    for row, r in results.items():
        print(_line(row, r, args, base))
    return 0


if __name__ == "__main__":
    sys.exit(main())
