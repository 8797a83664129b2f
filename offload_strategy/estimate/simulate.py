"""Predict training of a model on a machine that may not be at hand: step time, memory per tier and
the largest model that fits, for several GPU budgets.

    offload-strategy simulate path/to/config.json --hardware rtx4090 --batch-size 8 --seq-len 2048
    offload-strategy simulate model=llama_7b hardware=rtx4090          # a model of the repository's conf/ (Hydra)
    offload-strategy simulate model=gpt2_xl hardware=a100_80g --gpu-memory 8GiB 16GiB 32GiB --nvme-memory 2TB
    offload-strategy simulate model=llama_7b hardware=rtx4090 --precision 32-true data.batch_size=8
    offload-strategy simulate model=llama_7b hardware=rtx4090 --ranks 4 --network-gbps 25   # tiered_ddp, per rank
    offload-strategy simulate model=llama_7b hardware=a100_80g --findings --png llama7b.png    # the papers' findings

The model is a Hugging Face ``config.json`` (``models.py``), or, in a checkout with the
``experiments`` extra, a Hydra job's. It is built on the meta device (nothing allocated), its units are costed
from their shapes and the hardware spec, and its blocks' activations from one forward on the meta
device (estimate/analytic.py). Per budget two policies are compared:

- ``fill``: parameters placed by first use in the whole GPU tier (``placement="fill"``), every
  block's activations kept; the row says when the activations do not fit beside the parameters;
- ``auto``: the joint search of resident units, streaming buffers and the activation layout
  (planning/auto.py, what ``placement="search"`` with ``activations="auto"`` runs), within the budget.

Printed per row: where the units live, the blocks' layout, what each tier holds, the predicted step
(planning/cost_model.py for the parameters, LoHan's model for what the layout adds) and tokens/s.
Then the largest model of the same width the budgets hold (more blocks of the same shape), and with
``--findings`` three checks of the papers' qualitative results on this model and machine:
MemFerry Fig. 3 (direct host access wins for embeddings and norms, loses for large GEMMs, and
Alg. 1's choice per layer kind), LoHan §IV-D (the step time against swapped activations is convex,
its case depends on how compute-bound the step is) and ProTrain Table 4 (a larger batch keeps
fewer units resident and checkpoints and swaps more). ``--png`` draws tokens/s per budget, LoHan's
curves and MemFerry's per-layer times. With ``--ranks N`` the step is rank 0's in a ``tiered_ddp``
run: budgets are per rank, gradients are reduced over the network link.
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..config import PolicyConfig, compute_dtype, format_bytes, parse_size
from ..hardware import AVAILABLE_SHARE, resolve_hardware
from ..planning.planner import TierBudgets
from ..planning.activations import BesideBlocks  # noqa: F401  (the tools' and tests' names)
from .shapes import (STATE_FACTOR, Pricing, ShapeModel, head_recomputed, parameter_links,  # noqa: F401
                                placed_step, shape_model, streamed_bytes, unit_costs)
from .models import ModelSource, causal_lm, compose, instantiate, model_source

Model = ShapeModel  # the name the tools and tests use


def _available_share() -> float:
    """The host budget where none is given: what the strategy takes by default (hardware.AVAILABLE_SHARE)."""
    return AVAILABLE_SHARE


TABLE4_BATCH_FACTORS = (0.25, 0.5, 1, 2, 4)  # batch sizes of the ProTrain / LoHan study, relative to data.batch_size


@dataclass(frozen=True)
class Row:
    policy: str
    homes: str
    layout: str
    gpu_parameters: int
    gpu_activations: int
    host: int
    nvme: int
    buffers: int
    seconds: float
    fits: bool
    note: str = ""
    blocks: tuple[str, ...] = ()  # each block's policy as planned (empty: every block kept)


def build(cfg: Any, hardware: Any, half: bool, efficiency: float, batch_size: Optional[int] = None, dtype: Optional[str] = None,
          mixed: bool = False) -> Model:
    """The step model's view of ``cfg.model`` (a Hydra job's) built on the meta device: 16-bit
    parameters where ``half`` (``*-true``), fp32 ones computed under autocast in ``dtype`` where ``mixed``."""
    shape = Shape(int(batch_size or cfg.data.batch_size), int(cfg.data.seq_len), str(cfg.model.get("name", cfg.model.family)))
    pricing = Pricing(hardware, efficiency=efficiency, half=half, mixed=mixed, dtype=dtype or ("bf16" if half else "fp32"))
    return build_module(instantiate(cfg.model), shape, pricing)


def build_module(module: Any, shape: "Shape", pricing: Pricing) -> Model:
    """The step model of a ``demos.CausalLM`` not yet configured (its network built here on the
    meta device), its loss as it trains: under ``loss_chunk_tokens`` a chunk at a time, the head
    run again in backward."""
    with torch.device("meta"):
        module.configure_model()
    head = module.model.get_output_embeddings() if module.hparams.get("loss_chunk_tokens") is not None else None
    return priced(module, module._loss, shape, pricing, head)


def build_from_config(path: Path, shape: "Shape", pricing: Pricing) -> Model:
    """The step model's view of the causal language model a Hugging Face ``config.json`` describes."""
    module = causal_lm(path)
    return priced(module, module, Shape(shape.batch_size, shape.seq_len, module.name), pricing)


@dataclass(frozen=True)
class Shape:
    """One step's batch: sequences, tokens each, and the model's name for the tables."""

    batch_size: int
    seq_len: int
    name: str = ""


def priced(module: nn.Module, loss: Callable[[torch.Tensor], torch.Tensor], shape: Shape, pricing: Pricing, head: Optional[nn.Module] = None) -> Model:
    """The step model of ``module`` (on the meta device) whose ``loss`` of token ids is one step's,
    16-bit where ``pricing.half``; 32-true prices the CUDA cores' fp32 peak (torch leaves TF32 off)."""
    if pricing.half:
        module.to(torch.bfloat16)
    ids = torch.zeros(shape.batch_size, shape.seq_len, dtype=torch.long, device="meta")
    return shape_model(module, lambda: loss(ids), pricing, name=shape.name, tokens=shape.batch_size * shape.seq_len, batch_size=shape.batch_size,
                       head=head)


def machine_of(hardware: Any, nvme: int, ranks: int = 1, network: Optional[float] = None, shard_states: bool = True,
               host_network: Optional[float] = None, shared_homes: bool = False, machines: int = 1) -> Any:
    """The step model's machine for a hardware spec (an NVMe tier without known bandwidths is
    priced at a typical drive's, and says so)."""
    from dataclasses import replace

    from offload_strategy.planning.cost_model import UNKNOWN_DISK, machine_from_spec

    if nvme and not (hardware.nvme_read_gbps and hardware.nvme_write_gbps):
        print(f"hardware {hardware.name!r} gives no NVMe bandwidth: NVMe priced at {UNKNOWN_DISK / 1e9:g} GB/s each way "
              f"(set +hardware.nvme_read_gbps=... +hardware.nvme_write_gbps=... for the drive you mean)")
    machine = machine_from_spec(hardware, nvme=bool(nvme))
    return replace(machine, world_size=ranks, network=machine.h2d if network is None else network, shard_states=shard_states,
                   host_network=host_network, shared_homes=shared_homes, replicated_persistent=shard_states, machines=machines)


def counts(layout: Optional[tuple[str, ...]], n_blocks: int) -> str:
    if layout is None:
        return f"{n_blocks}/0/0"
    from offload_strategy.planning.activations import KEEP, RECOMPUTED, SWAPPED

    return f"{layout.count(KEEP)}/{sum(p in RECOMPUTED for p in layout)}/{sum(p in SWAPPED for p in layout)}"


def compare_policies(model: Model, machine: Any, gpu: int, host: int, nvme: int, sharding: Any, owners: list[int]) -> list[Row]:
    """The ``fill`` and ``auto`` rows for one GPU budget (see the module docstring)."""
    from offload_strategy.planning.activations import KEEP, peak_bytes
    from offload_strategy.planning.auto import plan_auto
    from offload_strategy.planning.placement import PlacementError, place_units

    costs = unit_costs(model, owners)
    order = [size.index for size in model.sizes]
    try:
        # every unit is updated as its gradients complete (one optimizer, no clipping or
        # accumulation), after its reduction to its owner under data parallelism; a rank keeps the
        # others' units' gradients only until sent
        placement = place_units(model.sizes, model.co_resident, gpu_bytes=gpu, host_bytes=host, nvme_bytes=nvme, state_factor=model.state_factor,
                                sharding=sharding, gradients_until_update=True)
    except PlacementError as error:
        return [Row(policy, "-", "-", 0, 0, 0, 0, 0, float("nan"), False, f"does not fit: {error}") for policy in ("fill", "auto")]
    buffers = sum(placement.device_slots.values())
    step = placed_step(model, costs, placement, machine)
    kept_peak = peak_bytes(model.blocks, [KEEP] * len(model.blocks), model.beside.head) + model.beside.in_blocks
    fits = placement.gpu_bytes + kept_peak <= gpu
    rows = [Row("fill", homes_of(placement), counts(None, len(model.blocks)), placement.gpu_bytes, kept_peak, placement.host_bytes, placement.nvme_bytes,
                buffers, step.seconds, fits, "" if fits else f"activations over budget by {fmt(placement.gpu_bytes + kept_peak - gpu)}")]
    links = parameter_links(machine, streamed_bytes(model, placement))
    try:
        # the activations outside the blocks and the backward's gradients take their share first, as the runtime plans
        plan = plan_auto(model.sizes, model.co_resident, order, costs, machine, gpu_bytes=max(gpu - model.beside.in_blocks, 0), host_bytes=host, nvme_bytes=nvme,
                         state_factor=model.state_factor, blocks=model.blocks, links=links, activation_host_bytes=max(host - placement.host_bytes, 0),
                         block_units=model.block_units, sharding=sharding, gradients_until_update=True, head=model.beside.head)
    except PlacementError as error:
        rows.append(Row("auto", "-", "-", 0, 0, 0, 0, 0, float("nan"), False, f"does not fit: {outside_note(model, gpu)}{error}"))
        return rows
    chosen = plan.parameters.placement
    layout = plan.activations.layout if plan.activations is not None else ()
    swapped = swapped_bytes(model, layout)
    activations = (plan.activations.peak_bytes if plan.activations is not None else 0) + model.beside.in_blocks
    rows.append(Row("auto", homes_of(chosen), counts(layout or None, len(model.blocks)), chosen.gpu_bytes, activations,
                    chosen.host_bytes + swapped["swap_host"], chosen.nvme_bytes + swapped["swap_nvme"], plan.parameters.buffers, plan.seconds,
                    chosen.gpu_bytes + activations <= gpu, blocks=tuple(layout)))
    return rows


# the placements a policy row prices: each fixes every unit's home, or places them by first use
POLICY_ROW_PLACEMENTS = ("fill", "host", "nvme")


def policy_name(policy: Any) -> str:
    """A policy row's name: its placement and its activations (a planner, or one block policy for all)."""
    activations = policy.activations if isinstance(policy.activations, str) else "per block"
    return f"{policy.placement}+{activations}"


def row_policy(cfg: Any, nvme: int) -> Any:
    """The Hydra config's policy when it asks for something other than the joint search (which
    the auto row prices), e.g. ``policy=lohan policy.placement=nvme``; None otherwise."""
    return preset_row_policy(instantiate(cfg.policy), nvme)


def preset_row_policy(policy: Any, nvme: int) -> Any:
    """``policy`` (a preset's name or a policy) when it is not the joint search, checked; None otherwise."""
    try:
        policy = PolicyConfig.coerce(policy) if isinstance(policy, str) else policy
    except ValueError as error:
        raise SystemExit(f"--policy: {error}") from None
    if policy.placement == "search":
        return None
    check_policy_row(policy, nvme)
    return policy


def check_policy_row(policy: Any, nvme: int) -> None:
    """Refuse a policy the rows cannot price, saying what they can."""
    if policy.placement not in POLICY_ROW_PLACEMENTS:
        raise SystemExit(f"policy.placement={str(policy.placement)!r}: a policy row prices placement {', '.join(POLICY_ROW_PLACEMENTS)} "
                         "beside the auto row (which is placement=search); choose one of those.")
    if not policy.update_during_backward:
        raise SystemExit("policy.update_during_backward=false: the step model prices updates overlapped with backward only; "
                         "set policy.update_during_backward=true.")
    if policy.placement == "nvme" and not nvme:
        raise SystemExit("policy.placement=nvme keeps every unit on NVMe: give --nvme-memory.")


def policy_row(model: Model, machine: Any, gpu: int, host: int, nvme: int, sharding: Any, owners: list[int], policy: Any) -> Row:
    """What the runtime plans under ``policy`` when it is not the joint search, as it plans it: the
    running session's planning sequence (``session/sequence.py``) on the shapes' profile: the
    parameters placed first in the whole GPU tier (every home fixed by ``placement`` host or nvme,
    or by first use under fill), the layout in what they leave, and where no layout fits there
    the parameters placed again in what the layout beside their smallest share leaves. The
    layout's work and traffic are added to the parameters' step as the auto row adds them."""
    from offload_strategy.planning.auto import layout_added_seconds

    from .budgets import plan_on_shapes

    name = policy_name(policy)
    _check_fixed_layout(model, policy)
    try:
        planned = plan_on_shapes(model, policy, TierBudgets(gpu, host, nvme), machine, sharding, owners)
    except ValueError as error:  # PlacementError too
        return Row(name, "-", "-", 0, 0, 0, 0, 0, float("nan"), False, f"does not fit: {error}")
    placement = planned.placement
    layout = planned.layout if planned.layout is not None else _fixed_layout(model, policy, placement, machine)
    streamed = streamed_bytes(model, placement)
    step = placed_step(model, unit_costs(model, owners), placement, machine)
    seconds = step.seconds + layout_added_seconds(step, streamed, model.blocks, layout.layout, parameter_links(machine, streamed))
    swapped = swapped_bytes(model, layout.layout)
    activations = layout.peak_bytes + (model.beside.in_blocks if planned.layout is None else 0)
    fits = placement.gpu_bytes + activations <= gpu and placement.host_bytes + swapped["swap_host"] <= host
    return Row(name, homes_of(placement), counts(layout.layout, len(model.blocks)), placement.gpu_bytes, activations,
               placement.host_bytes + swapped["swap_host"], placement.nvme_bytes + swapped["swap_nvme"], sum(placement.device_slots.values()),
               seconds, fits, "" if fits else f"activations over budget by {fmt(placement.gpu_bytes + activations - gpu)}", tuple(layout.layout))


def _check_fixed_layout(model: Model, policy: Any) -> None:
    """A list of block policies must name one per block."""
    if not isinstance(policy.activations, str) and len(policy.activations) != len(model.blocks):
        raise SystemExit(f"policy.activations lists {len(policy.activations)} block policies, but the model has {len(model.blocks)} blocks: "
                         "give one per block, or one name for all.")


def _fixed_layout(model: Model, policy: Any, placement: Any, machine: Any) -> Any:
    """The layout no planner chose (the policy's own, every block's policy fixed), priced beside ``placement``."""
    from offload_strategy.planning.activations import ActivationPlan, peak_bytes, step_seconds

    from .budgets import layout_planner, running_layout

    fixed = list(running_layout(policy, model, layout_planner(policy, model)))
    links = parameter_links(machine, streamed_bytes(model, placement))
    return ActivationPlan(tuple(fixed), step_seconds(model.blocks, fixed, links), peak_bytes(model.blocks, fixed, model.beside.head))


def swapped_bytes(model: Model, layout: Sequence[str]) -> dict[str, int]:
    """What ``layout`` keeps in host memory (swapped blocks, inputs recomputed from there) and on NVMe."""
    return {"swap_host": sum(b.host_bytes(p) for b, p in zip(model.blocks, layout)),
            "swap_nvme": sum(b.activation_bytes for b, p in zip(model.blocks, layout) if p == "swap_nvme")}


def outside_note(model: Model, gpu: int) -> str:
    """What the activations outside the blocks and the backward's gradients leave of the GPU tier,
    before a refusal that names what is left."""
    if not model.beside.bytes:
        return ""
    return (f"the activations outside the blocks ({fmt(model.outside_bytes)}) and the backward's gradients ({fmt(model.gradient_bytes)}) "
            f"leave {fmt(max(gpu - model.beside.bytes, 0))} of {fmt(gpu)} at the head's backward: ")


def homes_of(placement: Any) -> str:
    return "/".join(str(sum(h == home for h in placement.home.values())) for home in ("gpu", "host", "nvme"))


def fmt(n: float) -> str:
    return format_bytes(n)


def rank_sharding(model: Model, ranks: int, shared_homes: bool = False, replicated: bool = False, machines: int = 1) -> tuple[Any, list[int]]:
    """Rank 0's sharding of ``model``'s states over ``ranks`` data-parallel ranks (None: one rank,
    or every rank keeping every state) and each unit's owner: one optimizer, no accumulation or
    clipping, so every backward reduces to the owners; persistent units replicated."""
    from offload_strategy.planning.sharding import Sharding, assign_owners

    owners = assign_owners([size.trainable_bytes for size in model.sizes], ranks)
    sharding = (Sharding({size.index: owner for size, owner in zip(model.sizes, owners)}, 0, ranks, gradients_sent=True, shared_homes=shared_homes,
                         replicated_persistent=True, machines=machines) if ranks > 1 and not replicated else None)
    return sharding, owners


def largest_depth(model: Model, machine: Any, gpu: int, host: int, nvme: int, ranks: int = 1, shared_homes: bool = False,
                  replicated: bool = False, at_most: Optional[int] = None) -> tuple[int, int, Optional[Row]]:
    """The most blocks of this model's shape (and the parameters they make) for which the joint
    search of the auto rows finds a plan within the budgets, and that plan's row. The search is
    slow on deep models, so it runs from two cheap placements: every block checkpointed beside
    the parameters placed first-use, the first guess (the search may hold more, with swaps, or
    less, keeping a prefix of units resident; where it does not plan that depth it is bisected
    below it), and the parameters placed beside one block's activations, the least any layout
    keeps in the GPU tier, with nothing counted for swaps' host or NVMe room (the bound above).
    Doubling, then bisection on the block count; ``at_most``: no deeper than that many blocks."""
    from offload_strategy.planning.activations import CHECKPOINT, peak_bytes
    from offload_strategy.planning.placement import PlacementError, place_units

    if not model.block_units or not model.blocks:
        return 0, 0, None

    def placed(deeper: Model, activations: int) -> bool:
        activations += deeper.beside.in_blocks
        if activations >= gpu:
            return False
        sharding, _ = rank_sharding(deeper, ranks, shared_homes, replicated, machine.machines)
        try:
            place_units(deeper.sizes, deeper.co_resident, gpu_bytes=gpu - activations, host_bytes=host, nvme_bytes=nvme,
                        state_factor=deeper.state_factor, sharding=sharding, gradients_until_update=True)
        except PlacementError:
            return False
        return True

    def checkpointed(depth: int) -> bool:
        return placed(model.deeper(depth), peak_bytes([model.blocks[0]] * depth, [CHECKPOINT] * depth, model.beside.head))

    def bounded(depth: int) -> bool:
        return placed(model.deeper(depth), max(model.blocks[0].activation_bytes, model.beside.head))  # every layout materialises one block in backward

    searched: dict[int, Optional[Row]] = {}

    def planned(depth: int) -> bool:
        if depth not in searched:
            deeper = model.deeper(depth)
            sharding, owners = rank_sharding(deeper, ranks, shared_homes, replicated, machine.machines)
            row = compare_policies(deeper, machine, gpu, host, nvme, sharding, owners)[-1]
            searched[depth] = row if row.fits else None
        return searched[depth] is not None

    cap = (at_most + 1) if at_most else None
    low = _last_true(checkpointed, 1, cap)
    high = _last_true(bounded, max(low, 1), cap) + 1  # the first depth no plan can hold
    found = _last_true(planned, low, high) if low and planned(low) else _last_true(planned, 1, max(low, 1) + 1)
    if not found:
        return 0, 0, None
    return found, model.deeper(found).parameters, searched[found]


def _last_true(holds: Any, low: int, high: Optional[int] = None) -> int:
    """The largest n >= ``low`` with ``holds(n)``, for a predicate true up to some n and false
    after (0 when ``holds(low)`` is false): doubling from ``low`` until it fails or reaches
    ``high`` (exclusive, where the answer is known to lie below), then bisection."""
    if low < 1 or not holds(low):
        return 0
    good, bad = low, high
    while bad is None:
        probe = good * 2
        if probe >= 1 << 20:
            return good
        good, bad = (probe, None) if holds(probe) else (good, probe)
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if holds(middle) else (good, middle)
    return good


def memferry_findings(model: Model) -> list[tuple[str, int, float, float, int]]:
    """MemFerry Fig. 3 per layer kind: (kind, units, on-GPU forward = copy + compute, DHA forward,
    units Alg. 1 runs in place), times summed over the kind's units."""
    from offload_strategy.planning.searches.access_modes import DHA, forward_modes

    modes, _ = forward_modes([c.transfer_seconds for c in model.costs], [c.forward_seconds for c in model.costs], [c.dha_forward_seconds for c in model.costs])
    kinds: dict[str, list[int]] = {}
    for i, u in enumerate(model.units):
        kinds.setdefault(layer_kind(u), []).append(i)
    out = []
    for kind, members in kinds.items():
        on_gpu = sum(model.costs[i].transfer_seconds + model.costs[i].forward_seconds for i in members)
        dha = sum(model.costs[i].dha_forward_seconds for i in members)
        out.append((kind, len(members), on_gpu, dha, sum(modes[i] == DHA for i in members)))
    return out


def layer_kind(unit: Any) -> str:
    """Embedding, norm or GEMM, from the unit's parameters (MemFerry Fig. 3's layer types)."""
    name = unit.name.lower()
    if "emb" in name or "wte" in name or "wpe" in name:
        return "embedding"
    if all(p.dim() < 2 for p in unit.params):
        return "norm / bias"
    return "linear (GEMM)"


def batch_study(rebuild: Callable[[int], Model], base: int, machine: Any, gpu: int, host: int, nvme: int) -> list[dict]:
    """ProTrain Table 4 and LoHan's cases across batch sizes at one GPU budget: the auto plan's
    resident units and layout, and LoHan's curve (parameters streamed from host memory, LoHan's
    setting); ``rebuild(batch)``: the model at another batch size, ``base`` the job's."""
    from offload_strategy.planning.activations import CHECKPOINT, step_seconds
    from offload_strategy.planning.auto import plan_auto
    from offload_strategy.planning.searches.swap_or_recompute import FALLING, RISING, lohan_search
    from offload_strategy.planning.placement import PlacementError

    out: list[dict] = []
    for factor in TABLE4_BATCH_FACTORS:
        batch = max(1, round(base * factor))
        if any(r["batch"] == batch for r in out):
            continue
        model = rebuild(batch)
        costs = unit_costs(model, [0] * len(model.units))
        order = [u.index for u in model.units]
        row: dict = {"batch": batch, "tokens": model.tokens}
        links = parameter_links(machine, sum(s.nbytes for s in model.sizes))
        try:
            plan = plan_auto(model.sizes, model.co_resident, order, costs, machine, gpu_bytes=max(gpu - model.beside.in_blocks, 0), host_bytes=host,
                             nvme_bytes=nvme, state_factor=model.state_factor, blocks=model.blocks, block_units=model.block_units, links=links,
                             activation_host_bytes=host // 2, gradients_until_update=True, head=model.beside.head)
            layout = plan.activations.layout if plan.activations is not None else ()
            row.update(persistent=plan.parameters.persistent, buffers=plan.parameters.buffers, checkpoint=layout.count("checkpoint") + layout.count("checkpoint_host"),
                       swap=layout.count("swap_host") + layout.count("swap_nvme"), keep=layout.count("keep"), seconds=plan.seconds)
        except PlacementError as error:
            row.update(error=outside_note(model, gpu) + str(error).split(";")[0])
        search = lohan_search(model.blocks, links, gpu_bytes=1 << 62, host_bytes=host // 2)
        recomputed = step_seconds(model.blocks, [CHECKPOINT] * len(model.blocks), links)
        row.update(case={RISING: "1 (PCIe-bound)", FALLING: "2 (compute-bound)"}.get(search.case, "3 (turns)"),
                   curve=((0, recomputed), *search.curve), all_recomputed=recomputed)
        best = min(row["curve"], key=lambda point: point[1])
        row.update(best_swapped=best[0], best_seconds=best[1])
        out.append(row)
    return out


def plot(path: Path, title: str, budgets: list[int], rows: list[list[Row]], tokens: int, study: list[dict], memferry: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 1 + bool(study) + bool(memferry)
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2), squeeze=False)
    ax = axes[0][0]
    for policy, marker in (("fill", "o"), ("auto", "s")):
        points = [(b / 2**30, tokens / r.seconds) for b, per in zip(budgets, rows) for r in per if r.policy == policy and r.fits and r.seconds == r.seconds]
        if points:
            ax.plot(*zip(*points), marker=marker, label=policy)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("GPU tier (GiB)")
    ax.set_ylabel("predicted tokens/s")
    ax.set_title("step by GPU budget (fitting plans)")
    ax.legend()
    panel = 1
    if study:
        ax = axes[0][panel]
        panel += 1
        for row in study:
            curve = row["curve"]
            ax.plot([b / 2**30 for b, _ in curve], [t / row["all_recomputed"] for _, t in curve], label=f"batch {row['batch']}: case {row['case'].split()[0]}")
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("activations swapped (GiB)")
        ax.set_ylabel("step / step with all recomputed")
        ax.set_title("LoHan: step time vs swapped activations")
        ax.legend(fontsize=8)
    if memferry:
        ax = axes[0][panel]
        kinds = [k for k, *_ in memferry]
        x = range(len(kinds))
        ax.bar([i - 0.2 for i in x], [g * 1e3 for _, _, g, _, _ in memferry], width=0.4, label="on-GPU (copy + compute)")
        ax.bar([i + 0.2 for i in x], [d * 1e3 for _, _, _, d, _ in memferry], width=0.4, label="DHA (in place)")
        ax.set_xticks(list(x), kinds)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("forward ms (all units of the kind)")
        ax.set_title("MemFerry Fig. 3: where direct host access wins")
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 140 * panels // 3), fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    tmp.replace(path)  # never a half-written figure


def explain(text: str) -> None:
    print(textwrap.fill(text, 110) + "\n")


def print_assumptions(hardware: Any, args: Any, model: Model, budgets: list[int], host: int, nvme: int, machine: Any) -> None:
    """Every figure the predictions rest on, with where it comes from and how to change it."""
    from offload_strategy.config import compute_dtype
    from offload_strategy.estimate.analytic import ADAM_BYTES_PER_PARAMETER, CPU_PARAMS_PER_S_PER_CORE, GPU_MEMORY_SHARE, cpu_update_rate

    copy = 2 if args.precision == "bf16-true" else 0
    memory = (f"{hardware.host_memory_gbps:g} GB/s of memory channels at {ADAM_BYTES_PER_PARAMETER + copy} bytes per parameter"
              if hardware.host_memory_gbps else "nothing (the memory bandwidth is not known)")

    peak = hardware.peak_flops(compute_dtype(args.precision))
    gradient = "and its fp32 gradient (4) at home, or only in flight where host memory needs it (each unit updated as its gradients complete)"
    per_param = f"2 (bf16) in the GPU tier; at home 14: the bf16 parameter, its fp32 master and two fp32 Adam states, {gradient}" \
        if args.precision == "bf16-true" \
        else f"4 (fp32, cast to bf16 on the GPU as it is used) in the GPU tier; at home 12: the parameter and two Adam states, {gradient}" \
        if args.precision == "bf16-mixed" \
        else f"4 (fp32) in the GPU tier; at home 12: the parameter and two Adam states, {gradient}"
    source = f" ({hardware.source})" if hardware.source else ""
    hbm = (f"memory-bound work (element-wise, norms, the loss) at {GPU_MEMORY_SHARE:.0%} of its {hardware.gpu_memory_gbps:g} GB/s "
           f"(+hardware.gpu_memory_gbps=)" if hardware.gpu_memory_gbps
           else "memory-bound work not priced: the GPU memory's bandwidth is not known (+hardware.gpu_memory_gbps=)")
    nvme_line = (f"{fmt(nvme)}, read {machine.nvme_read / 1e9:.1f} GB/s, write {machine.nvme_write / 1e9:.1f} GB/s (--nvme-memory; "
                 f"+hardware.nvme_read_gbps=, +hardware.nvme_write_gbps=)") if nvme else "none (--nvme-memory 2TB adds one)"
    lines = [
        f"machine: {hardware.name}{source}; every figure below can be replaced, e.g. +hardware.host_memory=512GiB",
        f"GPU compute: matrix products at {args.efficiency:.0%} of the {hardware.gpu}'s dense {compute_dtype(args.precision)} peak, "
        f"{peak / 1e12:.0f} TFLOP/s (--efficiency; +hardware.gpu_{compute_dtype(args.precision)}_tflops=); {hbm}",
        f"GPU tier budgets: {', '.join(fmt(b) for b in budgets)} of its {fmt(hardware.gpu_memory)} (--gpu-memory)",
        f"host memory: {fmt(host)}, {_available_share():.0%} of the machine's {fmt(hardware.host_memory)} left to the run (--host-memory)",
        f"NVMe: {nvme_line}",
        f"host <-> GPU: {machine.h2d / 1e9:.1f} GB/s in, {machine.d2h / 1e9:.1f} GB/s out, what the link delivers (its datasheet rate times "
        f"the shares 10Cache measured, hardware/specs.py; +hardware.h2d_gbps=, +hardware.d2h_gbps=)",
        f"CPU optimizer: Adam at {cpu_update_rate(hardware, copy) / 1e9:.1f} G parameters/s: {CPU_PARAMS_PER_S_PER_CORE / 1e9:.2f} G/s per core on "
        f"{hardware.cpu_cores} cores, bounded by {memory} (+hardware.cpu_cores=, +hardware.host_memory_gbps=)",
        f"bytes per parameter ({args.precision}, --precision): {per_param}",
        f"batch: {model.batch_size} sequences x {model.tokens // model.batch_size} tokens (--batch-size, --seq-len)",
        "activations: every tensor autograd saves in one forward of the model on the meta device (eager kernels; fused ones save less)",
    ]
    print("Assumptions:")
    for line in lines:
        print(f"- {line}")
    print()


def policy_table(model: Model, machine: Any, budgets: list[int], host: int, nvme: int, sharding: Any, owners: list[int],
                 policy: Any = None) -> list[list[Any]]:
    """Every policy at every GPU budget, printed as a table; the rows, one list per budget
    (``policy``: a policy other than the joint search, priced in a row of its own before auto's)."""
    print("| gpu_memory | policy | units gpu/host/nvme | blocks keep/ckpt/swap | GPU tier: parameters + activations | host | NVMe | streaming buffers | step (s) | tokens/s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    all_rows = []
    for gpu in budgets:
        rows = compare_policies(model, machine, gpu, host, nvme, sharding, owners)
        if policy is not None:
            rows.insert(len(rows) - 1, policy_row(model, machine, gpu, host, nvme, sharding, owners, policy))
        all_rows.append(rows)
        for r in rows:
            if r.homes == "-":
                print(f"| {fmt(gpu)} | {r.policy} | {r.note} ||||||||")
                continue
            tokens = f"{model.tokens / r.seconds:,.0f}" if r.fits else f"- ({r.note})"
            print(f"| {fmt(gpu)} | {r.policy} | {r.homes} | {r.layout} | {fmt(r.gpu_parameters)} + {fmt(r.gpu_activations)} | {fmt(r.host)} | "
                  f"{fmt(r.nvme)} | {r.buffers} | {r.seconds:.2f} | {tokens} |")
    return all_rows


def _check_ranks(args: argparse.Namespace, machine_spec: Any) -> None:
    """Refuse rank and machine counts no run could have, saying which flag to change."""
    if args.ranks < 1:
        raise SystemExit(f"--ranks {args.ranks}: give at least one rank.")
    if args.share_host_homes and args.replicate_states:
        raise SystemExit("--share-host-homes needs sharded states: drop --replicate-states.")
    if args.machines < 1 or args.ranks % args.machines:
        raise SystemExit(f"--machines {args.machines}: {args.ranks} ranks cannot be spread evenly over them; give a count that divides --ranks.")
    if args.share_host_homes and args.ranks // args.machines > machine_spec.gpus:
        raise SystemExit(f"--share-host-homes: {args.ranks // args.machines} ranks per machine do not fit on one {machine_spec.name} machine "
                         f"({machine_spec.gpus} GPUs), and only one machine's ranks share host memory; give --machines.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``simulate`` command's arguments (``offload-strategy simulate``)."""
    parser.add_argument("model", nargs="*", help="a Hugging Face config.json (or its directory); or, in a checkout with the experiments extra, "
                        "Hydra overrides of its job: model=..., hardware=..., data.batch_size=..., data.seq_len=... (a bare name: model=NAME)")
    parser.add_argument("--hardware", default=None, help="a known machine (rtx4090, h100_80g, ...) or auto: this one (default: auto, or the Hydra job's)")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step (default: the Hydra job's, else 1)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the Hydra job's, else 2048)")
    parser.add_argument("--policy", default=None, help="a policy preset priced in a row of its own beside auto's (default: the Hydra job's policy)")
    parser.add_argument("--gpu-memory", nargs="*", default=None, help="GPU-tier budgets to compare (default: 25%%, 50%% and 90%% of the GPU)")
    parser.add_argument("--host-memory", default=None, help="host budget (default: 95%% of the machine's, what the strategy finds available on an idle machine)")
    parser.add_argument("--nvme-memory", default="0", help="NVMe budget (default: none)")
    parser.add_argument("--precision", default="bf16-true", choices=["bf16-true", "bf16-mixed", "32-true"])
    parser.add_argument("--ranks", type=int, default=1, help="data-parallel ranks (tiered_ddp); budgets are per rank")
    parser.add_argument("--network-gbps", type=float, default=None, help="GB/s each rank moves in collectives (default: the host->GPU link's)")
    parser.add_argument("--host-network-gbps", type=float, default=None,
                        help="GB/s of collectives on host memory (gloo: offloaded units' reductions and parameters; default: --network-gbps)")
    parser.add_argument("--replicate-states", action="store_true", help="every rank keeps every optimizer state (shard_states=False)")
    parser.add_argument("--share-host-homes", action="store_true",
                        help="each machine's ranks keep one copy of host homes (share_host_homes=True)")
    parser.add_argument("--machines", type=int, default=1, help="the ranks span this many machines, as many on each (num_nodes)")
    parser.add_argument("--efficiency", type=float, default=0.5, help="model FLOPs utilisation of the GPU's dense peak")
    parser.add_argument("--largest-at-most", type=int, default=None,
                        help="search the largest model no deeper than this many blocks (the search takes a minute or more on deep models)")
    parser.add_argument("--findings", action="store_true", help="check MemFerry's, LoHan's and ProTrain's findings on this model and machine")
    parser.add_argument("--png", type=Path, default=None, help="write the figure here")


@dataclass(frozen=True)
class Job:
    """What is simulated: the machine's spec, the model at a batch size priced on a rank's share of
    that machine, the job's batch size, and the policy priced beside auto's at an NVMe budget."""

    spec: Any
    build: Callable[[Any, int], Model]
    batch_size: int
    policy: Callable[[int], Any]


def job_of(args: argparse.Namespace) -> Job:
    """The job the command line names: a ``config.json`` with flags, or a Hydra job."""
    source = model_source(args.model)
    half, mixed, dtype = args.precision == "bf16-true", args.precision.endswith("-mixed"), compute_dtype(args.precision)
    if source.hydra:
        cfg = compose(hydra_overrides(source, args))
        return Job(instantiate(cfg.hardware), lambda hardware, batch: build(cfg, hardware, half, args.efficiency, batch_size=batch, dtype=dtype, mixed=mixed),
                   int(cfg.data.batch_size), lambda nvme: preset_row_policy(args.policy, nvme) if args.policy else row_policy(cfg, nvme))
    assert source.path is not None
    path, seq = source.path, args.seq_len or 2048

    def at(hardware: Any, batch: int) -> Model:
        return build_from_config(path, Shape(batch, seq), Pricing(hardware, dtype=dtype, efficiency=args.efficiency, half=half, mixed=mixed))

    return Job(resolve_hardware(args.hardware or "auto"), at, args.batch_size or 1, lambda nvme: preset_row_policy(args.policy, nvme) if args.policy else None)


def hydra_overrides(source: ModelSource, args: argparse.Namespace) -> list[str]:
    """The Hydra job's overrides, the flags that name its groups and sizes among them."""
    flags = {"hardware": args.hardware, "data.batch_size": args.batch_size, "data.seq_len": args.seq_len}
    return [*source.overrides, *(f"{key}={value}" for key, value in flags.items() if value is not None)]


def run(args: argparse.Namespace) -> int:
    """``offload-strategy simulate``: the tables for the job ``args`` names (see the module docstring)."""
    job = job_of(args)
    machine_spec = job.spec
    _check_ranks(args, machine_spec)
    hardware = machine_spec.rank_share(args.ranks // args.machines)  # each rank's cores, memory channels and host memory
    model = job.build(hardware, job.batch_size)
    budgets = [parse_size(g) for g in args.gpu_memory] if args.gpu_memory else [int(hardware.gpu_memory * f) for f in (0.25, 0.5, 0.9)]
    host = parse_size(args.host_memory) if args.host_memory else int(_available_share() * hardware.host_memory)
    nvme = parse_size(args.nvme_memory)
    network = None if args.network_gbps is None else args.network_gbps * 1e9  # None: the host link's
    host_network = None if args.host_network_gbps is None else args.host_network_gbps * 1e9
    shared = args.share_host_homes and args.ranks > args.machines
    machine = machine_of(hardware, nvme, ranks=args.ranks, network=network, shard_states=not args.replicate_states, host_network=host_network,
                         shared_homes=shared, machines=args.machines)
    sharding, owners = rank_sharding(model, args.ranks, shared, args.replicate_states, args.machines)
    compute = model.compute_seconds
    activations = sum(b.activation_bytes for b in model.blocks)
    title = (f"{model.name}: {model.parameters / 1e9:.2f} B parameters in {len(model.units)} units and {len(model.blocks)} blocks, {args.precision}; "
             f"{hardware.name} ({hardware.gpu}, {fmt(hardware.gpu_memory)}, {hardware.cpu_cores} cores); "
             f"{model.tokens:,} tokens per step ({fmt(activations)} of block activations, {fmt(model.outside_bytes)} kept outside the blocks, "
             f"{fmt(model.gradient_bytes)} for the backward's gradients); "
             f"compute alone {compute:.2f} s per step")
    print(f"\n{title}\n")
    print_assumptions(hardware, args, model, budgets, host, nvme, machine)
    if args.ranks > 1:
        print(f"tiered_ddp on {args.ranks} ranks, collectives at {machine.network / 1e9:.0f} GB/s per rank on the GPU tier and "
              f"{machine.host_collectives / 1e9:.0f} GB/s on host memory (--host-network-gbps), optimizer states "
              f"{'replicated' if args.replicate_states else 'sharded'}{', host homes one copy per machine' if shared else ''}: "
              f"budgets, step and tokens/s are rank 0's "
              f"(the run's tokens/s are {args.ranks}x); each rank has {hardware.cpu_cores} of the machine's {machine_spec.cpu_cores} cores "
              f"and that share of its memory channels and host memory\n")
    all_rows = policy_table(model, machine, budgets, host, nvme, sharding, owners, policy=job.policy(nvme))
    depth, parameters, plan = largest_depth(model, machine, max(budgets), host, nvme, ranks=args.ranks, shared_homes=shared,
                                            replicated=args.replicate_states, at_most=args.largest_at_most)
    if depth and plan is not None:
        least = "at least " if depth == args.largest_at_most else ""
        print(f"\nLargest model of this width within GPU {fmt(max(budgets))}, host {fmt(host)}, NVMe {fmt(nvme)}: "
              f"{least}{depth} blocks ({parameters / 1e9:.1f} B parameters; this one has {len(model.blocks)}), as the auto rows plan it: "
              f"units {plan.homes}, blocks {plan.layout} (keep/ckpt/swap), {plan.seconds:.2f} s per step.")
    else:
        print(f"\nNot even one block of this model fits GPU {fmt(max(budgets))}, host {fmt(host)}, NVMe {fmt(nvme)}.")

    study, memferry = [], []
    if args.findings:
        memferry = memferry_findings(model)
        print("\nMemFerry Fig. 3: forward of each layer kind with its parameters in host memory (all units of the kind)\n")
        explain(
            "A layer whose weights live in host memory can run two ways: copy the weights into GPU memory first, then compute "
            "(on-GPU), or let the GPU kernel read them in place over the PCIe link as it computes (direct host access, DHA). "
            "Reading in place saves the copy when each weight is read once (an embedding looks up a few rows; a norm reads a "
            "vector), but a matrix multiply reads each weight many times, and over PCIe that is far slower than one copy. "
            "MemFerry measured that DHA wins for embeddings and norms and loses for large matrix multiplies; the table prices "
            "both for every layer kind of this model, and its last column is how many units MemFerry's Algorithm 1 would run in place."
        )
        print("| layer kind | units | on-GPU: copy + compute (ms) | direct host access (ms) | faster | Alg. 1 runs in place |")
        print("|---|---|---|---|---|---|")
        for kind, n, on_gpu, dha, in_place in memferry:
            faster = "tie (the bytes cross once either way)" if abs(dha - on_gpu) <= 0.01 * on_gpu else "DHA" if dha < on_gpu else "on-GPU"
            print(f"| {kind} | {n} | {on_gpu * 1e3:.2f} | {dha * 1e3:.2f} | {faster} | {in_place} of {n} |")
        gpu = budgets[len(budgets) // 2]
        study = batch_study(lambda batch: job.build(hardware, batch), job.batch_size, machine, gpu, host, nvme)
        print(f"\nProTrain Table 4 and LoHan §IV-D across batch sizes, GPU tier {fmt(gpu)} (the auto plan; "
              "LoHan's curve with every parameter streamed from host memory, its setting)\n")
        explain(
            "A larger batch needs more memory for activations (what forward keeps for backward), so fewer parameters can stay "
            "in the GPU tier ('persistent units') and more blocks' activations are recomputed in backward ('ckpt') or copied "
            "out to host memory and back ('swap'); ProTrain's Table 4 shows that trend, and each row here is the planner's "
            "choice at that batch. Swapping costs link time, recomputing costs GPU time, and LoHan showed the step time is "
            "convex in how much is swapped, in one of three shapes: case 1, the link is the bottleneck even with everything "
            "recomputed, so swap as little as fits; case 2, compute is the bottleneck even with everything swapped, so swap "
            "everything; case 3, the time falls then rises, and the turn is the best amount. The last columns are the best "
            "amount to swap and the step there relative to recomputing every block."
        )
        print("| batch | tokens | persistent units | buffers | blocks keep/ckpt/swap | step (s) | LoHan case | fastest swap (GiB of all) | step there / all recomputed |")
        print("|---|---|---|---|---|---|---|---|---|")
        for row in study:
            total = row["curve"][-1][0] if row["curve"] else 0
            cells = (f"{row['persistent']} | {row['buffers']} | {row['keep']}/{row['checkpoint']}/{row['swap']} | {row['seconds']:.2f}"
                     if "error" not in row else f"does not fit: {row['error']} | | |")
            print(f"| {row['batch']} | {row['tokens']:,} | {cells} | {row['case']} | {row['best_swapped'] / 2**30:.2f} of {total / 2**30:.2f} | "
                  f"{row['best_seconds'] / row['all_recomputed']:.2f} |")
    if args.png is not None:
        plot(args.png, title, budgets, all_rows, model.tokens, study, memferry)
        print(f"\nfigure: {args.png}")
    return 0

