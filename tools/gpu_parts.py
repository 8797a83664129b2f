"""What the GPU check's parts (``tools/gpu_check.sh``: race, timeline, memory) share before their
heavy imports: where there is no CUDA GPU a part says so in one line and exits 2, and the hidden
``--device cpu`` that runs the same code on the emulated device at tiny sizes (for checking the
scripts on a machine without a GPU; its figures mean nothing for a GPU)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

# device nodes CUDA needs (the NVIDIA driver's; WSL's): without any, no CUDA GPU, and no need to
# import torch to know it (the suite runs every part's refusal)
_DEVICE_NODES = ("/dev/nvidiactl", "/dev/dxg")


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)


def cuda_available() -> bool:
    if not any(os.path.exists(node) for node in _DEVICE_NODES):
        return False
    import torch

    return torch.cuda.is_available()


def exit_without_cuda(part: str, argv: Sequence[str]) -> None:
    """Unless ``argv`` asks for ``--device cpu``: where there is no CUDA GPU, one line and exit 2
    (called before the script imports Lightning and the package)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_device_argument(parser)
    known, _ = parser.parse_known_args(list(argv))
    if known.device == "cuda" and not cuda_available():
        print(f"gpu-check {part}: no CUDA GPU on this machine, nothing checked (the CPU suite is 'make test').")
        sys.exit(2)
