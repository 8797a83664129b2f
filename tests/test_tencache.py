"""10Cache Algorithms 1 and 2 on hand-worked cases."""

import ast
from pathlib import Path

import pytest

from offload_strategy.planning.searches import buffer_counts as tencache
from offload_strategy.planning.searches.buffer_counts import SizeClass, buffer_counts, size_classes, size_counts, tensor_size_distribution

# The running example: four 512-byte, two 1024-byte and one 4096-byte tensor.
# Bytes per size: 512*4 = 2048, 1024*2 = 2048, 4096*1 = 4096; total 8192.
TC = {512: 4, 1024: 2, 4096: 1}


def test_size_counts_histogram_drops_empty_tensors():
    assert size_counts([1024, 512, 4096, 512, 0, 512, 1024, 512]) == TC
    assert list(size_counts([4096, 512, 1024])) == [512, 1024, 4096]  # sorted by size
    assert size_counts([]) == {}


@pytest.mark.parametrize("bad", [-1, 1.5, "512", True])
def test_size_counts_rejects_non_sizes(bad):
    with pytest.raises(ValueError, match="whole numbers of bytes"):
        size_counts([512, bad])


def test_algorithm_1_distribution():
    # TSD[s] = s*c / 8192: 2048/8192, 2048/8192, 4096/8192.
    assert tensor_size_distribution(TC) == {512: 0.25, 1024: 0.25, 4096: 0.5}
    assert tensor_size_distribution({}) == {}
    assert tensor_size_distribution({512: 0}) == {512: 0.0}  # no bytes: no division by zero


def test_algorithm_2_budgets_split_by_share_and_cpu_capped_by_what_gpu_holds():
    # gpu_bytes = 4096: shares 1024, 1024, 2048 bytes
    #   gpu[512]  = min(floor(1024/512)=2, 4) = 2
    #   gpu[1024] = min(floor(1024/1024)=1, 2) = 1
    #   gpu[4096] = min(floor(2048/4096)=0, 1) = 0   (half a big tensor's share holds no buffer)
    # cpu_bytes = 8192: shares 2048, 2048, 4096 bytes
    #   cpu[512]  = min(floor(2048/512)=4,   4-2=2) = 2   <- cap c - gpu bites
    #   cpu[1024] = min(floor(2048/1024)=2,  2-1=1) = 1   <- cap c - gpu bites
    #   cpu[4096] = min(floor(4096/4096)=1,  1-0=1) = 1
    gpu, cpu = buffer_counts(TC, tensor_size_distribution(TC), gpu_bytes=4096, cpu_bytes=8192)
    assert gpu == {512: 2, 1024: 1, 4096: 0}
    assert cpu == {512: 2, 1024: 1, 4096: 1}
    assert sum(s * n for s, n in gpu.items()) <= 4096 and sum(s * n for s, n in cpu.items()) <= 8192


def test_algorithm_2_gpu_count_cap_leaves_nothing_for_cpu():
    # gpu_bytes = 65536: floor(16384/512)=32, floor(16384/1024)=16, floor(32768/4096)=8,
    # each capped at its count c: 4, 2, 1. The CPU then gets min(..., c - c) = 0 everywhere.
    gpu, cpu = buffer_counts(TC, tensor_size_distribution(TC), gpu_bytes=65536, cpu_bytes=65536)
    assert gpu == TC
    assert cpu == {512: 0, 1024: 0, 4096: 0}


def test_algorithm_2_small_cpu_budget_floors():
    # No GPU; cpu_bytes = 2048: shares 512, 512, 1024 bytes -> floor 1, 0, 0 buffers.
    gpu, cpu = buffer_counts(TC, tensor_size_distribution(TC), gpu_bytes=0, cpu_bytes=2048)
    assert gpu == {512: 0, 1024: 0, 4096: 0}
    assert cpu == {512: 1, 1024: 0, 4096: 0}


def test_algorithm_2_exact_fit_survives_floating_point_shares():
    # TC = {1: 4, 9: 5}: total 49 bytes, TSD[1] = 4/49. With gpu_bytes = 49 the size-1 share is
    # exactly 4 bytes, but 4/49*49 in floats is 3.9999999999999996: a plain floor loses a buffer.
    counts = {1: 4, 9: 5}
    gpu, _ = buffer_counts(counts, tensor_size_distribution(counts), gpu_bytes=49, cpu_bytes=0)
    assert gpu == {1: 4, 9: 5}


@pytest.mark.parametrize(
    "distribution, gpu_bytes, message",
    [
        ({512: 0.25, 1024: 0.25}, 0, r"no share for tensor sizes \[4096\]"),
        ({512: 0.5, 1024: 0.5, 4096: 0.5}, 0, r"sum to 1.5 > 1"),
        ({512: -0.1, 1024: 0.25, 4096: 0.5}, 0, r"not fractions in \[0, 1\]"),
        ({512: 0.25, 1024: 0.25, 4096: 0.5}, -1, r"gpu_bytes=-1"),
    ],
)
def test_algorithm_2_rejects_bad_inputs(distribution, gpu_bytes, message):
    with pytest.raises(ValueError, match=message):
        buffer_counts(TC, distribution, gpu_bytes=gpu_bytes, cpu_bytes=0)


def test_size_classes_largest_first_without_empty_classes():
    gpu, cpu = buffer_counts(TC, tensor_size_distribution(TC), gpu_bytes=4096, cpu_bytes=8192)
    assert size_classes(gpu) == [SizeClass(1024, 1), SizeClass(512, 2)]
    assert size_classes(cpu) == [SizeClass(4096, 1), SizeClass(1024, 1), SizeClass(512, 2)]
    with pytest.raises(ValueError, match="count -1"):
        size_classes({512: -1})


@pytest.mark.parametrize("kwargs", [{"slot_bytes": 0, "count": 1}, {"slot_bytes": 512, "count": -1}, {"slot_bytes": 1.5, "count": 1}])
def test_size_class_validates(kwargs):
    with pytest.raises(ValueError, match="SizeClass"):
        SizeClass(**kwargs)


def test_planning_does_not_import_torch():
    # planning is pure: neither the module nor the package's __init__ may import torch.
    package = Path(tencache.__file__).parent
    for path in (Path(tencache.__file__), package.parent / "__init__.py"):
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                imported.add(node.module.split(".")[0])
        assert "torch" not in imported, path
