"""Every input of the public parsers (sizes, budgets as fractions and percentages, policy fields,
plan files) either parses to the right value or raises ``ValueError`` naming the argument and the
value; nothing else escapes. Checked on generated inputs."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from offload_strategy.config import ACTIVATION_PLANNERS, BLOCK_POLICIES, Budget, PolicyConfig, parse_size
from offload_strategy.planning.plan_file import load_plan

UNITS = {"": 1, "B": 1, "KiB": 1024, "MiB": 1024**2, "GiB": 1024**3, "TiB": 1024**4, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4}

anything = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.from_regex(r"\A-?[0-9]{0,4}\.?[0-9]{0,3}(e[+-]?[0-9]{1,4})? ?(%|[KMGT]i?B|[KMGTB])?\Z"),
    st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@given(st.integers(0, 2**20), st.sampled_from(sorted(UNITS)))
def test_a_whole_number_with_a_unit_is_that_many_bytes(n, unit):
    assert parse_size(f"{n}{unit}", "gpu_memory") == n * UNITS[unit]
    assert parse_size(f"{n} {unit}".strip(), "gpu_memory") == n * UNITS[unit]


@given(st.floats(0.001, 1000.0), st.sampled_from(["KiB", "MiB", "GiB", "KB", "MB", "GB"]))
def test_a_decimal_with_a_unit_is_rounded_down_to_bytes(x, unit):
    text = f"{x:.3f}{unit}"
    assert parse_size(text, "host_memory") == int(float(f"{x:.3f}") * UNITS[unit])


@given(anything)
def test_a_size_parses_or_names_the_argument(value):
    try:
        result = parse_size(value, "gpu_memory")
    except ValueError as error:
        assert "gpu_memory=" in str(error) and repr(value)[:20] in str(error)
    else:
        assert isinstance(result, int) and result >= 0


@given(anything)
def test_a_budget_parses_or_names_the_argument(value):
    try:
        budget = Budget.parse(value, "host_memory")
    except ValueError as error:
        assert "host_memory=" in str(error) and repr(value)[:20] in str(error)
    else:
        assert (budget.bytes is None) or budget.bytes >= 0
        assert (budget.fraction is None) or 0 < budget.fraction <= 1
        assert not (budget.bytes is not None and budget.fraction is not None)


@given(st.integers(1, 100))
def test_a_percentage_is_that_fraction_of_what_is_free(percent):
    assert Budget.parse(f"{percent}%", "nvme_memory").fraction == pytest.approx(percent / 100)


@given(st.floats(100.01, 1e6) | st.just(0.0))
def test_a_percentage_out_of_range_is_echoed_as_written(percent):
    text = f"{percent:.2f}%"
    with pytest.raises(ValueError, match=rf"nvme_memory='{text}': a percentage"):
        Budget.parse(text, "nvme_memory")


@pytest.mark.parametrize("value", ["0.5", "0.25 B", "1.5"])
def test_a_sub_byte_string_is_refused_and_points_at_fractions(value):
    with pytest.raises(ValueError, match=r"not a whole number of bytes.*fraction"):
        Budget.parse(value, "gpu_memory")


def test_a_size_too_large_to_hold_is_refused():
    with pytest.raises(ValueError, match=r"gpu_memory='1e400' is too large"):
        parse_size("1e400", "gpu_memory")


policy_fields = st.fixed_dictionaries(
    {},
    optional={
        "name": st.one_of(st.sampled_from(["auto", "none"]), anything),
        "placement": st.one_of(st.sampled_from(["fill", "search", "host", "nvme", "layerwise"]), anything),
        "activations": st.one_of(
            st.sampled_from(BLOCK_POLICIES + ACTIVATION_PLANNERS), st.lists(st.sampled_from(BLOCK_POLICIES), min_size=1, max_size=3), anything,
        ),
        "chunk_size": anything,
        "gradient_reserve": anything,
        "prefetch": anything,
        "checksums": anything,
        "block_class": anything,
    },
)


@given(st.one_of(policy_fields, anything))
def test_a_policy_parses_or_names_the_field(value):
    try:
        policy = PolicyConfig.coerce(value)
    except ValueError as error:
        assert "policy" in str(error)
    else:
        assert policy.placement in ("fill", "search", "host", "nvme", "layerwise")
        acts = policy.activations
        assert (isinstance(acts, str) and acts in BLOCK_POLICIES + ACTIVATION_PLANNERS) or (isinstance(acts, tuple) and set(acts) <= set(BLOCK_POLICIES))


def test_activations_given_as_a_number_is_refused_by_name():
    with pytest.raises(ValueError, match=r"policy.activations=5 must be"):
        PolicyConfig(activations=5)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=12,
)
plan_like = st.fixed_dictionaries(
    {"version": st.sampled_from([1, 2, "1"]), "units": st.one_of(json_values, st.lists(st.fixed_dictionaries(
        {"name": json_values, "bytes": st.one_of(st.integers(-5, 10**6), json_values), "home": st.sampled_from(["gpu", "host", "nvme", "disk"])},
    ), max_size=3))},
    optional={"activations": st.one_of(st.sampled_from(["keep"]), st.lists(st.sampled_from(BLOCK_POLICIES + ("x",)), max_size=3), json_values),
              "budgets": json_values, "prediction": json_values},
)


# no deadline: each example writes and reads a file, which a busy machine can hold up for far longer than 200 ms
@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=150, deadline=None)
@given(st.one_of(plan_like.map(lambda d: json.dumps(d).encode()), st.binary(max_size=64)))
def test_a_plan_file_loads_or_names_the_file(tmp_path, content):
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    try:
        plan = load_plan(path)
    except ValueError as error:
        assert "plan_file=" in str(error) or "the plan" in str(error)
    else:
        assert all(u.nbytes >= 0 for u in plan.units)
        assert plan.activations is None or set(plan.activations) <= set(BLOCK_POLICIES)


def test_a_plan_file_that_is_not_text_or_not_there_is_refused_by_name(tmp_path):
    binary = tmp_path / "plan.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match=r"plan_file=.*plan.json.* is not JSON text"):
        load_plan(binary)
    with pytest.raises(ValueError, match=r"plan_file=.*missing.json.* cannot be read"):
        load_plan(tmp_path / "missing.json")


def test_activations_in_a_plan_file_must_be_a_list():
    from offload_strategy.planning.plan_file import PlanFile

    with pytest.raises(ValueError, match=r"activations='keep'; it must be a list of block policies"):
        PlanFile.from_json({"version": 1, "units": [], "activations": "keep"})


def test_an_nvme_path_the_strategy_created_is_removed_and_one_it_found_is_left(tmp_path):
    from offload_strategy import TieredStrategy
    from tests.helpers import PARAMETERS_ONLY, train

    created = tmp_path / "scratch" / "deep" / "nvme"
    found = tmp_path / "found"
    found.mkdir()
    for path in (created, found):
        train(TieredStrategy(policy={**PARAMETERS_ONLY, "placement": "nvme"}, gpu_memory="1MiB", host_memory="1GiB", nvme_path=path), tmp_path / "run", epochs=1)
    assert not (tmp_path / "scratch").exists(), "the directories made for nvme_path were left behind"
    assert found.is_dir() and not any(found.iterdir())
