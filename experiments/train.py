"""Train a model with the tiered strategy, as configured by Hydra.

    python experiments/train.py                                   # the built-in default
    python experiments/train.py model=gpt2_small trainer.max_steps=50
    python experiments/train.py -m model=gpt2_tiny strategy.name=tiered,auto   # a sweep

Prints a summary table, writes ``metrics.json`` into the job's output directory, and returns
the configured objective for sweepers.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional, Union

# Models are built from configs; nothing may be fetched from a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("WANDB_SILENT", "true")
# Lightning 2.6 on torch 2.13 warns about its own pytree helper on every run; nothing to act on.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")

if __package__ in (None, ""):  # run as a script: make `experiments` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_original_cwd, instantiate
from lightning.pytorch.callbacks import ModelCheckpoint, ThroughputMonitor
from lightning.pytorch.loggers import Logger, WandbLogger
from omegaconf import DictConfig, OmegaConf

from experiments.summary import MetricsRecorder, build_summary, format_short_summary, write_json_atomic
from offload_strategy import HardwareSpec, MemoryBudgetError, OffloadMonitor, TieredDDPStrategy, TieredStrategy
from offload_strategy.config import compute_dtype
from offload_strategy.planning.placement import PlacementError

# where a job keeps its checkpoints, under its output directory: ``last.ckpt`` is the run's last step
CHECKPOINTS = "checkpoints"


def build_strategy(cfg: DictConfig, hardware: HardwareSpec) -> Union[TieredStrategy, TieredDDPStrategy, str]:
    """``strategy.name=tiered`` gives a TieredStrategy, ``tiered_ddp`` a TieredDDPStrategy (one
    rank per ``trainer.devices``); any other name is passed to Lightning."""
    options: dict[str, Any] = OmegaConf.to_container(cfg.strategy, resolve=True)  # type: ignore[assignment]
    name = options.pop("name")
    shard_states = options.pop("shard_states", True)
    share_host_homes = options.pop("share_host_homes", False)
    if name == "tiered_ddp":
        return TieredDDPStrategy(policy=instantiate(cfg.policy), hardware=hardware, shard_states=shard_states, share_host_homes=share_host_homes, **options)
    if name != "tiered":
        return name
    return TieredStrategy(policy=instantiate(cfg.policy), hardware=hardware, **options)


def build_logger(cfg: DictConfig) -> Optional[Logger]:
    return instantiate(cfg.logger) if cfg.logger.get("_target_") else None


def check_shapes(cfg: DictConfig, vocab_size: int, seq_len: int) -> None:
    """Refuse a model that cannot read the data before anything is built."""
    model_cfg = cfg.model.config
    positions = model_cfg.get("n_positions") or model_cfg.get("max_position_embeddings")
    if positions is not None and seq_len > positions:
        raise ValueError(f"data.seq_len={seq_len} exceeds the {cfg.model.name} context of {positions} positions; lower data.seq_len.")
    vocab = model_cfg.get("vocab_size")
    if vocab is not None and vocab_size > vocab:
        raise ValueError(f"the data has {vocab_size} token ids but {cfg.model.name} a vocabulary of {vocab}; raise model.config.vocab_size.")


def hyperparameters(cfg: DictConfig, hardware: HardwareSpec) -> dict[str, Any]:
    """What the logger records of the job: its configuration as plain values (the model's config a
    nested dict, without Hydra's ``_target_`` class paths), the overrides that made it, and the
    hardware's values as probed or named."""
    # Hydra's own settings are there only where the config was composed with them (tests, tools)
    values = {key: OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node for key, node in cfg.items() if key != "hydra"}
    config: dict[str, Any] = _without_targets(values)
    config["hardware"] = hardware.to_dict()
    config["overrides"] = list(HydraConfig.get().overrides.task)
    config["preset"] = preset_name()
    return config


def preset_name() -> str:
    """The policy preset's name (``conf/policy/<name>.yaml``), a key of its own to filter and group runs by."""
    return str(HydraConfig.get().runtime.choices.get("policy", "custom"))


def resolve_resume(resume: Optional[str]) -> Optional[str]:
    """``resume=last``: the ``last.ckpt`` of the latest job under ``outputs/`` and ``multirun/`` of the
    directory the job was started from; any other value is a checkpoint's path, as Lightning takes it."""
    if resume != "last":
        return resume
    root = Path(get_original_cwd())
    found = [p for top in ("outputs", "multirun") for p in (root / top).glob(f"**/{CHECKPOINTS}/last.ckpt")]
    if not found:
        raise FileNotFoundError(f"resume=last: no {CHECKPOINTS}/last.ckpt under {root / 'outputs'} or {root / 'multirun'}; "
                                f"run a job first, or give resume=<path to a .ckpt>.")
    return str(max(found, key=lambda p: p.stat().st_mtime))


def trainer_options(cfg: DictConfig) -> dict[str, Any]:
    """A run shorter than ``val_check_interval`` validates at its last step, so ``val_loss`` (the
    sweep's default objective) is known for every run."""
    max_steps, interval = cfg.trainer.get("max_steps", -1), cfg.trainer.get("val_check_interval")
    if isinstance(interval, int) and max_steps is not None and 0 < max_steps < interval:
        return {"val_check_interval": max_steps}
    return {}


def record_refusal(output_dir: Path, error: ValueError) -> float:
    """A sweep's job refused for its budgets: its ``metrics.json`` says why, and the sweep goes on."""
    write_json_atomic(output_dir / "metrics.json", {"preset": preset_name(), "refused": str(error), "error": type(error).__name__,
                                                    "overrides": list(HydraConfig.get().overrides.task)})
    print(f"refused: {error}\nrecorded in {output_dir / 'metrics.json'}; the sweep goes on", file=sys.stderr)
    return float("nan")


def _without_targets(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_targets(v) for k, v in value.items() if k != "_target_"}
    if isinstance(value, list):
        return [_without_targets(v) for v in value]
    return value


def report_summary(logger: Logger, summary: dict[str, Any], step: int) -> None:
    """The run's summary figures: W&B keeps them as the run's summary, apart from its history;
    other loggers get them as one last row."""
    numbers = {f"summary/{k}": float(v) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if isinstance(logger, WandbLogger):
        logger.experiment.summary.update(numbers)
    else:
        logger.log_metrics(numbers, step=step)
        logger.save()  # fit has ended, and with it the logger's own writes: a CSV file would never get the row


def finish_wandb() -> None:
    # Between multirun jobs the W&B run must be closed, or the next job logs into it.
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()


def run(cfg: DictConfig) -> float:
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    L.seed_everything(cfg.seed, workers=True)

    datamodule = instantiate(cfg.data)
    check_shapes(cfg, datamodule.vocab_size, datamodule.seq_len)
    module = instantiate(cfg.model, _convert_="all")  # plain containers in the checkpoint's hyperparameters
    hardware: HardwareSpec = instantiate(cfg.hardware)
    strategy = build_strategy(cfg, hardware)

    logger = build_logger(cfg)
    recorder = MetricsRecorder(mirror=logger)
    loggers: list[Logger] = ([logger] if logger is not None else []) + [recorder]
    checkpoints = ModelCheckpoint(dirpath=output_dir / CHECKPOINTS, save_last=True)
    callbacks = [
        ThroughputMonitor(batch_size_fn=lambda batch: batch.shape[0], length_fn=lambda batch: batch.numel(), window_size=cfg.throughput_window),
        OffloadMonitor(),
        checkpoints,
    ]
    trainer: L.Trainer = instantiate(cfg.trainer, strategy=strategy, logger=loggers, callbacks=callbacks, **trainer_options(cfg))
    if logger is not None:
        logger.log_hyperparams(hyperparameters(cfg, hardware))

    device = trainer.strategy.root_device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        start = time.perf_counter()
        trainer.fit(module, datamodule=datamodule, ckpt_path=resolve_resume(cfg.resume))
        wall = time.perf_counter() - start
        precision = str(trainer.precision)
        summary = build_summary(
            recorder,
            model_name=module.name,
            num_parameters=module.num_parameters,
            strategy=type(trainer.strategy).__name__,
            steps=trainer.global_step,
            wall_seconds=wall,
            peak_flops=hardware.peak_flops(compute_dtype(precision)) if device.type == "cuda" else None,
            peak_gpu_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            offload=trainer.strategy.metrics(reset=False) if isinstance(trainer.strategy, (TieredStrategy, TieredDDPStrategy)) else None,
        )
        summary["preset"] = preset_name()
        summary["checkpoint"] = checkpoints.last_model_path or checkpoints.best_model_path or None
        if logger is not None:
            report_summary(logger, summary, trainer.global_step)
    finally:
        finish_wandb()
    if not trainer.is_global_zero:  # under data parallelism rank 0 reports for the run
        objective = summary.get(cfg.objective)
        return float("nan") if objective is None else float(objective)
    payload = {
        **summary,
        "precision": precision,
        "hardware": hardware.to_dict(),
        "overrides": list(HydraConfig.get().overrides.task),
        "loss_curve": recorder.history.get("train/loss", []),
    }
    write_json_atomic(output_dir / "metrics.json", payload)
    print(format_short_summary(summary, output_dir / "metrics.json"))
    objective = summary.get(cfg.objective)
    if cfg.objective not in summary:
        raise ValueError(f"objective={cfg.objective!r} is not in the summary; choose one of {', '.join(summary)}.")
    return float("nan") if objective is None else float(objective)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    try:
        return run(cfg)
    except (PlacementError, MemoryBudgetError) as error:  # budgets refused, when the strategy is built or set up
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            raise
        return record_refusal(Path(HydraConfig.get().runtime.output_dir), error)


if __name__ == "__main__":
    main()
