"""tools/compare_peers.py as a user runs it: each row in a process of its own, a row that cannot
run on this machine a line that says why, never a crash of the whole table."""

from __future__ import annotations

import pytest

from tools.compare_peers import flops_per_token, main


def test_model_flops_per_token_by_hand():
    # 6 x 100 parameters + 12 x 2 layers x 8 wide x 16 positions
    assert flops_per_token(100, {"n_layer": 2, "n_embd": 8}, 16) == 600 + 3072
    assert flops_per_token(100, {"num_hidden_layers": 2, "hidden_size": 8}, 16) == 600 + 3072


@pytest.mark.slow
def test_a_dry_run_on_the_cpu_prints_every_row(capsys):
    main(["--model", "gpt2_tiny", "--accelerator", "cpu", "--rows", "lightning", "tiered", "fsdp_offload", "--steps", "2", "--warmup", "0",
          "--seq-len", "32", "--batch-size", "2", "--precision", "32-true"])
    table = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line for line in table.splitlines() if line.startswith("| ") and "---" not in line}
    assert "failed" not in rows["lightning"] and "failed" not in rows["tiered"]
    assert rows["tiered"].rstrip().endswith("| 1.00 |")  # the reference of the last column
    assert "failed" in rows["fsdp_offload"] and "GPU" in rows["fsdp_offload"]  # FSDP's offload needs CUDA: said, not raised


def test_an_unknown_model_names_the_known_ones():
    with pytest.raises(SystemExit, match="gpt2_tiny"):
        main(["--model", "gpt2_huge", "--rows", "lightning"])


def test_a_sequence_longer_than_the_model_s_positions_is_refused_before_any_row():
    """The docstring's dry run used the default --seq-len 1024 on gpt2_tiny (256 positions): every
    row failed with an index error from the position embedding."""
    with pytest.raises(SystemExit, match=r"--seq-len 1024 is longer than gpt2_tiny's 256 positions; pass --seq-len 256 or less"):
        main(["--model", "gpt2_tiny", "--accelerator", "cpu", "--rows", "lightning"])


@pytest.mark.slow
def test_a_failed_row_prints_the_end_of_its_error_output_and_peers_recompute_their_blocks(capsys):
    """A GPU out-of-memory message runs to several lines; the table keeps 160 characters of one."""
    main(["--model", "gpt2_tiny", "--accelerator", "cpu", "--rows", "fsdp_offload", "--steps", "2", "--warmup", "0", "--seq-len", "32",
          "--batch-size", "2", "--precision", "32-true"])
    captured = capsys.readouterr()
    assert "fsdp_offload failed (exit 1); the end of its error output:" in captured.err
    assert "the peers recompute every block" in captured.out
