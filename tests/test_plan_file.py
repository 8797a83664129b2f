"""Plans written by one run and run again by another, and plans that do not fit refused."""

from __future__ import annotations

import json

import lightning as L
import pytest

from offload_strategy import TieredStrategy
from offload_strategy.estimate.plans import show
from offload_strategy.planning.placement import PlacementError
from tests.helpers import PARAMETERS_ONLY, assert_same_weights, train
from tests.test_activations import gpt2
from tests.test_activations import STREAMED, streamed
from tests.test_offload import param_bytes


class Dump(L.Callback):
    def __init__(self, path) -> None:
        self.path = path
        self.homes: list[str] = []

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        strategy.dump_plan(self.path)
        self.homes = [strategy.engine.placement.home[i] for i in range(len(strategy.engine.states))]


class Homes(L.Callback):
    def on_train_end(self, trainer, pl_module) -> None:
        self.homes = [trainer.strategy.engine.placement.home[i] for i in range(len(trainer.strategy.engine.states))]
        self.activations = list(trainer.strategy.tiered.activations.policies)


def test_a_dumped_plan_runs_again_without_planning(tmp_path, capsys):
    total = param_bytes(gpt2)
    plan = tmp_path / "plan.json"
    dump = Dump(plan)
    policy = {"name": "auto", "activations": ("checkpoint", "swap_host", "keep", "keep")}
    first = TieredStrategy(**streamed(total), policy={**policy, **STREAMED})  # (room for the layout's activations beside)
    train(first, tmp_path / "first", epochs=1, make_model=gpt2, extra_callbacks=(dump,))
    written = json.loads(plan.read_text())
    assert written["version"] == 1 and written["activations"] == list(policy["activations"])
    assert "host" in {u["home"] for u in written["units"]}
    # what the plan implies, for reading: offloaded units stream in and (emulated device, no
    # gradient reserve) write their gradients straight home; states live with the parameters
    for unit in written["units"]:
        assert unit["mode"] == ("resident" if unit["home"] == "gpu" else "streamed")
        assert unit["gradient"] == ("gpu" if unit["home"] == "gpu" else "direct")
        assert unit["states"] == unit["home"]
    predicted = written["prediction"]
    assert predicted["step_seconds"] > 0 and predicted["h2d_bytes"] > 0
    parts = predicted["forward_seconds"] + predicted["backward_seconds"] + predicted["update_tail_seconds"]
    assert parts == pytest.approx(predicted["step_seconds"])
    show(plan)
    shown = capsys.readouterr().out
    assert "| unit | name | bytes | home | mode | gradient | optimizer states |" in shown
    assert f"predicted step (the step model): {predicted['step_seconds'] * 1e3:.1f} ms" in shown

    # Edit the plan: every unit on host. The edited plan is what runs, whatever the budget would choose.
    written["units"] = [{**u, "home": "host"} for u in written["units"]]
    smallest = min(range(len(written["units"])), key=lambda i: written["units"][i]["bytes"])
    written["units"][smallest]["home"] = "gpu"
    written["activations"] = ["checkpoint"] * 4
    plan.write_text(json.dumps(written))
    plain_losses, plain_weights, _ = train("auto", tmp_path / "plain", epochs=2, make_model=gpt2)
    seen = Homes()
    again = TieredStrategy(**streamed(total), plan_file=plan)
    losses, weights, _ = train(again, tmp_path / "again", epochs=2, make_model=gpt2, extra_callbacks=(seen,))
    assert seen.homes == [u["home"] for u in written["units"]] and seen.activations == ["checkpoint"] * 4
    assert losses == plain_losses
    assert_same_weights(plain_weights, weights)


def _plan(tmp_path, units, activations=None, version=1):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"version": version, "units": units, "activations": activations, "budgets": None}))
    return path


def _units_of_gpt2(tmp_path):
    total = param_bytes(gpt2)
    plan = tmp_path / "good.json"
    train(TieredStrategy(**streamed(total), policy={**PARAMETERS_ONLY, **STREAMED}), tmp_path / "dump", epochs=1, make_model=gpt2, extra_callbacks=(Dump(plan),))
    return json.loads(plan.read_text())["units"], total


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda u: u[:-1], r"the plan has \d+ units but this model has \d+"),
        (lambda u: [{**u[0], "bytes": u[0]["bytes"] + 4}, *u[1:]], r"unit 0 of the plan is '.*' of [\d,]+ bytes but this model's is '.*' of [\d,]+ bytes"),
        (lambda u: [{**u[0], "home": "tape"}, *u[1:]], r"names homes \['tape'\]"),
    ],
    ids=["unit count", "unit bytes", "home"],
)
def test_a_plan_for_another_model_is_refused_before_training(tmp_path, edit, message):
    units, total = _units_of_gpt2(tmp_path)
    path = _plan(tmp_path, edit(units))
    with pytest.raises(ValueError, match=message):
        train(TieredStrategy(gpu_memory=int(0.5 * total), host_memory="1GiB", plan_file=path), tmp_path / "run", epochs=1, make_model=gpt2)


def test_unreadable_plans_and_plans_that_do_not_fit_are_refused(tmp_path):
    units, total = _units_of_gpt2(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"is not JSON"):
        train(TieredStrategy(gpu_memory=int(0.5 * total), plan_file=bad), tmp_path / "a", epochs=1, make_model=gpt2)
    with pytest.raises(ValueError, match=r"is not a version-1 plan \(found version 7\)"):
        train(TieredStrategy(gpu_memory=int(0.5 * total), plan_file=_plan(tmp_path, units, version=7)), tmp_path / "b", epochs=1, make_model=gpt2)
    with pytest.raises(ValueError, match=r"the plan gives 3 block policies but this model has 4 blocks"):
        train(TieredStrategy(gpu_memory=int(0.5 * total), plan_file=_plan(tmp_path, units, ["keep"] * 3)), tmp_path / "c", epochs=1, make_model=gpt2)
    everything_on_gpu = _plan(tmp_path, [{**u, "home": "gpu"} for u in units])
    with pytest.raises(PlacementError, match=r"needs .* in the GPU tier"):
        train(TieredStrategy(gpu_memory=int(0.5 * total), plan_file=everything_on_gpu), tmp_path / "d", epochs=1, make_model=gpt2)
    on_host = _plan(tmp_path, [{**u, "home": "host"} for u in units])
    with pytest.raises(PlacementError, match=r"the plan keeps .* in host memory .* but host_memory grants"):
        train(TieredStrategy(gpu_memory=int(0.5 * total), host_memory=total, plan_file=on_host, policy=PARAMETERS_ONLY), tmp_path / "e", epochs=1, make_model=gpt2)
