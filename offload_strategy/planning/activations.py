"""What each block does with its activations: the interleaved layout and the search that sizes it.

Pure functions on measured block costs:

- :func:`interleaved_layout` is ProTrain's block layout (§3.1.2, Fig. 2): swap blocks early, each
  followed by its share of checkpointed blocks, kept blocks last. Swapping early gives the copies
  the most forward compute to hide behind; interleaving checkpointed blocks between swapped ones
  keeps swapped activations from piling up in the GPU tier; kept blocks last are consumed first
  by backward, which leaves time to bring the swapped ones back.
- :func:`step_seconds` is LoHan's overlapped step-time model (§IV-B, Eq. 2 and 5) applied to a
  layout: each pass takes as long as its busiest resource (compute, either PCIe direction, the
  SSD), recomputation adds to backward compute, swapped activations add to both PCIe directions,
  and the part that host memory cannot hold adds to the SSD (Eq. 3: α·A = A − MEM_avail).
- :func:`choose_layout` is ProTrain's search (§3.3) over the two counts (swapped blocks,
  checkpointed blocks): every pair is laid out, its peak checked against the GPU-tier budget for
  activations, and the fastest that fits wins (fewer managed blocks on a tie).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from ..config import BlockPolicy, format_bytes
from .cost_model import Bandwidth, move_seconds

KEEP, CHECKPOINT, SWAP_HOST, SWAP_NVME = BlockPolicy.KEEP, BlockPolicy.CHECKPOINT, BlockPolicy.SWAP_HOST, BlockPolicy.SWAP_NVME
CHECKPOINT_HOST = BlockPolicy.CHECKPOINT_HOST
RECOMPUTED = (CHECKPOINT, CHECKPOINT_HOST)  # recomputed in backward: the block's units are needed together there
SWAPPED = (SWAP_HOST, SWAP_NVME)


def recomputes(layout: Sequence[str]) -> bool:
    """Whether ``layout`` recomputes any block."""
    return any(p in RECOMPUTED for p in layout)


@dataclass(frozen=True)
class BlockCost:
    """One block, as profiled: what it saves for backward, what a checkpoint of it saves, its forward time."""

    activation_bytes: int
    input_bytes: int
    forward_seconds: float

    def held_bytes(self, policy: str) -> int:
        """GPU-tier bytes the block holds from its forward to its backward under ``policy``."""
        return self.activation_bytes if policy == KEEP else self.input_bytes if policy == CHECKPOINT else 0

    def moved_bytes(self, policy: str) -> int:
        """Bytes the block copies out of the GPU tier after its forward and back before its
        backward: its activations when swapped, its input when recomputed from host memory."""
        return self.activation_bytes if policy in SWAPPED else self.input_bytes if policy == CHECKPOINT_HOST else 0

    def host_bytes(self, policy: str) -> int:
        """Host memory the block takes from its forward to its backward under ``policy``."""
        return self.activation_bytes if policy == SWAP_HOST else self.input_bytes if policy == CHECKPOINT_HOST else 0


@dataclass(frozen=True)
class Links(Bandwidth):
    """The links activation swaps use, and the parameter traffic already planned on them."""

    parameter_forward_seconds: float = 0.0  # host -> GPU tier parameter copies in forward
    parameter_backward_seconds: float = 0.0
    # LoHan's model states on the SSDs (Eq. 2 and 5): gradients GPU -> host in backward, the SSD
    # busy in forward (16-bit parameters read) and backward (states read and written back)
    gradient_backward_seconds: float = 0.0
    nvme_forward_seconds: float = 0.0
    nvme_backward_seconds: float = 0.0
    # bytes of the NVMe budget the parameters' placement leaves for swapped activations (None: no bound)
    nvme_room: Optional[int] = None

    @classmethod
    def beside(cls, links: Bandwidth, streamed_bytes: int = 0, nvme_room: Optional[int] = None) -> "Links":
        """``links`` with ``streamed_bytes`` of parameters crossing host -> GPU tier in forward and
        again in backward, and ``nvme_room`` bytes of NVMe for swapped activations."""
        seconds = streamed_bytes / links.h2d if streamed_bytes else 0.0
        return cls(
            h2d=links.h2d, d2h=links.d2h, nvme_read=links.nvme_read, nvme_write=links.nvme_write,
            parameter_forward_seconds=seconds, parameter_backward_seconds=seconds, nvme_room=nvme_room,
        )

    def holds_on_nvme(self, nbytes: int) -> bool:
        """Whether ``nbytes`` of swapped activations may go to NVMe: a link to it, and room in its budget."""
        return nbytes <= 0 or (self.nvme_write > 0 and (self.nvme_room is None or nbytes <= self.nvme_room))

    @classmethod
    def lohan(cls, links: Bandwidth, parameters: int) -> "Links":
        """LoHan's setting (§IV-D, Eq. 2 and 5) for ``parameters`` 16-bit parameters whose model
        states live on the SSDs: forward copies each parameter in (2 bytes) after reading it from
        the SSD; backward copies it in again and its gradient out (2 bytes each way), and the
        optimizer reads and writes back 14 bytes of states per parameter on the SSD. Without an
        SSD link the states stay in host memory and only the link terms remain."""
        p = 2 * parameters
        copy_in = p / links.h2d if links.h2d else 0.0
        on_ssd = links.nvme_read > 0 and links.nvme_write > 0
        return cls(
            h2d=links.h2d, d2h=links.d2h, nvme_read=links.nvme_read, nvme_write=links.nvme_write,
            parameter_forward_seconds=copy_in, parameter_backward_seconds=copy_in,
            gradient_backward_seconds=p / links.d2h if links.d2h else 0.0,
            nvme_forward_seconds=p / links.nvme_read if on_ssd else 0.0,
            nvme_backward_seconds=7 * p / links.nvme_read + 7 * p / links.nvme_write if on_ssd else 0.0,
        )


@dataclass(frozen=True)
class BesideBlocks:
    """GPU-tier bytes no block's policy changes, planned beside every layout of the blocks:

    - ``outside``: what the forward keeps for backward outside every block (the embeddings'
      output, the head's input, the loss's log-softmax);
    - ``gradients``: the backward's working memory at its largest, twice the largest tensor the
      forward saved. An operation's backward holds the gradient of its output and makes the
      gradient of its input, each as large as what it saved, while the saved tensors are still
      held: cross-entropy's backward makes two gradients the size of its log-softmax before any
      block's backward frees anything.

    Two moments differ (:func:`peak_bytes`). At the head's backward, right after the forward,
    all of it is held (:attr:`bytes`). By the time the blocks' backward runs, the head's backward
    has freed what was saved after the last block (``after``: the head's input, the loss's
    log-softmax) and its gradients; a block's backward makes gradients of its own largest saved
    tensor's size (``block_gradients``, twice the largest tensor saved by the time the last block
    ended; None: not measured apart, as large as ``gradients``). :attr:`in_blocks` is what is
    beside block j's backward, :attr:`head` what the head's moment holds beyond that.
    """

    outside: int = 0
    gradients: int = 0
    after: int = 0
    block_gradients: Optional[int] = None

    @property
    def bytes(self) -> int:
        """The most at any moment: at the head's backward."""
        return self.outside + self.gradients

    @property
    def in_blocks(self) -> int:
        """Beside each block's backward: what was saved before the blocks, and the block's gradients."""
        gradients = self.gradients if self.block_gradients is None else min(self.block_gradients, self.gradients)
        return self.outside - min(self.after, self.outside) + gradients

    @property
    def head(self) -> int:
        """What the head's backward holds beyond :attr:`in_blocks`."""
        return self.bytes - self.in_blocks

    def fields(self) -> tuple[int, int, int, int]:
        """outside, gradients, after, block_gradients (the last as large as ``gradients`` where not measured apart)."""
        return (self.outside, self.gradients, self.after, self.gradients if self.block_gradients is None else self.block_gradients)

    def scaled(self, growth: float) -> "BesideBlocks":
        """For a batch whose blocks take ``growth`` times the inputs (both grow with batch size times sequence length)."""
        return BesideBlocks(*(round(n * growth) for n in self.fields()))

    def largest(self, other: "BesideBlocks") -> "BesideBlocks":
        return BesideBlocks(*(max(a, b) for a, b in zip(self.fields(), other.fields())))

    def note(self, lead: str) -> str:
        """``lead`` and what these bytes are, for a message; empty when there are none."""
        parts = [f"{format_bytes(n)} {what}" for n, what in ((self.outside, "of activations outside the blocks"),
                                                             (self.gradients, "for the backward's gradients")) if n]
        return lead + " and ".join(parts) if parts else ""


@dataclass(frozen=True)
class ActivationPlan:
    layout: tuple[str, ...]
    seconds: float  # predicted forward + backward
    peak_bytes: int  # activations held in the GPU tier at the worst moment


def interleaved_layout(n_blocks: int, n_swap: int, n_checkpoint: int) -> list[str]:
    """ProTrain Fig. 2: ``interleaved_layout(8, 2, 4)`` is S C C S C C K K (swap, checkpoint, keep)."""
    if n_swap < 0 or n_checkpoint < 0 or n_swap + n_checkpoint > n_blocks:
        raise ValueError(f"{n_swap} swapped + {n_checkpoint} checkpointed blocks do not fit in {n_blocks} blocks.")
    layout: list[str] = []
    if n_swap == 0:
        layout = [CHECKPOINT] * n_checkpoint
    else:
        share, extra = divmod(n_checkpoint, n_swap)
        for group in range(n_swap):  # earlier groups take the remainder
            layout += [SWAP_HOST] + [CHECKPOINT] * (share + (1 if group < extra else 0))
    return layout + [KEEP] * (n_blocks - len(layout))


def split_swaps(costs: Sequence[BlockCost], layout: Sequence[str], host_bytes: int) -> list[str]:
    """LoHan Eq. 3: host memory takes swapped blocks in forward order while it can; the rest go
    to NVMe. The inputs of blocks recomputed from host memory take their share of it as they come."""
    out, used = [], 0
    for cost, choice in zip(costs, layout):
        if choice in SWAPPED:
            fits = used + cost.activation_bytes <= host_bytes
            used += cost.activation_bytes if fits else 0
            choice = SWAP_HOST if fits else SWAP_NVME
        elif choice == CHECKPOINT_HOST:
            used += cost.input_bytes
        out.append(choice)
    return out


def nvme_swapped_bytes(costs: Sequence[BlockCost], layout: Sequence[str]) -> int:
    """The bytes a layout swaps to NVMe in a step (its ``swap_nvme`` blocks' activations)."""
    return sum(c.activation_bytes for c, p in zip(costs, layout) if p == SWAP_NVME)


def peak_bytes(costs: Sequence[BlockCost], layout: Sequence[str], head: int = 0) -> int:
    """The most activation bytes the GPU tier holds at once, over the moments that matter:

    - the end of forward, when the head's backward runs: kept blocks hold their activations,
      checkpointed ones their inputs (in host memory under ``checkpoint_host``), the last block
      copied out may still be on its way, and ``head`` more bytes are held
      (``BesideBlocks.head``: what the head saved, its gradients);
    - backward at block j (last to first): the blocks below j still hold theirs, block j is
      materialised (kept, recomputed or brought back), and a block j that was copied out has
      started bringing back the nearest copied-out block below it (the runtime prefetches one
      such block ahead: a swapped block's activations, a ``checkpoint_host`` block's input).
    """
    held = [c.held_bytes(p) for c, p in zip(costs, layout)]
    in_flight = max((c.moved_bytes(p) for c, p in zip(costs, layout)), default=0)
    peak = sum(held) + in_flight + head
    below = 0
    moved_below = 0  # the nearest copied-out block below j: what a copied-out block j prefetches
    for j, (cost, policy) in enumerate(zip(costs, layout)):
        moved = policy in SWAPPED or policy == CHECKPOINT_HOST
        peak = max(peak, below + cost.activation_bytes + (moved_below if moved else 0))
        below += held[j]
        if moved:
            moved_below = cost.moved_bytes(policy)
    return peak


def step_seconds(costs: Sequence[BlockCost], layout: Sequence[str], links: Links) -> float:
    """LoHan Eq. 2 + Eq. 5 for one layout: the busiest resource of each pass sets its length. The
    host <-> GPU link is duplex, each direction its own term; the SSD is simplex, so its reads and
    writes in a pass add up."""
    forward = sum(c.forward_seconds for c in costs)
    recompute = sum(c.forward_seconds for c, p in zip(costs, layout) if p in RECOMPUTED)
    swapped = sum(c.moved_bytes(p) for c, p in zip(costs, layout))
    on_nvme = sum(c.activation_bytes for c, p in zip(costs, layout) if p == SWAP_NVME)
    return _passes_seconds(links, forward, recompute, swapped, on_nvme)


def _passes_seconds(links: Links, forward: float, recompute: float, swapped: int, on_nvme: int) -> float:
    """Forward and backward, each as long as its busiest resource."""
    t_forward = max(
        forward, move_seconds(swapped, links.d2h), links.parameter_forward_seconds,
        links.nvme_forward_seconds + move_seconds(on_nvme, links.nvme_write),
    )
    t_backward = max(
        2 * forward + recompute, links.gradient_backward_seconds, links.parameter_backward_seconds + move_seconds(swapped, links.h2d),
        links.nvme_backward_seconds + move_seconds(on_nvme, links.nvme_read),
    )
    return t_forward + t_backward


LAYOUT_COUNTS = 128  # block counts tried per policy: every count up to this many blocks, evenly spaced ones beyond


def _counts(most: int, stride: int) -> list[int]:
    return sorted({*range(0, most + 1, stride), most})


def _layouts(costs: Sequence[BlockCost], links: Links, host_bytes: int, head: int = 0, inputs_in_host: bool = False,
             peak_under: Optional[int] = None):
    """Every interleaved layout (swapped, checkpointed counts) that has a path for its swaps, as
    (layout, peak bytes, predicted seconds, blocks managed). Beyond ``LAYOUT_COUNTS`` blocks the
    counts are evenly spaced (with every block swapped or checkpointed kept), as ProTrain's
    search tries a small set of them: each layout costs time linear in the blocks, so the full
    search would grow with their cube. ``inputs_in_host``: the checkpointed blocks' inputs wait in
    host memory (``checkpoint_host``), in layouts where host memory holds them and whose kept
    blocks alone hold less than ``peak_under``."""
    n = len(costs)
    stride = -(-n // LAYOUT_COUNTS)  # 1 up to LAYOUT_COUNTS blocks
    pricer = _Pricer(costs, links, host_bytes, head)
    kept_from = [0] * (n + 1)  # the kept blocks' activations, kept ones being the last
    for j in reversed(range(n)):
        kept_from[j] = kept_from[j + 1] + costs[j].activation_bytes
    for n_swap in _counts(n, stride):
        for n_checkpoint in _counts(n - n_swap, stride):
            if inputs_in_host and (not n_checkpoint or (peak_under is not None and kept_from[n_swap + n_checkpoint] >= peak_under)):
                continue
            layout = interleaved_layout(n, n_swap, n_checkpoint)
            if inputs_in_host:
                if sum(c.input_bytes for c, p in zip(costs, layout) if p == CHECKPOINT) > host_bytes:
                    continue
                layout = [CHECKPOINT_HOST if p == CHECKPOINT else p for p in layout]
            priced = pricer(layout)
            if priced is not None:
                yield (*priced, n_swap + n_checkpoint)


class _Pricer:
    """:func:`split_swaps`, :func:`peak_bytes` and :func:`step_seconds` of one layout in a single
    pass over the blocks, with the same sums in the same order (so the same numbers to the bit):
    the searches price thousands of layouts of deep models."""

    def __init__(self, costs: Sequence[BlockCost], links: Links, host_bytes: int, head: int = 0) -> None:
        self.head = head
        self.activation = [c.activation_bytes for c in costs]
        self.input = [c.input_bytes for c in costs]
        self.seconds = [c.forward_seconds for c in costs]
        self.forward = sum(self.seconds)
        self.links, self.host_bytes = links, host_bytes

    def __call__(self, interleaved: Sequence[str]) -> tuple[list[str], int, float] | None:
        """(layout with its swaps split, peak bytes, step seconds); None where swaps would need NVMe and there is no link to it."""
        layout: list[str] = []
        recompute: float = 0  # int 0 first, as sum() starts: the same float to the bit
        host_used, in_flight, swapped, on_nvme, to_nvme = 0, 0, 0, 0, False
        below, swapped_below, moments = 0, 0, 0  # held below block j; the nearest swapped block below; backward's worst moment
        for a, i, f, choice in zip(self.activation, self.input, self.seconds, interleaved):
            if choice in SWAPPED:
                fits = host_used + a <= self.host_bytes
                host_used += a if fits else 0
                choice = SWAP_HOST if fits else SWAP_NVME
                moments = max(moments, below + a + swapped_below)
                swapped_below, in_flight, swapped = a, max(in_flight, a), swapped + a
                on_nvme, to_nvme = on_nvme + (0 if fits else a), to_nvme or not fits
            elif choice == CHECKPOINT_HOST:  # the input copied out and back, the rest recomputed
                host_used += i
                moments = max(moments, below + a + swapped_below)
                swapped_below, in_flight, swapped = i, max(in_flight, i), swapped + i
                recompute += f
            else:
                moments = max(moments, below + a)
                held = a if choice == KEEP else i
                below += held
                recompute += f if choice == CHECKPOINT else 0
            layout.append(choice)
        if to_nvme and not self.links.holds_on_nvme(on_nvme):
            return None
        # the end of forward (everything held, the last swap in flight), or a moment of backward
        return layout, max(below + in_flight + self.head, moments), _passes_seconds(self.links, self.forward, recompute, swapped, on_nvme)


def choose_layout(costs: Sequence[BlockCost], links: Links, gpu_bytes: int, host_bytes: int, head: int = 0) -> ActivationPlan:
    """ProTrain §3.3's search over (swapped, checkpointed) block counts: the fastest layout whose
    activation peak (``head``: :func:`peak_bytes`) fits ``gpu_bytes``; swaps beyond ``host_bytes``
    go to NVMe where there is a link to it. Where no layout fits with the checkpointed blocks'
    inputs in the GPU tier, the same search with them in host memory (``checkpoint_host``: the
    least inter-block activations LoHan and ZeRO-Infinity offload). Raises ValueError, with the
    smallest peak any layout reaches, when none fits."""
    smallest: list[int] = []
    for inputs_in_host in (False, True):
        best = _fastest_fitting(_layouts(costs, links, host_bytes, head, inputs_in_host), gpu_bytes, smallest)
        if best is not None:
            return best
    raise ValueError(
        f"no layout of keep / checkpoint / swap fits the activations of {len(costs)} blocks in {gpu_bytes:,} bytes of the GPU tier "
        f"(the smallest peak is {min(smallest):,} bytes); lower the batch size or sequence length, or raise gpu_memory."
    )


def _fastest_fitting(layouts, gpu_bytes: int, smallest: list[int]) -> Optional[ActivationPlan]:
    """The fastest of ``layouts`` (as :func:`_layouts` yields them) within ``gpu_bytes``, fewer
    managed blocks on a tie; each one's peak is added to ``smallest``."""
    best: ActivationPlan | None = None
    best_key: tuple[float, int] | None = None
    for layout, peak, seconds, managed in layouts:
        smallest.append(peak)
        if peak > gpu_bytes:
            continue
        key = (round(seconds, 12), managed)
        if best_key is None or key < best_key:
            best, best_key = ActivationPlan(tuple(layout), seconds, peak), key
    return best


def layout_frontier(costs: Sequence[BlockCost], links: Links, host_bytes: int, head: int = 0) -> list[ActivationPlan]:
    """The layouts worth considering when the GPU tier is shared with parameters: each one faster
    than every layout with a smaller peak (the Pareto front of peak against time), or as fast and
    managing fewer blocks (as :func:`choose_layout` breaks ties: a swap the model prices as free
    still moves bytes), smallest peak first. Whatever the budget left for activations, the best
    layout that fits is on it. Below the smallest peak of the layouts that keep the checkpointed
    blocks' inputs in the GPU tier, those with the inputs in host memory (as :func:`choose_layout`
    turns to them)."""
    in_gpu = _front(_layouts(costs, links, host_bytes, head))
    least = in_gpu[0].peak_bytes if in_gpu else None
    in_host = [plan for plan in _front(_layouts(costs, links, host_bytes, head, inputs_in_host=True, peak_under=least))
               if least is None or plan.peak_bytes < least]
    return in_host + in_gpu


def _front(layouts) -> list[ActivationPlan]:
    ranked = sorted(layouts, key=lambda t: (t[1], round(t[2], 12), t[3]))
    front: list[ActivationPlan] = []
    managed_last = 0
    for layout, peak, seconds, managed in ranked:
        if not front or seconds < front[-1].seconds - 1e-12 or (seconds <= front[-1].seconds + 1e-12 and managed < managed_last):
            front.append(ActivationPlan(tuple(layout), seconds, peak))
            managed_last = managed
    return front


def teraio_layout(costs: Sequence[BlockCost], links: Links, gpu_bytes: int, host_bytes: int, head: int = 0) -> ActivationPlan:
    """TeraIO's lifetime-aware offloading (§3.2, :func:`~.teraio.plan_migrations`) applied to the
    blocks: the step is the blocks' forward kernels then their backward kernels (twice as long),
    each block's activations a tensor used at its forward and at its backward, the memory of a
    kernel what the blocks before it hold. The migrations TeraIO plans until every kernel fits
    decide each block: moved to the SSD is ``swap_nvme``, to host memory ``swap_host``, not moved
    ``keep``. What TeraIO would leave to stall, the earliest kept blocks cover. TeraIO does not
    recompute; when offloading cannot bring the peak under ``gpu_bytes``, ValueError says so
    (``activations="auto"`` can also checkpoint)."""
    from .searches.migrations import SSD, TensorUses, plan_migrations

    n = len(costs)
    keep_all = [KEEP] * n
    if peak_bytes(costs, keep_all, head) <= gpu_bytes:
        return ActivationPlan(tuple(keep_all), step_seconds(costs, keep_all, links), peak_bytes(costs, keep_all, head))
    # the runtime copies a swapped block out while the next blocks run: one block's bytes stay
    # reserved for the copy in flight, which TeraIO's kernel-by-kernel memory does not see
    capacity = gpu_bytes - max(c.activation_bytes for c in costs)
    held = [sum(c.activation_bytes for c in costs[: j + 1]) for j in range(n)]
    seconds = [c.forward_seconds for c in costs] + [2 * costs[j].forward_seconds for j in reversed(range(n))]
    # the head's backward, right after the last block's forward, holds ``head`` more
    memory = held[:-1] + [held[-1] + head] + [held[j] for j in reversed(range(n))]
    tensors = [TensorUses(f"block{j}", costs[j].activation_bytes, (j, 2 * n - 1 - j)) for j in range(n)]
    plan = plan_migrations(
        seconds, memory, tensors, max(capacity, 0), ssd_write=links.nvme_write, ssd_read=links.nvme_read,
        host_bandwidth=min(links.d2h, links.h2d), host_limit=host_bytes,
    )
    layout = [KEEP] * n
    for migration in plan.migrations:
        layout[int(migration.tensor[len("block"):])] = SWAP_NVME if migration.destination == SSD else SWAP_HOST
    # What TeraIO leaves over capacity would stall its kernels; the runtime cannot stall, so the
    # earliest blocks still kept go too (to host memory while it has room), until the peak fits.
    host_left = host_bytes - sum(c.activation_bytes for c, p in zip(costs, layout) if p == SWAP_HOST)
    peak = peak_bytes(costs, layout, head)
    for j in range(n - 1):
        if peak <= gpu_bytes:
            break
        if layout[j] != KEEP:
            continue
        if costs[j].activation_bytes <= host_left or links.nvme_write <= 0:
            layout[j], host_left = SWAP_HOST, host_left - costs[j].activation_bytes
        else:
            layout[j] = SWAP_NVME
        peak = peak_bytes(costs, layout, head)
    on_nvme = nvme_swapped_bytes(costs, layout)
    if not links.holds_on_nvme(on_nvme):
        raise ValueError(
            f"TeraIO's offloads send {on_nvme:,} bytes of activations to NVMe, over the {links.nvme_room:,} bytes the NVMe budget "
            f"leaves beside the parameters; raise nvme_memory or host_memory, or use activations='auto', which can also recompute blocks."
        )
    if peak > gpu_bytes:
        raise ValueError(
            f"TeraIO's offloads leave {peak:,} bytes of activations in the GPU tier at the worst moment, over the {gpu_bytes:,} "
            f"bytes it has; raise gpu_memory, or use activations='auto', which can also recompute blocks."
        )
    return ActivationPlan(tuple(layout), step_seconds(costs, layout, links), peak)

