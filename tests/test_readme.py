"""The README and the docs: their examples run as written, their links resolve, and the README
stays a short guide whose tables name what the code has."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
# the README is a guide: what it is, install, quick start, settings, commands, resume, glossary, links
README_MOST_LINES = 260


def example(name: str) -> str:
    """The Python block marked ``<!-- example: name -->`` in the README or a file of docs/."""
    for page in [README, *DOCS]:
        found = re.search(rf"<!-- example: {name} -->\s*```python\n(.*?)```", page.read_text(), re.S)
        if found:
            return found.group(1)
    raise AssertionError(f"neither README.md nor docs/*.md has an example marked {name!r}")


def run_script(text: str, where: Path) -> subprocess.CompletedProcess:
    """``text`` run as a user runs an example they pasted into a file, which must succeed."""
    script = where / "example.py"
    script.write_text(text)
    result = subprocess.run([sys.executable, str(script)], cwd=where, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section of a Markdown text."""
    found = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert found, f"README.md has no section {heading!r}"
    return found.group(1)


def table_column(text: str, column: int = 0) -> list[str]:
    """The backticked names in one column of a section's Markdown tables, header and rule rows left out."""
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("|")]
    cells = [row[column] for row in rows if len(row) > column and not set(row[column].strip()) <= set("-")]
    return [name for cell in cells[1:] for name in re.findall(r"`([^`]+)`", cell)]


def test_the_cpu_example_trains_with_offloaded_units(tmp_path):
    result = run_script(example("cpu"), tmp_path)
    streamed = re.search(r"^([\d.]+) units streamed from host memory$", result.stdout, re.M)
    assert streamed and float(streamed.group(1)) > 0, result.stdout[-2000:]


def test_when_nothing_needs_offloading_one_line_says_so(tmp_path):
    result = run_script(example("cpu").replace('gpu_memory="1MiB"', 'gpu_memory="1GiB"'), tmp_path)
    said = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("tiered: everything fits")]
    assert len(said) == 1 and "nothing is offloaded" in said[0], result.stderr[-2000:]
    assert "0 units streamed" in result.stdout or "units streamed" not in result.stdout


def test_the_fabric_example_trains_offloaded_and_saves_a_checkpoint_plain_torch_reads(tmp_path):
    result = run_script(example("fabric"), tmp_path)
    streamed = re.search(r"^(\d+) bytes streamed from host memory$", result.stdout, re.M)
    assert streamed and int(streamed.group(1)) > 0, result.stdout[-2000:]
    import torch

    checkpoint = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    assert checkpoint["step"] == 9 and checkpoint["model"]["0.weight"].shape == (256, 256)
    assert len(checkpoint["optimizer"]["state"]) == 16, "the optimizer's states are not all in the checkpoint"


def test_the_gpu_check_says_when_there_is_no_gpu_and_names_the_cpu_suite(tmp_path):
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("a GPU is here: make gpu-check runs the checks themselves")
    out = tmp_path / "gpu-check"
    env = {**__import__("os").environ, "PYTHON": sys.executable}
    result = subprocess.run(["bash", str(ROOT / "tools/gpu_check.sh"), str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "no CUDA GPU on this machine" in result.stdout, result.stdout + result.stderr
    # it names the CPU suite, as docs/gpu.md says, and checks nothing
    assert "make test" in (out / "summary.txt").read_text() and not (out / "environment.txt").exists()


# --- the README is a short guide, and every link in it and in docs/ leads somewhere ----------------


def test_the_readme_is_a_short_guide():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MOST_LINES, (
        f"README.md has {lines} lines, more than {README_MOST_LINES}: move the detail into docs/guide.md or docs/reference.md")


def without_code(text: str) -> str:
    """``text`` less its fenced code blocks, where ``#`` starts a comment, not a heading."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file (a repeated heading gets -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", without_code(page.read_text()), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", without_code(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:: not this repository's
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no file {linked})")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target} (no heading with the anchor #{anchor} in {linked.name})")
    return broken


def test_every_relative_link_in_the_readme_and_the_docs_resolves():
    broken = {page.name: found for page in [README, *DOCS] if (found := broken_links(page))}
    assert not broken, broken


def test_a_link_to_a_missing_heading_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Choose your settings\n\n[ok](#choose-your-settings) [gone](#no-such) [file](missing.md)\n")
    assert broken_links(page) == ["#no-such (no heading with the anchor #no-such in page.md)", f"missing.md (no file {tmp_path / 'missing.md'})"]


def test_the_docs_the_readme_sends_readers_to_exist():
    text = README.read_text()
    for name in ["guide.md", "reference.md", "gpu.md", "benchmarks.md"]:
        assert f"(docs/{name}" in text, f"README.md does not link docs/{name}"


# --- the README's commands and tables name what the project has ----------------------------------


def test_the_two_commands_are_make_train_and_make_test_and_ci_runs_the_second():
    block = re.search(r"```bash\n(.*?)```", section(README.read_text(), "The two commands"), re.S)
    assert block, "the section 'The two commands' has no command block"
    commands = [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.strip()]
    assert commands == ["make train", "make test"], commands
    ci = [line.strip() for line in (ROOT / ".ci/run").read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert ci[-1] == "make test", ci


def test_every_preset_the_settings_table_names_exists():
    from offload_strategy import PRESETS

    named = [name for name in table_column(section(README.read_text(), "Choose your settings"), 4) if name != "tiered_ddp"]
    assert named, "the settings table names no preset"
    unknown = sorted(set(named) - set(PRESETS))
    assert not unknown, f"the settings table names presets that do not exist: {unknown}; they are {sorted(PRESETS)}"


def test_every_metric_the_readme_explains_is_one_the_strategy_reports(tmp_path):
    listed = table_column(section(README.read_text(), "Metrics"))
    assert len(listed) >= 10, listed
    script = example("cpu") + "\nimport json\nprint('METRICS', json.dumps(sorted(strategy.metrics())))\n"
    reported = json.loads(re.search(r"^METRICS (.*)$", run_script(script, tmp_path).stdout, re.M).group(1))
    assert not set(listed) - set(reported), f"the README explains metrics the strategy does not report: {sorted(set(listed) - set(reported))}"


def said_in_code() -> list[str]:
    """The fixed start of each line the package prints with ``tiered: ``, up to its first placeholder."""
    texts = (path.read_text() for path in (ROOT / "offload_strategy").rglob("*.py"))
    return [found for text in texts for found in re.findall(r'"(tiered: [^"{]*)', text)]


def fixed_words(line: str) -> str:
    """The words of a log line as the README quotes it, up to its first example value or ``...``."""
    words = []
    for word in line.split():
        if word == "..." or re.search(r"\d", word) or re.fullmatch(r"[A-Z]", word):
            break
        words.append(word)
    return " ".join(words)


def test_every_log_line_the_readme_explains_is_one_the_strategy_prints():
    quoted = [fixed_words(line) for line in table_column(section(README.read_text(), "Log lines")) if line.startswith("tiered: ")]
    checked = [line for line in quoted if len(line.split()) >= 3]  # "tiered: the ..." names too little to look up
    assert len(checked) >= 4, quoted
    said = said_in_code()
    unknown = [line for line in checked if not any(s.startswith(line) or (line.startswith(s) and len(s) >= 20) for s in said)]
    assert not unknown, f"the README explains log lines the package does not print: {unknown}"
