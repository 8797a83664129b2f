
import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from offload_strategy import Budget, HardwareSpec, MemoryBudgetError, PolicyConfig, TieredStrategy, known_hardware, parse_size
from offload_strategy.hardware import KNOWN_MACHINES, probe_hardware, resolve_hardware


@pytest.mark.parametrize(
    "text, expected",
    [(0, 0), (1536, 1536), ("1536", 1536), ("1KiB", 1024), ("1 KB", 1000), ("16GiB", 16 * 2**30), ("16gb", 16 * 10**9), ("1.5T", int(1.5 * 2**40)), ("2M", 2 * 2**20)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["lots", "16 parsecs", "-1GiB", -5, "", True, 1.5, [1]])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="size|negative|whole"):
        parse_size(bad, "host_memory")


def test_budget_forms_and_resolution():
    assert Budget.parse(None, "x").resolve(1000) == 1000
    assert Budget.parse(0.25, "x").resolve(1000) == 250
    assert Budget.parse("50%", "x").resolve(1000) == 500
    assert Budget.parse(1.0, "x").resolve(1000) == 1000
    assert Budget.parse("1KiB", "x").resolve(10) == 1024  # absolute budgets are checked at setup, not clipped


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gpu_memory": -1}, r"gpu_memory=-1 is negative"),
        ({"host_memory": "12 bananas"}, r"host_memory='12 bananas' is not a size"),
        ({"gpu_memory": 1.5}, r"gpu_memory=1.5: a float is a fraction .* \(0, 1\]"),
        ({"host_memory": 0.0}, r"host_memory=0.0: a float is a fraction"),
        ({"host_memory": "150%"}, r"host_memory='150%': a percentage of the free memory must lie in \(0%, 100%\]"),
        ({"nvme_memory": "1GiB"}, r"nvme_memory='1GiB' was given without nvme_path"),
        ({"policy": "fastest"}, r"policy='fastest' is not a policy name or preset; choose one of auto, none, fill, memferry"),
        ({"policy": {"name": "auto", "speed": 11}}, r"unknown fields \['speed'\]"),
        ({"hardware": "dgx9000"}, r"hardware='dgx9000' is not a known machine; known: a100_40g"),
        ({"plan_file": "/nonexistent/plan.json"}, r"plan_file='/nonexistent/plan.json' is not a file"),
    ],
)
def test_constructor_rejects(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TieredStrategy(**kwargs)


def test_nvme_path_that_is_a_file_is_rejected(tmp_path):
    file = tmp_path / "swap"
    file.write_text("x")
    with pytest.raises(ValueError, match=r"nvme_path=.*swap' exists and is not a directory"):
        TieredStrategy(nvme_path=file)


def test_constructor_stores_what_was_asked(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    strategy = TieredStrategy(policy="none", hardware="rtx4090", gpu_memory="8GiB", host_memory=0.5, nvme_path=tmp_path / "nvme", nvme_memory="1GiB", plan_file=plan)
    assert strategy.policy == PolicyConfig("none")
    assert strategy.hardware is KNOWN_MACHINES["rtx4090"]
    assert strategy.gpu_memory == Budget(bytes=8 * 2**30)
    assert strategy.host_memory == Budget(fraction=0.5)
    assert strategy.nvme_path == (tmp_path / "nvme").absolute()
    assert strategy.plan_file == plan
    assert not (tmp_path / "nvme").exists(), "constructing must not touch the disk"


def test_setup_refuses_budget_larger_than_free(tmp_path):
    trainer = L.Trainer(strategy=TieredStrategy(host_memory="1000TiB"), accelerator="cpu", devices=1, max_steps=1, logger=False, default_root_dir=tmp_path)
    with pytest.raises(MemoryBudgetError, match=r"host_memory=1000.00 TiB asks for more than is free in host memory: .* GiB free"):
        trainer.fit(BoringModel())


def test_setup_resolves_budgets(tmp_path):
    strategy = TieredStrategy(gpu_memory="64MiB", host_memory=0.5, nvme_path=tmp_path, nvme_memory="1MiB")
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=2, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    trainer.fit(BoringModel())
    assert strategy.budgets.gpu == 64 * 2**20
    assert strategy.budgets.nvme == 2**20
    assert 0 < strategy.budgets.host
    assert strategy.hardware is not None and strategy.hardware.name == "auto"
    metrics = strategy.metrics()
    assert metrics["budget/gpu_bytes"] == 64 * 2**20
    assert metrics["memory/process_peak_rss_bytes"] > 10 * 2**20


def test_known_hardware_and_overrides():
    spec = known_hardware("H100-80G", host_memory="512GiB")
    assert spec.host_memory == 512 * 2**30
    assert spec.gpu_memory == 80 * 2**30
    assert spec.peak_flops("bf16") == pytest.approx(989.4e12)
    assert known_hardware("v100_16g").peak_flops("bf16") is None
    with pytest.raises(ValueError, match="not fields of HardwareSpec"):
        known_hardware("h200", pcie_lanes=16)


def test_every_known_machine_is_complete():
    for name, spec in KNOWN_MACHINES.items():
        assert spec.name == name
        assert spec.gpu_memory >= 16 * 2**30 and spec.host_memory >= spec.gpu_memory
        assert spec.h2d_gbps and spec.d2h_gbps and spec.cpu_cores > 0
        assert spec.gpu_memory_gbps and spec.gpu_memory_gbps > 5 * spec.h2d_gbps  # memory-bound work is priced for every one
        assert spec.source, f"{name} cites no source"


def test_a_probed_gpu_borrows_its_datasheet_memory_bandwidth():
    """A probed machine takes the peaks its GPU's datasheet gives, the memory bandwidth among them
    (an A100 with 40 GB is the 40 GB card's 1,555 GB/s, not the 80 GB one's 2,039)."""
    from offload_strategy.hardware.probe import _borrowed_figures

    assert _borrowed_figures("NVIDIA A100-SXM4-80GB", 80 * 2**30)["gpu_memory_gbps"] == 2039.0
    assert _borrowed_figures("NVIDIA A100-SXM4-40GB", 40 * 2**30)["gpu_memory_gbps"] == 1555.0
    assert _borrowed_figures("an unknown card", 8 * 2**30)["gpu_memory_gbps"] is None


def test_a_gpu_tier_of_all_that_is_free_leaves_cublas_its_workspaces(monkeypatch):
    """cuBLAS takes a workspace per thread and stream multiplying matrices, outside every tier:
    measured on an H200 (compute capability 9), 32 MiB at the first product and 1 MiB of
    cuBLASLt's at the first with a bias, again for autograd's backward thread. A tier granted all
    free memory used to leave nothing for them."""
    from offload_strategy.hardware import cublas_workspace_bytes, gpu_free
    from offload_strategy.hardware import probe

    assert cublas_workspace_bytes(9) == 33 * 2**20
    assert cublas_workspace_bytes(8) == 8 * 2**20 + 128 * 2**10 + 2**20  # ":4096:2:16:8" and 1 MiB
    assert cublas_workspace_bytes(9, ":4096:2", "0") == 8 * 2**20
    assert cublas_workspace_bytes(8, ":16:8", "2048") == 128 * 2**10 + 2 * 2**20
    monkeypatch.setattr(probe.torch.cuda, "mem_get_info", lambda device: (10 * 2**30, 80 * 2**30))
    monkeypatch.setattr(probe.torch.cuda, "get_device_capability", lambda device: (9, 0))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("TORCH_CUBLASLT_WORKSPACE_SIZE", raising=False)
    share = 4 * 2**30  # probe.GPU_MARGIN_SHARE of the 80 GiB (tests/test_gpu_margin.py)
    assert gpu_free(torch.device("cuda", 0)) == 10 * 2**30 - 66 * 2**20 - share
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8:4096:8")
    assert gpu_free(torch.device("cuda", 0)) == 10 * 2**30 - 2 * 65 * 2**20 - share


def test_probe_and_resolve():
    spec = probe_hardware()
    assert spec.host_memory > 0 and spec.cpu_cores >= 1
    assert resolve_hardware({"name": "x", "gpu": "g", "gpu_memory": "1GiB", "gpu_bf16_tflops": None, "gpu_fp16_tflops": None, "h2d_gbps": 1.0, "d2h_gbps": 1.0, "host_memory": "2GiB", "cpu_cores": 2}).gpu_memory == 2**30
    with pytest.raises(ValueError, match="does not describe a HardwareSpec"):
        resolve_hardware({"name": "x"})
    with pytest.raises(ValueError, match=r"hardware.h2d_gbps=-1"):
        HardwareSpec(name="x", gpu="g", gpu_memory=1, gpu_bf16_tflops=None, gpu_fp16_tflops=None, h2d_gbps=-1, d2h_gbps=1, host_memory=1, cpu_cores=1)


def test_unwritable_nvme_path_is_refused_before_training(tmp_path):
    import os

    if os.geteuid() == 0:
        # root writes anywhere: use a path under a regular file instead
        blocker = tmp_path / "file"
        blocker.write_text("x")
        path = blocker / "nvme"
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        path = locked / "nvme"
    trainer = L.Trainer(strategy=TieredStrategy(nvme_path=path), accelerator="cpu", devices=1, max_steps=1, logger=False, default_root_dir=tmp_path)
    with pytest.raises(ValueError, match=r"nvme_path=.* cannot hold the NVMe tier's files: .*Give a directory"):
        trainer.fit(BoringModel())


def test_inference_needs_no_trainable_parameters(tmp_path):
    # fit from a frozen model is in tests/test_recipes.py (a callback unfreezes it, as plain allows)
    model = BoringModel()
    model.requires_grad_(False)
    trainer = L.Trainer(strategy=TieredStrategy(), accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path)
    assert trainer.validate(model, verbose=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_a_gpu_asked_for_where_there_is_none_is_refused_before_training(tmp_path):
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match="No supported gpu backend found"):
        L.Trainer(strategy=TieredStrategy(), accelerator="gpu", devices=1, logger=False, default_root_dir=tmp_path)


def test_the_default_policy_plans_everything_and_none_plans_nothing():
    default = PolicyConfig()
    assert (default.name, default.placement, default.activations) == ("auto", "search", "auto")
    none = PolicyConfig(name="none")
    assert (none.placement, none.activations) == ("fill", "keep")
    chosen = PolicyConfig(placement="fill", activations=["keep", "checkpoint"])
    assert (chosen.placement, chosen.activations) == ("fill", ("keep", "checkpoint"))
    assert PolicyConfig.coerce({"name": "auto", "throttle": True}).activations == "auto"
