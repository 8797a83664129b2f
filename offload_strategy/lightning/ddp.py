"""``TieredDDPStrategy`` (``strategy="tiered_ddp"``): data parallelism on ``torch.distributed``, as
launched by Lightning's DDP (``devices=N``, ``num_nodes=M``, torchrun and SLURM environments),
with every rank running the tiered engine on its own device.

The model is not wrapped in ``DistributedDataParallel``: the engine reduces each unit's gradients
itself, as backward completes them and before they are offloaded, and with ``shard_states`` each
rank keeps the fp32 masters and optimizer states of only the units it owns (see
:mod:`offload_strategy.runtime.grads.exchange`). Checkpoints are consolidated into the same standard
Lightning checkpoint a single-device run writes, and either loads into the other.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from lightning.fabric.plugins import ClusterEnvironment
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.io.checkpoint_plugin import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

from ..checkpoint.atomic import AtomicCheckpointIO
from .hooks import TieredHooks
from ..config import Budget, BudgetLike, HardwareSpec, PolicyConfig, StateDictType, format_bytes
from ..planning.cost_model import Machine
from ..planning.placement import UnitSize
from ..planning.planner import TierBudgets
from ..planning.sharding import Sharding, assign_owners
from ..runtime.engine import TieredEngine
from ..runtime.grads.exchange import DataParallel, Reduction, collective_latency, collective_rate
from ..runtime.updates.rank_states import StatesMoved, load_across_ranks, state_indices
from ..runtime.shared_homes import SHARED_MEMORY_DIR, shared_memory_unavailable
from .context import TieredOptions
from .core import TieredCore

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from lightning.pytorch.accelerators import Accelerator


def _sync_module_states(module: nn.Module, host_group: Any) -> None:
    """Rank 0's parameters and buffers to every rank (as DDP does at wrapping): those in host memory
    over the gloo group, since NCCL moves GPU tensors only, the others over the default group."""
    from torch.distributed.distributed_c10d import _get_default_group
    from torch.distributed.utils import _sync_params_and_buffers

    ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", []))
    states = [t.detach() for name, t in (*module.named_parameters(), *module.named_buffers()) if name not in ignored]
    for group, on_gpu in ((host_group, False), (_get_default_group(), True)):
        tensors = [t for t in states if (t.device.type == "cuda") == on_gpu]
        if tensors:
            _sync_params_and_buffers(group, tensors, 250 * 2**20, 0)


def machines_and_peers(where: list[tuple[int, int]]) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
    """Each machine's global ranks, and each local index's across the machines, in order, from
    every rank's (machine, local rank): launchers number ranks machine by machine or round-robin."""
    machines = [tuple(r for r, (m, _) in enumerate(where) if m == machine) for machine in sorted({m for m, _ in where})]
    peers = [tuple(r for r, (_, k) in enumerate(where) if k == local) for local in sorted({k for _, k in where})]
    return machines, peers


class TieredDDPStrategy(TieredHooks, DDPStrategy):
    """:class:`~offload_strategy.TieredStrategy` on every rank of a data-parallel run.

    Takes TieredStrategy's arguments; the budgets are per rank (``None`` shares what is free on
    the node among its ranks, and every rank plans with the smallest budget any rank got). And:

    Args:
        shard_states: each rank keeps the fp32 masters and optimizer states of 1/N of the units
            (ZeRO-2 style), so their host memory and NVMe files fall about N-fold; ``False`` keeps
            them all on every rank (each rank updates every unit, no parameters are exchanged).
        share_host_homes: the ranks of each machine keep one copy of the parameters of the units
            homed in host memory, in shared memory (``/dev/shm``), instead of a copy each: each
            unit's owner writes its update there, and host memory holds them once per machine,
            not once per rank. On one machine nothing is broadcast for them; on several
            (``num_nodes``) the owner sends each update to one rank of every other machine.
            Needs ``shard_states`` and several ranks on each machine. Between steps the
            parameters are then that one copy, so code that changes
            them in place (a callback) must do so on one rank, or write the same values on
            every rank (``load_state_dict``, ``copy_``): ``mul_`` on every rank is applied once
            per rank.
        process_group_backend, timeout, start_method, cluster_environment: as for Lightning's
            ``DDPStrategy``.
    """

    strategy_name = "tiered_ddp"

    def __init__(
        self,
        policy: Union[str, PolicyConfig, dict[str, Any]] = "auto",
        hardware: Union[str, HardwareSpec, dict[str, Any]] = "auto",
        gpu_memory: BudgetLike = None,
        host_memory: BudgetLike = None,
        nvme_path: Optional[Union[str, Path]] = None,
        nvme_memory: BudgetLike = None,
        plan_file: Optional[Union[str, Path]] = None,
        shard_states: bool = True,
        share_host_homes: bool = False,
        *,
        accelerator: Optional["Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        max_batch: Any = None,
    ) -> None:
        options = TieredOptions.parse(policy, hardware, gpu_memory, host_memory, nvme_path, nvme_memory, plan_file, max_batch)
        self.shard_states = bool(shard_states)
        self._ranks = DataParallelRanks(self, options, self.shard_states, bool(share_host_homes))
        self.tiered = TieredCore(options, self, self._ranks)
        self.tiered.checkpoints.state_dict_type = StateDictType.FULL  # consolidated on rank 0
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io or AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
        )

    # -- no DistributedDataParallel wrapper: the engine reduces the gradients ------------------------

    @override
    def configure_ddp(self) -> None:
        if not self.tiered.runs_an_engine():  # nothing is tiered: plain DDP
            return super().configure_ddp()
        assert self.model is not None
        _sync_module_states(self.model, self._ranks.process_groups()[0])  # every rank starts from rank 0's parameters, as DDP does

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        super().setup(trainer)
        rank_zero_info(self.describe())

    # -- checkpoints: one consolidated, standard checkpoint ------------------------------------------

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's standard state dict with every rank's units in it, on rank 0 (the rank
        that writes checkpoints); other ranks return an empty dict, as for ZeroRedundancyOptimizer."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        state = optimizer.state_dict()
        # after fit too: the engine is gone, but each facade holds only its own units' states
        if not self.shard_states or self.world_size == 1 or self.tiered.policy.name == "none" or not dist.is_initialized():
            return state
        gathered: Optional[list[Any]] = [None] * self.world_size if self.is_global_zero else None
        dist.gather_object(state["state"], gathered, dst=0, group=self._ranks.process_groups()[2])
        if not self.is_global_zero:
            return {}
        merged: dict[int, Any] = {}
        for part in gathered or []:
            merged.update(part)
        return {"state": dict(sorted(merged.items())), "param_groups": state["param_groups"]}

    def describe(self) -> str:
        """One line for logs: ranks, sharding and each rank's budgets."""
        budgets = self.tiered.budgets
        where = "" if budgets is None else (
            f", per rank: GPU tier {format_bytes(budgets.gpu)}, host {format_bytes(budgets.host)}, NVMe {format_bytes(budgets.nvme)}"
        )
        shared = ", host homes one copy per machine" if self._ranks.homes_shared() else ""
        return f"tiered_ddp: {self.world_size} ranks, optimizer states {'sharded' if self.shard_states else 'replicated'}{shared}{where}"


class DataParallelRanks:
    """What data parallelism changes in the tiered core (``lightning.core.Ranks``): the engine
    runs even when everything fits (it reduces the gradients), each rank keeps the optimizer
    states of the units it owns, decisions taken from measurements are rank 0's, and budgets are
    per rank and the same on every rank. Reads the ranks from Lightning's DDP strategy."""

    engine_when_all_fits = True

    def __init__(self, strategy: DDPStrategy, options: TieredOptions, shard_states: bool, share_host_homes: bool = False) -> None:
        self.strategy, self.options, self.shard_states = strategy, options, shard_states
        self.share_host_homes = share_host_homes
        self._homes_shared: Optional[bool] = None
        self._groups: Optional[tuple[Any, Any, Any]] = None
        self._machine_groups: Optional[tuple[Any, Any, tuple[int, ...], tuple[int, ...]]] = None
        # collectives: bytes/s on host memory's group (gloo) and the GPU tier's, seconds per call on the host's
        self._rates: Optional[tuple[float, float, float]] = None
        self.states_moved = StatesMoved()  # optimizer states sent and received when the units are placed again

    def data_parallel(self, sizes: list[UnitSize]) -> Optional[DataParallel]:
        host, device, control = self.process_groups()
        machine, peers, machine_ranks, peer_ranks = self.machine_groups()
        return DataParallel(
            rank=self.strategy.global_rank,
            world_size=self.strategy.world_size,
            owners=self._owners(sizes),
            host_group=host,
            device_group=device,
            control_group=control,
            shard_states=self.shard_states and self.options.policy.name != "none",  # 'none': every rank keeps every state, as DDP
            machines=self.machines,
            machine_group=machine,
            peer_group=peers,
            machine_ranks=machine_ranks,
            peer_ranks=peer_ranks,
        )

    @property
    def machines(self) -> int:
        return max(1, self.strategy.world_size // max(1, self.strategy.num_processes))

    def _owners(self, sizes: list[UnitSize]) -> tuple[int, ...]:
        return tuple(assign_owners([u.trainable_bytes for u in sizes], self.strategy.world_size))

    def sharding(self, sizes: list[UnitSize], gradients_sent: bool) -> Optional[Sharding]:
        if not self.shard_states or self.options.policy.name == "none":
            return None
        owners = dict(zip((u.index for u in sizes), self._owners(sizes)))
        return Sharding(owners, self.strategy.global_rank, self.strategy.world_size, gradients_sent, self.homes_shared(), replicated_persistent=True,
                        machines=self.machines)

    def homes_shared(self) -> bool:
        """Whether each machine's ranks keep one copy of host homes: asked for, states sharded,
        several ranks on each machine, and a shared-memory file system on every machine to map it
        from (decided once, alike on every rank)."""
        if self._homes_shared is None:
            processes = self.strategy.num_processes
            wanted = self.share_host_homes and self.shard_states and processes > 1
            unavailable = shared_memory_unavailable()
            possible = self._on_every_rank(not unavailable)
            if self.share_host_homes and not self.shard_states:
                rank_zero_warn("share_host_homes needs shard_states=True (every rank updating every unit would write the one copy at "
                               "once); each rank keeps its own copy of host homes.")
            elif self.share_host_homes and processes == 1 and self.strategy.world_size > 1:
                rank_zero_warn("share_host_homes: each machine runs one rank, so there is nothing to share; each rank keeps its own copy "
                               "of host homes.")
            elif wanted and not possible:
                why = unavailable or f"another machine cannot map files from its {SHARED_MEMORY_DIR}"
                rank_zero_warn(f"share_host_homes: {why}; each rank keeps its own copy of host homes.")
            self._homes_shared = wanted and possible
        return self._homes_shared

    def _on_every_rank(self, holds: bool) -> bool:
        """Whether ``holds`` on every rank (this rank's answer where there is no process group yet)."""
        if self.strategy.world_size == 1 or not dist.is_initialized():
            return holds
        every = torch.tensor([int(holds)], dtype=torch.int64)
        dist.all_reduce(every, op=dist.ReduceOp.MIN, group=self.process_groups()[2])
        return bool(every.item())

    def machine_groups(self) -> tuple[Any, Any, tuple[int, ...], tuple[int, ...]]:
        """Where host homes are shared per machine on several machines: this machine's ranks and
        this rank's peers (its local index on every machine), as process groups and as global
        ranks, from every rank's (node, local rank), whatever order the launcher numbered them
        in; on one machine (the control group, None, (), ()). Every rank creates every group, in
        one order, as ``new_group`` requires."""
        control = self.process_groups()[2]
        if self.machines == 1 or not self.homes_shared():
            return control, None, (), ()
        if self._machine_groups is None:
            where: list[Any] = [None] * self.strategy.world_size
            dist.all_gather_object(where, (self.strategy.node_rank, self.strategy.local_rank), group=control)
            machines, peers = machines_and_peers(where)
            groups = {ranks: self._new_group(list(ranks)) for ranks in (*machines, *peers)}
            rank = self.strategy.global_rank
            mine, peer = next(m for m in machines if rank in m), next(p for p in peers if rank in p)
            self._machine_groups = (groups[mine], groups[peer], mine, peer)
        return self._machine_groups

    def measure_links(self) -> None:
        """What an all-reduce moves per rank on host memory's group and on the GPU tier's, measured
        once at set-up; rank 0's figures for every rank, so that every rank plans alike."""
        if self._rates is not None or self.options.policy.name == "none" or not (dist.is_available() and dist.is_initialized()):
            return
        host, device, _ = self.process_groups()
        host_rate = collective_rate(host, torch.device("cpu"))
        device_rate = host_rate if device is host else collective_rate(device, self.strategy.root_device)
        self._rates = self.same_on_every_rank((host_rate, device_rate, collective_latency(host, torch.device("cpu"))))

    def machine(self, links: Machine) -> Machine:
        """``links`` with the ranks: each unit's reduction and its parameters' broadcast priced at
        the collectives measured on its tier (before any measurement, at the host link's rate)."""
        host_rate, device_rate, latency = self._rates if self._rates is not None else (links.h2d, links.h2d, 0.0)
        one_group = self._groups is None or self._groups[1] is self._groups[0]  # on CPU both tiers' collectives are gloo's
        return replace(links, world_size=self.strategy.world_size, network=device_rate, host_network=None if one_group else host_rate,
                       shard_states=self.shard_states, collective_latency=latency, shared_homes=self.homes_shared(), machines=self.machines,
                       replicated_persistent=self.shard_states)

    def link_metrics(self) -> dict[str, float]:
        moved = {"link/states_moved_bytes_total": float(self.states_moved.total), "link/states_moved_largest_bytes": float(self.states_moved.largest)}
        if self._rates is None:
            return moved
        return {"link/collectives_host_gbps": self._rates[0] / 1e9, "link/collectives_gpu_gbps": self._rates[1] / 1e9,
                "link/collective_latency_ms": self._rates[2] * 1e3, **moved}

    def process_groups(self) -> tuple[Any, Any, Any]:
        """(host, device, control) groups, created once and in the same order on every rank: gloo
        for tensors in host memory (CPU tensors work under NCCL too), the default group for the GPU tier."""
        if self._groups is None:
            host, control = self._new_group(), self._new_group()
            device = dist.group.WORLD if self.strategy.root_device.type == "cuda" else host
            self._groups = (host, device, control)
        return self._groups

    def _new_group(self, ranks: Optional[list[int]] = None) -> Any:
        """A gloo group with the strategy's ``timeout`` (``new_group``'s own default is half an
        hour): a rank that stops responding fails the others' collectives after the timeout, as
        it fails Lightning's default group's."""
        return dist.new_group(ranks, backend="gloo", timeout=getattr(self.strategy, "_timeout", None))

    def same_on_every_rank(self, choice: Any) -> Any:
        return self.strategy.broadcast(choice, src=0)

    def largest_on_every_rank(self, value: int) -> int:
        if self.strategy.world_size == 1 or not dist.is_initialized():
            return value
        largest = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.process_groups()[2])
        return int(largest.item())

    def check_same_on_every_rank(self, what: str, choice: Hashable) -> None:
        if self.strategy.world_size == 1 or not dist.is_initialized():
            return
        every: list[Any] = [None] * self.strategy.world_size
        dist.all_gather_object(every, choice, group=self.process_groups()[2])
        differ = [rank for rank, theirs in enumerate(every) if theirs != every[0]]
        if differ:
            raise RuntimeError(
                f"tiered_ddp: the ranks disagree on {what}, which every rank must choose alike (the collectives would wait on each "
                f"other forever): rank 0 chose {every[0]}, rank {differ[0]} {every[differ[0]]}"
                f"{f' ({len(differ)} ranks differ from rank 0)' if len(differ) > 1 else ''}. This is a bug in the placement: "
                f"please report it with this run's log and budgets."
            )

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict[str, Any], engine: Optional[TieredEngine]) -> None:
        """Under sharded states each rank's old engine handed over its own units' states only, and
        a new placement may give a unit another owner, or replicate it in the GPU tier on every
        rank: each rank loads its own, and a unit's states that a rank now needs and did not keep
        come from a rank that kept them, a unit at a time as its load reaches them
        (``runtime/updates/rank_states.py``). Nothing is gathered: beyond its own, a rank holds a
        few units' states at once."""
        if not self.shard_states or self.strategy.world_size == 1 or not dist.is_initialized():
            optimizer.load_state_dict(state)
            return
        units = [s.unit.params for s in engine.states] if engine is not None else []
        taken = engine.updater.optimizers.get(id(optimizer)) if engine is not None else None
        groups, needs = state_indices(optimizer, units, taken)
        load_across_ranks(optimizer, state, groups, needs, self.process_groups()[2], self.states_moved)

    def gradient_reduction(self, accumulating: bool, needs_all_gradients: bool) -> Optional[Reduction]:
        """``needs_all_gradients``: something other than the engine's clipping by norm reads every
        reduced gradient before the step."""
        if accumulating:
            return None  # as DDP's no_sync: accumulate locally, reduce on the last micro-batch
        return Reduction.ALL if needs_all_gradients else Reduction.OWNER

    def share_budgets(self, granted: TierBudgets, requested: tuple[Budget, Budget, Budget]) -> TierBudgets:
        """Per rank, the same on every rank: what a rank sees free on its node is free for all the
        node's ranks, so a tier given as "all that is free" or a fraction of it is split among
        them (each rank has its own GPU); then every rank takes the smallest any rank got."""
        local = max(self.strategy.num_processes, 1)
        shared = [self.strategy.root_device.type != "cuda", True, True]
        values = [
            b // local if split and budget.bytes is None else b
            for b, budget, split in zip((granted.gpu, granted.host, granted.nvme), requested, shared)
        ]
        if dist.is_available() and dist.is_initialized():
            smallest = torch.tensor(values, dtype=torch.int64)
            dist.all_reduce(smallest, op=dist.ReduceOp.MIN, group=self.process_groups()[2])
            values = [int(v) for v in smallest.tolist()]
        return TierBudgets(gpu=values[0], host=values[1], nvme=values[2])
