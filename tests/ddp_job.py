"""One data-parallel training run on CPU processes, as a user launches it: this script is started
once and Lightning starts the other ranks by running it again. Each rank writes what it saw to
``<out>/rank<r>.json``; rank 0 also writes the final weights to ``<out>/weights.pt`` and a
checkpoint to ``<out>/last.ckpt``.

    python tests/ddp_job.py --strategy tiered_ddp --devices 2 --out /tmp/run --nvme /tmp/run/nvme
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
warnings.filterwarnings("ignore")

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import offload_strategy  # noqa: E402,F401  (registers "tiered_ddp")
from offload_strategy.demos import CausalLM  # noqa: E402
from offload_strategy import TieredDDPStrategy, TieredStrategy  # noqa: E402
from offload_strategy.planning.placement import HOST, HOST_SLOT_ALIGNMENT, align  # noqa: E402
from tests.helpers import PARAMETERS_ONLY, LossRecorder, tiny_data  # noqa: E402

GPT2_4L = dict(vocab_size=256, n_positions=32, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)


class HfCheckpointing(CausalLM):
    """transformers' own activation checkpointing on every layer."""

    def configure_model(self) -> None:
        super().configure_model()
        self.model.gradient_checkpointing_enable()


class ManualAccumulation(CausalLM):
    """Manual optimization: two backward calls, then clipping by norm and the step."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss / 2)
        if batch_idx % 2 == 1:
            self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
            optimizer.step()
            optimizer.zero_grad()
        return loss


class Sgd(CausalLM):
    """Plain SGD, no momentum: one step under bf16-true gives DDP's weights exactly where the
    reduced gradients are DDP's (its bf16 update rounds once from fp32, as an fp32 master's does)."""

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class ChangesGradientsAfterBackward(CausalLM):
    """``on_after_backward`` halves every gradient in place and clamps the last layer norm's."""

    def on_after_backward(self) -> None:
        for p in self.parameters():
            if p.grad is not None:
                p.grad.mul_(0.5)
        norm = self.model.transformer.ln_f.weight
        if norm.grad is not None:
            norm.grad = norm.grad.clamp(-1e-3, 1e-3)


class RankBranch(CausalLM):
    """A head used on rank 0 only, and one used on no rank: DDP's unused-parameter cases."""

    def configure_model(self) -> None:
        super().configure_model()
        if not hasattr(self, "side"):
            self.side = torch.nn.Linear(GPT2_4L["n_embd"], 1)
            self.unused = torch.nn.Linear(GPT2_4L["n_embd"], 1)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 0:
            embedded = self.model.get_input_embeddings()(batch)
            loss = loss + 0.1 * self.side(embedded).mean()
        return loss


class Hang(L.Callback):
    """Rank ``rank`` stops responding before batch ``batch``: it writes the time it stopped to
    ``<out>/hung.txt`` and sleeps, as a process stuck in I/O or a deadlock would."""

    def __init__(self, out: Path, rank: int, batch: int) -> None:
        self.out, self.rank, self.batch = out, rank, batch

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.batch:
            (self.out / "hung.txt").write_text(str(time.time()))
            time.sleep(3600)


def model_bytes(config: dict = GPT2_4L) -> int:
    model = CausalLM(family="gpt2", config=config, lr=1e-2, warmup_steps=2)
    model.configure_model()
    return sum(p.numel() * p.element_size() for p in model.parameters())


class Metrics(L.Callback):
    """The strategy's metrics after the last batch (optimizer-state bytes per tier)."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}

    def on_train_batch_end(self, trainer, *args) -> None:
        metrics = getattr(trainer.strategy, "metrics", None)
        if metrics is not None:
            self.last = {k: v for k, v in metrics().items() if k.startswith(("optimizer/", "units/", "budget/", "gradients/", "tier/", "link/collective", "link/states"))}
        engine = getattr(getattr(trainer.strategy, "tiered", None), "engine", None)
        if engine is not None:  # fp32 masters of every host unit with 16-bit parameters, whoever owns it
            self.last["all_host_masters_bytes"] = float(sum(
                align(s.unit.layout_nbytes(s.master_dtypes), HOST_SLOT_ALIGNMENT) for s in engine.states if s.home == HOST and s.widened
            ))
            self.last["race_checked"] = float(getattr(engine.device, "race_check", None) is not None)  # the suite's (tests/conftest.py)


class LargestCollective:
    """The most bytes one call of ``torch.distributed`` carried to or from this rank while it is
    entered: an object collective's objects, pickled (every rank's for an all-gather), a
    broadcast's or a message's tensor."""

    NAMES = ("all_gather_object", "broadcast_object_list", "broadcast", "send", "recv")

    def __init__(self) -> None:
        self.largest = 0

    def _wrap(self, call: Any) -> Any:
        def measured(*args: Any, **kwargs: Any) -> Any:
            out = call(*args, **kwargs)
            first = args[0] if args else next(iter(kwargs.values()))
            carried = first.nbytes if torch.is_tensor(first) else len(pickle.dumps(first))
            self.largest = max(self.largest, carried)
            return out

        return measured

    def __enter__(self) -> "LargestCollective":
        self.calls = {name: getattr(dist, name) for name in self.NAMES}
        for name, call in self.calls.items():
            setattr(dist, name, self._wrap(call))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, call in self.calls.items():
            setattr(dist, name, call)


class PlaceAgain(L.Callback):
    """Places the units again after each step of ``at``, in ``fraction`` of the GPU tier at the
    first and all of it at the next (units leave the GPU tier, where every rank keeps their states,
    then join it again, where each rank needs their owner's; the tier less the kept layout's peak
    is the parameters' all). Records, per placement: this rank's
    optimizer-state bytes before it (in all, on NVMe, its largest unit's); the bytes of tensors
    made once the new engine is built, alive at once beyond what the placement left alive
    (``LiveBytes``: what taking the states in passed through memory); the most one collective
    brought to this rank (``LargestCollective``); and the units in the GPU tier after it."""

    def __init__(self, at: list[int], fraction: float) -> None:
        self.at, self.fraction = at, fraction
        self.placements: list[dict[str, int]] = []

    def on_train_batch_end(self, trainer, *args) -> None:
        from offload_strategy.estimate.live_bytes import LiveBytes  # noqa: PLC0415

        if trainer.global_step not in self.at:
            return
        core = trainer.strategy.tiered
        engine, budget = core.engine, core.context.budgets.gpu
        held = dict(engine.updater.state_bytes)
        on_nvme = dict(engine.nvme_states.sizes) if engine.nvme_states is not None else {}
        fixed = core.session.activations.fixed  # the kept layout's measured peak takes its part of the tier
        share = core.session.gpu_for_parameters(fixed.peak_bytes) if fixed is not None else budget
        gpu_bytes = int(self.fraction * share) if self.at.index(trainer.global_step) % 2 == 0 else share
        build = core._build_engine

        def built(*args: Any, **kwargs: Any) -> Any:
            engine = build(*args, **kwargs)
            live.reset()
            return engine

        core._build_engine = built
        try:
            with LiveBytes() as live, LargestCollective() as collectives:
                core._replace_engine(core.recipe(trainer), gpu_bytes=gpu_bytes)
        finally:
            del core._build_engine
        self.placements.append({"loading": live.peak - live.bytes, "collective": collectives.largest, "states": sum(held.values()),
                                "largest": max(held.values(), default=0), "nvme": sum(on_nvme.values()), "largest_nvme": max(on_nvme.values(), default=0),
                                "gpu_units": int(core.engine.metrics(reset=False)["units/gpu"])})


def record_threads() -> dict[str, list[str]]:
    """The names of the threads that waited on the host for the copies of gradients home, and of
    those that launched backward's reductions, filled in as the run goes (``--record-threads``)."""
    from offload_strategy.hardware.device import Device, Event  # noqa: PLC0415
    from offload_strategy.runtime.grads.exchange import GradientExchange  # noqa: PLC0415
    from offload_strategy.runtime.grads.path import GradientPath  # noqa: PLC0415

    seen: dict[str, list[str]] = {"copy_waits": [], "launches": []}
    issued: dict[int, Event] = {}
    inside = threading.local()
    receive, copy_to_host, wait, launch = GradientPath.receive, Device.copy_to_host, Event.wait, GradientExchange._launch

    def receiving(self, p):
        inside.on = True
        try:
            return receive(self, p)
        finally:
            inside.on = False

    def copying(self, dst, src):
        event = copy_to_host(self, dst, src)
        if getattr(inside, "on", False):
            issued[id(event)] = event
        return event

    def waiting(event):
        if issued.get(id(event)) is event:
            seen["copy_waits"].append(threading.current_thread().name)
        return wait(event)

    def launching(self, *args):
        seen["launches"].append(threading.current_thread().name)
        return launch(self, *args)

    GradientPath.receive, Device.copy_to_host, Event.wait, GradientExchange._launch = receiving, copying, waiting, launching
    return seen


def kept_peak(layers: int, precision: str = "32-true", rank_branch: bool = False) -> int:
    """The kept layout's peak per rank at this job's batch, as the first step measures it, with
    128 KiB of the backward's gradients: each 32-wide block's 225.5 KiB and 81.6 KiB outside the
    blocks in fp32; 113 KiB and 73.4 KiB under bf16-true; the head used on rank 0 alone 8 KiB more."""
    if precision == "bf16-true":
        return 206_212 + 115_712 * layers
    return 214_660 + 230_912 * layers + (8_192 if rank_branch else 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="tiered_ddp", choices=["ddp", "ddp_find_unused_parameters_true", "tiered_ddp", "tiered", "auto"])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num-nodes", type=int, default=1, help="machines (each started with its NODE_RANK; --devices ranks on each)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--resume", type=Path, default=None)
    parser.add_argument("--nvme", type=Path, default=None, help="an NVMe tier in this directory")
    parser.add_argument("--host-factor", type=float, default=None, help="host_memory as a multiple of the parameter bytes")
    parser.add_argument("--no-shard", action="store_true", help="every rank keeps every optimizer state")
    parser.add_argument("--share-homes", action="store_true", help="one copy of host homes for both ranks (share_host_homes)")
    parser.add_argument("--gpu-factor", type=float, default=0.3, help="gpu_memory as a multiple of the parameter bytes")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--clip-norm", type=float, default=None)
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--rank-branch", action="store_true", help="a model with parameters unused on some ranks")
    parser.add_argument("--layers", type=int, default=GPT2_4L["n_layer"], help="the model's transformer blocks")
    parser.add_argument("--default-policy", action="store_true", help="the default policy (placement and activations searched) with a GPU tier of 3.2 times the parameters (the logits need room beside the blocks, and the first steps room for their own layout)")
    parser.add_argument("--hf-checkpointing", action="store_true", help="transformers' own activation checkpointing on every layer")
    parser.add_argument("--manual", action="store_true", help="manual optimization accumulating two backward calls, clipping by norm")
    parser.add_argument("--activations", default=None, help="with --default-policy: policy.activations (the placement still searched)")
    parser.add_argument("--sgd", action="store_true", help="plain SGD instead of AdamW with warm-up")
    parser.add_argument("--after-backward", action="store_true", help="on_after_backward changes the gradients")
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--policy-none", action="store_true", help="policy 'none' (every unit in the GPU tier)")
    parser.add_argument("--loss-chunk-tokens", type=int, default=None, help="the loss a chunk of this many tokens at a time")
    parser.add_argument("--timeout", type=float, default=None, help="the strategy's timeout, seconds")
    parser.add_argument("--copied-home", action="store_true", help="gradients copied home (gradient_reserve=1, as on CUDA), no prefetch")
    parser.add_argument("--record-threads", action="store_true", help="report the threads that waited for gradients' copies and launched reductions")
    parser.add_argument("--place-again", type=int, nargs="+", default=None, metavar="STEP",
                        help="the units placed again after each STEP, in turn in a part of the GPU tier (--place-again-fraction) and in all of it")
    parser.add_argument("--place-again-fraction", type=float, default=0.3)
    parser.add_argument("--hang", type=int, nargs=2, default=None, metavar=("RANK", "STEP"), help="RANK stops responding before STEP")
    args = parser.parse_args()

    config = dict(GPT2_4L, n_layer=args.layers)
    total = model_bytes(config)
    host = args.host_factor if args.host_factor is not None else 4.2 if args.nvme else 6.0
    # the kept layout's peak is counted in the GPU tier (measured in the first step, the parameters
    # placed again beside it after that step): --gpu-factor is the parameters' share beside it
    budgets = dict(gpu_memory=int(args.gpu_factor * total) + kept_peak(args.layers, args.precision, args.rank_branch), host_memory=int(host * total), policy=PARAMETERS_ONLY)
    if args.default_policy:
        budgets = dict(gpu_memory=int(3.2 * total), host_memory=int(host * total), **({"policy": {"activations": args.activations}} if args.activations else {}))
    if args.policy_none:
        budgets = dict(policy="none", host_memory=int(host * total))
    if args.nvme:
        budgets.update(nvme_path=args.nvme, nvme_memory="64MiB")
    if args.copied_home:
        budgets["policy"] = {**PARAMETERS_ONLY, "gradient_reserve": 1.0, "prefetch": False}
    threads = record_threads() if args.record_threads else None
    if args.strategy == "tiered_ddp":
        timeout = {"timeout": timedelta(seconds=args.timeout)} if args.timeout else {}
        strategy = TieredDDPStrategy(shard_states=not args.no_shard, share_host_homes=args.share_homes, **timeout, **budgets)
    elif args.strategy == "tiered":
        strategy = TieredStrategy(**budgets)
    else:
        strategy = args.strategy

    L.seed_everything(7, verbose=False)
    kinds = {RankBranch: args.rank_branch, HfCheckpointing: args.hf_checkpointing, ManualAccumulation: args.manual, Sgd: args.sgd,
             ChangesGradientsAfterBackward: args.after_backward}
    kind = next((k for k, wanted in kinds.items() if wanted), CausalLM)
    model = kind(family="gpt2", config=config, lr=1e-2, warmup_steps=2, loss_chunk_tokens=args.loss_chunk_tokens)
    recorder, metrics = LossRecorder(), Metrics()
    hang = [Hang(args.out, *args.hang)] if args.hang else []
    again = [PlaceAgain(args.place_again, args.place_again_fraction)] if args.place_again else []
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_epochs=args.epochs,
        max_steps=args.max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=args.out,
        callbacks=[recorder, metrics, *hang, *again],
        precision=args.precision,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=args.clip_norm,
    )
    trainer.fit(model, datamodule=tiny_data(), ckpt_path=args.resume)
    trainer.save_checkpoint(args.out / "last.ckpt")  # every rank takes part; rank 0 writes
    rank = trainer.global_rank
    report = {"losses": recorder.losses, "metrics": metrics.last, "world_size": trainer.world_size, **({"threads": threads} if threads else {}),
              **({"placed_again": again[0].placements} if again else {})}
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))
    if rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, args.out / "weights.pt")


if __name__ == "__main__":
    main()
