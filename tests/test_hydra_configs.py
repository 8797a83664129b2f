"""Every option of every config group composes and instantiates, with HydraConfig set as Hydra would.
What experiments/train.py makes of them (the strategy, the logger, the logged configuration, the
shape checks) is tested by running it, in tests/test_first_day_job.py."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from offload_strategy import HardwareSpec, PolicyConfig, TieredStrategy
from offload_strategy.demos import CausalLM

CONF = Path(__file__).resolve().parent.parent / "conf"

# Published sizes of the shapes each model config copies, in millions of parameters.
PUBLISHED_MILLIONS = {
    "gpt2_tiny": 3.29,
    "gpt2_small": 124,
    "gpt2_medium": 355,
    "gpt2_xl": 1558,
    "opt_1_3b": 1316,
    "llama_1b": 1236,
    "llama_7b": 6738,
    "mistral_7b": 7242,
    "mixtral_8x7b": 46703,
    "llama_70b": 70000,
    "gpt3_175b": 175000,
}


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def compose_as_hydra(overrides: list[str], output_dir: Path) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = str(output_dir)  # set by Hydra when a job starts
    HydraConfig.instance().set_config(cfg)
    return cfg


def test_every_group_has_options():
    for group in ("model", "data", "hardware", "policy", "trainer", "logger", "experiment"):
        assert options(group), f"conf/{group}/ is empty"
    assert set(PUBLISHED_MILLIONS) == set(options("model"))


@pytest.mark.parametrize("name", options("model"))
def test_model_configs_build_the_published_shapes(name, tmp_path):
    cfg = compose_as_hydra([f"model={name}"], tmp_path)
    module = instantiate(cfg.model)
    assert isinstance(module, CausalLM) and module.model is None  # building is deferred
    with torch.device("meta"):
        module.configure_model()
    millions = module.num_parameters / 1e6
    assert millions == pytest.approx(PUBLISHED_MILLIONS[name], rel=0.02)
    assert module.flops_per_token(128) > 6 * module.active_parameters
    if name.startswith("mixtral"):  # 2 of 8 experts a token: 12.9 B active parameters
        assert module.active_parameters / 1e9 == pytest.approx(12.9, rel=0.01)
    else:
        assert module.active_parameters == module.num_parameters


@pytest.mark.parametrize("name", options("data"))
def test_data_configs_load_batches(name, tmp_path):
    overrides = [f"data={name}"]
    if name == "text":
        corpus = tmp_path / "corpus"
        corpus.mkdir()
        for i in range(3):
            (corpus / f"part{i}.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
        overrides.append(f"data.path={corpus}")
    if name == "stdlib":
        overrides.append("data.max_bytes=200000")
    cfg = compose_as_hydra(overrides, tmp_path)
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    assert batch.shape == (cfg.data.batch_size, cfg.data.seq_len) and batch.dtype == torch.long
    assert int(batch.max()) < datamodule.vocab_size
    assert len(datamodule.val_set) > 0


@pytest.mark.parametrize("name", options("hardware"))
def test_hardware_configs(name, tmp_path):
    cfg = compose_as_hydra([f"hardware={name}"], tmp_path)
    spec = instantiate(cfg.hardware)
    assert isinstance(spec, HardwareSpec)
    assert spec.name == name
    assert TieredStrategy(policy=instantiate(cfg.policy), hardware=spec).hardware is spec


def test_hardware_fields_can_be_overridden(tmp_path):
    cfg = compose_as_hydra(["hardware=rtx4090", "+hardware.host_memory=256GiB"], tmp_path)
    assert instantiate(cfg.hardware).host_memory == 256 * 2**30


@pytest.mark.parametrize("name", options("policy"))
def test_policy_configs(name, tmp_path):
    cfg = compose_as_hydra([f"policy={name}"], tmp_path)
    policy = instantiate(cfg.policy)
    assert isinstance(policy, PolicyConfig) and policy.name == ("none" if name == "none" else "auto")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.gpu) if n == "gpu" else n for n in options("trainer")])
def test_trainer_configs(name, tmp_path):
    cfg = compose_as_hydra([f"trainer={name}"], tmp_path)
    trainer = instantiate(cfg.trainer, strategy=TieredStrategy(policy=instantiate(cfg.policy), hardware=instantiate(cfg.hardware)), logger=False)
    assert isinstance(trainer, L.Trainer) and isinstance(trainer.strategy, TieredStrategy)
    assert trainer.default_root_dir == str(tmp_path)


@pytest.mark.parametrize("name", options("logger"))
def test_logger_configs(name, tmp_path):
    cfg = compose_as_hydra([f"logger={name}"], tmp_path)
    logger = instantiate(cfg.logger) if cfg.logger.get("_target_") else None  # as the job builds it
    if name == "none":
        assert logger is None
    else:
        assert logger is not None and Path(logger.save_dir) == tmp_path


@pytest.mark.parametrize("name", [n for n in options("logger") if n.startswith("wandb")])
def test_wandb_runs_of_a_policy_sweep_are_told_apart_and_grouped(name, tmp_path):
    names = {compose_as_hydra([f"logger={name}", f"policy={policy}"], tmp_path).logger.name for policy in ("auto", "lohan", "zero_offload")}
    assert names == {"gpt2-tiny-auto-tiered", "gpt2-tiny-lohan-tiered", "gpt2-tiny-zero_offload-tiered"}
    assert compose_as_hydra([f"logger={name}"], tmp_path).logger.group


@pytest.mark.parametrize("name", options("experiment"))
def test_experiment_presets_compose(name, tmp_path):
    cfg = compose_as_hydra([f"experiment={name}"], tmp_path)
    assert cfg.hydra.runtime.choices["experiment"] == name
    with open_dict(cfg):
        del cfg["hydra"]  # its sweep paths resolve only inside a running multirun
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved["trainer"]["default_root_dir"] == str(tmp_path)
    assert isinstance(instantiate(cfg.model), CausalLM)
    assert isinstance(instantiate(cfg.hardware), HardwareSpec)
