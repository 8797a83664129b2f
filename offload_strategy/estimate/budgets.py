"""An estimate before any run: the least budgets each policy preset needs for a model, and its
predicted step, without memory for the model.

The model's parameters are replaced by meta tensors in a copy (nothing allocated), one training
step's forward runs on the meta device (``estimate/analytic.py``: what autograd saves per block and
outside the blocks, as the runtime counts it), and the planning sequence the running strategy
takes (``session/sequence.py``: the profiling placement, the search, the activation layout beside
it and the placement again) decides, on that profile, whether each preset accepts a
``gpu_memory``. The least GPU tier is bisected over those decisions, then the least host memory
and NVMe at it; the units are where the plan at the least budgets keeps them.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ..config import PRESETS, ActivationPlanner, BlockPolicy, HardwareSpec, PlacementMode, PolicyConfig, compute_dtype, format_bytes
from ..hardware import AVAILABLE_SHARE, resolve_hardware
from ..planning.activations import peak_bytes
from ..planning.auto import AutoPlan
from ..planning.cost_model import Machine, machine_from_spec
from ..planning.placement import Placement
from ..planning.planner import ModelUnits, Planner, TierBudgets
from ..planning.sharding import Sharding
from .shapes import Pricing, ShapeModel, placed_step, shape_model, unit_costs
from ..runtime.activations.policies import resolve_policies
from ..session.plans import optimizer_state_factor
from ..session.sequence import Profile, SequencePlan, plan_from_profile

# the NVMe tier the bisection may use where host memory runs out: more than any drive holds
_ANY_NVME = 1 << 60
# the bisection stops within this share of the least GPU tier (and 4 KiB)
_RESOLUTION = 0.002
_HALF = {"bf16-true": torch.bfloat16, "16-true": torch.float16}
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")

Loss = Callable[[Any, Any], torch.Tensor]


@dataclass(frozen=True)
class PresetEstimate:
    """One preset's least budgets (bytes) and its predicted step at them (seconds; None where the
    hardware gives no peak to price compute at, or nothing fits)."""

    preset: str
    gpu_memory: int
    host_memory: int
    nvme_memory: int
    step_seconds: Optional[float]
    units: str  # units in the GPU tier / host memory / NVMe at the least GPU tier
    # GPU memory the activations take beyond gpu_memory: policy 'none' (everything kept as plain
    # training does, unplanned) budgets parameters, gradients and states alone
    activations_beside: int = 0
    note: str = ""  # why the preset does not fit (its budgets are then 0)

    @property
    def fits(self) -> bool:
        return not self.note


@dataclass(frozen=True)
class Estimate(Mapping[str, PresetEstimate]):
    """Every preset's :class:`PresetEstimate` by name (``estimate(...)["auto"].gpu_memory``); its
    ``str`` is the table."""

    model: str
    parameters: int
    precision: str
    hardware: str
    tokens: int
    rows: Mapping[str, PresetEstimate]

    def __getitem__(self, preset: str) -> PresetEstimate:
        if preset not in self.rows:
            raise KeyError(f"no estimate for preset {preset!r}; estimated: {', '.join(self.rows)}.")
        return self.rows[preset]

    def __iter__(self) -> Iterator[str]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __str__(self) -> str:
        lines = [
            f"{self.model}: {self.parameters / 1e6:,.1f} M parameters, {self.precision}, {self.tokens:,} tokens per step, "
            f"priced on {self.hardware}",
            "| preset | gpu_memory | + activations beside it | host_memory | nvme_memory | units gpu/host/nvme | predicted step |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in self.rows.values():
            if not row.fits:
                lines.append(f"| {row.preset} | does not fit: {row.note} ||||||")
                continue
            step = "n/a" if row.step_seconds is None else f"{row.step_seconds * 1e3:,.1f} ms"
            beside = format_bytes(row.activations_beside, at_least=True) if row.activations_beside else "-"
            lines.append(f"| {row.preset} | {format_bytes(row.gpu_memory, at_least=True)} | {beside} | {format_bytes(row.host_memory, at_least=True)} | "
                         f"{format_bytes(row.nvme_memory, at_least=True)} | {row.units} | {step} |")
        return "\n".join(lines)


def estimate(
    model: nn.Module, example_batch: Any, *, precision: str = "32-true", policy: Union[None, str, Sequence[str]] = None,
    hardware: Union[None, str, HardwareSpec, Mapping[str, Any]] = None, loss: Optional[Loss] = None,
    optimizer: Optional[torch.optim.Optimizer] = None, efficiency: float = 0.5,
) -> Estimate:
    """The least ``gpu_memory``, ``host_memory`` and ``nvme_memory`` each policy preset needs to
    train ``model`` on batches like ``example_batch``, and its predicted step.

    ``model``: a LightningModule (its ``training_step(batch, 0)`` gives the loss; its
    ``configure_optimizers`` the optimizer whose states are counted), or an ``nn.Module`` with
    ``loss``, called as ``loss(model(inputs), target)`` for a batch ``(inputs, target)`` (without
    ``loss``: ``model(**batch)`` or ``model(batch)``, whose ``.loss`` or value is the loss). Its
    parameters may be real, on the meta device, or not built yet (``configure_model``): nothing is
    allocated for them, and the model is left as it was. ``policy``: one preset or several (all by
    default); ``hardware``: a known machine's name (``rtx4090``), a spec, or this machine (default),
    whose GPU peak prices the step (no peak: the step is not predicted); ``optimizer``: for an
    ``nn.Module``, the optimizer it trains with (Adam's two states per parameter by default);
    ``efficiency``: the share of the GPU's dense peak matrix products reach."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one the strategy runs; choose one of {', '.join(PRECISIONS)}.")
    presets = _presets(policy)
    spec = resolve_hardware("auto" if hardware is None else hardware)
    fused = torch.cuda.is_available() if hardware in (None, "auto") else True  # a CPU's attention saves more than a fused kernel
    shaped = _shape(model, example_batch, precision, dataclasses.replace(Pricing(spec), efficiency=efficiency, fused_attention=fused), loss, optimizer)
    host = int(AVAILABLE_SHARE * spec.host_memory)
    machine = machine_from_spec(spec, nvme=True)
    priced = spec.peak_flops(compute_dtype(precision)) is not None
    rows = {name: _preset_estimate(shaped, name, host, machine, priced) for name in presets}
    return Estimate(shaped.name, shaped.parameters, precision, spec.name, shaped.tokens, rows)


def _presets(policy: Union[None, str, Sequence[str]]) -> list[str]:
    names = list(PRESETS) if policy is None else [policy] if isinstance(policy, str) else list(policy)
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        raise ValueError(f"policy={unknown!r}: no such preset; choose among {', '.join(PRESETS)}.")
    return names


# -- the model on the meta device ----------------------------------------------------------------------


def _shape(model: nn.Module, batch: Any, precision: str, given: Pricing, loss: Optional[Loss], optimizer: Optional[torch.optim.Optimizer]) -> ShapeModel:
    """The shape model of a meta copy of ``model`` and one training step's forward on ``batch``
    (``given``: the machine, the efficiency and the attention kernel)."""
    spec = given.hardware
    meta = meta_copy(model)
    if precision in _HALF:
        meta.to(_HALF[precision])
    meta.train()
    dtype = compute_dtype(precision)
    # the sizes need no price: a machine without a GPU peak is priced at a stand-in one, and its step not reported
    stand_in = dataclasses.replace(spec, gpu_bf16_tflops=spec.gpu_bf16_tflops or 100.0, gpu_fp16_tflops=spec.gpu_fp16_tflops or 100.0,
                                   gpu_fp32_tflops=spec.gpu_fp32_tflops or 100.0)
    pricing = dataclasses.replace(given, hardware=stand_in, dtype=dtype, half=precision in _HALF, mixed=precision.endswith("-mixed"),
                                  state_factor=_state_factor(meta, optimizer))
    on_meta = tree_map(lambda t: torch.empty_like(t, device="meta") if isinstance(t, torch.Tensor) else t, batch)
    tokens, rows = _tokens(on_meta)
    return shape_model(meta, lambda: _step_loss(meta, on_meta, loss), pricing, name=type(model).__name__, tokens=tokens, batch_size=rows)


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors (ties kept), built by its
    ``configure_model`` on the meta device where that is where it makes its layers."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    meta = copy.deepcopy(model, memo)
    configure = getattr(meta, "configure_model", None)
    if callable(configure):
        with torch.device("meta"):
            configure()
    if not any(True for _ in meta.parameters()):
        raise ValueError(f"{type(model).__name__} has no parameters (nor builds any in configure_model): nothing to estimate.")
    return meta


def _state_factor(meta: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> float:
    """Optimizer state bytes per parameter byte, as the strategy measures them."""
    if optimizer is None and callable(getattr(meta, "training_step", None)):
        optimizer = _first_optimizer(meta.configure_optimizers())  # type: ignore[operator]
    return optimizer_state_factor([optimizer]) if optimizer is not None else 2.0


def _first_optimizer(configured: Any) -> Optional[torch.optim.Optimizer]:
    """The optimizer of what ``configure_optimizers`` returned (one, a list, a dict, a tuple of lists)."""
    for item in tree_flatten(configured, is_leaf=lambda x: isinstance(x, torch.optim.Optimizer))[0]:
        if isinstance(item, torch.optim.Optimizer):
            return item
    return None


def _tokens(batch: Any) -> tuple[int, int]:
    """The tokens a step prices its matrix products for (an integer tensor's elements: token ids;
    else the first tensor's rows) and the batch's rows."""
    tensors = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor)]
    if not tensors:
        raise ValueError("example_batch holds no tensor: give a batch as the model's training step takes it.")
    ids = next((t for t in tensors if not t.is_floating_point()), None)
    rows = int(tensors[0].shape[0]) if tensors[0].dim() else 1
    return (ids.numel() if ids is not None else rows), rows


def _step_loss(model: nn.Module, batch: Any, loss: Optional[Loss]) -> torch.Tensor:
    """The training step's loss, as the run computes it."""
    if callable(getattr(model, "training_step", None)) and loss is None:
        with warnings.catch_warnings():  # its self.log calls have no trainer to log to here
            warnings.filterwarnings("ignore", message=".*self.log.*")
            return _as_loss(model.training_step(batch, 0))  # type: ignore[operator]
    if loss is not None:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise ValueError(f"with loss=, example_batch must be (inputs, target); got a {type(batch).__name__}.")
        return loss(model(batch[0]), batch[1])
    out = model(**batch) if isinstance(batch, Mapping) else model(batch)
    return _as_loss(out)


def _as_loss(out: Any) -> torch.Tensor:
    value = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", out)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"the training step gave {type(out).__name__}, not a loss: give loss= (called as loss(model(inputs), target)).")
    return value


# -- the least budgets ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Fit:
    """What a preset's run holds at a GPU tier it accepts."""

    placement: Placement
    beside: int  # the GPU bytes the activations take beyond the budget (no layout planned)
    search: Optional[AutoPlan] = None  # the search's plan, where the preset searches


def _preset_estimate(model: ShapeModel, name: str, host: int, machine: Machine, priced: bool) -> PresetEstimate:
    policy = PolicyConfig.coerce(name)
    try:
        least, fit = least_budgets(model, policy, host, machine)
    except ValueError as error:
        return PresetEstimate(name, 0, 0, 0, None, "-", note=str(error))
    placement = fit.placement
    units = "/".join(str(sum(h == tier for h in placement.home.values())) for tier in ("gpu", "host", "nvme"))
    step = _step(model, policy, fit, machine) if priced else None
    return PresetEstimate(name, least.gpu, least.host, least.nvme, step, units, activations_beside=fit.beside)


def least_budgets(model: ShapeModel, policy: PolicyConfig, host: int, machine: Machine) -> tuple[TierBudgets, _Fit]:
    """The least GPU tier with ``host`` bytes of host memory and NVMe to spare; then the least host
    memory with that GPU tier (NVMe only where the policy or that placement uses it); then the
    least NVMe with both; and what the run holds at the three."""
    upper = _upper(model)
    try:
        gpu, fit = _least(model, policy, machine, lambda n: TierBudgets(n, host, _ANY_NVME), upper)
    except ValueError:
        raise ValueError(f"no gpu_memory up to {format_bytes(upper)} fits beside host_memory={format_bytes(host)} (95% of the machine's): "
                         f"it homes more than that there; give hardware= a machine with more host memory") from None
    spare = _ANY_NVME if policy.placement == PlacementMode.NVME or fit.placement.nvme_bytes else 0
    least_host, fit = _least(model, policy, machine, lambda n: TierBudgets(gpu, n, spare), host)
    if not spare:
        return TierBudgets(gpu, least_host, 0), fit
    nvme, fit = _least(model, policy, machine, lambda n: TierBudgets(gpu, least_host, n), upper)
    return TierBudgets(gpu, least_host, nvme), fit


def _least(model: ShapeModel, policy: PolicyConfig, machine: Machine, budgets: Callable[[int], TierBudgets], upper: int) -> tuple[int, _Fit]:
    """The least budget of one tier: bisected over the sequence without its search (which prices
    every placement of a large model at each point), then checked with it; bisected again with
    it where the search's placement is refused there."""
    least, _ = least_budget(lambda n: accepts(model, policy, budgets(n), machine, search=False), upper)
    fit = accepts(model, policy, budgets(least), machine)
    if fit is not None:
        return least, fit
    return least_budget(lambda n: accepts(model, policy, budgets(n), machine), upper)


def _upper(model: ShapeModel) -> int:
    """A GPU tier every preset fits in: everything resident, every block's activations kept, twice."""
    states = sum(s.nbytes + s.trainable_bytes * (2 + model.state_factor) + s.landing_bytes for s in model.sizes)
    kept = peak_bytes(model.blocks, [BlockPolicy.KEEP] * len(model.blocks), model.beside.head) if model.blocks else 0
    return int(2 * (states + kept + model.beside.bytes)) + (64 << 20)


def least_budget(fits: Callable[[int], Optional[_Fit]], upper: int) -> tuple[int, _Fit]:
    """The least budget of one tier ``fits`` accepts (bisected: the planner's decisions only grow
    easier with more), and what the run holds there; ValueError where even ``upper`` is refused."""
    top = fits(upper)
    if top is None:
        raise ValueError(f"refused even with {format_bytes(upper)}")
    nothing = fits(0)
    if nothing is not None:
        return 0, nothing
    low, high, best = 0, upper, top
    while high - low > max(4096, int(_RESOLUTION * high)):
        middle = (low + high) // 2
        fit = fits(middle)
        if fit is None:
            low = middle
        else:
            high, best = middle, fit
    return high, best


def accepts(model: ShapeModel, policy: PolicyConfig, budgets: TierBudgets, machine: Machine, search: bool = True) -> Optional[_Fit]:
    """What a run of ``model`` under ``policy`` holds in the GPU tier at ``budgets``, or None where
    the strategy refuses it: the planning sequence the running session takes (``session/sequence.py``:
    the profiling placement, the search, the layout beside it and the placement again) on the
    shapes' profile; ``machine``: what prices the search."""
    try:
        planned = plan_on_shapes(model, policy, budgets, machine, search=search)
    except ValueError:  # PlacementError too
        return None
    # a layout the user fixed is counted in the GPU tier (the sequence refuses it there); policy 'none' keeps its activations beside
    beside = _kept_peak(model, running_layout(policy, model, None)) if policy.name == "none" else 0
    return _Fit(planned.placement, beside, planned.search)


def plan_on_shapes(model: ShapeModel, policy: PolicyConfig, budgets: TierBudgets, machine: Machine, sharding: Optional[Sharding] = None,
                   owners: Optional[Sequence[int]] = None, search: bool = True) -> SequencePlan:
    """What the running session plans for ``model`` under ``policy`` within ``budgets``, from the
    shapes' profile of its units and blocks (``sharding``, ``owners``: rank 0's under data parallelism)."""
    planner = Planner(policy, budgets, has_nvme=budgets.nvme > 0)
    planning = layout_planner(policy, model)
    owners = list(owners) if owners is not None else [0] * len(model.sizes)
    profile = Profile([s.index for s in model.sizes], unit_costs(model, owners), list(model.blocks), model.beside)
    return plan_from_profile(planner, model_units(model, policy, sharding), profile, running_layout(policy, model, planning), planning, machine,
                             measured="estimated from the shapes", search=search)


def layout_planner(policy: PolicyConfig, model: ShapeModel) -> Optional[str]:
    """The planner that lays out the blocks (``auto``, ``teraio``, ``lohan``), or None."""
    named = policy.activations if isinstance(policy.activations, str) else None
    if policy.name == "none" or not model.blocks or named not in tuple(ActivationPlanner):
        return None
    return named


def running_layout(policy: PolicyConfig, model: ShapeModel, planning: Optional[str]) -> Sequence[str]:
    """The blocks' policies of the first steps: the profiling layout under a planner (the first
    block kept, the others checkpointed), the policy's own otherwise."""
    count = len(model.blocks)
    if planning is not None:
        return [BlockPolicy.KEEP] + [BlockPolicy.CHECKPOINT] * (count - 1)
    if policy.name == "none" or not count or policy.activations in tuple(ActivationPlanner):
        return [BlockPolicy.KEEP] * count
    return resolve_policies([nn.Module()] * count, policy.activations or BlockPolicy.KEEP)


def model_units(model: ShapeModel, policy: PolicyConfig, sharding: Optional[Sharding] = None) -> ModelUnits:
    """What the planner knows of the model, as the strategy tells it for one optimizer without
    clipping or accumulation: each unit updated as its gradients complete where the policy does so."""
    return ModelUnits(
        sizes=list(model.sizes), names=[f"unit{s.index}" for s in model.sizes], co_resident=model.co_resident, block_units=model.block_units,
        state_factor=model.state_factor, sharding=sharding, gradients_until_update=policy.update_during_backward,
    )


def _kept_peak(model: ShapeModel, running: Sequence[str]) -> int:
    """The activations' peak under policy 'none': the strategy budgets the parameters alone, and
    the activations take their GPU memory beside the budget."""
    return (peak_bytes(model.blocks, running, model.beside.head) if model.blocks else 0) + model.beside.in_blocks


def _step(model: ShapeModel, policy: PolicyConfig, fit: _Fit, machine: Machine) -> Optional[float]:
    """The step model's prediction at the least budgets: the search's plan where the preset
    searches, the placement's parameter step otherwise."""
    if fit.search is not None:
        return fit.search.seconds if math.isfinite(fit.search.seconds) else None
    return placed_step(model, unit_costs(model, [0] * len(model.sizes)), fit.placement, machine).seconds
