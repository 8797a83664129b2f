"""``CheckpointStates``: the model's and the optimizers' true state, out of the tiers and back.

The strategies' core holds one, built with the context it shares (``TieredContext``: the
Lightning state, the budgets, the engine in place) and the record of parameters built without
memory (``DeferredParameters``). It writes and reads checkpoints (a full state dict of true values,
or a sharded directory whose NVMe values are read when written), gathers every parameter for a
callback, and after training brings the units left on NVMe back into host memory as far as the
budget allows. Calls go one way: the core and the strategies' hooks call it; it reads the context
and calls the engine, never the core.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch
from lightning.pytorch.utilities import rank_zero_info

from ..config import StateDictType, format_bytes
from ..construction.deferred import DeferredParameters
from ..hardware import FreedHostMemory, host_available
from ..memory.nvme import NvmeStore
from ..planning.placement import GPU, HOST, NVME
from ..runtime.engine import TieredEngine
from ..runtime.updates.optimizers import compact
from .sharded import LazyState, Readers, ShardedCheckpoint, is_sharded_checkpoint, write_sharded

if TYPE_CHECKING:
    from ..lightning.context import TieredContext

# a unit's parameters, and their bytes with the optimizer states' in its file
UnitOnNvme = tuple[list[torch.nn.Parameter], int]


@dataclass(frozen=True)
class LeftOnNvme:
    """Units an engine's close left on NVMe, the store they read from, and the host memory the
    budget leaves them after the units in memory (``CheckpointStates.room_after_training``)."""

    store: NvmeStore
    units: list[UnitOnNvme]
    room: int
    # the closed engine's limit on the freed memory glibc keeps: each unit read back is read
    # into buffers and freed (at 303M, 170 MiB of them kept through teardown, docs/benchmarks.md)
    freed: FreedHostMemory = field(default_factory=FreedHostMemory)


class CheckpointStates:
    """Checkpoints with true values from every tier, parameters gathered for callbacks, and the
    units on NVMe brought back after training."""

    def __init__(self, context: "TieredContext", deferred: DeferredParameters) -> None:
        self.context = context
        self.deferred = deferred
        self.state_dict_type = StateDictType.FULL  # the single-process strategy chooses (data-parallel: full)
        self._stand_ins: Optional[Readers] = None  # the sharded checkpoint being built: NVMe values, read when written

    # -- checkpoints written ------------------------------------------------------------------------

    def lightning_module_state_dict(self, plain: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        engine = self.context.engine
        # the checkpoint being built is sharded: values on NVMe stay there until written
        self._stand_ins = (engine.stand_in_readers() if engine is not None else {}) if self._writes_sharded() else None
        if engine is None:
            return plain()
        module = self.context.module
        if self._stand_ins is not None:
            # plain detached aliases of the placeholders: detaching an offloaded parameter the
            # usual way would lend (read) its unit, gathering the model after all
            with torch._C.DisableTorchFunctionSubclass():
                state = module.state_dict()
            return type(state)((k, compact(v)) for k, v in state.items())
        # Views of where each value lives, as plain training returns views of its parameters: no
        # second copy of the model, except for units on NVMe, which are read into fresh buffers.
        # Each over only its own bytes, so that a checkpoint does not carry whole slabs.
        with engine.materialized():
            state = module.state_dict()
        return type(state)((k, compact(v)) for k, v in state.items())

    def optimizer_state(self, optimizer: torch.optim.Optimizer, plain: Callable[[torch.optim.Optimizer], dict[str, Any]]) -> dict[str, Any]:
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's
        engine = self.context.engine
        if self._stand_ins is not None and engine is not None and id(inner) in engine.updater.optimizers:
            return engine.updater.optimizers[id(inner)].state_dict(contextlib.nullcontext)  # NVMe units' states as stand-ins
        return plain(optimizer)

    def _writes_sharded(self) -> bool:
        """The next checkpoint is a directory written tensor by tensor (docs/guide.md, "Checkpoints")."""
        if self.state_dict_type is StateDictType.AUTO:
            engine = self.context.engine
            return engine is not None and nvme_state_bytes(engine) > half_host_available()
        return self.state_dict_type is StateDictType.SHARDED

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any], plain: Callable[..., None]) -> None:
        readers, self._stand_ins = self._stand_ins, None
        if readers is None:
            return plain(checkpoint, filepath, storage_options=storage_options)
        if storage_options is not None:
            raise TypeError("a sharded checkpoint takes no storage_options: it is written by torch.distributed.checkpoint, not by the CheckpointIO plugin.")
        if self.context.lightning.is_global_zero:
            write_sharded(checkpoint, filepath, readers)

    # -- checkpoints read ---------------------------------------------------------------------------

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: Optional[bool], plain: Callable[..., dict[str, Any]], read: Callable[..., Any]
    ) -> dict[str, Any]:
        """``read``: the checkpoint IO's reader of the sharded checkpoint's metadata file."""
        if not is_sharded_checkpoint(checkpoint_path):
            return plain(checkpoint_path, weights_only=weights_only)
        # the model's and optimizers' tensors are read when loaded into their places, the rest now
        source = ShardedCheckpoint(checkpoint_path, weights_only)
        checkpoint = source.meta(lambda path: read(path, weights_only=weights_only))
        checkpoint["state_dict"] = source.model_state()
        if source.optimizer_count():
            checkpoint["optimizer_states"] = [source.optimizer_state(i) for i in range(source.optimizer_count())]
        return checkpoint

    def load_model_state_dict(self, checkpoint: Any, strict: bool, plain: Callable[..., None]) -> None:
        state = checkpoint["state_dict"]
        engine = self.context.engine
        with engine.materialized(writeback=True) if engine is not None else contextlib.nullcontext():
            if not isinstance(state, LazyState):
                return plain(checkpoint, strict=strict)
            # parameters built without memory are read when placed, the others in place now
            state.checkpoint.load_model(
                self.context.module, strict, defer=lambda p: engine is None and p in self.deferred, set_source=self.deferred.set_source
            )

    def load_optimizer_state_dict(self, checkpoint: Any, plain: Callable[[Any], None]) -> None:
        """The optimizers' states from a checkpoint. With an engine each unit's go where the unit
        lives (NVMe units' to their files); Lightning's own load would then move every state to
        the GPU, reading NVMe units' into memory on the way."""
        if self.context.engine is None:
            return plain(checkpoint)
        for optimizer, state in zip(self.context.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)
        return None

    @contextlib.contextmanager
    def gathered_parameters(self, writeback: bool = False) -> Iterator[None]:
        """Every parameter holds its true value in a real tensor for the duration, as DeepSpeed's
        ``GatheredParameters`` and FSDP's ``summon_full_params`` give them: for callbacks that
        read weights between steps (a weight-norm logger, an EMA), where units at home on NVMe
        otherwise show placeholders. With ``writeback=True`` what the block writes into the
        parameters is kept (an averaging callback copying weights in, a manual load); the
        optimizer's fp32 masters then start from the written values."""
        engine = self.context.engine
        if engine is None:
            yield
            return
        with engine.materialized(writeback=writeback):
            yield

    # -- after training: the units left on NVMe -----------------------------------------------------

    def settle_after_training(self, left: LeftOnNvme, failing: bool = False) -> None:
        """Once the tiers' memory is gone, the units left on NVMe that fit come back (``_bring_back``);
        the others stay there, their store open while anything reads from it, and a line says so.
        ``failing``: training's own failure propagates; where a unit cannot be read back then (a
        write the failure cut short), that failure is the one to see and the files go."""
        gc.collect()  # the engine's cycles, and the tiers' memory with them, before anything is read back
        left.freed.release()  # what the tiers and the steps freed, before the reads
        try:
            stay = self._bring_back(left.units, left.room, left.freed)
        except Exception:
            left.store.close()
            if failing:
                return
            raise
        if not stay:
            left.store.close()
            return
        weakref.finalize(self, left.store.close)  # the parameters and states left there read from it
        nbytes = sum(size for _, size in stay)
        rank_zero_info(
            f"tiered: after training, {len(stay)} of the {len(left.units)} units at home on NVMe stay there ({format_bytes(nbytes)} of "
            f"parameters and optimizer states beyond the {format_bytes(left.room)} that host_memory and the host memory available leave "
            f"after the units in memory): each parameter, and its optimizer states, is read from its file when first used "
            f"(optimizer.state_dict(), a checkpoint, more training) and held from then on."
        )

    def room_after_training(self, engine: TieredEngine) -> int:
        """Host memory that units at home on NVMe may take after training: the host budget (and
        the emulated GPU tier's, host memory too) less what the units in those tiers bring back,
        within half of what the machine has available."""
        budgets = self.context.budgets
        if budgets is None:
            return 0
        emulated = self.context.root_device.type != "cuda"
        homes = (HOST, GPU) if emulated else (HOST,)
        states = engine.updater.state_bytes if engine.updater is not None else {}
        held = sum(int(s.unit.nbytes) + states.get(s.unit.index, 0) for s in engine.states if s.home in homes)
        return max(min(budgets.host + (budgets.gpu if emulated else 0) - held, half_host_available()), 0)

    def _bring_back(self, on_nvme: list[UnitOnNvme], room: int, freed: FreedHostMemory) -> list[UnitOnNvme]:
        """Units left on NVMe read back into memory, parameters and optimizer states, in order,
        as long as they fit in ``room``; the ones that stay. What their reads freed is given back
        past ``freed``'s limit, unit by unit."""
        stay: list[UnitOnNvme] = []
        for params, size in on_nvme:
            if size > room or stay:  # in order: what comes back is a prefix, what stays the rest
                stay.append((params, size))
                continue
            room -= size
            for p in params:
                if p in self.deferred:
                    self.deferred.materialize(p)
                for optimizer in self.context.optimizers:
                    if p in optimizer.state:
                        optimizer.state[p]  # noqa: B018 (read from its file, then held)
            freed.check()
        return stay


def nvme_state_bytes(engine: TieredEngine) -> int:
    """Parameters and optimizer states at home on NVMe."""
    on_nvme = sum(s.unit.nbytes for s in engine.states if s.home == NVME)
    return on_nvme + (sum(engine.nvme_states.sizes.values()) if engine.nvme_states is not None else 0)


def units_on_nvme(engine: TieredEngine) -> list[UnitOnNvme]:
    """Each unit at home on NVMe: its parameters, and their bytes with the optimizer states' in its file."""
    sizes = engine.nvme_states.sizes if engine.nvme_states is not None else {}
    return [(list(s.unit.params), s.unit.nbytes + sizes.get(s.unit.index, 0)) for s in engine.states if s.home == NVME]


def half_host_available() -> int:
    """What NVMe-resident state may take in host memory before it stays on NVMe after fit and
    checkpoints of it are sharded (``state_dict_type="auto"``)."""
    return host_available() // 2
