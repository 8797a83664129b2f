"""Specifications of known machines, for planning and what-if simulation without probing.

Link figures are what a PCIe link delivers, not its theoretical per-direction bandwidth (PCIe
3.0 x16 15.8 GB/s, 4.0 x16 31.5 GB/s, 5.0 x16 63.0 GB/s, as ProTrain §5 quotes them): 10Cache
(Table 2) measured pinned copies of 16 MB on PCIe 4.0 x16 at 24.74 GB/s host -> GPU and 25.91 GB/s
back, 78.5% and 82.3% of 31.5, and those shares apply to every generation here. An SSD array
delivers less than the sum of its drives: TeraIO (§5) measured about 16 GB/s from RAID-0 arrays of
four drives rated 6.7 GB/s read and 6.5 GB/s write, 60% and 62% of the sums. What is lost is in
the path the drives share, not in each drive: LoHan's machine scales near linearly from one drive
to three (§V-F), and its one-drive step (Fig. 10b, 69.5 s) is shorter even than its states'
traffic at the drive's datasheet rates. So a machine with fewer of its drives runs each at the
drive's own rates, up to the array's (``known_hardware``). GPU peaks are dense (no sparsity) tensor
core figures with fp32 accumulation, from the vendor datasheets and architecture whitepapers; the
fp32 peak is the CUDA cores' (no TF32), what `32-true` matmuls run at under torch's defaults;
the GPU memory bandwidth is the datasheet's (memory-bound kernels reach a share of it,
``profiling.analytic.GPU_MEMORY_SHARE``).
Host memory, cores and SSDs are those of the testbed each spec is named after, the memory in
binary units: DRAM modules come in powers of two, so a server sold with "384 GB" has twelve 32 GiB
modules, 384 GiB (JEDEC's capacity "GB" is 2**30 bytes); the host memory
bandwidth is the theoretical peak of its CPUs' memory channels (channels x transfer rate x 8 bytes,
from the CPU datasheets). A spec is either one GPU's share of a larger machine (the DGX ones) or
a whole machine with ``gpus`` GPUs, whose data-parallel ranks share its CPU side
(``HardwareSpec.rank_share``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from ..config import HardwareSpec, parse_size

PCIE3_X16 = 15.8
PCIE4_X16 = 31.5
PCIE5_X16 = 63.0
H2D_SHARE = 24.74 / PCIE4_X16  # 10Cache Table 2, pinned
D2H_SHARE = 25.91 / PCIE4_X16
ARRAY_READ_SHARE = 16.0 / (4 * 6.7)  # TeraIO §5, RAID-0 of four SSDs
ARRAY_WRITE_SHARE = 16.0 / (4 * 6.5)
P5510_READ_GBPS, P5510_WRITE_GBPS = 6.5, 3.4  # Intel D7-P5510 3.84 TB datasheet, sequential, per drive (LoHan Table III)

KNOWN_MACHINES: dict[str, HardwareSpec] = {
    spec.name: spec
    for spec in (
        HardwareSpec(
            name="h100_80g",
            gpu="NVIDIA H100 80GB HBM3 (SXM5)",
            gpu_memory=parse_size("80GiB"),
            gpu_bf16_tflops=989.4,  # H100 datasheet: 1,979 with sparsity
            gpu_fp16_tflops=989.4,
            h2d_gbps=PCIE5_X16 * H2D_SHARE,
            d2h_gbps=PCIE5_X16 * D2H_SHARE,
            host_memory=parse_size("256GiB"),  # one GPU's share of a DGX H100 (2 TB, 112 cores, 8 data NVMe)
            cpu_cores=14,
            nvme_count=1,
            nvme_read_gbps=7.0,  # Samsung PM1733 3.84 TB U.2 datasheet
            nvme_write_gbps=3.8,
            host_memory_gbps=76.8,  # 2x Xeon Platinum 8480C, 8 channels of DDR5-4800 each (614.4 GB/s), one GPU's eighth
            gpu_fp32_tflops=66.9,  # H100 SXM5 datasheet: FP32 67 TFLOPS
            gpu_memory_gbps=3350.0,  # H100 SXM5 datasheet: HBM3
            source="NVIDIA H100 datasheet; DGX H100 user guide (per-GPU share)",
        ),
        HardwareSpec(
            name="h200",
            gpu="NVIDIA H200 141GB HBM3e (SXM5)",
            gpu_memory=parse_size("141GB"),
            gpu_bf16_tflops=989.4,  # H200 datasheet: 1,979 with sparsity
            gpu_fp16_tflops=989.4,
            h2d_gbps=PCIE5_X16 * H2D_SHARE,
            d2h_gbps=PCIE5_X16 * D2H_SHARE,
            host_memory=parse_size("256GiB"),  # one GPU's share of a DGX H200 (2 TB, 112 cores)
            cpu_cores=14,
            nvme_count=1,
            nvme_read_gbps=7.0,
            nvme_write_gbps=3.8,
            host_memory_gbps=76.8,  # as the DGX H100: 614.4 GB/s, one GPU's eighth
            gpu_fp32_tflops=66.9,  # H200 datasheet: FP32 67 TFLOPS
            gpu_memory_gbps=4800.0,  # H200 datasheet: HBM3e
            source="NVIDIA H200 datasheet; DGX H200 user guide (per-GPU share)",
        ),
        HardwareSpec(
            name="a100_40g",
            gpu="NVIDIA A100 40GB",
            gpu_memory=parse_size("40GiB"),
            gpu_bf16_tflops=312.0,  # A100 datasheet: 624 with sparsity
            gpu_fp16_tflops=312.0,
            h2d_gbps=PCIE4_X16 * H2D_SHARE,
            d2h_gbps=PCIE4_X16 * D2H_SHARE,
            host_memory=parse_size("256GiB"),  # 10Cache Table 3: AMD EPYC 7763 (64 cores), 256 GB, 3 TB Samsung NVMe
            cpu_cores=64,
            nvme_count=1,
            nvme_read_gbps=2.36,  # 10Cache Table 1 (measured, NVMe on PCIe 4.0 x4)
            nvme_write_gbps=0.73,
            host_memory_gbps=204.8,  # AMD EPYC 7763: 8 channels of DDR4-3200
            gpu_fp32_tflops=19.5,  # A100 datasheet
            gpu_memory_gbps=1555.0,  # A100 40GB datasheet: HBM2
            source="NVIDIA A100 datasheet; 10Cache Tables 1 and 3",
        ),
        HardwareSpec(
            name="a100_80g",
            gpu="NVIDIA A100 80GB",
            gpu_memory=parse_size("80GiB"),
            gpu_bf16_tflops=312.0,
            gpu_fp16_tflops=312.0,
            h2d_gbps=PCIE4_X16 * H2D_SHARE,  # ProTrain §5 testbed: PCIe 4 (31.5 GB/s on paper)
            d2h_gbps=PCIE4_X16 * D2H_SHARE,
            host_memory=parse_size("1TiB"),  # ProTrain §5: Xeon Platinum 8480+ (112 cores), 1 TB DRAM
            cpu_cores=112,
            nvme_count=0,
            host_memory_gbps=614.4,  # 2x Xeon Platinum 8480+: 8 channels of DDR5-4800 each
            gpu_fp32_tflops=19.5,  # A100 datasheet
            gpu_memory_gbps=2039.0,  # A100 80GB SXM datasheet: HBM2e
            source="NVIDIA A100 datasheet; ProTrain §5 testbed",
            gpus=4,  # ProTrain §5.1: four A100s share the machine
        ),
        HardwareSpec(
            name="rtx4090",
            gpu="NVIDIA GeForce RTX 4090",
            gpu_memory=parse_size("24GiB"),
            gpu_bf16_tflops=165.2,  # Ada whitepaper, fp32 accumulate (330.3 with fp16 accumulate)
            gpu_fp16_tflops=165.2,
            h2d_gbps=PCIE4_X16 * H2D_SHARE,
            d2h_gbps=PCIE4_X16 * D2H_SHARE,
            host_memory=parse_size("768GiB"),  # LoHan Table III: 2x Xeon Gold 5320 (52 cores), 768 GB DDR4
            cpu_cores=52,
            nvme_count=12,  # LoHan Table III: 12x Intel P5510 3.84 TB
            nvme_read_gbps=12 * P5510_READ_GBPS * ARRAY_READ_SHARE,
            nvme_write_gbps=12 * P5510_WRITE_GBPS * ARRAY_WRITE_SHARE,
            nvme_drive_read_gbps=P5510_READ_GBPS,
            nvme_drive_write_gbps=P5510_WRITE_GBPS,
            host_memory_gbps=375.4,  # 2x Xeon Gold 5320: 8 channels of DDR4-2933 each
            gpu_fp32_tflops=82.6,  # Ada whitepaper
            gpu_memory_gbps=1008.0,  # Ada whitepaper: 21 Gbps GDDR6X, 384-bit
            source="NVIDIA Ada whitepaper; LoHan Table III",
        ),
        HardwareSpec(
            name="rtx3090",
            gpu="NVIDIA GeForce RTX 3090",
            gpu_memory=parse_size("24GiB"),
            gpu_bf16_tflops=71.0,  # GA102 whitepaper, fp32 accumulate (142 with fp16 accumulate)
            gpu_fp16_tflops=71.0,
            h2d_gbps=PCIE3_X16 * H2D_SHARE,  # ProTrain §5 testbed: PCIe 3 (15.8 GB/s on paper)
            d2h_gbps=PCIE3_X16 * D2H_SHARE,
            host_memory=parse_size("384GiB"),  # ProTrain §5: Xeon Silver 4214R (24 cores), 384 GB
            cpu_cores=24,
            nvme_count=0,
            host_memory_gbps=230.4,  # 2x Xeon Silver 4214R: 6 channels of DDR4-2400 each
            gpu_fp32_tflops=35.6,  # GA102 whitepaper
            gpu_memory_gbps=936.2,  # GA102 whitepaper: 19.5 Gbps GDDR6X, 384-bit
            source="NVIDIA GA102 whitepaper; ProTrain §5 testbed",
            gpus=4,  # ProTrain §5.1: four RTX 3090s share the machine
        ),
        HardwareSpec(
            name="l40s",
            gpu="NVIDIA L40S 48GB",
            gpu_memory=parse_size("48GB"),
            gpu_bf16_tflops=362.05,  # L40S datasheet: 733 with sparsity
            gpu_fp16_tflops=362.05,
            h2d_gbps=PCIE4_X16 * H2D_SHARE,
            d2h_gbps=PCIE4_X16 * D2H_SHARE,
            host_memory=parse_size("256GiB"),  # 10Cache Table 3: 2x Xeon Silver 4314 (32 cores), 256 GB, 2 TB NVMe
            cpu_cores=32,
            nvme_count=1,
            nvme_read_gbps=2.36,  # 10Cache Table 1 (measured)
            nvme_write_gbps=0.73,
            host_memory_gbps=341.2,  # 2x Xeon Silver 4314: 8 channels of DDR4-2666 each
            gpu_fp32_tflops=91.6,  # L40S datasheet
            gpu_memory_gbps=864.0,  # L40S datasheet: GDDR6
            source="NVIDIA L40S datasheet; 10Cache Tables 1 and 3",
        ),
        HardwareSpec(
            name="v100_16g",
            gpu="NVIDIA Tesla V100 16GB (SXM2)",
            gpu_memory=parse_size("16GiB"),
            gpu_bf16_tflops=None,  # Volta has no bf16 tensor cores
            gpu_fp16_tflops=125.0,  # V100 datasheet (SXM2)
            h2d_gbps=PCIE3_X16 * H2D_SHARE,
            d2h_gbps=PCIE3_X16 * D2H_SHARE,
            host_memory=parse_size("61GiB"),  # AWS p3.2xlarge: 1x V100, 8 vCPU, 61 GiB
            cpu_cores=8,
            nvme_count=0,
            host_memory_gbps=17.1,  # Xeon E5-2686 v4, 4 channels of DDR4-2400 (76.8 GB/s), the instance's 4 of 18 cores
            gpu_fp32_tflops=15.7,  # V100 datasheet (SXM2)
            gpu_memory_gbps=900.0,  # V100 datasheet (SXM2): HBM2
            source="NVIDIA V100 datasheet; AWS p3.2xlarge instance specification",
        ),
    )
}


def known_hardware(name: str, **overrides: Any) -> HardwareSpec:
    """The spec of a known machine, with any field replaced (``host_memory="512GiB"``). A new
    ``nvme_count`` (the machine's drives, more or fewer) changes the NVMe rates not given with it:
    fewer drives than the machine's run at one drive's rates each, up to the array's, where the
    spec gives a drive's (``nvme_drive_read_gbps``; see the module docstring); more drives, or a
    spec without a drive's rates, scale the array's with the count."""
    key = name.lower().replace("-", "_")
    if key not in KNOWN_MACHINES:
        raise ValueError(f"hardware={name!r} is not a known machine; known: {', '.join(sorted(KNOWN_MACHINES))}, or 'auto' to probe this one.")
    spec = KNOWN_MACHINES[key]
    fields = {f.name for f in dataclasses.fields(spec)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"hardware overrides {unknown} are not fields of HardwareSpec; fields: {sorted(fields)}.")
    count = overrides.get("nvme_count")
    if isinstance(count, int) and count > 0 and spec.nvme_count and count != spec.nvme_count:
        for array, drive in (("nvme_read_gbps", "nvme_drive_read_gbps"), ("nvme_write_gbps", "nvme_drive_write_gbps")):
            if array not in overrides and getattr(spec, array) is not None:
                overrides[array] = drives_rate(getattr(spec, array), spec.nvme_count, count, overrides.get(drive, getattr(spec, drive)))
    return dataclasses.replace(spec, **overrides) if overrides else spec


def drives_rate(array_gbps: float, array_drives: int, drives: int, drive_gbps: Optional[float] = None) -> float:
    """The rate of ``drives`` of the drives of an array of ``array_drives`` that moves
    ``array_gbps``: one drive's ``drive_gbps`` each, up to the array's rate (the path they share;
    more drives than the array's widen it in proportion). Without a drive's rate, the array's in
    proportion to the drives."""
    scaled = array_gbps * drives / array_drives
    if drive_gbps is None:
        return scaled
    return min(drives * drive_gbps, max(array_gbps, scaled))
