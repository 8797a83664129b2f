"""The ``offload-strategy`` commands that were scripts of the repository: ``simulate``, ``plan``,
``probe`` and ``consolidate``, run in-process on small inputs, without Hydra where the model is a
Hugging Face config.json."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from offload_strategy import TieredStrategy
from offload_strategy.cli import _parser, main
from offload_strategy.config import parse_size
from offload_strategy.estimate import simulate as sim
from offload_strategy.estimate.models import causal_lm
from offload_strategy.estimate.shapes import Pricing
from offload_strategy.checkpoint.sharded import consolidate, write_sharded
from tests.helpers import TINY_GPT2, assert_same_weights, train

LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}


@pytest.fixture
def no_hydra(monkeypatch):
    """Hydra cannot be imported: what a wheel installed without the experiments extra sees."""
    for name in [n for n in sys.modules if n == "hydra" or n.startswith("hydra.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "hydra", None)


def config_file(tmp_path, fields=LLAMA):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(fields))
    return path


def table(out: str, header: str) -> list[list[str]]:
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines[start + 2:] if line.startswith("| ")]


def test_every_tool_is_a_command():
    commands = _parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    assert {"estimate", "simulate", "plan", "probe", "consolidate", "report"} <= set(commands)


def test_simulate_prices_a_config_file_without_hydra(tmp_path, capsys, no_hydra):
    path = config_file(tmp_path)
    assert main(["simulate", str(path), "--hardware", "rtx4090", "--batch-size", "2", "--seq-len", "32", "--precision", "32-true",
                 "--gpu-memory", "1MiB", "64MiB", "--largest-at-most", "4"]) == 0
    out = capsys.readouterr().out
    rows = table(out, "| gpu_memory | policy")
    assert [(r[0], r[1]) for r in rows] == [("1.00 MiB", "fill"), ("1.00 MiB", "auto"), ("64.00 MiB", "fill"), ("64.00 MiB", "auto")]
    # the rows are the simulator's own for that model: built here from the same file, priced the same way
    model = sim.build_from_config(path, sim.Shape(2, 32), Pricing(sim.resolve_hardware("rtx4090"), dtype="fp32"))
    machine = sim.machine_of(sim.resolve_hardware("rtx4090"), 0)
    expected = sim.compare_policies(model, machine, parse_size("1MiB"), int(0.95 * sim.resolve_hardware("rtx4090").host_memory), 0, None,
                                    [0] * len(model.sizes))
    assert rows[1][2] == expected[1].homes and rows[1][3] == expected[1].layout
    parameters, activations = (parse_size(part) for part in rows[1][4].split(" + "))
    assert parameters + activations <= 2**20 and int(rows[1][2].split("/")[1]) > 0  # within the budget, by offloading
    units = len(model.sizes)
    assert rows[2][2] == f"{units}/0/0"  # 64 MiB holds every unit
    assert f"{model.parameters / 1e9:.2f} B parameters in {units} units and 3 blocks" in out


def test_simulate_prices_a_preset_in_a_row_of_its_own(tmp_path, capsys, no_hydra):
    """A preset that fixes every home (lohan: all on host, its own activation planner) gets its row beside fill and
    auto, priced as the runtime places it; the default preset is the auto row itself."""
    args = ["simulate", str(config_file(tmp_path)), "--hardware", "rtx4090", "--batch-size", "2", "--seq-len", "32", "--gpu-memory", "64MiB",
            "--largest-at-most", "2"]
    assert main([*args, "--policy", "lohan"]) == 0
    rows = table(capsys.readouterr().out, "| gpu_memory | policy")
    assert [r[1] for r in rows] == ["fill", "host+lohan", "auto"]
    assert rows[1][2].startswith("0/") and rows[1][2].endswith("/0")  # every unit at home in host memory, though 64 MiB holds them all
    assert main([*args, "--policy", "auto"]) == 0
    assert [r[1] for r in table(capsys.readouterr().out, "| gpu_memory | policy")] == ["fill", "auto"]
    with pytest.raises(SystemExit, match="--policy: policy='nope' is not a policy name or preset; choose one of auto"):
        main([*args, "--policy", "nope"])


def test_hydra_overrides_without_hydra_say_what_to_give_instead(tmp_path, no_hydra):
    with pytest.raises(SystemExit, match="need Hydra, which is not installed: give a Hugging Face config.json"):
        main(["simulate", "model=llama_7b", "hardware=rtx4090"])
    with pytest.raises(SystemExit, match="need Hydra"):
        main(["plan", "--from-shapes", "--out", str(tmp_path / "plan.json"), "llama_7b"])
    with pytest.raises(SystemExit, match="either one config.json or Hydra overrides"):
        main(["simulate", str(config_file(tmp_path)), "data.batch_size=2"])


def test_options_other_than_overrides_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "model=gpt2_tiny", "--no-such-flag"])
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_a_plan_from_shapes_of_a_config_file_runs_in_the_strategy(tmp_path, capsys, no_hydra):
    """The tiny GPT-2 the tests train, planned from its config.json and the RTX 4090's spec within
    600 KiB of GPU tier: the strategy runs the plan (every unit where it says), and trains as plain
    Lightning does."""
    path = config_file(tmp_path, {"model_type": "gpt2", **TINY_GPT2})
    plan = tmp_path / "plan.json"
    assert main(["plan", "--from-shapes", "--out", str(plan), str(path), "--hardware", "rtx4090", "--batch-size", "4", "--seq-len", "16",
                 "--gpu-memory", "600KiB", "--host-memory", "1GiB"]) == 0
    out = capsys.readouterr().out
    assert "built on the meta device" in out and "| unit | name | bytes | home |" in out
    written = json.loads(plan.read_text())
    assert written["budgets"] == {"gpu": 600 * 2**10, "host": 2**30, "nvme": 0}
    homes = [u["home"] for u in written["units"]]
    assert "host" in homes and "gpu" in homes, homes
    assert len(written["activations"]) == TINY_GPT2["n_layer"]
    names = [name for name, _ in causal_lm(path).named_parameters()]
    assert all(any(p.startswith(u["name"] + ".") or p == u["name"] for p in names) for u in written["units"])

    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=1)
    seen = []

    class Seen(Callback):
        def on_train_end(self, trainer, pl_module) -> None:
            engine = trainer.strategy.engine
            seen.extend(engine.placement.home[i] for i in range(len(engine.states)))

    strategy = TieredStrategy(gpu_memory="600KiB", host_memory="1GiB", plan_file=plan)
    losses, weights, _ = train(strategy, tmp_path / "planned", epochs=1, extra_callbacks=(Seen(),))
    assert seen == homes
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def test_plan_shows_a_plan_file_and_needs_out_or_show(tmp_path, capsys):
    with pytest.raises(SystemExit, match="give --out PLAN.json to make a plan, or --show PLAN.json"):
        main(["plan"])
    with pytest.raises(SystemExit, match="a plan made by running needs the repository's Hydra job"):
        main(["plan", "--out", str(tmp_path / "p.json"), str(config_file(tmp_path))])


def _checkpoint() -> dict:
    generator = torch.Generator().manual_seed(3)
    weights = {"layer.weight": torch.randn(8, 4, generator=generator), "layer.bias": torch.randn(8, generator=generator)}
    states = {0: {"exp_avg": torch.randn(8, 4, generator=generator), "step": torch.tensor(5.0)}}
    return {"state_dict": weights, "optimizer_states": [{"state": states, "param_groups": [{"lr": 0.1, "params": [0]}]}], "epoch": 2,
            "global_step": 12}


def test_consolidate_round_trips_a_sharded_checkpoint(tmp_path, capsys):
    original = _checkpoint()
    directory = tmp_path / "sharded.ckpt"
    write_sharded(original, directory)
    single = tmp_path / "single.ckpt"
    assert main(["consolidate", str(directory), str(single)]) == 0
    assert f"wrote {single}" in capsys.readouterr().out
    loaded = torch.load(single, weights_only=True)
    assert loaded["epoch"] == 2 and loaded["global_step"] == 12
    assert_same_weights(original["state_dict"], loaded["state_dict"])
    state = loaded["optimizer_states"][0]["state"][0]
    assert torch.equal(state["exp_avg"], original["optimizer_states"][0]["state"][0]["exp_avg"])

    back = tmp_path / "back.ckpt"
    assert main(["consolidate", str(single), str(back), "--sharded"]) == 0
    assert back.is_dir()
    again = consolidate(back)
    assert_same_weights(original["state_dict"], again["state_dict"])
    assert torch.equal(again["optimizer_states"][0]["state"][0]["exp_avg"], state["exp_avg"])


def test_consolidate_refuses_what_it_cannot_convert(tmp_path):
    single = tmp_path / "single.ckpt"
    torch.save(_checkpoint(), single)
    with pytest.raises(SystemExit, match="is not a sharded checkpoint directory .*--sharded"):
        main(["consolidate", str(single), str(tmp_path / "out.ckpt")])
    with pytest.raises(SystemExit, match="does not exist"):
        main(["consolidate", str(tmp_path / "missing"), str(tmp_path / "out.ckpt")])
    with pytest.raises(SystemExit, match="the target must differ from the source"):
        main(["consolidate", str(single), str(single), "--sharded"])


def test_probe_measures_the_store_against_the_disk_and_leaves_nothing(tmp_path, capsys):
    root = tmp_path / "new" / "nvme"  # created for the probe, removed after it
    assert main(["probe", "--path", str(root), "--size", "64MiB", "--repeat", "1", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    rows = {r[0]: r for r in table(out, "| measurement | GB/s | how |")}
    for name in ("host memory copy", "raw disk write", "raw disk read", "NvmeStore write", "NvmeStore read"):
        assert float(rows[name][1]) > 0, rows[name]
    ratio = float(rows["store / raw, read"][1].rstrip("%")) / 100
    assert ratio == pytest.approx(float(rows["NvmeStore read"][1]) / float(rows["raw disk read"][1]), rel=0.05, abs=0.01)
    assert not (tmp_path / "new").exists()
