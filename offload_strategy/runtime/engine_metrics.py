"""The engine's tier figures for the metric table (docs/reference.md, "Metrics"): bytes per tier
and link, units per home, gradient buffers, optimizer states; read from its collaborators."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..planning.placement import GPU, HOST, NVME

if TYPE_CHECKING:
    from .engine import TieredEngine


def tier_metrics(engine: TieredEngine) -> dict[str, float]:
    memory, store, states, updater = engine.ctx.memory, engine.store, engine.states, engine.updater
    assert updater is not None  # metrics are read from an engine that was built
    out = {
        "link/h2d_bytes_total": float(engine.device.bytes_to_device),
        "link/d2h_bytes_total": float(engine.device.bytes_to_host),
        "link/nvme_read_bytes_total": float(store.bytes_read if store else 0),
        "link/nvme_write_bytes_total": float(store.bytes_written if store else 0),
    }
    persistent = sum(s.device_slot.slot_bytes for s in states if s.home == GPU and s.device_slot is not None)
    out["tier/gpu_bytes"] = float(persistent + memory.device_pool.used_bytes)
    out["tier/gpu_peak_bytes"] = float(persistent + memory.device_pool.peak_used_bytes)
    out["tier/gpu_reserved_bytes"] = float(memory.persistent_region.numel() + memory.arena.numel())
    # optimizer states (and fp32 masters kept with them) by tier: under sharded data
    # parallelism, this rank's share
    state_bytes = {home: float(sum(b for i, b in updater.state_bytes.items() if states[i].home == home)) for home in (GPU, HOST)}
    masters = float(memory.master_region.numel())  # fp32 masters of the host units updated here
    # homes and gradients in the slab (or this rank's share of the homes the machine's ranks
    # share), staging buffers in use, optimizer states and masters
    out["tier/host_shared_bytes"] = float(memory.shared_slab.nbytes if memory.shared_slab is not None else 0)
    fixed = engine.host_bytes_held() - memory.staging_pool.capacity_bytes + state_bytes[HOST]
    out["tier/host_bytes"] = float(fixed + memory.staging_pool.used_bytes)
    out["tier/host_peak_bytes"] = float(fixed + memory.staging_pool.peak_used_bytes)
    out["tier/nvme_bytes"] = float(store.used_bytes if store else 0)
    for home in (GPU, HOST, NVME):
        out[f"units/{home}"] = sum(1 for s in states if s.home == home)
    out["units/direct_gradients"] = len(engine.gradients.direct)
    buffers = engine.gradients.buffers
    out["gradients/buffers_most_held"] = int(buffers.most_held)
    out["gradients/buffers_beyond_plan_total"] = int(buffers.extra)
    out["optimizer/gpu_state_bytes"] = state_bytes[GPU]
    out["optimizer/host_state_bytes"] = state_bytes[HOST]
    out["optimizer/host_master_bytes"] = masters
    out["optimizer/nvme_state_bytes"] = float(sum(engine.nvme_states.sizes.values()) if engine.nvme_states is not None else 0)
    return out
