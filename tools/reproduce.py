"""The step model against figures the five papers published: each paper's setting reproduced with
Hydra overrides and the budgets of ``offload-strategy simulate``, the published figure beside the model's.

    python tools/reproduce.py                 # every point, a markdown table
    python tools/reproduce.py --only LH PT-1  # points whose id starts so

The model prices *this* library's plan (the joint search of ``planning/auto.py``) on the paper's
machine, at the efficiency and link rates every other prediction uses: nothing here is tuned to a
point. Where a paper's system decides as one of the library's policies does, its setting names
that policy among its overrides and the model prices the runtime's plan under it
(``simulate.policy_row``): LoHan's points run LoHan's own configuration, every model state on the
SSDs and its activation search (``policy=lohan policy.placement=nvme``). Each paper's system keeps its model states as it says: every one of them trains in mixed
precision as Micikevicius et al. define it (16-bit parameters computed with and moved, fp32 masters
and Adam states at home), which is this library's ``bf16-true``; ``point.precision`` can say
otherwise for a setting that differs. The papers' systems and ours differ in what they keep where, so a ratio far from 1 says
either that the hardware is priced wrong or that the two systems decide differently; the notes
say which where it is known. Kinds of point:

- ``step_s``, ``tokens_per_s``: the auto plan's predicted step at the paper's batch (or the fastest
  over the batches given, where the paper reports its best batch), all ranks' tokens;
- ``tflops``: model FLOPs (forward, backward twice forward, attention included) per second, and
  where the paper counts the recomputation too (``Point.recomputation_counted``: LoHan's), the
  recomputed blocks' forward FLOPs of the plan on top (what the GPU runs, as the paper's figure
  counts what its GPU ran);
- ``forward_s``: the GPU compute of one forward, without transfers;
- ``activations_gb``: what the blocks save for backward (bf16, each storage once);
- ``largest_b``: the largest model of the point's width the budgets hold (``simulate.largest_depth``),
  under whichever of the library's two mixed precisions holds more (``LARGEST_PRECISIONS``):
  ``bf16-true`` keeps a 16-bit copy beside each fp32 master (with Adam 14 bytes a parameter at
  home, 16-bit copies moved), ``bf16-mixed`` the fp32 parameters alone (12 bytes, moved in fp32,
  cast on the GPU by autocast); a user after the largest model takes the one that holds it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from offload_strategy.hardware.specs import P5510_READ_GBPS, P5510_WRITE_GBPS  # noqa: E402


# LoHan Table IV: the models its largest-model figures were searched over (GPT-3's shapes), billions
LOHAN_SERIES = tuple(
    (size, (f"model.config.n_layer={layers}", f"model.config.n_head={heads}", f"model.config.n_embd={width}"))
    for size, layers, heads, width in ((6, 28, 32, 4096), (13, 40, 40, 5120), (30, 48, 56, 7168), (70, 80, 64, 8192), (135, 88, 88, 11264),
                                       (175, 96, 96, 12288), (276, 112, 112, 14336), (412, 128, 128, 16384))
)
LOHAN_BATCH_1 = ("model=gpt3_175b", "model.config.n_positions=1024", "data=synthetic", "data.seq_len=1024", "data.batch_size=1")
# LoHan's own configuration (§IV): every model state on the SSDs, each unit updated on the CPU as
# its gradients arrive, its activation search deciding what to swap
LOHAN_POLICY = ("policy=lohan", "policy.placement=nvme")
LOHAN_175B = ("model=gpt3_175b", "model.config.n_positions=1024", "+model.config.activation_function=gelu_pytorch_tanh", "hardware=rtx4090",
              "data=synthetic", "data.seq_len=1024", "model.loss_chunk_tokens=auto", *LOHAN_POLICY)
LOHAN_13B = (*LOHAN_175B, "model.config.n_embd=5120", "model.config.n_layer=40", "model.config.n_head=40")
# Why some LoHan points differ (LoHan §IV-A, and its artifact's code): differences between the systems, not prices
LOHAN_FINER_RECOMPUTE = ("LoHan recomputes half a block at a time (its artifact checkpoints attention and MLP apart, their inputs in host "
                         "memory); this runtime recomputes whole blocks (their inputs in host memory, "
                         "as LoHan's), so a block's activations at this batch leave no room to swap any (64) or do not fit (128)")
# LoHan's TFLOPS count the FLOPs its GPU ran, the recomputation's included: at batch 64 and 128
# (155.8, 153.8) the figures are above what the 13B's forward and backward alone allow at the rate
# LoHan's own forward at batch 32 measures (5.96 s, LH-11), which recomputation only lengthens; its
# artifact recomputes every half block by default (run.sh, gpt_model.py); and its Fig. 10b at
# batch 48 and 64 stays a constant 0.71-0.75x of every drive count counted without (3/4 where
# every block is recomputed). Every LoHan TFLOPS point says so (``recomputation_counted``).
# LoHan Eq. 4-5: with every model state on the SSDs a step reads 16 bytes a parameter from them
# (the 16-bit parameters in forward, 14 bytes of states in backward) and writes 14 back, and an
# SSD is simplex, its reads and writes adding up
LOHAN_SSD_BYTES = (16, 14)
P5510 = (P5510_READ_GBPS, P5510_WRITE_GBPS)
GPT2_W8192 = ("model=gpt2_xl", "model.config.n_embd=8192", "model.config.n_head=64", "data=synthetic", "data.seq_len=1024", "data.batch_size=1")
GPT2_10B = ("model=gpt2_xl", "model.config.n_embd=4096", "model.config.n_layer=48", "model.config.n_head=32", "data=synthetic", "data.seq_len=1024")
LLAMA_13B = ("model=llama_7b", "model.config.hidden_size=5120", "model.config.intermediate_size=13824", "model.config.num_hidden_layers=40",
             "model.config.num_attention_heads=40", "model.config.num_key_value_heads=40", "data=synthetic", "data.seq_len=1024")
A40 = ("hardware=l40s", "+hardware.gpu=NVIDIA_A40", "+hardware.gpu_memory=48GB", "+hardware.gpu_bf16_tflops=149.7",
       "+hardware.gpu_fp16_tflops=149.7", "+hardware.gpu_fp32_tflops=37.4", "+hardware.gpu_memory_gbps=696")
RTX4080 = ("+hardware.gpu=NVIDIA_RTX_4080", "+hardware.gpu_memory=16GiB", "+hardware.gpu_bf16_tflops=97.5", "+hardware.gpu_fp16_tflops=97.5",
           "+hardware.gpu_fp32_tflops=48.7", "+hardware.gpu_memory_gbps=716.8")
# A point without a host budget takes what the strategy finds available on an idle machine: AVAILABLE_SHARE (95%) of its memory.
# ProTrain's four-GPU machines (§5.1): per rank a quarter of 95% of the host memory
PT_4X3090: dict[str, Any] = dict(gpu="22GiB", host="91.2GiB", ranks=4)
PT_4XA100: dict[str, Any] = dict(gpu="72GiB", host="243.2GiB", ranks=4, network_gbps=300)


@dataclass(frozen=True)
class Point:
    ident: str
    source: str  # where in the paper
    kind: str  # see the module docstring
    published: float
    overrides: tuple[str, ...]
    gpu: str
    host: Optional[str] = None  # None: AVAILABLE_SHARE of the machine's
    nvme: str = "0"
    ranks: int = 1
    machines: int = 1  # the ranks span this many machines; each machine's ranks keep one copy of host homes (share_host_homes)
    network_gbps: Optional[float] = None
    host_network_gbps: Optional[float] = None  # gloo's collectives on host memory, where priced apart
    batches: tuple[int, ...] = ()  # the paper's best batch: the fastest of these per rank
    precision: str = "bf16-true"  # how the paper's system keeps its model states (see POINTS)
    note: str = ""
    unreproducible: str = ""  # why the setting cannot be reproduced: shown, not counted
    # a ``forward_s`` point whose published compute time sets the GPU's achieved share of its peak
    # on that machine (then that point calibrates and is not counted)
    rate_from: Optional[str] = None
    # ``largest_b`` over a paper's own list of models (size in billions, the overrides that make
    # it), where the paper searched such a list: the largest of them that the auto plan holds
    series: tuple[tuple[float, tuple[str, ...]], ...] = ()
    # each SSD's datasheet (read, write) GB/s, where every model state is on the SSDs: the paper's
    # own traffic at those rates is a floor under its step (``drive_floor``)
    drive_gbps: Optional[tuple[float, float]] = None
    # a ``tflops`` figure that counts the FLOPs the GPU ran, recomputation included (LoHan's: the
    # comment after LOHAN_FINER_RECOMPUTE says why); the paper's own recomputed share is not known,
    # so the step its figure means lies between none recomputed and every block
    recomputation_counted: bool = False


POINTS = (
    Point("LH-15", "LoHan §V-C: 135 TFLOPS, 13B, batch 32, RTX 4090, 12 SSDs", "tflops", 135.0,
          (*LOHAN_13B, "data.batch_size=32"), "22GiB", nvme="40TB", drive_gbps=P5510, rate_from="LH-11", recomputation_counted=True,
          note="the loss a chunk at a time, as in every LoHan setting (model.loss_chunk_tokens=auto): Hugging Face's fp32 loss would hold 19 GiB "
               "of the 22 GiB tier at the head's backward, which LoHan's run at this batch cannot have"),
    Point("LH-11", "LoHan §III-C: forward compute 5.96 s, 13B, batch 32", "forward_s", 5.96, (*LOHAN_13B, "data.batch_size=32"), "22GiB", nvme="40TB"),
    Point("LH-9", "LoHan §III-B: 213 GB of activations, 13B, batch 32", "activations_gb", 213.0, (*LOHAN_13B, "data.batch_size=32"), "22GiB",
          nvme="40TB"),
    Point("LH-1", "LoHan abstract: 276B trains on an RTX 4090 with 768 GB", "largest_b", 276.0, (*LOHAN_BATCH_1, "hardware=rtx4090"), "22GiB",
          nvme="40TB", series=LOHAN_SERIES, note="the largest of LoHan's Table IV models (6B to 412B) the auto plan holds, as LoHan searched"),
    Point("LH-3", "LoHan abstract: 175B trains on an RTX 4080 with 256 GB (a lower bound)", "largest_b", 175.0,
          (*LOHAN_BATCH_1, "hardware=rtx4090", *RTX4080), "15GiB", host="256GiB", nvme="40TB", series=LOHAN_SERIES,
          note="host budget the machine's whole 256 GiB; the largest of LoHan's Table IV models the auto plan holds"),
    # LoHan's artifact (its repository's evaluation_data.md) lists the measurements its figures plot
    *(Point(f"LH-5a-{batch}", f"LoHan Fig. 5a (artifact data): {tflops} TFLOPS, 13B, batch {batch}, RTX 4090", "tflops", tflops,
            (*LOHAN_13B, f"data.batch_size={batch}"), "22GiB", nvme="40TB", drive_gbps=P5510, rate_from="LH-11", note=note,
            recomputation_counted=True)
      for batch, tflops, note in ((8, 42.8, ""), (16, 84.3, ""), (64, 155.8, LOHAN_FINER_RECOMPUTE), (128, 153.8, LOHAN_FINER_RECOMPUTE))),
    *(Point(f"LH-10b-{drives}", f"LoHan Fig. 10b (artifact data): {tflops} TFLOPS, 13B, batch 32, RTX 4090, {drives} SSD{'s' * (drives > 1)}",
            "tflops", tflops, (*LOHAN_13B, "data.batch_size=32", f"+hardware.nvme_count={drives}"), "22GiB", nvme="40TB", rate_from="LH-11",
            drive_gbps=P5510, note="each drive at its datasheet rates, up to the 12-drive array's", recomputation_counted=True)
      for drives, tflops in ((1, 37.5), (2, 64.3), (3, 81.1), (6, 121.7))),
    # the same figure's batches 48 and 64, added after the drives' rates and the FLOP count were settled: a check of both
    *(Point(f"LH-10b-{batch}-{drives}", f"LoHan Fig. 10b (artifact data): {tflops} TFLOPS, 13B, batch {batch}, RTX 4090, "
            f"{drives} SSD{'s' * (drives > 1)}", "tflops", tflops,
            (*LOHAN_13B, f"data.batch_size={batch}", *((f"+hardware.nvme_count={drives}",) if drives < 12 else ())), "22GiB", nvme="40TB",
            rate_from="LH-11", drive_gbps=P5510, recomputation_counted=True,
            note="each drive at its datasheet rates, up to the 12-drive array's" if drives < 12 else "")
      for batch, figures in ((48, (53.1, 89.7, 121.7, 146.3, 153.9)), (64, (70.3, 111.7, 136.3, 151.5, 148.2)))
      for drives, tflops in zip((1, 2, 3, 6, 12), figures)),
    *(Point(f"LH-7b-{batch}", f"LoHan Fig. 7b (artifact data): {tflops} TFLOPS, 175B, batch {batch}, RTX 4090", "tflops", tflops,
            (*LOHAN_175B, f"data.batch_size={batch}"), "22GiB", nvme="40TB", drive_gbps=P5510, rate_from="LH-11", note=note,
            recomputation_counted=True)
      for batch, tflops, note in ((8, 52.6, ""), (16, 86.9, ""))),
    Point("PT-1a", "ProTrain Table 2: 34B on one RTX 3090 (384 GB)", "largest_b", 34.0, (*GPT2_W8192, "model.config.n_layer=42", "hardware=rtx3090"),
          "22GiB"),
    Point("PT-1b", "ProTrain Table 2: 37B on four RTX 3090 (384 GB)", "largest_b", 37.0, (*GPT2_W8192, "model.config.n_layer=46", "hardware=rtx3090"),
          "22GiB", host="91.2GiB", ranks=4, note="host per rank: a quarter of 95% of 384 GiB"),
    Point("PT-1c", "ProTrain Table 2: 75B on one A100 80GB (1 TB)", "largest_b", 75.0, (*GPT2_W8192, "model.config.n_layer=93", "hardware=a100_80g"),
          "72GiB"),
    Point("PT-1d", "ProTrain Table 2: 87B on four A100 80GB (1 TB)", "largest_b", 87.0, (*GPT2_W8192, "model.config.n_layer=108", "hardware=a100_80g"),
          "72GiB", host="243.2GiB", ranks=4, note="host per rank: a quarter of 95% of 1 TiB"),
    Point("PT-6a", "ProTrain Table 3: Mistral-7B, 4 A100, best batch", "tokens_per_s", 11060.92,
          ("model=mistral_7b", "hardware=a100_80g", "data=synthetic", "data.seq_len=1024"), **PT_4XA100, batches=(8, 16, 32)),
    Point("PT-6b", "ProTrain Table 3: GPT-2 10B, 4 A100, best batch", "tokens_per_s", 8266.40, (*GPT2_10B, "hardware=a100_80g"), **PT_4XA100, batches=(8, 16, 32)),
    Point("PT-6c", "ProTrain Table 3: LLaMA-13B, 4 A100, batch 228", "tokens_per_s", 6471.32, (*LLAMA_13B, "hardware=a100_80g", "data.batch_size=57"),
          **PT_4XA100),
    Point("PT-6d", "ProTrain Table 3: GPT-2 20B, 4 A100, best batch", "tokens_per_s", 5043.75,
          ("model=gpt2_xl", "model.config.n_embd=8192", "model.config.n_layer=24", "model.config.n_head=64", "data=synthetic", "data.seq_len=1024",
           "hardware=a100_80g"), **PT_4XA100, batches=(8, 16, 32)),
    Point("PT-14", "ProTrain §5.3.1: GPT-2 10B, 4 RTX 3090, 2,493 tokens/s", "tokens_per_s", 2493.0, (*GPT2_10B, "hardware=rtx3090"), **PT_4X3090, batches=(4, 8, 16)),
    Point("PT-22", "ProTrain §5.4: GPT 175B, 16 A100 (4 nodes, 100 Gb/s), batch 256", "tokens_per_s", 2218.70,
          ("model=gpt3_175b", "model.config.n_positions=1024", "hardware=a100_80g", "data=synthetic", "data.seq_len=1024", "data.batch_size=16"),
          "72GiB", host="243.2GiB", ranks=16, machines=4, network_gbps=12.5),
    Point("TC-1", "10Cache Table 5: BERT, batch 128, A40, CPU-GPU: 381.70 ms", "step_s", 0.3817,
          ("model=gpt2_small", "model.config.vocab_size=30522", "model.config.n_positions=512", *A40, "data=synthetic", "data.seq_len=128",
           "data.batch_size=128"), "44GB", host="200GB", note="BERT-base's shapes as a 12 x 768 GPT-2",
          unreproducible="the sequence length is not stated (128 taken; BERT's 512 is ~4x the compute), and the model fits the A40, "
                         "where this library offloads nothing and 10Cache offloads it all"),
)


@dataclass(frozen=True)
class Setting:
    """A point's model on its machine, with its budgets."""

    model: Any
    hardware: Any
    gpu: int
    host: int
    nvme: int
    shared_homes: bool = False  # each machine's ranks keep one copy of host homes
    policy: Any = None  # the policy the paper's system decides by, where not the joint search (``simulate.row_policy``)


def setting(point: Any, sim: Any, efficiency: float, batch: Optional[int] = None) -> Setting:
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from offload_strategy import parse_size
    from offload_strategy.config import compute_dtype
    from offload_strategy.hardware import AVAILABLE_SHARE

    overrides = [*point.overrides, "logger=none", *([f"data.batch_size={batch}"] if batch else [])]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    hardware = instantiate(cfg.hardware).rank_share(point.ranks // point.machines)  # each rank's share of its machine's CPU side
    model = sim.build(cfg, hardware, point.precision == "bf16-true", efficiency, dtype=compute_dtype(point.precision),
                      mixed=point.precision.endswith("-mixed"))
    host = parse_size(point.host) if point.host else int(AVAILABLE_SHARE * hardware.host_memory)
    nvme = parse_size(point.nvme)
    return Setting(model, hardware, parse_size(point.gpu), host, nvme, shares_homes(point), sim.row_policy(cfg, nvme))


def shares_homes(point: Any) -> bool:
    return point.ranks > point.machines  # several ranks on each machine


def plan_row(point: Any, sim: Any, at: Setting) -> Any:
    """The plan's row for the point's setting (rank 0's with several ranks): the joint search's,
    or the policy's where the setting names one."""
    sharding, owners = sim.rank_sharding(at.model, point.ranks, at.shared_homes, machines=point.machines)
    machine = point_machine(point, sim, at)
    if at.policy is not None:
        return sim.policy_row(at.model, machine, at.gpu, at.host, at.nvme, sharding, owners, at.policy)
    return sim.compare_policies(at.model, machine, at.gpu, at.host, at.nvme, sharding, owners)[-1]


def point_machine(point: Any, sim: Any, at: Setting) -> Any:
    """The step model's machine for a point's setting: its ranks, links and collectives."""
    network = None if point.network_gbps is None else point.network_gbps * 1e9
    host_network = None if point.host_network_gbps is None else point.host_network_gbps * 1e9
    return sim.machine_of(at.hardware, at.nvme, ranks=point.ranks, network=network, shard_states=True, shared_homes=at.shared_homes,
                          host_network=host_network, machines=point.machines)


def forward_seconds(model: Any) -> float:
    """One forward's GPU compute: the blocks' (their units' included) and the units' outside them."""
    inside = {i for units in model.block_units for i in units}
    return sum(b.forward_seconds for b in model.blocks) + sum(c.forward_seconds for i, c in enumerate(model.costs) if i not in inside)


def _largest(point: Point, sim: Any, efficiency: float) -> tuple[float, str]:
    if point.series:
        return _largest_of_series(point, sim, efficiency)
    at = setting(point, sim, efficiency)
    depth, parameters, plan = sim.largest_depth(at.model, point_machine(point, sim, at), at.gpu, at.host, at.nvme, ranks=point.ranks,
                                                shared_homes=at.shared_homes)
    return parameters / 1e9, f"{depth} blocks" + (f", units {plan.homes}, blocks {plan.layout}" if plan is not None else "")


def _largest_of_series(point: Point, sim: Any, efficiency: float) -> tuple[float, str]:
    """The largest of the paper's models the auto plan holds, tried from the largest down."""
    for size, overrides in sorted(point.series, reverse=True):
        member = dataclasses.replace(point, overrides=(*point.overrides, *overrides))
        at = setting(member, sim, efficiency)
        row = plan_row(member, sim, at)
        if row.fits:
            beyond = " (the list's largest: a lower bound)" if size == max(s for s, _ in point.series) else ""
            return size, f"{size:g}B{beyond}: {len(at.model.blocks)} blocks, units {row.homes}, blocks {row.layout}"
    return 0.0, "none of the paper's models"


def refusal(note: str) -> str:
    """A refused setting's reason, short enough for a table cell."""
    return "refused: " + note.removeprefix("does not fit: ")[:160]


def _activations(point: Point, sim: Any, at: Setting, efficiency: float) -> tuple[float, str]:
    return sum(b.activation_bytes for b in at.model.blocks) / 1e9, f"{len(at.model.blocks)} blocks"


def _forward(point: Point, sim: Any, at: Setting, efficiency: float) -> tuple[float, str]:
    return forward_seconds(at.model), ""


def _planned(point: Point, sim: Any, at: Setting, efficiency: float) -> tuple[float, str]:
    row = plan_row(point, sim, at)
    if not row.fits:
        return float("nan"), refusal(row.note)
    plan = f"batch {at.model.batch_size}/rank, units {row.homes}, blocks {row.layout}"
    if point.kind == "step_s":
        return row.seconds, plan
    if point.kind == "tokens_per_s":
        return at.model.tokens * point.ranks / row.seconds, plan
    recomputed = recomputed_flops(at.model, row.blocks) if point.recomputation_counted else 0.0
    return (3 * at.model.forward_flops + recomputed) / row.seconds / 1e12, plan  # backward twice forward


def recomputed_flops(model: Any, blocks: tuple[str, ...]) -> float:
    """The forward FLOPs a plan whose blocks do ``blocks`` runs again in backward."""
    from offload_strategy.planning.activations import RECOMPUTED

    return sum(f for f, policy in zip(model.block_flops, blocks) if policy in RECOMPUTED)


def published_step(point: Point, at: Setting, longest: bool = False) -> float:
    """The step, in seconds, a throughput or step-time point's published figure means for one rank.
    A figure that counts the recomputation means a step as long as the paper's system recomputed:
    the shortest (none recomputed), or with ``longest`` every block recomputed."""
    if point.kind == "tflops":
        recomputed = sum(at.model.block_flops) if longest and point.recomputation_counted else 0.0
        return (3 * at.model.forward_flops + recomputed) / (point.published * 1e12)
    if point.kind == "tokens_per_s":
        return at.model.tokens * point.ranks / point.published
    return point.published


def drive_floor(point: Point, at: Setting) -> str:
    """Why the paper's own traffic cannot fit in its published step on its drives, or "" where it
    can: the drives at their datasheet rates, all of them busy the whole step, without the array's
    loss the model prices them with, against the longest step the figure can mean. A figure faster
    than that was not reached the way the paper describes the setting, so no model of that setting
    can reproduce it."""
    if point.drive_gbps is None or GROUPS.get(point.kind) != "throughput and step time":
        return ""
    from offload_strategy.config import format_bytes

    drives, parameters = at.hardware.nvme_count, at.model.parameters
    (read_bytes, write_bytes), (read, write) = LOHAN_SSD_BYTES, point.drive_gbps
    floor = parameters * (read_bytes / read + write_bytes / write) / (drives * 1e9)
    step = published_step(point, at, longest=True)  # the longest the figure can mean, however much the paper recomputed
    if step >= floor:
        return ""
    return (f"the paper's own SSD traffic (Eq. 4-5: {read_bytes} bytes a parameter read, {write_bytes} written, the drive simplex) takes "
            f"{floor:.1f} s on {drives} drive{'s' * (drives > 1)} at the datasheet's {read:g} / {write:g} GB/s, longer than the published "
            f"step of {step:.1f} s{' (every block recomputed: the longest the figure can mean)' if point.recomputation_counted else ''}: the run moved less over its drives than the paper says (its host memory, "
            f"{format_bytes(at.hardware.host_memory)}, could hold this model's {format_bytes(read_bytes * parameters)} of states)")


def compute_ceiling(point: Point, at: Setting) -> str:
    """Where the published figure is faster than the model's GPU compute alone at the point's rate
    (forward and backward, nothing recomputed, nothing waited on), what that compute gives; ""
    otherwise. No schedule the model prices reaches such a figure: the point still counts, and
    the note says that the miss lies in the GPU's rate or the paper's FLOP count, not the plan."""
    if GROUPS.get(point.kind) != "throughput and step time":
        return ""
    compute = at.model.compute_seconds
    step = published_step(point, at)
    if step >= compute:
        return ""
    alone = compute if point.kind == "step_s" else point.published * step / compute  # a rate scales inversely with the step
    return (f"above the GPU's compute alone in the model ({alone:,.4g} at this rate, {compute:.2f} s a step against the published "
            f"{step:.2f} s): no schedule reaches it")


GROUPS = {"step_s": "throughput and step time", "tokens_per_s": "throughput and step time", "tflops": "throughput and step time",
          "largest_b": "largest model", "activations_gb": "activation bytes"}
KINDS = {"activations_gb": _activations, "forward_s": _forward, "step_s": _planned, "tokens_per_s": _planned,
         "tflops": _planned}


# mixed precisions a largest-model point is tried in (the module docstring)
LARGEST_PRECISIONS = ("bf16-true", "bf16-mixed")


def run(point: Point, sim: Any, efficiency: float) -> tuple[float, str]:
    """The model's figure for ``point`` and what the plan was (the fastest batch where several;
    the larger model of the library's mixed precisions)."""
    if point.kind == "largest_b":
        tried = []
        for precision in LARGEST_PRECISIONS:
            size, plan = _largest(dataclasses.replace(point, precision=precision), sim, efficiency)
            tried.append((size, f"{precision}: {plan}"))
        return max(tried, key=lambda r: r[0])
    results = [KINDS[point.kind](point, sim, setting(point, sim, efficiency, batch), efficiency) for batch in point.batches or (None,)]
    return max(results, key=lambda r: -1.0 if math.isnan(r[0]) else r[0])


def calibrations(points: list[Point], sim: Any, efficiency: float) -> dict[str, float]:
    """The share of the GPU's dense peak each calibrating point's published forward time implies:
    the model's forward FLOPs over that time less the memory-bound part, which runs at the memory
    bandwidth whatever the tensor cores reach."""
    from offload_strategy.config import compute_dtype

    rates = {}
    calibrating = {p.rate_from for p in POINTS if p.rate_from}
    for ident in {p.rate_from for p in points if p.rate_from} | {p.ident for p in points if p.ident in calibrating}:
        point = next(p for p in POINTS if p.ident == ident)
        at = setting(point, sim, efficiency)
        peak = at.hardware.peak_flops(compute_dtype(point.precision))
        memory_bound = forward_seconds(at.model) - at.model.forward_flops / (peak * efficiency)
        if point.published <= memory_bound:
            raise SystemExit(f"{ident}: the published {point.published:g} s is no longer than the model's memory-bound work alone "
                             f"({memory_bound:.3g} s); the GPU's memory bandwidth is priced too low for this point")
        rates[ident] = at.model.forward_flops / (peak * (point.published - memory_bound))
    return rates


# -- the papers' qualitative findings on their own settings -------------------------------------------


@dataclass(frozen=True)
class Finding:
    ident: str
    source: str
    paper_says: str
    check: str  # see FINDING_CHECKS
    overrides: tuple[str, ...]
    gpu: str
    host: Optional[str] = None
    nvme: str = "0"
    ranks: int = 1
    machines: int = 1  # the ranks span this many machines; each machine's ranks keep one copy of host homes (share_host_homes)
    network_gbps: Optional[float] = None
    host_network_gbps: Optional[float] = None  # gloo's collectives on host memory, where priced apart
    precision: str = "bf16-true"
    expect: tuple[float, ...] = ()  # what the check compares with (see each check)
    rate_from: Optional[str] = None


def _lohan(finding: Finding, sim: Any, at: Setting) -> Any:
    """LoHan's Algorithm 1 in LoHan's setting (model states on the SSDs, Eq. 2 and 5), swaps to
    host memory (half of it) and on to the SSDs (as ``simulate.py --findings``)."""
    from offload_strategy.planning.activations import Links
    from offload_strategy.planning.searches.swap_or_recompute import lohan_search

    links = Links.lohan(sim.machine_of(at.hardware, at.nvme), at.model.parameters)
    return lohan_search(at.model.blocks, links, gpu_bytes=1 << 62, host_bytes=at.host // 2)


def _lohan_case(finding: Finding, sim: Any, at: Setting) -> tuple[str, bool]:
    from offload_strategy.planning.searches.swap_or_recompute import FALLING, RISING

    case = {RISING: 1, FALLING: 2}.get(_lohan(finding, sim, at).case, 3)
    return f"case {case}", case == finding.expect[0]


def _lohan_swap(finding: Finding, sim: Any, at: Setting) -> tuple[str, bool]:
    search = _lohan(finding, sim, at)
    swapped = min(search.curve, key=lambda point: point[1])[0] / 1e9 if search.curve else 0.0
    low, high = finding.expect
    return f"{swapped:.1f} GB swapped at the fastest", low <= swapped <= high


def _protrain_row(finding: Finding, sim: Any, at: Setting) -> tuple[str, bool]:
    """ProTrain Table 4: (least and most share of blocks checkpointed, least and most share of
    the parameters' bytes resident) the row's configuration lies in."""
    row = plan_row(finding, sim, at)
    if not row.fits:
        return row.note[:80], False
    keep, checkpoint, swap = (int(n) for n in row.layout.split("/"))
    blocks = keep + checkpoint + swap
    homes = dict(zip(("gpu", "host", "nvme"), (int(n) for n in row.homes.split("/"))))
    sizes = at.model.sizes  # the search keeps the leading units resident, as ProTrain its leading chunks
    resident = sum(s.nbytes for s in sizes[: homes["gpu"]]) / sum(s.nbytes for s in sizes)
    low_ckpt, high_ckpt, low_resident, high_resident = finding.expect
    ok = low_ckpt <= checkpoint / blocks <= high_ckpt and low_resident <= resident <= high_resident
    return f"{checkpoint} of {blocks} blocks checkpointed, {swap} swapped, {resident:.0%} of the parameters resident", ok


def _memferry(finding: Finding, sim: Any, at: Setting) -> tuple[str, bool]:
    """MemFerry Fig. 3: in place (DHA) faster for embeddings, on-GPU for matrix multiplies."""
    kinds = {kind: (on_gpu, dha) for kind, _, on_gpu, dha, _ in sim.memferry_findings(at.model)}
    embedding, gemm = kinds.get("embedding"), kinds.get("linear (GEMM)")
    ok = embedding is not None and gemm is not None and embedding[1] < embedding[0] and gemm[0] < gemm[1]
    said = [f"{kind}: on-GPU {g * 1e3:.2f} ms, in place {d * 1e3:.2f} ms" for kind, (g, d) in kinds.items()]
    return "; ".join(said), ok


def _swap_against_recompute(finding: Finding, sim: Any, at: Setting) -> tuple[str, bool]:
    """ProTrain §5.3.1: one block's activations swapped out over the link (its d2h rate) against
    recomputing them (the block's forward); both grow with the batch, so their ratio does not."""
    block = at.model.blocks[0]
    swap = block.activation_bytes / (at.hardware.d2h_gbps * 1e9)
    ratio = swap / block.forward_seconds
    low, high = finding.expect
    return f"swap {swap:.2f} s, recompute {block.forward_seconds:.2f} s per block at batch {at.model.batch_size}: {ratio:.2f}x", low <= ratio <= high


def _out_of_memory(finding: Finding, sim: Any, at: Setting) -> tuple[str, bool]:
    """A setting the paper's system ran out of memory in: the plan refuses it too."""
    row = plan_row(finding, sim, at)
    if row.fits:
        return f"plans it: units {row.homes}, blocks {row.layout}", False
    return refusal(row.note), True


FINDING_CHECKS = {"lohan_case": _lohan_case, "lohan_swap_gb": _lohan_swap, "protrain_row": _protrain_row, "memferry_fig3": _memferry,
                  "swap_vs_recompute": _swap_against_recompute, "out_of_memory": _out_of_memory}
GPT2_1B = ("model=gpt2_xl", "model.config.n_layer=32", "data=synthetic", "data.seq_len=1024")
# ProTrain's Table 4 batches are taken as global (8 or 64 over 4 GPUs: 2 or 16 each); as per-GPU
# batches GPT-2 1B's activations at batch 8 (26 GB in HF's eager kernels) could not all be kept on a
# 24 GB card as row A keeps them

FINDINGS = (
    Finding("LH-19a", "LoHan §V-E, Fig. 9b", "13B, batch 24: the step rises with the swapped amount (case 1)", "lohan_case",
            (*LOHAN_13B, "data.batch_size=24"), "22GiB", nvme="40TB", expect=(1,), rate_from="LH-11"),
    Finding("LH-19b", "LoHan §V-E, Fig. 9b", "13B, batch 48: the step falls, then rises (case 3)", "lohan_case",
            (*LOHAN_13B, "data.batch_size=48"), "22GiB", nvme="40TB", expect=(3,), rate_from="LH-11"),
    Finding("LH-9b", "LoHan §III-C", "13B, batch 32: ~34 GB of the 213 swapped, the rest recomputed", "lohan_swap_gb",
            (*LOHAN_13B, "data.batch_size=32"), "22GiB", nvme="40TB", expect=(34 * 0.8, 34 * 1.2), rate_from="LH-11"),
    Finding("LH-7b-32", "LoHan Fig. 7b (artifact data)", "175B, batch 32, RTX 4090: out of memory", "out_of_memory",
            (*LOHAN_175B, "data.batch_size=32"), "22GiB", nvme="40TB", rate_from="LH-11"),
    Finding("PT-21A", "ProTrain Table 4, row A", "GPT-2 1B, batch 8, 4 RTX 3090: nothing checkpointed or swapped, every chunk resident",
            "protrain_row", (*GPT2_1B, "hardware=rtx3090", "data.batch_size=2"), **PT_4X3090, expect=(0.0, 0.0, 0.99, 1.0)),
    Finding("PT-21B", "ProTrain Table 4, row B", "GPT-2 1B, batch 64, 4 RTX 3090: 24 of 32 blocks checkpointed, 2 swapped, 2 of 12 chunks resident",
            "protrain_row", (*GPT2_1B, "hardware=rtx3090", "data.batch_size=16"), **PT_4X3090, expect=(0.5, 1.0, 0.0, 0.35)),
    Finding("PT-21C", "ProTrain Table 4, row C", "GPT-2 1B, batch 64, 4 A100: nothing checkpointed or swapped, every chunk resident",
            "protrain_row", (*GPT2_1B, "hardware=a100_80g", "data.batch_size=16"), **PT_4XA100, expect=(0.0, 0.0, 0.99, 1.0)),
    Finding("PT-21D", "ProTrain Table 4, row D", "GPT-2 10B, batch 8, 4 RTX 3090: every block checkpointed, 3 of 49 chunks resident",
            "protrain_row", (*GPT2_10B, "hardware=rtx3090", "data.batch_size=2"), **PT_4X3090, expect=(0.9, 1.0, 0.0, 0.15)),
    Finding("PT-21E", "ProTrain Table 4, row E", "GPT-2 10B, batch 8, 4 A100: nothing checkpointed, 15 of 49 chunks resident",
            "protrain_row", (*GPT2_10B, "hardware=a100_80g", "data.batch_size=2"), **PT_4XA100, expect=(0.0, 0.1, 0.15, 0.5)),
    Finding("PT-11", "ProTrain §5.3.1", "GPT-2 40B on an A100: a block's activations swap in 1.9 s and recompute in 0.95 s (2.0x; "
            "the batch is not stated, and the ratio does not depend on it)", "swap_vs_recompute",
            (*GPT2_W8192[:-1], "model.config.n_layer=2", "hardware=a100_80g", "data.batch_size=8"), "72GiB", expect=(2.0 * 0.8, 2.0 * 1.2)),
    Finding("MF-11", "MemFerry §III-B, Fig. 3", "BERT-base on an A100 over a 100 Gb/s link: in place faster for embeddings, on-GPU for GEMMs "
            "(the embedding untied: Fig. 3 times its lookup)",
            "memferry_fig3", ("model=gpt2_small", "model.config.vocab_size=30522", "model.config.n_positions=512", "+model.config.tie_word_embeddings=false",
                              "hardware=a100_80g",
                              "+hardware.h2d_gbps=12.5", "+hardware.d2h_gbps=12.5", "data=synthetic", "data.seq_len=128", "data.batch_size=32"),
            "72GiB"),
)


def findings_table(findings: list[Finding], sim: Any, rates: dict[str, float], efficiency: float) -> int:
    print("\n| finding | paper | the paper says | the model says | reproduced |")
    print("|---|---|---|---|---|")
    reproduced = 0
    for finding in findings:
        at = setting(finding, sim, rates.get(finding.rate_from or "", efficiency))
        said, ok = FINDING_CHECKS[finding.check](finding, sim, at)
        reproduced += ok
        print(f"| {finding.ident} | {finding.source} | {finding.paper_says} | {said} | {'yes' if ok else 'no'} |", flush=True)
    print(f"\n{reproduced} of {len(findings)} findings reproduced.")
    return reproduced


def command(point: Any, efficiency: float = 0.5) -> str:
    """``point``'s setting as an offload-strategy simulate command line, the GPU at ``efficiency`` of its peak
    (the flag left out at simulate's default)."""
    flags = [f"--gpu-memory {point.gpu}"]
    flags += [f"--efficiency {efficiency:.4g}"] if efficiency != 0.5 else []
    flags += [f"--host-memory {point.host}"] if point.host else []
    flags += [f"--nvme-memory {point.nvme}"] if point.nvme != "0" else []
    flags += [f"--ranks {point.ranks}"] if point.ranks > 1 else []
    flags += [f"--machines {point.machines}"] if point.machines > 1 else []
    flags += ["--share-host-homes"] if shares_homes(point) else []
    flags += [f"--network-gbps {point.network_gbps:g}"] if point.network_gbps else []
    flags += [f"--host-network-gbps {point.host_network_gbps:g}"] if point.host_network_gbps else []
    flags += [f"--precision {point.precision}"] if point.precision != "bf16-true" else []
    batches = f"  # the fastest of data.batch_size={','.join(map(str, point.batches))}" if getattr(point, "batches", ()) else ""
    if getattr(point, "kind", "") == "largest_b":
        batches = f"  # and with --precision {LARGEST_PRECISIONS[1]}: the larger model counts"
    published = [o for size, o in getattr(point, "series", ()) if size == point.published]  # the paper's own model of its list
    return "offload-strategy simulate " + " ".join([*point.overrides, *(published[0] if published else ()), *flags]) + batches


def figures_table(points: list[Point], sim: Any, rates: dict[str, float], efficiency: float) -> None:
    print("| point | published | setting | published figure | model | model / published | plan |")
    print("|---|---|---|---|---|---|---|")
    within: dict[str, list[int]] = {}  # per group of kinds: within ±20%, counted
    for point in points:
        started = time.perf_counter()
        rate = rates.get(point.rate_from or "", efficiency)
        ours, plan = run(point, sim, rate)
        ratio = ours / point.published
        calibrating = point.ident in rates
        at = setting(point, sim, rate)  # built once for both judgements (a large model's meta build takes seconds)
        unreproducible = point.unreproducible or drive_floor(point, at)
        if not calibrating and not unreproducible:
            tally = within.setdefault(GROUPS.get(point.kind, point.kind), [0, 0])
            tally[0] += abs(ratio - 1) <= 0.2
            tally[1] += 1
        note = f"; {point.note}" if point.note else ""
        note += "; the recomputation's FLOPs counted, as the paper's figures count them" if point.recomputation_counted else ""
        note += f"; the GPU at {rate:.1%} of its peak, from {point.rate_from}" if point.rate_from else ""
        note += f"; calibrates the GPU's rate ({rates[point.ident]:.1%} of its dense peak), not counted" if calibrating else ""
        note += f"; not counted: {unreproducible}" if unreproducible else ""
        ceiling = "" if calibrating else compute_ceiling(point, at)
        note += f"; {ceiling}" if ceiling else ""
        print(f"| {point.ident} | {point.source} | {point.kind}{note} | {point.published:,.4g} | {ours:,.4g} | {ratio:.2f} | {plan} "
              f"({time.perf_counter() - started:.0f} s) |", flush=True)
    print("\nWithin ±20% of the published figure (a setting the model refuses counts as a miss): " + "; ".join(
        f"{group} {n} of {of}" for group, (n, of) in within.items()) + f"; all {sum(n for n, _ in within.values())} of {sum(of for _, of in within.values())}.")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=(), help="point or finding ids, or their prefixes (LH, PT-1)")
    parser.add_argument("--efficiency", type=float, default=0.5, help="model FLOPs utilisation of the GPU's dense peak, as offload-strategy simulate")
    parser.add_argument("--commands", action="store_true", help="print each setting's offload-strategy simulate command after the tables")
    parser.add_argument("--host-network-gbps", type=float, default=None,
                        help="every data-parallel point's collectives on host memory (gloo) at this rate per rank, apart from the GPU tier's")
    args = parser.parse_args(argv)
    every = (*POINTS, *FINDINGS)
    if args.host_network_gbps is not None:
        every = tuple(dataclasses.replace(p, host_network_gbps=args.host_network_gbps) if p.ranks > 1 else p for p in every)
    chosen = [p for p in every if not args.only or any(p.ident.startswith(o) for o in args.only)]
    if not chosen:
        raise SystemExit(f"--only {' '.join(args.only)}: nothing matches; the ids are {', '.join(p.ident for p in every)}")
    from offload_strategy.estimate import simulate as sim

    points = [p for p in chosen if isinstance(p, Point)]
    findings = [f for f in chosen if isinstance(f, Finding)]
    rates = calibrations([*points, *findings], sim, args.efficiency)
    if points:
        figures_table(points, sim, rates, args.efficiency)
    if findings:
        findings_table(findings, sim, rates, args.efficiency)
    if args.commands:
        print()
        for item in chosen:
            print(f"{item.ident}: {command(item, rates.get(item.rate_from or '', args.efficiency))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
