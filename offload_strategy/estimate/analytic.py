"""A profile computed from a model's shapes and a ``HardwareSpec``, for models and machines that are
not at hand (the model can live on the meta device: nothing is allocated or run).

Each unit's forward costs 2 FLOPs per parameter per token for every module that multiplies by it
(a linear layer, or an output head tied to an embedding); an embedding lookup costs none. Backward
costs twice forward. Time is FLOPs over the GPU's dense peak at ``efficiency`` (model FLOPs
utilisation). Attention's sequence-squared work is not attached to parameters and is left out of
the units' times (the blocks' costs below include it). The CPU optimizer updates 0.8 G parameters
per second per core (fused AdamW measured so on the development machine), at most what the memory
channels move (``HardwareSpec.host_memory_gbps``): Adam reads the master, its gradient and two
states and writes back the master and the states, 28 bytes per fp32 parameter, and writes the
16-bit copy of a 16-bit one (:func:`cpu_update_rate`).

Direct host access (MemFerry §III-B, Fig. 3): a unit computed in place on pinned host memory reads
its parameters over the host -> GPU link while it computes. An embedding reads only the rows it
looks up; a matrix is re-read by every tile of ``DHA_TILE_TOKENS`` tokens of a GEMM (the GPU cannot
cache it across tiles), and vectors (norms, biases) are read once. So DHA takes
``max(compute, bytes read / link)``, against the copy plus the compute for on-GPU execution
(GFGB): an embedding is cheaper read in place, a norm costs the same either way (its bytes
cross once; the copy's launch is not priced), a large GEMM far more in place.

Memory-bound work (the roofline's other side): the element-wise operations, norms, the loss's
softmax and copies run at the GPU's memory bandwidth, not its tensor cores. Each such operation
of the meta forward moves its inputs and outputs once through GPU memory (views and allocations
move nothing; matrix products are priced by FLOPs); its time is those bytes at
``GPU_MEMORY_SHARE`` of the datasheet's bandwidth (``HardwareSpec.gpu_memory_gbps``; unknown: not
priced). Backward moves twice what forward does, as its FLOPs are twice forward's. Per token this
is a fixed count of bytes per hidden unit (a block of Hugging Face's GPT-2 moves about 218 bytes
per token per unit of width in bf16 with dropout on, Mistral's about 156) against FLOPs that grow
with the width squared, so narrow models lose a larger share of their step to it than wide ones.
A matrix product takes the longer of its FLOPs at ``efficiency`` and its operands' and result's
bytes at the memory bandwidth: with many tokens the first (every point of the papers' tables),
with few tokens against a large weight the second (a batch of a few tokens reads the whole weight
for little arithmetic), which is how the step's efficiency falls with the batch.
:func:`attach_unattributed` spreads each block's time beyond its units' matrix products
(attention's and this) over the block's units, so that the step model computes for as long.

Block activations (:func:`analytic_compute`) come from one forward of the model on the meta device:
what autograd saves inside each block (parameters excluded, as the runtime's accounting does; each
storage once, however many operations save it or views of it), the
block's input (what a checkpoint keeps), and the FLOPs the block runs (attention included), all
from shapes without allocating anything. Attention through ``scaled_dot_product_attention`` is
counted as the fused kernels a GPU runs it with (FlashAttention): they save the query, key, value,
output and one fp32 log-sum-exp per query row, never the sequence-squared score matrix that the
meta device's reference path would save; their FLOPs are the two matrix products.

Mixed precision (``bf16-mixed``, ``16-mixed``): ``torch.autocast`` casts nothing on the meta device,
so :class:`Autocast` makes its casts above autograd, as autocast does: matrix products run on
16-bit casts of their fp32 inputs (a parameter's cast is a new tensor autograd keeps for backward,
2 bytes per weight of every product in a kept block), and reductions, norms, softmax and losses on
fp32 casts of 16-bit inputs (PyTorch's "Autocast Op Reference" lists for CUDA; for the CPU's, which
``tools/validate_activations.py`` checks the emulation against a real forward with, see
``AUTOCAST_CPU``). The runtime counts the same casts: they are saved tensors outside its buffers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import FlopCounterMode, flop_registry, shape_wrapper

from ..config import HardwareSpec
from ..planning.activations import BesideBlocks, BlockCost
from ..planning.cost_model import UNKNOWN_LINK
from ..runtime.units import TransferUnit

CPU_PARAMS_PER_S_PER_CORE = 0.8e9
ADAM_BYTES_PER_PARAMETER = 28  # fp32: master, gradient, two states read; master and states written
DHA_TILE_TOKENS = 128  # rows of a GEMM's output tile: each such tile reads the whole weight once
# the share of the datasheet's memory bandwidth that PyTorch's eager element-wise kernels reach:
# an assumption, not a measurement here (`offload-strategy probe` prints a GPU-memory copy's share to check
# it on a GPU; the reproduction's count of points within 20% is the same at 70% and 90%)
GPU_MEMORY_SHARE = 0.8


@dataclass(frozen=True)
class AnalyticUnit:
    name: str
    nbytes: int
    trainable_bytes: int
    parameters: int
    forward_flops: float
    forward_seconds: float
    backward_seconds: float
    update_seconds: float
    transfer_seconds: float = 0.0  # the copy into the GPU tier
    dha_read_bytes: int = 0  # what computing on it in host memory reads over the link
    dha_forward_seconds: float = 0.0  # forward computed in place on host memory (MemFerry's DHA)


def analytic_units(
    units: list[TransferUnit],
    users: dict[nn.Module, list[TransferUnit]],
    tokens: int,
    hardware: HardwareSpec,
    dtype: str = "bf16",
    efficiency: float = 0.5,
) -> list[AnalyticUnit]:
    """Per-unit costs of one step of ``tokens`` tokens, in the units' order."""
    peak = hardware.peak_flops(dtype)
    if not peak:
        raise ValueError(f"hardware {hardware.name!r} gives no {dtype} peak FLOP/s; set gpu_{dtype}_tflops to model it.")
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency={efficiency!r} must lie in (0, 1].")
    multiplies: dict[int, int] = {u.index: 0 for u in units}
    for module, used in users.items():
        if isinstance(module, nn.Embedding):
            continue
        for u in used:
            multiplies[u.index] += 1
    link = hardware.h2d_gbps * 1e9 if hardware.h2d_gbps else UNKNOWN_LINK
    reads = dha_read_bytes(units, users, tokens)
    routed = routed_shares(users)
    out = []
    for u in units:
        matrix = sum(p.numel() * routed.get(id(p), 1.0) for p in u.params if p.dim() >= 2)
        flops = 2.0 * matrix * tokens * multiplies[u.index]
        forward = flops / (peak * efficiency)
        trainable = sum(p.numel() for p in u.trainable)
        read = reads[u.index]
        out.append(
            AnalyticUnit(
                name=u.name,
                nbytes=u.nbytes,
                trainable_bytes=sum(p.numel() * p.element_size() for p in u.trainable),
                parameters=sum(p.numel() for p in u.params),
                forward_flops=flops,
                forward_seconds=forward,
                backward_seconds=2 * forward,
                update_seconds=trainable / cpu_update_rate(hardware, _low_precision_bytes(u)),
                transfer_seconds=u.nbytes / link,
                dha_read_bytes=read,
                dha_forward_seconds=max(forward, read / link),
            )
        )
    return out


def routed_shares(modules: Iterable[nn.Module]) -> dict[int, float]:
    """id(parameter) -> the share of it each token multiplies, for a mixture of experts' stacked
    expert matrices (leading dimension ``num_experts``): a token meets ``top_k`` of them, the
    ``top_k`` its router (a module with ``top_k`` and the same ``num_experts``) sends it to."""
    modules = list(modules)
    top_k = {m.num_experts: m.top_k for m in modules if isinstance(getattr(m, "top_k", None), int) and isinstance(getattr(m, "num_experts", None), int)}
    shares = {}
    for module in modules:
        experts = getattr(module, "num_experts", None)
        if experts not in top_k or getattr(module, "top_k", None) is not None:
            continue  # not an experts module, or the router itself (every token meets all of it)
        for p in module.parameters(recurse=False):
            if p.dim() >= 3 and p.shape[0] == experts:
                shares[id(p)] = top_k[experts] / experts
    return shares


def cpu_update_rate(hardware: HardwareSpec, copy_bytes: int = 0) -> float:
    """Parameters per second the CPU optimizer updates: every core's rate, bounded by what the
    memory channels move at ``ADAM_BYTES_PER_PARAMETER`` (plus ``copy_bytes`` for the 16-bit copy
    written back) per parameter. Without a known memory bandwidth, the cores' rate alone."""
    rate = CPU_PARAMS_PER_S_PER_CORE * max(hardware.cpu_cores, 1)
    if hardware.host_memory_gbps:
        rate = min(rate, hardware.host_memory_gbps * 1e9 / (ADAM_BYTES_PER_PARAMETER + copy_bytes))
    return rate


def _low_precision_bytes(unit: TransferUnit) -> int:
    """Bytes of the 16-bit copy written back per parameter (0 when the parameters are the masters)."""
    sizes = {p.element_size() for p in unit.trainable}
    return min(sizes) if sizes and min(sizes) < 4 else 0


def dha_read_bytes(units: list[TransferUnit], users: dict[nn.Module, list[TransferUnit]], tokens: int) -> dict[int, int]:
    """Bytes each unit's forward reads over the link when computed in place on host memory (see
    the module docstring): looked-up rows for an embedding, a matrix once per GEMM tile, vectors once."""
    tiles = max(1, math.ceil(tokens / DHA_TILE_TOKENS))
    owner = {id(p): u for u in units for p in u.params}
    reads = {u.index: 0 for u in units}
    for module, used in users.items():
        for p in module.parameters(recurse=False):
            u = owner.get(id(p))
            if u is None or u not in used:
                continue
            row = p.element_size() * (p.numel() // max(p.shape[0], 1)) if p.dim() >= 2 else 0
            if isinstance(module, nn.Embedding):
                reads[u.index] += min(tokens, p.shape[0]) * row
            elif p.dim() >= 2:
                reads[u.index] += tiles * p.numel() * p.element_size()
            else:
                reads[u.index] += p.numel() * p.element_size()
    return reads


@dataclass(frozen=True)
class AnalyticCompute:
    """A forward's GPU time from shapes: each block's costs, and the time outside every block (the
    embedding, the head and the loss)."""

    blocks: list[BlockCost]
    outside_forward_seconds: float
    forward_flops: float  # the whole forward's, attention's products included
    # kept for backward outside every block (the embeddings', the head's input, the loss's
    # log-softmax), as the runtime measures it in the profiled steps
    outside_activation_bytes: int = 0
    largest_saved_bytes: int = 0  # the largest tensor saved, in a block or outside: the backward's gradients are twice it
    outside_after_bytes: int = 0  # of the outside bytes, those saved after the last block (freed by the head's backward)
    largest_through_blocks_bytes: Optional[int] = None  # the largest saved by the last block's end (None: not apart)
    block_flops: tuple[float, ...] = ()  # each block's forward FLOPs (attention's products included), what recomputing it runs again

    @property
    def beside(self) -> BesideBlocks:
        """What every layout of the blocks is planned beside, as the runtime plans it."""
        through = None if self.largest_through_blocks_bytes is None else 2 * self.largest_through_blocks_bytes
        return BesideBlocks(self.outside_activation_bytes, 2 * self.largest_saved_bytes, self.outside_after_bytes, through)


def analytic_compute(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    forward: Callable[[], Any],
    hardware: HardwareSpec,
    dtype: str = "bf16",
    efficiency: float = 0.5,
    autocast: Optional["Autocast"] = None,
    fused_attention: bool = True,
) -> AnalyticCompute:
    """Each block's activation bytes, input bytes and forward time, and the forward time outside
    the blocks, from one call of ``forward`` (which runs ``model`` on meta-device inputs; see the
    module docstring): FLOPs at ``efficiency`` of the dense peak plus the memory-bound bytes at
    ``GPU_MEMORY_SHARE`` of the memory bandwidth. ``autocast``: the forward runs under mixed
    precision, its casts made by this mode. ``fused_attention``: attention saves what a GPU's
    fused kernel keeps; without, what torch's own kernel saves on the meta device (its math path,
    as a CPU runs it)."""
    peak = hardware.peak_flops(dtype)
    if not peak:
        raise ValueError(f"hardware {hardware.name!r} gives no {dtype} peak FLOP/s; set gpu_{dtype}_tflops to model it.")
    bandwidth = hardware.gpu_memory_gbps * 1e9 * GPU_MEMORY_SHARE if hardware.gpu_memory_gbps else math.inf

    def seconds(flops: float, moved: float) -> float:
        return flops / (peak * efficiency) + moved / bandwidth

    meter = _BlockMeter(model, len(blocks), autocast)
    if math.isfinite(bandwidth):
        meter.traffic.rates = (peak * efficiency, bandwidth)
    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(meter.pre(index), with_kwargs=True))
        handles.append(block.register_forward_hook(meter.post(index), with_kwargs=True))
    reference = torch.nn.functional.scaled_dot_product_attention
    if fused_attention:
        torch.nn.functional.scaled_dot_product_attention = meter.attention
    try:
        with torch.autograd.graph.saved_tensors_hooks(meter.pack, lambda t: t), meter.counter, meter.traffic, autocast or contextlib.nullcontext():
            forward()
    finally:
        torch.nn.functional.scaled_dot_product_attention = reference
        for handle in handles:
            handle.remove()
    costs = [BlockCost(activation_bytes=s, input_bytes=i, forward_seconds=seconds(f + a, m) + e)
             for s, i, f, a, m, e in zip(meter.saved, meter.inputs, meter.flops, meter.fused, meter.moved, meter.excess)]
    outside_flops = meter.counter.get_total_flops() - sum(meter.flops)
    outside_moved = meter.traffic.total - sum(meter.moved)
    outside_excess = max(meter.traffic.excess - sum(meter.excess), 0.0)
    total_flops = meter.counter.get_total_flops() + sum(meter.fused)
    return AnalyticCompute(costs, seconds(max(outside_flops, 0), max(outside_moved, 0)) + outside_excess, total_flops,
                           meter.outside_saved, meter.largest_saved, meter.outside_after, meter.largest_through_blocks,
                           tuple(f + a for f, a in zip(meter.flops, meter.fused)))


def attach_unattributed(
    costs: Sequence[AnalyticUnit], block_units: Sequence[Sequence[int]], compute: AnalyticCompute,
) -> list[AnalyticUnit]:
    """The units' costs with the compute no parameter accounts for (attention's products, the
    memory-bound work) added to the units that run beside it: each block's time beyond its units'
    matrix products over that block's units, the time outside blocks over the other units, each
    share in proportion to the units' own forward time (evenly where they have none). Backward
    gets twice what forward gets; so does a unit computed in place on host memory (the work runs
    on the GPU either way). ``block_units``: each block's unit indices, as ``costs`` orders them."""
    extra = [0.0] * len(costs)
    inside = {i for units in block_units for i in units}
    groups = [(list(units), block.forward_seconds) for units, block in zip(block_units, compute.blocks)]
    groups.append(([i for i in range(len(costs)) if i not in inside], compute.outside_forward_seconds))
    for units, seconds in groups:
        own = sum(costs[i].forward_seconds for i in units)
        surplus = seconds - own
        if not units or surplus <= 0:
            continue
        for i in units:
            extra[i] += surplus * (costs[i].forward_seconds / own if own > 0 else 1 / len(units))
    return [
        dataclasses.replace(c, forward_seconds=c.forward_seconds + e, backward_seconds=c.backward_seconds + 2 * e,
                            dha_forward_seconds=c.dha_forward_seconds + e) if e else c
        for c, e in zip(costs, extra)
    ]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _BlockMeter:
    """What each block saves for backward (parameters aside), its input's bytes, its FLOPs and
    the bytes its memory-bound operations move, from hooks around the blocks, saved-tensor hooks
    and two dispatch modes over the forward."""

    def __init__(self, model: nn.Module, count: int, autocast: Optional["Autocast"] = None) -> None:
        self.autocast = autocast
        self.parameters = {id(p) for p in model.parameters()}
        self.saved, self.inputs, self.flops, self.moved = [0] * count, [0] * count, [0] * count, [0] * count
        self.excess = [0.0] * count  # seconds memory-bound matrix products take beyond their FLOPs
        self.fused = [0] * count  # fused attention's FLOPs, which the counter does not see
        # each block's saved storages: a tensor saved by several operations, or views of one
        # output (a fused projection split into query, key and value), hold its memory once
        self.held: list[dict[int, Any]] = [{} for _ in range(count)]
        self.outside_held: dict[int, Any] = {}  # the same, outside every block (a storage a block saved is the block's)
        self.outside_saved = 0
        self.largest_saved = 0
        self.count = count
        self.outside_after = 0  # ... of it, saved once the last block had run
        self.largest_through_blocks: Optional[int] = None  # the largest saved when the last block ended
        self.current: list[int] = []  # the block running now (innermost last)
        self.counter = FlopCounterMode(display=False, custom_mapping=_COUNTED_APART)
        self.traffic = _MemoryTraffic()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        is_parameter = id(t) in self.parameters or (t._base is not None and id(t._base) in self.parameters)
        if is_parameter:
            return t
        storage = t.untyped_storage()
        self.largest_saved = max(self.largest_saved, min(_nbytes(t), storage.nbytes()))
        if self.current:
            block = self.current[-1]
            if storage._cdata not in self.held[block]:
                self.held[block][storage._cdata] = storage  # held, so that its address is not reused meanwhile
                self.saved[block] += storage.nbytes()
        elif storage._cdata not in self.outside_held and not any(storage._cdata in held for held in self.held):
            self.outside_held[storage._cdata] = storage
            self.outside_saved += storage.nbytes()
            self.outside_after += storage.nbytes() if self.largest_through_blocks is not None else 0
        return t

    def pre(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            self.inputs[index] = _nbytes(first) if first is not None else 0
            self.flops[index] -= self.counter.get_total_flops()
            self.moved[index] -= self.traffic.total
            self.excess[index] -= self.traffic.excess
            self.current.append(index)
        return hook

    def post(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            self.flops[index] += self.counter.get_total_flops()
            self.moved[index] += self.traffic.total
            self.excess[index] += self.traffic.excess
            self.current.pop()
            if index == self.count - 1 and not self.current:
                self.largest_through_blocks = self.largest_saved
        return hook

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.current:
            # QK^T and PV: 2 FLOPs per multiply-add, over every query row and key
            self.fused[self.current[-1]] += 4 * query.shape[:-1].numel() * key.shape[-2] * query.shape[-1]
        # the fused kernel reads the query, key and value and writes the output and the log-sum-exp
        if self.autocast is not None:  # attention is one of autocast's matrix products
            query, key, value = self.autocast.lower((query, key, value))
        self.traffic.total += 2 * _nbytes(query) + _nbytes(key) + _nbytes(value) + 4 * query.shape[:-1].numel()
        return _FusedAttention.apply(query, key, value)


_MATRIX_PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm", "convolution", "_grouped_mm"}


def grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of ``torch._grouped_mm`` (mixture-of-experts layers: rows routed to experts, each
    multiplied by its expert's matrix only), which torch's counter leaves out: every output element
    is one dot product over the contraction. With a 2-D second operand the groups split the
    contraction, so each output row and column still meets it once per group."""
    contraction = a_shape[-1]
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * out_shape[-2] * out_shape[-1] * contraction
    return 2 * math.prod(out_shape) * contraction


_COUNTED_APART = {torch.ops.aten._grouped_mm: grouped_mm_flops}
_ALLOCATIONS = {"empty", "new_empty", "empty_like", "empty_strided", "new_empty_strided"}


class _MemoryTraffic(TorchDispatchMode):
    """The bytes memory-bound operations move: each operation's tensor inputs and outputs once.
    Matrix products are priced by their FLOPs, and views and allocations move nothing; an
    embedding lookup reads only the rows it returns. With ``rates`` (FLOP/s, bytes/s) a matrix
    product that moves its operands for longer than it computes (few tokens against a large
    weight: the roofline's memory side) adds the difference to ``excess``."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.excess = 0.0
        self.rates: Optional[tuple[float, float]] = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if name in _MATRIX_PRODUCTS:
            self._roofline(func, args, kwargs or {}, out)
            return out
        if name in _ALLOCATIONS:
            return out
        outputs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if name == "embedding":
            self.total += 2 * sum(_nbytes(t) for t in outputs)
            return out
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage()._cdata for t in inputs}
        if not func._schema.is_mutable and any(t.untyped_storage()._cdata in storages for t in outputs):
            return out  # a view of an input
        self.total += sum(_nbytes(t) for t in (*inputs, *outputs))
        return out


    def _roofline(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        count = flop_registry.get(func._overloadpacket) or _counted_apart(func._overloadpacket)
        if self.rates is None or count is None:
            return
        flop_rate, byte_rate = self.rates
        moved = sum(_nbytes(t) for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor))
        self.excess += max(0.0, moved / byte_rate - count(*args, **kwargs, out_val=out) / flop_rate)


def _counted_apart(op: Any) -> Optional[Callable[..., int]]:
    formula = _COUNTED_APART.get(op)
    return None if formula is None else shape_wrapper(formula)


class _FusedAttention(torch.autograd.Function):
    """What a fused attention kernel keeps for backward (see the module docstring), by shape only."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        row_logsumexp = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, row_logsumexp)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        query, key, value, _, _ = ctx.saved_tensors
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)


# torch.autocast's op lists by function name (PyTorch's "Autocast Op Reference"): what runs in the
# 16-bit type, and what in fp32, on a GPU ...
AUTOCAST_CUDA = (
    frozenset({"__matmul__", "__rmatmul__", "addbmm", "addmm", "addmv", "addr", "baddbmm", "bmm", "chain_matmul", "multi_dot", "conv1d", "conv2d",
               "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "linear", "matmul", "mm", "mv", "prelu", "einsum",
               "scaled_dot_product_attention"}),
    frozenset({"__pow__", "__rdiv__", "__rpow__", "__rtruediv__", "acos", "asin", "binary_cross_entropy_with_logits", "cosh",
               "cosine_embedding_loss", "cdist", "cosine_similarity", "cross_entropy", "cumprod", "cumsum", "dist", "erfinv", "exp", "expm1",
               "group_norm", "hinge_embedding_loss", "kl_div", "l1_loss", "layer_norm", "log", "log_softmax", "log10", "log1p", "log2",
               "margin_ranking_loss", "mse_loss", "multilabel_margin_loss", "multi_margin_loss", "nll_loss", "norm", "normalize", "pdist",
               "poisson_nll_loss", "pow", "prod", "reciprocal", "rsqrt", "sinh", "smooth_l1_loss", "soft_margin_loss", "softmax", "softmin",
               "softplus", "sum", "renorm", "tan", "triplet_margin_loss"}),
)
# ... and on the CPU, whose fp32 list leaves norms, softmax and powers in the 16-bit type
AUTOCAST_CPU = (
    frozenset({"__matmul__", "__rmatmul__", "conv1d", "conv2d", "conv3d", "bmm", "mm", "baddbmm", "addmm", "addbmm", "linear", "matmul",
               "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu", "scaled_dot_product_attention"}),
    frozenset({"binary_cross_entropy", "cdist", "mse_loss", "cosine_embedding_loss", "nll_loss", "hinge_embedding_loss", "poisson_nll_loss",
               "smooth_l1_loss", "cross_entropy", "l1_loss", "huber_loss", "margin_ranking_loss", "soft_margin_loss", "triplet_margin_loss",
               "multi_margin_loss", "kl_div", "multilabel_margin_loss", "binary_cross_entropy_with_logits", "prod", "trace"}),
)


class Autocast(TorchFunctionMode):
    """``torch.autocast``'s casts where autocast makes none (meta tensors), above autograd as it
    makes them, so that what autograd saves is the cast: an op of the 16-bit list gets its fp32
    tensor arguments cast to ``dtype``, one of the fp32 list its 16-bit ones cast to fp32; an op
    given an explicit ``dtype=`` is left alone, as autocast leaves it (see the module docstring).
    ``lists``: the device's (lower, fp32) op names, ``AUTOCAST_CUDA`` or ``AUTOCAST_CPU``."""

    def __init__(self, dtype: torch.dtype, lists: tuple[frozenset[str], frozenset[str]] = AUTOCAST_CUDA) -> None:
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"autocast runs in bfloat16 or float16, not {dtype}.")
        self.dtype = dtype
        self.lower_ops, self.fp32_ops = lists

    def lower(self, tree: Any) -> Any:
        """``tree`` with its fp32 tensors cast to the 16-bit type."""
        return tree_map(lambda t: t.to(self.dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t, tree)

    @staticmethod
    def widen(tree: Any) -> Any:
        """``tree`` with its 16-bit tensors cast to fp32."""
        return tree_map(lambda t: t.float() if isinstance(t, torch.Tensor) and t.dtype in (torch.bfloat16, torch.float16) else t, tree)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if kwargs.get("dtype") is None:
            if name in self.lower_ops:
                args, kwargs = self.lower((args, kwargs))
            elif name in self.fp32_ops:
                args, kwargs = self.widen((args, kwargs))
        return func(*args, **kwargs)
