"""What a CUDA GPU's memory holds beyond the tensors a plan counts: the context, cuBLAS's and
cuBLASLt's workspaces (one per stream that runs a matrix product), the caching allocator's cache.
``gpu_memory=None`` grants what is free less this reserve (``hardware/probe.py``).

    python tools/cuda_reserve.py

One row per operation, run once on tensors of a few KiB, in order: tensor memory allocated
(which ``torch.cuda.max_memory_allocated`` and so the tier's peak sees), memory the allocator
reserved, and what the driver reports used. Prints nothing useful without a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _row(name: str, rows: list[tuple[str, int, int, int]]) -> None:
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    rows.append((name, torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), total - free))


def main() -> None:
    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to measure")
        return
    rows: list[tuple[str, int, int, int]] = []
    _row("context", rows)
    a = torch.randn(64, 64, device="cuda")
    _row("a 16 KiB tensor", rows)
    steps = [
        ("fp32 matmul", lambda: a @ a),
        ("bf16 matmul", lambda: a.bfloat16() @ a.bfloat16()),
        ("linear with bias (cuBLASLt)", lambda: F.linear(a, a, a[0])),
        ("bf16 linear with bias", lambda: F.linear(a.bfloat16(), a.bfloat16(), a[0].bfloat16())),
        ("linear's backward", lambda: F.linear(a.clone().requires_grad_(), a).sum().backward()),
        ("attention (scaled_dot_product)", lambda: F.scaled_dot_product_attention(*(a.view(1, 1, 64, 64).bfloat16(),) * 3)),
        ("cross entropy", lambda: F.cross_entropy(a, torch.zeros(64, dtype=torch.long, device="cuda"))),
    ]
    for name, run in steps:
        run()
        _row(name, rows)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        a.detach() @ a.detach()
        F.linear(a.detach(), a.detach(), a[0].detach())
    _row("matmuls on a second stream", rows)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}\n")
    print("| after | allocated | reserved | used on the device |")
    print("|---|---|---|---|")
    for name, allocated, reserved, used in rows:
        print(f"| {name} | {allocated / 2**20:.2f} MiB | {reserved / 2**20:.2f} MiB | {used / 2**20:.0f} MiB |")


if __name__ == "__main__":
    main()
