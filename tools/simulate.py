"""Predict a training step of a model on a machine that may not be at hand, for several GPU budgets.

    python tools/simulate.py model=llama_7b hardware=rtx4090
    python tools/simulate.py model=gpt2_xl hardware=a100_80g --gpu-memory 8GiB 16GiB 32GiB --nvme-memory 2TB
    python tools/simulate.py model=llama_7b hardware=rtx4090 --precision 32-true data.batch_size=8
    python tools/simulate.py model=llama_7b hardware=rtx4090 --ranks 4 --network-gbps 25   # tiered_ddp, per rank

The model is built on the meta device from its config (nothing allocated), its units are placed by
the same placement the strategy runs, each unit is costed from its shapes and the hardware spec
(profiling/analytic.py), and planning/cost_model.py simulates the step. Printed per budget: where
the units live, what each tier holds, the predicted step time and tokens/s, and the share of the
step that transfers and updates leave exposed; and ProTrain's search (planning/protrain.py): the
count of leading units kept resident that the step model predicts fastest, with its buffers.
With ``--ranks N`` the step is rank 0's in a ``tiered_ddp`` run: budgets are per rank, gradients
are reduced over the network link, rank 0 updates the units it owns and receives the others.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

STATE_FACTOR = 2.0  # Adam: two states per parameter


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-memory", nargs="*", default=None, help="GPU-tier budgets to compare (default: 25%%, 50%% and 90%% of the GPU)")
    parser.add_argument("--host-memory", default=None, help="host budget (default: 80%% of the machine's)")
    parser.add_argument("--nvme-memory", default="0", help="NVMe budget (default: none)")
    parser.add_argument("--precision", default="bf16-true", choices=["bf16-true", "32-true"])
    parser.add_argument("--ranks", type=int, default=1, help="data-parallel ranks (tiered_ddp); budgets are per rank")
    parser.add_argument("--network-gbps", type=float, default=None, help="GB/s each rank moves in collectives (default: the host->GPU link's)")
    parser.add_argument("--replicate-states", action="store_true", help="every rank keeps every optimizer state (shard_states=False)")
    parser.add_argument("--efficiency", type=float, default=0.5, help="model FLOPs utilisation of the GPU's dense peak")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides: model=..., hardware=..., data.batch_size=..., data.seq_len=...")
    args = parser.parse_args(argv)

    import torch
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from offload_strategy import format_bytes, parse_size
    from offload_strategy.planning.cost_model import GPU, Machine, UnitCost, simulate_step
    from offload_strategy.planning.placement import NVME, PlacementError, UnitSize, place_units
    from offload_strategy.planning.protrain import search_persistent
    from offload_strategy.planning.sharding import assign_owners
    from offload_strategy.profiling.analytic import analytic_units
    from offload_strategy.runtime.units import build_units

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=[*args.overrides, "logger=none"])
    module = instantiate(cfg.model)
    with torch.device("meta"):
        module.configure_model()
    half = args.precision == "bf16-true"
    if half:
        module.to(torch.bfloat16)
    hardware = instantiate(cfg.hardware)
    units, users = build_units(module)
    tokens = int(cfg.data.batch_size) * int(cfg.data.seq_len)
    costs = analytic_units(units, users, tokens, hardware, dtype="bf16" if half else "fp16", efficiency=args.efficiency)
    # under bf16-true gradients, states and masters are fp32 (twice the 16-bit bytes), plus a 16-bit landing area
    widen = 2 if half else 1
    state_factor = STATE_FACTOR + (1.5 if half else 0.0)
    sizes = [UnitSize(u.index, u.nbytes, c.trainable_bytes * widen) for u, c in zip(units, costs)]
    co_resident = [[u.index for u in used] for used in users.values()]
    budgets = [parse_size(g) for g in args.gpu_memory] if args.gpu_memory else [int(hardware.gpu_memory * f) for f in (0.25, 0.5, 0.9)]
    host = parse_size(args.host_memory) if args.host_memory else int(0.8 * hardware.host_memory)
    nvme = parse_size(args.nvme_memory)
    gbps = lambda v: (v or 0.0) * 1e9  # noqa: E731
    if args.ranks < 1:
        raise SystemExit(f"--ranks {args.ranks}: give at least one rank.")
    network = gbps(args.network_gbps if args.network_gbps is not None else hardware.h2d_gbps)
    machine = Machine(h2d=gbps(hardware.h2d_gbps), d2h=gbps(hardware.d2h_gbps), nvme_read=gbps(hardware.nvme_read_gbps), nvme_write=gbps(hardware.nvme_write_gbps),
                      world_size=args.ranks, network=network, shard_states=not args.replicate_states)
    owners = assign_owners([size.trainable_bytes for size in sizes], args.ranks)
    # rank 0 keeps the states of the units it owns only (None: every unit's, one rank or replicated)
    owned = {i for i, o in enumerate(owners) if o == 0} if args.ranks > 1 and not args.replicate_states else None
    compute = sum(c.forward_seconds + c.backward_seconds for c in costs)
    params = sum(c.parameters for c in costs)
    print(f"\n{cfg.model.get('name', cfg.model.family)}: {params / 1e9:.2f} B parameters in {len(units)} units, {args.precision}; "
          f"{hardware.name} ({hardware.gpu}, {format_bytes(hardware.gpu_memory)}, {hardware.cpu_cores} cores); "
          f"{tokens:,} tokens per step; compute alone {compute:.2f} s per step at {args.efficiency:.0%} of peak\n")
    if args.ranks > 1:
        print(f"tiered_ddp on {args.ranks} ranks, collectives at {network / 1e9:.0f} GB/s per rank, optimizer states "
              f"{'replicated' if args.replicate_states else 'sharded'}: budgets, step and tokens/s are rank 0's "
              f"(the run's tokens/s are {args.ranks}x)\n")
    print("| gpu_memory | units gpu/host/nvme | GPU tier | host | NVMe | streaming buffers | step (s) | tokens/s | exposed | host->GPU per step | searched: persistent units, buffers, step (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for gpu in budgets:
        try:
            placement = place_units(sizes, co_resident, gpu_bytes=gpu, host_bytes=host, nvme_bytes=nvme, state_factor=state_factor, owned=owned)
        except PlacementError as error:
            print(f"| {format_bytes(gpu)} | does not fit: {error} |||||||||")
            continue
        step_units = [
            UnitCost(
                nbytes=u.nbytes, forward_seconds=c.forward_seconds, backward_seconds=c.backward_seconds, home=placement.home[u.index],
                gradient_bytes=u.nbytes if any(p.requires_grad for p in u.params) else 0,
                state_bytes=int(size.trainable_bytes * state_factor) if placement.home[u.index] == NVME else 0,
                update_seconds=0.0 if placement.home[u.index] == GPU else c.update_seconds,
                owned=owners[u.index] == 0,
            )
            for u, c, size in zip(units, costs, sizes)
        ]
        buffers = sum(placement.device_slots.values())
        step = simulate_step(step_units, buffers, machine)
        homes = "/".join(str(sum(h == home for h in placement.home.values())) for home in ("gpu", "host", "nvme"))
        unit_costs = {u.index: c for u, c in zip(units, step_units)}
        best = search_persistent(sizes, co_resident, [u.index for u in units], unit_costs, machine, gpu_bytes=gpu, host_bytes=host,
                                 nvme_bytes=nvme, state_factor=state_factor, owned=owned)[0]
        print(f"| {format_bytes(gpu)} | {homes} | {format_bytes(placement.gpu_bytes)} | {format_bytes(placement.host_bytes)} | "
              f"{format_bytes(placement.nvme_bytes)} | {buffers} | {step.seconds:.2f} | {tokens / step.seconds:,.0f} | "
              f"{step.exposed_seconds / step.seconds:.0%} | {format_bytes(step.h2d_bytes)} | "
              f"{best.persistent}, {best.buffers}, {best.prediction.seconds:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
