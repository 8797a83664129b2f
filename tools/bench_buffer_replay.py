"""What replaying a checkpointed block's buffers costs: a forward and backward of a stack of
residual blocks (a 3x3 convolution and BatchNorm2d each) with every block checkpointed, timed with
``BufferReplay`` as the runtime uses it and with a stand-in that does nothing (the old behaviour:
wrong running statistics, the same work otherwise); and the bytes it holds from forward to backward.

    PYTHONPATH=. python tools/bench_buffer_replay.py --blocks 16 --channels 64 --size 32 --batch 16
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from unittest import mock

import torch
from torch import nn

from offload_strategy.runtime.activations import policies as activations
from offload_strategy.runtime.activations.policies import ActivationPolicies
from offload_strategy.runtime.activations.buffer_replay import BufferReplay


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


class NoReplay:
    def __init__(self, block: nn.Module) -> None:
        pass

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        yield


def step_seconds(model: nn.Module, x: torch.Tensor, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(x).square().mean().backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--channels", type=int, default=64)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=11)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(args.channels) for _ in range(args.blocks)))
    ActivationPolicies(model, "checkpoint")
    x = torch.randn(args.batch, args.channels, args.size, args.size)
    held = []
    original = BufferReplay.forward

    @contextlib.contextmanager
    def counted(self: BufferReplay) -> Iterator[None]:
        with original(self):
            yield
        held.append(self.held_bytes)

    results = {}
    for name, replay in (("no replay", NoReplay), ("BufferReplay", BufferReplay), ("no replay again", NoReplay), ("BufferReplay again", BufferReplay)):
        with mock.patch.object(activations, "BufferReplay", replay), mock.patch.object(BufferReplay, "forward", counted):
            results[name] = step_seconds(model, x, args.steps)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    print(f"{args.blocks} blocks, {args.channels} channels, {args.size}x{args.size}, batch {args.batch}; buffers {buffers} B")
    for name, seconds in results.items():
        print(f"  {name:>20}: {seconds * 1e3:.1f} ms a step (median of {args.steps - 1})")
    print(f"  held from forward to backward per block: {held[-1]} B (every block: {sum(held[-args.blocks:])} B)")
    print(f"  the replay alone, per block (copy before, check after, a fresh copy and put back around the recomputation): {replay_seconds(model[0]) * 1e6:.1f} us")


def replay_seconds(block: nn.Module, repeats: int = 2000) -> float:
    """The replay's own time for one block, its forward left out (the step times above are noisy
    on a shared machine; this is what the replay adds to each checkpointed block)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        replay = BufferReplay(block)
        with replay.forward():
            pass
        with replay.recomputing():
            pass
        times.append(time.perf_counter() - start)
    return statistics.median(times)


if __name__ == "__main__":
    main()
