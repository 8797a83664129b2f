"""A model as the step model sees it, from its shapes: built on the meta device (nothing allocated
or run), its units costed from their shapes and a ``HardwareSpec``, its blocks' activations from
one forward on the meta device (``estimate/analytic.py``). Used by :func:`offload_strategy.estimate`, the
``offload-strategy`` command, and the repository's simulation and planning tools."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..config import HardwareSpec
from ..planning.activations import BesideBlocks, Links
from ..planning.cost_model import Machine, StepPrediction, UnitCost, simulate_step
from ..planning.placement import GPU, NVME, Placement, UnitSize
from ..runtime.activations.policies import find_blocks
from ..runtime.units import build_units
from .analytic import Autocast, analytic_compute, analytic_units, attach_unattributed

STATE_FACTOR = 2.0  # Adam: two states per parameter


@dataclass
class ShapeModel:
    """Everything the predictions need about the model, built once."""

    name: str
    units: list  # TransferUnit
    costs: list  # AnalyticUnit, one per unit
    sizes: list  # UnitSize, one per unit
    co_resident: list[list[int]]
    block_units: list[list[int]]
    blocks: list  # BlockCost at the configured batch
    tokens: int
    batch_size: int
    state_factor: float
    parameters: int
    forward_flops: float = 0.0  # one forward's, attention's products included
    block_flops: tuple[float, ...] = ()  # each block's share of it: what recomputing the block runs again
    # what every layout of the blocks is planned beside, as the runtime plans it: the activations
    # kept outside the blocks (the logits' log-softmax...) and the backward's gradients
    beside: BesideBlocks = BesideBlocks()

    @property
    def compute_seconds(self) -> float:
        """The GPU's compute alone a step: every unit's forward and backward, nothing recomputed, nothing waited on."""
        return sum(c.forward_seconds + c.backward_seconds for c in self.costs)

    @property
    def outside_bytes(self) -> int:
        return self.beside.outside

    @property
    def gradient_bytes(self) -> int:
        return self.beside.gradients

    def deeper(self, depth: int) -> "ShapeModel":
        """This model with ``depth`` copies of its first block, units renumbered in execution
        order (the units before the blocks, each copy's, the rest), for capacity searches. Its
        ``units`` are left empty: the predictions need the sizes and costs only."""
        first = self.block_units[0]
        in_blocks = {i for units in self.block_units for i in units}
        start = min(in_blocks)
        before = [s.index for s in self.sizes if s.index not in in_blocks and s.index < start]
        after = [s.index for s in self.sizes if s.index not in in_blocks and s.index > start]
        order = [*before, *(i for _ in range(depth) for i in first), *after]
        copy_of = [[len(before) + b * len(first) + k for k in range(len(first))] for b in range(depth)]
        outside = {old: len(before) + depth * len(first) + k for k, old in enumerate(after)} | {old: k for k, old in enumerate(before)}
        position = {old: k for k, old in enumerate(first)}
        groups = [[outside[i] for i in g] for g in self.co_resident if not set(g) & in_blocks]
        groups += [[copy[position[i]] for i in g] for copy in copy_of for g in self.co_resident if set(g) <= set(first)]
        return dataclasses.replace(
            self, units=[], costs=[self.costs[i] for i in order],
            sizes=[dataclasses.replace(self.sizes[i], index=k) for k, i in enumerate(order)],
            co_resident=groups, block_units=copy_of, blocks=[self.blocks[0]] * depth,
            parameters=sum(self.costs[i].parameters for i in order), forward_flops=0.0, block_flops=self.block_flops[:1] * depth,
        )



def head_recomputed(costs: list, head_units: list) -> list:
    """Under a loss computed in chunks (``model.loss_chunk_tokens``) backward runs each chunk's
    head and cross-entropy again: the head's units' forward (with its share of the loss's
    memory-bound work) once more in backward."""
    again = {u.index for u in head_units}
    return [dataclasses.replace(c, backward_seconds=c.backward_seconds + c.forward_seconds) if i in again else c for i, c in enumerate(costs)]


@dataclass(frozen=True)
class Pricing:
    """How a shape model's work is priced: the machine, the dtype matrix products run in
    (``bf16``, ``fp16``, ``fp32``), the share of the GPU's dense peak they reach, 16-bit
    parameters (``*-true``), and autocast's casts (``*-mixed``)."""

    hardware: HardwareSpec
    dtype: str = "bf16"
    efficiency: float = 0.5
    half: bool = False
    mixed: bool = False
    state_factor: float = STATE_FACTOR  # the optimizer's state bytes per parameter byte
    fused_attention: bool = True  # attention saves what a GPU's fused kernel keeps (a CPU's: torch's math path)


def shape_model(module: nn.Module, forward: Callable[[], Any], pricing: Pricing, *, name: str, tokens: int, batch_size: int,
                head: Optional[nn.Module] = None) -> ShapeModel:
    """The step model's view of ``module`` (on the meta device) and one training step's forward
    ``forward()`` of ``tokens`` tokens; ``head``: an output head whose forward the loss runs again
    in backward (a loss computed in chunks)."""
    units, users = build_units(module)
    costs = analytic_units(units, users, tokens, pricing.hardware, dtype=pricing.dtype, efficiency=pricing.efficiency)
    blocks = find_blocks(module)
    autocast = Autocast(torch.float16 if pricing.dtype == "fp16" else torch.bfloat16) if pricing.mixed and pricing.dtype != "fp32" else None
    compute = analytic_compute(module, blocks, forward, pricing.hardware, dtype=pricing.dtype, efficiency=pricing.efficiency, autocast=autocast,
                               fused_attention=pricing.fused_attention)
    inside = [{id(m) for m in block.modules()} for block in blocks]
    block_units = [sorted({u.index for m, used in users.items() if id(m) in ids_ for u in used}) for ids_ in inside]
    costs = attach_unattributed(costs, block_units, compute)  # attention's products and the memory-bound work
    if head is not None:
        costs = head_recomputed(costs, users.get(head, []))
    # under *-true gradients, states and masters are fp32 (twice the 16-bit bytes); gradients land in 16 bits first
    widen = 2 if pricing.half else 1
    return ShapeModel(
        name=name, units=units, costs=costs,
        sizes=[UnitSize(u.index, u.nbytes, c.trainable_bytes * widen, landing_bytes=u.nbytes if pricing.half and c.trainable_bytes else 0)
               for u, c in zip(units, costs)],
        co_resident=[[u.index for u in used] for used in users.values()], block_units=block_units, blocks=compute.blocks,
        tokens=tokens, batch_size=batch_size, state_factor=pricing.state_factor + (1.0 if pricing.half else 0.0),
        parameters=sum(c.parameters for c in costs), forward_flops=compute.forward_flops, block_flops=compute.block_flops, beside=compute.beside,
    )


def unit_costs(model: ShapeModel, owners: Sequence[int]) -> dict[int, UnitCost]:
    """The step model's cost of each unit (``owners``: each unit's rank under sharded states, 0 for this one)."""
    return {
        size.index: UnitCost(
            nbytes=size.nbytes, forward_seconds=c.forward_seconds, backward_seconds=c.backward_seconds,
            gradient_bytes=size.nbytes if c.trainable_bytes else 0, update_seconds=c.update_seconds, owned=owners[size.index] == 0,
            reduced_bytes=size.reduced_bytes,  # as the runtime reduces them: 16-bit gradients in 16 bits
        )
        for c, size in zip(model.costs, model.sizes)
    }


def placed_step(model: ShapeModel, costs: dict[int, UnitCost], placement: Placement, machine: Machine) -> StepPrediction:
    """The step model's prediction for the parameters as ``placement`` homes them: NVMe units
    read and write their states there, persistent units update in the GPU tier."""
    step_units = [
        dataclasses.replace(
            costs[size.index], home=placement.home[size.index],
            state_bytes=int(size.trainable_bytes * model.state_factor) if placement.home[size.index] == NVME else 0,
            update_seconds=0.0 if placement.home[size.index] == GPU else costs[size.index].update_seconds,
        )
        for size in model.sizes
    ]
    return simulate_step(step_units, placement.device_slots, machine, placement.host_copies)


def streamed_bytes(model: ShapeModel, placement: Placement) -> int:
    """The offloaded units' bytes: what forward copies into the GPU tier once."""
    return sum(model.sizes[i].nbytes for i, h in placement.home.items() if h != GPU)


def parameter_links(machine: Machine, streamed: int) -> Links:
    """The links activation swaps use, with ``streamed`` parameter bytes crossing host -> GPU in each pass."""
    return Links.beside(machine, streamed)
