"""Typed configuration shared by Python users and the Hydra experiments.

Everything here is plain data: parsing and validation of what a user typed, no torch state.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional, Union

# What the process may hold beyond ``host_memory`` (and the emulated GPU tier's budget on a
# machine without a GPU) from construction to after teardown: the runtime's own threads and
# buffers that no budget counts: the allocator arenas of the update worker, the NVMe threads and
# autograd's backward thread (glibc keeps one arena per thread, and freed blocks in it), the
# NVMe store's bounce buffers, the state Lightning, torch and autograd make at the first step,
# and the optimizer's temporaries of an update in host memory, of a chunk's size whatever the
# parameter's (runtime/updates/chunks.py: 16 MiB under AdamW).
# Measured on the development machine at 108 MiB beyond the budgets for a 19M-parameter GPT-2
# (tests/test_host_bound.py) and 130-145 MiB for the 4- and 8-million-parameter ones of
# tests/test_beyond_host.py; not the model's size. What glibc keeps of freed blocks grows with the
# units' sizes instead (docs/benchmarks.md, "Host memory as a bound").
RUNTIME_HOST_ALLOWANCE = 192 * 2**20

# A budget as a user writes it: bytes (int), a size string ("16GiB"), a fraction of what is
# free (float in (0, 1], or a string such as "50%"), or None for "all that is free".
BudgetLike = Union[int, float, str, None]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_PERCENT_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*%\s*$")


def parse_size(value: Union[int, float, str], name: str = "size") -> int:
    """Parse a byte count: ``1024``, ``"512MiB"``, ``"16GiB"``, ``"1.5 TB"``.

    Binary units (KiB, MiB, GiB, TiB, and the bare K/M/G/T) are powers of 1024; decimal units
    (KB, MB, GB, TB) are powers of 1000, as the vendors print them.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not a size: give bytes (int) or a string like '16GiB'.")
    if isinstance(value, int):
        result = value
    elif isinstance(value, float):
        if not math.isfinite(value) or value != int(value) or abs(value) >= 2**63:
            raise ValueError(f"{name}={value!r} is not a whole number of bytes.")
        result = int(value)
    elif isinstance(value, str):
        match = _SIZE_RE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(
                f"{name}={value!r} is not a size: write bytes or a number with a unit "
                f"(B, KiB, MiB, GiB, TiB, KB, MB, GB, TB), e.g. '16GiB'."
            )
        number = float(match.group(1)) * _UNITS[unit]
        if not math.isfinite(number) or number >= 2**63:
            raise ValueError(f"{name}={value!r} is too large to be a size in bytes; give a size such as '16GiB'.")
        if _UNITS[unit] == 1 and number != int(number):
            raise ValueError(
                f"{name}={value!r} is not a whole number of bytes; give a size with a unit such as '512MiB', "
                f"or a fraction of what is free as a number (0.5) or a percentage ('50%')."
            )
        result = int(number)
    else:
        raise ValueError(f"{name}={value!r} is not a size: give bytes (int) or a string like '16GiB'.")
    if result < 0:
        raise ValueError(f"{name}={value!r} is negative; a size must be >= 0 bytes.")
    return result


def format_bytes(n: Optional[float], at_least: bool = False) -> str:
    """Human-readable binary size, e.g. ``1.50 GiB``; ``n/a`` for None. ``at_least``: rounded up,
    so that a minimum a message names is enough when given back as it reads."""
    if n is None:
        return "n/a"
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            value = math.ceil(n / scale * 100) / 100 if at_least else n / scale
            return f"{value:.2f} {unit}"
    return f"{math.ceil(n) if at_least else int(n)} B"


@dataclass(frozen=True)
class Budget:
    """How much of one memory tier the strategy may use.

    Exactly one of ``bytes`` and ``fraction`` is set, or neither ("all that is free").
    """

    bytes: Optional[int] = None
    fraction: Optional[float] = None

    @classmethod
    def parse(cls, value: BudgetLike, name: str) -> "Budget":
        if value is None:
            return cls()
        if isinstance(value, Budget):
            return value
        if isinstance(value, bool):
            raise ValueError(f"{name}={value!r} is not a budget: give bytes, a size like '16GiB', or a fraction in (0, 1].")
        if isinstance(value, float):
            if not math.isfinite(value) or value <= 0 or value > 1:
                raise ValueError(
                    f"{name}={value!r}: a float is a fraction of the free memory and must lie in (0, 1]; "
                    f"for an absolute budget give bytes as an int or a string like '16GiB'."
                )
            return cls(fraction=value)
        if isinstance(value, str):
            percent = _PERCENT_RE.match(value)
            if percent:
                share = float(percent.group(1))
                if not 0 < share <= 100:
                    raise ValueError(f"{name}={value!r}: a percentage of the free memory must lie in (0%, 100%].")
                return cls(fraction=share / 100.0)
        return cls(bytes=parse_size(value, name))

    def resolve(self, free: int) -> int:
        """Bytes granted given ``free`` bytes available in the tier."""
        if self.bytes is not None:
            return self.bytes
        if self.fraction is not None:
            return int(free * self.fraction)
        return free

    def __str__(self) -> str:
        if self.bytes is not None:
            return format_bytes(self.bytes)
        if self.fraction is not None:
            return f"{self.fraction:.0%} of free"
        return "all free"


class _Name(str, Enum):
    """A name users write in configs: equal to, hashed and printed as its string."""

    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]


class Tier(_Name):
    """Where a unit lives: the GPU tier, host memory, or NVMe files."""

    GPU = "gpu"
    HOST = "host"
    NVME = "nvme"


class StateDictType(_Name):
    """How checkpoints are written (the words of Lightning's FSDP strategy)."""

    FULL = "full"  # one file, as plain Lightning writes
    SHARDED = "sharded"  # a directory, tensor by tensor
    AUTO = "auto"  # sharded when what lives on NVMe would not fit in half the host memory

    @classmethod
    def coerce(cls, value: Union[str, "StateDictType"]) -> "StateDictType":
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"state_dict_type={value!r}: choose one of {', '.join(repr(k.value) for k in cls)}.") from None


class BlockPolicy(_Name):
    """What a repeated block does with its activations."""

    KEEP = "keep"
    CHECKPOINT = "checkpoint"  # recomputed in backward
    CHECKPOINT_HOST = "checkpoint_host"  # recomputed in backward from its input, which waits in host memory
    SWAP_HOST = "swap_host"  # copied to host memory after forward, back ahead of backward
    SWAP_NVME = "swap_nvme"  # on to NVMe

    @property
    def letter(self) -> str:
        """One letter per block in printed layouts."""
        return {"keep": "K", "checkpoint": "C", "checkpoint_host": "H", "swap_host": "S", "swap_nvme": "N"}[self.value]


class ActivationPlanner(_Name):
    """A search that chooses every block's policy from the profiled first step."""

    AUTO = "auto"  # ProTrain's interleaved layout under the step model
    TERAIO = "teraio"  # TeraIO's offload selection
    LOHAN = "lohan"  # LoHan's swap-or-recompute search


class PlacementMode(_Name):
    """Where the planner may put parameters (``PolicyConfig.placement``)."""

    FILL = "fill"
    SEARCH = "search"
    HOST = "host"
    NVME = "nvme"
    LAYERWISE = "layerwise"
    OFFLOAD_STATES = "offload_states"  # parameters in the GPU tier through the step; gradients, states and masters at home in host memory


POLICY_NAMES = ("auto", "none")
BLOCK_POLICIES = tuple(BlockPolicy)
ACTIVATION_PLANNERS = tuple(ActivationPlanner)
PLACEMENTS = tuple(PlacementMode)


@dataclass(frozen=True)
class PolicyConfig:
    """What the planner may do.

    ``auto`` lets the planner choose every placement from the profile; ``none`` keeps every
    tensor in the GPU tier (plain training through the tiered runtime, the baseline). Left unset,
    ``placement`` and ``activations`` follow the name: ``"search"`` and ``"auto"`` under ``auto``
    (parameters and activations share the GPU tier as the joint search chooses), ``"fill"`` and
    ``"keep"`` under ``none``.

    ``chunk_size``: merge consecutive transfer units into chunks of up to this many bytes
    (ProTrain §3.1.1); ``None`` keeps one unit per module that owns parameters.
    ``gradient_reserve``: the share of offloaded units' gradient bytes that may be produced in the
    GPU tier and copied home afterwards; the rest is written straight into host memory
    (GO-MemFerry's reserve factor). ``None`` chooses: 0 on the emulated GPU tier, where a direct
    write is just a write; 1 on CUDA devices for now.
    ``throttle``: on a machine without a GPU, make copies between the emulated GPU tier and host
    memory take as long as the hardware spec's PCIe link would (for what-if runs).
    ``checksums``: verify everything read back from NVMe (parameters, optimizer states, spilled
    gradients, swapped activations) against an XXH3 checksum of each chunk taken as it was written,
    seeded by the file and the write, so that damaged, swapped or stale files are an error naming
    the file before anything reads the value; ``False`` turns them off (docs/benchmarks.md: their cost).
    ``activations``: what each repeated block does with its activations: ``"keep"``,
    ``"checkpoint"`` (recompute in backward), ``"swap_host"`` or ``"swap_nvme"`` (copied out of the
    GPU tier after forward, back ahead of backward); one name for all blocks or a list with one per block;
    or a planner deciding from the profiled first step: ``"auto"`` (ProTrain's layout search),
    ``"teraio"`` (TeraIO's offload selection), ``"lohan"`` (LoHan's swap-or-recompute search);
    ``block_class`` names the blocks' class when they are not found automatically.

    What the planner may decide for parameters, so that the papers' and the baselines' choices can
    be compared one against another (the presets in ``conf/policy/`` set these):
    ``placement``: ``"fill"`` keeps the first units in execution order in the GPU tier as far as
    the budget allows beside the streaming buffers, then host memory, then NVMe; ``"search"`` picks
    how many stay resident by ProTrain's search under the step model, from the measured first
    step; ``"host"`` streams every unit from host memory; ``"nvme"`` keeps every unit's parameters
    and optimizer states on NVMe; ``"layerwise"`` streams every unit from host memory through a GPU
    tier of only the smallest working set (one layer at a time).
    ``prefetch``: copy units ahead of their use along the recorded order (False: each unit is
    fetched when a module asks for it). ``update_during_backward``: update each unit as soon as its
    gradients are complete, overlapped with backward (False: all updates after backward).
    """

    name: str = "auto"
    chunk_size: Optional[Union[int, str]] = None
    gradient_reserve: Optional[float] = None
    throttle: bool = False
    checksums: bool = True
    activations: Union[str, tuple[str, ...], None] = None
    block_class: Optional[str] = None
    placement: Optional[str] = None
    prefetch: bool = True
    update_during_backward: bool = True

    def __post_init__(self) -> None:
        if self.name not in POLICY_NAMES:
            raise ValueError(f"policy={self.name!r} is not a known policy; choose one of {', '.join(POLICY_NAMES)}.")
        # unset: the planner decides under "auto"; "none" keeps everything where plain training would
        if self.activations is None:
            object.__setattr__(self, "activations", "auto" if self.name == "auto" else "keep")
        if self.placement is None:
            object.__setattr__(self, "placement", "search" if self.name == "auto" else "fill")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"policy.placement={self.placement!r} is not known; choose one of {', '.join(PLACEMENTS)}.")
        self._check_flags()
        self._check_activations()
        if self.block_class is not None and not isinstance(self.block_class, str):
            raise ValueError(f"policy.block_class={self.block_class!r} must be the name of the blocks' class, or None.")
        if self.chunk_size is not None:
            size = parse_size(self.chunk_size, "policy.chunk_size")
            if size == 0:
                raise ValueError("policy.chunk_size=0: give a positive size such as '32MiB', or None for one unit per module.")
            object.__setattr__(self, "chunk_size", size)

    def _check_flags(self) -> None:
        for flag in ("prefetch", "update_during_backward", "throttle", "checksums"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"policy.{flag}={getattr(self, flag)!r} must be true or false.")
        reserve = self.gradient_reserve
        if reserve is not None and not (isinstance(reserve, (int, float)) and not isinstance(reserve, bool) and 0.0 <= reserve <= 1.0):
            raise ValueError(
                f"policy.gradient_reserve={reserve!r} must lie in [0, 1] (the share of gradient bytes kept in the GPU tier), or be None."
            )

    def _check_activations(self) -> None:
        names = f"a block policy ({', '.join(BLOCK_POLICIES)}) or a planner ({', '.join(ACTIVATION_PLANNERS)})"
        if isinstance(self.activations, str):
            if self.activations not in BLOCK_POLICIES + ACTIVATION_PLANNERS:
                raise ValueError(f"policy.activations={self.activations!r} is not {names}.")
            return
        if not isinstance(self.activations, (list, tuple)) or not self.activations:
            raise ValueError(f"policy.activations={self.activations!r} must be {names}, or a list of block policies, one per block.")
        unknown = [a for a in self.activations if not isinstance(a, str) or a not in BLOCK_POLICIES]
        if unknown:
            raise ValueError(f"policy.activations lists {unknown!r}, which are not block policies; each must be one of {', '.join(BLOCK_POLICIES)}.")
        object.__setattr__(self, "activations", tuple(self.activations))

    @classmethod
    def coerce(cls, value: Union[str, "PolicyConfig", Mapping[str, Any]]) -> "PolicyConfig":
        if isinstance(value, PolicyConfig):
            return value
        if isinstance(value, str):
            if value not in PRESETS:
                raise ValueError(f"policy={value!r} is not a policy name or preset; choose one of {', '.join(PRESETS)}.")
            return cls(**PRESETS[value])
        if isinstance(value, Mapping):
            fields = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(str(k) for k in set(value) - fields - {"_target_"})
            if unknown:
                raise ValueError(f"policy has unknown fields {unknown}; known fields: {sorted(fields)}.")
            return cls(**{k: v for k, v in value.items() if k in fields})
        raise ValueError(f"policy={value!r} is not a policy name, a PolicyConfig or a mapping of its fields.")


# The policies each paper, or each baseline users compare us with, decides by: one definition,
# used by ``policy="<name>"`` in Python, the ``tiered_<name>`` strategy names and Hydra's
# conf/policy/<name>.yaml (tests/test_presets.py holds the YAML to these).
PRESETS: dict[str, dict[str, Any]] = {
    "auto": {"name": "auto"},
    "none": {"name": "none"},
    "fill": {"placement": "fill", "activations": "keep"},
    "memferry": {"placement": "fill", "activations": "keep", "gradient_reserve": None},
    "go_memferry": {"placement": "fill", "activations": "keep", "gradient_reserve": 0.0},
    "tencache": {"placement": "fill", "activations": "keep", "gradient_reserve": 1.0, "prefetch": True},
    "teraio": {"placement": "fill", "activations": "teraio"},
    "protrain": {"placement": "search", "activations": "auto"},
    "lohan": {"placement": "host", "activations": "lohan", "update_during_backward": True},
    # DeepSpeed's configurations (docs/guide.md, "Presets and the papers"): stage 2 with offload_optimizer to the CPU;
    # stage 3 with offload_param and offload_optimizer to the CPU; stage 3 with both to NVMe
    "zero_offload": {"placement": "offload_states", "activations": "keep", "gradient_reserve": 1.0, "update_during_backward": False},
    "zero3_offload": {"placement": "host", "activations": "keep", "gradient_reserve": 1.0, "update_during_backward": False},
    "zero_infinity": {"placement": "nvme", "activations": "keep", "gradient_reserve": 1.0, "update_during_backward": False},
    "l2l": {"placement": "layerwise", "activations": "keep", "prefetch": False, "update_during_backward": False},
}


@dataclass(frozen=True)
class HardwareSpec:
    """A machine as the planner sees it. Bandwidths in GB/s (10^9 bytes/s), sizes in bytes.

    ``None`` means "not known": the profiler measures it on a real machine.
    """

    name: str
    gpu: str
    gpu_memory: int
    gpu_bf16_tflops: Optional[float]
    gpu_fp16_tflops: Optional[float]
    h2d_gbps: Optional[float]
    d2h_gbps: Optional[float]
    host_memory: int
    cpu_cores: int
    nvme_count: int = 0
    nvme_read_gbps: Optional[float] = None
    nvme_write_gbps: Optional[float] = None
    # one drive's own rates, where the array's (above) are below their sum: fewer drives than the
    # machine has run at these each, up to the array's (``hardware.specs.known_hardware``)
    nvme_drive_read_gbps: Optional[float] = None
    nvme_drive_write_gbps: Optional[float] = None
    host_memory_gbps: Optional[float] = None  # what the CPU's memory channels move, both directions together
    # dense fp32 peak without tensor cores: what `32-true` matmuls run at under torch's default
    # (torch.backends.cuda.matmul.allow_tf32 is False)
    gpu_fp32_tflops: Optional[float] = None
    # the GPU memory's datasheet bandwidth, which memory-bound kernels (element-wise operations,
    # norms, the loss's softmax) run at
    gpu_memory_gbps: Optional[float] = None
    source: str = ""
    # GPUs in the machine whose ranks share its CPU cores, memory channels and host memory (a
    # spec that already describes one GPU's share of a larger machine says 1)
    gpus: int = 1

    _SIZE_FIELDS = ("gpu_memory", "host_memory")

    def __post_init__(self) -> None:
        for field in self._SIZE_FIELDS:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                object.__setattr__(self, field, parse_size(value, f"hardware.{field}"))
        for field in ("gpu_bf16_tflops", "gpu_fp16_tflops", "gpu_fp32_tflops", "h2d_gbps", "d2h_gbps", "nvme_read_gbps", "nvme_write_gbps",
                      "nvme_drive_read_gbps", "nvme_drive_write_gbps", "host_memory_gbps", "gpu_memory_gbps"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, (int, float)) or value < 0):
                raise ValueError(f"hardware.{field}={value!r} must be a non-negative number or None.")
        for field in ("cpu_cores", "nvme_count"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"hardware.{field}={value!r} must be a non-negative integer.")
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"hardware.gpus={self.gpus!r} must be a positive integer (the GPUs sharing this machine's CPU).")

    def rank_share(self, ranks: int) -> "HardwareSpec":
        """What each of ``ranks`` data-parallel ranks on this machine has of its CPU side: cores,
        memory channels and host memory divided among the ranks its GPUs run (at most ``gpus``);
        each GPU keeps its own link."""
        sharing = max(1, min(ranks, self.gpus))
        if sharing == 1:
            return self
        bandwidth = None if self.host_memory_gbps is None else self.host_memory_gbps / sharing
        return dataclasses.replace(self, cpu_cores=max(1, self.cpu_cores // sharing), host_memory_gbps=bandwidth,
                                   host_memory=self.host_memory // sharing, gpus=1)

    def peak_flops(self, dtype_name: str) -> Optional[float]:
        """Dense peak FLOP/s of the GPU for ``bf16``, ``fp16`` or ``fp32`` work, if known."""
        tflops = {"bf16": self.gpu_bf16_tflops, "fp16": self.gpu_fp16_tflops, "fp32": self.gpu_fp32_tflops}.get(dtype_name)
        if dtype_name not in ("bf16", "fp16", "fp32"):
            raise ValueError(f"no peak for dtype {dtype_name!r}; choose bf16, fp16 or fp32.")
        return None if not tflops else tflops * 1e12

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def compute_dtype(precision: str) -> str:
    """The dtype a Lightning precision flag's matmuls run in: ``bf16``, ``fp16`` or ``fp32``."""
    precision = str(precision)
    if precision.startswith("bf16"):
        return "bf16"
    if precision.startswith("16"):
        return "fp16"
    return "fp32"
