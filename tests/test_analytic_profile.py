"""Costs from shapes alone, worked out by hand, and the what-if tool on a model that is not built."""

from __future__ import annotations

import dataclasses
import os
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from offload_strategy import HardwareSpec
from offload_strategy.config import PolicyConfig, compute_dtype, parse_size
from offload_strategy.demos import CausalLM
from offload_strategy.estimate import simulate as sim
from offload_strategy.hardware.specs import known_hardware
from offload_strategy.estimate.analytic import CPU_PARAMS_PER_S_PER_CORE, analytic_compute, analytic_units, cpu_update_rate
from offload_strategy.estimate.shapes import Pricing
from offload_strategy.runtime.units import build_units

ROOT = Path(__file__).resolve().parent.parent
# 1,000 FLOP/s of bf16: times come out in whole seconds
TOY = HardwareSpec(name="toy", gpu="toy", gpu_memory="1GiB", gpu_bf16_tflops=1e-9, gpu_fp16_tflops=1e-9, h2d_gbps=1.0, d2h_gbps=1.0, host_memory="4GiB", cpu_cores=2)


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.body = nn.Linear(4, 4, bias=True)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # the output head multiplies by the embedding


def test_flops_and_times_by_hand():
    units, users = build_units(Tied())
    costs = analytic_units(units, users, tokens=5, hardware=TOY, efficiency=0.5)
    by_name = {c.name: c for c in costs}
    # the embedding's unit: no FLOPs as a lookup, 2 x 40 x 5 = 400 as the head's matrix
    assert by_name["embed"].forward_flops == 400 and by_name["embed"].forward_seconds == pytest.approx(400 / 500)
    # body: 2 x 16 x 5 = 160 (the bias is not a matrix); backward twice forward
    assert by_name["body"].forward_flops == 160 and by_name["body"].backward_seconds == pytest.approx(2 * 160 / 500)
    assert by_name["body"].update_seconds == pytest.approx(20 / (2 * CPU_PARAMS_PER_S_PER_CORE))
    assert "head" not in by_name  # its only parameter belongs to the embedding's unit
    with pytest.raises(ValueError, match=r"efficiency=0 must lie in \(0, 1\]"):
        analytic_units(units, users, tokens=5, hardware=TOY, efficiency=0)


def test_32_true_is_priced_at_the_fp32_peak_not_the_tensor_cores():
    """torch leaves TF32 off: 32-true matmuls run on the CUDA cores. With an fp32 peak of 125 FLOP/s
    (an eighth of bf16's 1,000) the body's 160 FLOPs at half efficiency take 160 / 62.5 = 2.56 s."""
    from offload_strategy import known_hardware
    from offload_strategy.config import compute_dtype

    assert [compute_dtype(p) for p in ("32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true")] == ["fp32", "bf16", "bf16", "fp16", "fp16"]
    slow = dataclasses.replace(TOY, gpu_fp32_tflops=1.25e-10)
    units, users = build_units(Tied())
    by_name = {c.name: c for c in analytic_units(units, users, tokens=5, hardware=slow, dtype="fp32", efficiency=0.5)}
    assert by_name["body"].forward_seconds == pytest.approx(2.56)
    assert known_hardware("a100_80g").peak_flops("fp32") == pytest.approx(19.5e12)  # the datasheet's FP32, not TF32's 156
    with pytest.raises(ValueError, match="gives no fp32 peak"):
        analytic_units(units, users, tokens=5, hardware=TOY, dtype="fp32")


def test_the_cpu_optimizer_is_bounded_by_the_memory_channels_by_hand():
    """Two cores at 0.8 G parameters/s are 1.6 G/s; memory channels of 28 GB/s move 28 bytes per fp32
    parameter (master, gradient, two states read; master, two states written) for 1 G/s, and
    30 bytes for a bf16 parameter (its copy written back too): 0.933 G/s."""
    bounded = dataclasses.replace(TOY, host_memory_gbps=28.0)
    units, users = build_units(Tied())
    fp32 = {c.name: c for c in analytic_units(units, users, tokens=5, hardware=bounded)}
    assert fp32["body"].update_seconds == pytest.approx(20 / 1e9)  # the channels bind, not the cores
    assert cpu_update_rate(bounded) == pytest.approx(1e9) and cpu_update_rate(bounded, copy_bytes=2) == pytest.approx(28e9 / 30)
    half = Tied().to(torch.bfloat16)
    units, users = build_units(half)
    bf16 = {c.name: c for c in analytic_units(units, users, tokens=5, hardware=bounded)}
    assert bf16["body"].update_seconds == pytest.approx(20 * 30 / 28e9)
    assert cpu_update_rate(dataclasses.replace(TOY, host_memory_gbps=1000.0)) == pytest.approx(2 * CPU_PARAMS_PER_S_PER_CORE)  # the cores bind


def test_data_parallel_ranks_share_the_machines_cpu_by_hand():
    """ProTrain's four A100s share 112 cores, 614.4 GB/s of memory channels and 1 TB: with four
    ranks each has 28 cores (22.4 G parameters/s), 153.6 GB/s (153.6 / 30 = 5.12 G bf16
    parameters/s: the channels bind) and 256 GiB of its 1 TiB. Eight ranks share as four do (four GPUs per
    machine, the others on other machines); a spec that is already one GPU's share is not split."""
    a100 = known_hardware("a100_80g")
    share = a100.rank_share(4)
    assert (share.cpu_cores, share.host_memory_gbps, share.host_memory) == (28, pytest.approx(153.6), 256 * 2**30)
    assert cpu_update_rate(share, copy_bytes=2) == pytest.approx(153.6e9 / 30)
    assert cpu_update_rate(a100, copy_bytes=2) == pytest.approx(614.4e9 / 30)  # one rank: the whole machine
    assert a100.rank_share(8) == share and a100.rank_share(1) is a100
    h100 = known_hardware("h100_80g")
    assert h100.rank_share(8) is h100
    with pytest.raises(ValueError, match="hardware.gpus"):
        dataclasses.replace(a100, gpus=0)


def test_direct_host_access_reads_by_hand():
    units, users = build_units(Tied())
    by_name = {c.name: c for c in analytic_units(units, users, tokens=5, hardware=TOY)}
    # 5 looked-up rows of 4 fp32 (80 bytes) plus the head's one GEMM tile over the 10 x 4 matrix (160)
    assert by_name["embed"].dha_read_bytes == 80 + 160
    assert by_name["body"].dha_read_bytes == 64 + 16  # the weight once, the bias once
    # 300 tokens: 3 tiles of 128 re-read each matrix; all 10 rows looked up
    by_name = {c.name: c for c in analytic_units(units, users, tokens=300, hardware=TOY)}
    assert by_name["embed"].dha_read_bytes == 10 * 16 + 3 * 160
    assert by_name["body"].dha_read_bytes == 3 * 64 + 16
    body = by_name["body"]
    assert body.transfer_seconds == pytest.approx(128 / 1e9)  # 80 bytes padded to 64-byte boundaries, at 1 GB/s
    assert body.dha_forward_seconds == pytest.approx(max(body.forward_seconds, 208 / 1e9))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


@pytest.mark.parametrize("experts, top_k", [(4, 2), (8, 2), (4, 4)])
def test_a_mixture_of_experts_counts_the_experts_each_token_meets_by_hand(experts, top_k):
    """Mixtral's experts are stacked matrices a grouped product multiplies by the rows routed to
    each: 8 tokens, hidden 16, intermediate 32. Each token meets ``top_k`` experts, each
    2 x (64 x 16 + 16 x 32) = 3,072 FLOPs: 8 x top_k x 3,072, whatever the number of experts
    (before: the unit counted every expert for every token, the forward none)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        vocab_size=50, num_local_experts=experts, num_experts_per_tok=top_k)
    with torch.device("meta"):
        model = transformers.MixtralForCausalLM(config).to(torch.bfloat16)
    units, users = build_units(model)
    (unit,) = [c for c in analytic_units(units, users, tokens=8, hardware=TOY) if c.name.endswith("experts")]
    assert unit.forward_flops == 8 * top_k * 3072
    x = torch.zeros(1, 8, dtype=torch.long, device="meta")
    # the rest by hand: per token 2 x (16x16 + 16x8 + 16x8 + 16x16 query/key/value/output, 16 x experts router, 16x50 head),
    # and attention's two products, 2 x 2 heads x 8 x 8 x 8 each
    rest = 8 * 2 * (256 + 128 + 128 + 256 + 16 * experts + 800) + 2 * 2 * 2 * 8 * 8 * 8
    assert analytic_compute(model, list(model.model.layers), lambda: model(x), TOY).forward_flops == rest + 8 * top_k * 3072


def test_block_costs_from_a_meta_forward_by_hand():
    with torch.device("meta"):
        model = nn.Sequential(Block(), Block())
        x = torch.zeros(2, 3, 4)
    costs = analytic_compute(model, list(model), lambda: model(x).sum(), TOY, efficiency=0.5).blocks
    assert len(costs) == 2
    for cost in costs:
        # saved: the linear's 6 x 4 fp32 input (96 bytes) and relu's 6 x 4 output (96); never the weight
        assert cost.activation_bytes == 192
        assert cost.input_bytes == 96  # what a checkpoint keeps
        # 2 x 6 tokens x 16 weights = 192 FLOPs at 1,000 FLOP/s x 0.5
        assert cost.forward_seconds == pytest.approx(192 / 500)
    assert analytic_compute(model, [], lambda: None, TOY).blocks == []


class NormedBlock(nn.Module):
    """A matrix product, a norm and an activation: one op of each of autocast's kinds."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(nn.functional.layer_norm(self.linear(x), (4,)))


def test_mixed_precision_saves_autocasts_casts_by_hand():
    """Under autocast (GPU op lists) the product runs on 16-bit casts of its fp32 input (2 x 3 x 4:
    48 bytes) and weight (16 weights: 32 bytes), both saved for backward, the weight's being a new
    tensor, not the parameter; the norm widens the 16-bit product (48 bytes) to fp32 and saves that
    (96) with its mean and inverse deviation (6 fp32 each: 48); relu saves its fp32 output (96).
    320 bytes, against 336 in fp32 (the input 96, the norm's input 96 and statistics 48, relu's 96)."""
    from offload_strategy.estimate.analytic import Autocast

    with torch.device("meta"):
        model = nn.Sequential(NormedBlock(), NormedBlock())
        x = torch.zeros(2, 3, 4, requires_grad=True)  # as inside a model: the product's input gets a gradient
    mixed = analytic_compute(model, list(model), lambda: model(x).sum(), TOY, autocast=Autocast(torch.bfloat16)).blocks
    assert mixed[0].activation_bytes == 48 + 32 + 96 + 48 + 96
    assert analytic_compute(model, list(model), lambda: model(x).sum(), TOY).blocks[0].activation_bytes == 336
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        Autocast(torch.float32)


def test_autocast_emulation_saves_what_a_real_autocast_forward_saves():
    """On the CPU, with the CPU's op lists, the meta forward under ``Autocast`` saves the same
    bytes as a real forward under ``torch.autocast`` (cast cache off, as Lightning enters it)."""
    from offload_strategy.estimate.analytic import AUTOCAST_CPU, Autocast

    def block() -> nn.Module:
        return nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate="tanh"), nn.Linear(16, 8), nn.LayerNorm(8), nn.Softmax(-1))

    torch.manual_seed(0)
    real_model = nn.Sequential(block(), block())
    held: dict[int, torch.UntypedStorage] = {}
    parameters = {id(p) for p in real_model.parameters()}
    inside = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside[0] and id(t) not in parameters:
            held.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage())
        return t

    real_model[0].register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    real_model[0].register_forward_hook(lambda *_: inside.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        real_model(torch.randn(2, 5, 8, requires_grad=True)).sum()
    with torch.device("meta"):
        model = nn.Sequential(block(), block())
        x = torch.zeros(2, 5, 8, requires_grad=True)
    estimate = analytic_compute(model, list(model), lambda: model(x).sum(), TOY, autocast=Autocast(torch.bfloat16, AUTOCAST_CPU)).blocks[0]
    assert estimate.activation_bytes == sum(s.nbytes() for s in held.values()) > 0


def test_memory_bound_work_is_priced_at_the_memory_bandwidth_by_hand():
    """Each block's relu reads the linear's 2 x 3 x 4 fp32 output (96 bytes) and writes as much: 192
    bytes moved, at 80% of 1,000 bytes/s = 0.24 s beside the matrix product's 192 FLOPs at 500
    FLOP/s (0.384 s). The matrix product and the views around it move nothing here. Outside the
    blocks, the sum reads the last output (96 bytes) and writes one float: 100 bytes, 0.125 s."""
    from offload_strategy.estimate.analytic import GPU_MEMORY_SHARE

    assert GPU_MEMORY_SHARE == 0.8
    with torch.device("meta"):
        model = nn.Sequential(Block(), Block())
        x = torch.zeros(2, 3, 4)
    bandwidth = dataclasses.replace(TOY, gpu_memory_gbps=1e-6)  # 1,000 bytes/s
    compute = analytic_compute(model, list(model), lambda: model(x).sum(), bandwidth, efficiency=0.5)
    assert [c.forward_seconds for c in compute.blocks] == pytest.approx([0.384 + 0.24] * 2)
    assert compute.outside_forward_seconds == pytest.approx(100 / 800)
    assert compute.forward_flops == 2 * 192
    # without a known memory bandwidth the memory-bound work is not priced, as before
    assert [c.forward_seconds for c in analytic_compute(model, list(model), lambda: model(x).sum(), TOY).blocks] == pytest.approx([0.384] * 2)


def test_a_product_of_few_tokens_is_priced_at_the_bytes_it_moves_by_hand():
    """The roofline's memory side for matrix products: one token through a 4 x 4 fp32 weight is 32
    FLOPs (0.064 s at 500 FLOP/s) but moves the weight (64 bytes), the input and the output (16
    each): 96 bytes at 800 bytes/s, 0.12 s, so the product takes 0.12 s; relu then moves 32 bytes
    (0.04 s). Six tokens (the test above) are compute-bound: 192 FLOPs, 0.384 s, against 256 bytes, 0.32 s."""
    with torch.device("meta"):
        model = nn.Sequential(Block(), Block())
        x = torch.zeros(1, 1, 4)
    bandwidth = dataclasses.replace(TOY, gpu_memory_gbps=1e-6)  # 1,000 bytes/s, 800 of it reached
    compute = analytic_compute(model, list(model), lambda: model(x).sum(), bandwidth, efficiency=0.5)
    assert [c.forward_seconds for c in compute.blocks] == pytest.approx([0.12 + 0.04] * 2)


def test_time_no_parameter_accounts_for_goes_to_the_units_beside_it_by_hand():
    """A block of 6 s whose units' products take 1 s and 3 s: the 2 s beyond them (attention's
    products, memory-bound work) go 0.5 s and 1.5 s to the units, twice that to their backward; a
    unit outside the blocks without FLOPs of its own (an embedding) gets all 0.7 s outside."""
    from offload_strategy.estimate.analytic import AnalyticCompute, AnalyticUnit, attach_unattributed
    from offload_strategy.planning.activations import BlockCost

    def unit(name: str, forward: float) -> AnalyticUnit:
        return AnalyticUnit(name=name, nbytes=1, trainable_bytes=1, parameters=1, forward_flops=forward, forward_seconds=forward,
                            backward_seconds=2 * forward, update_seconds=0.0, dha_forward_seconds=forward)

    costs = [unit("embed", 0.0), unit("q", 1.0), unit("mlp", 3.0)]
    compute = AnalyticCompute([BlockCost(activation_bytes=0, input_bytes=0, forward_seconds=6.0)], outside_forward_seconds=0.7, forward_flops=0.0)
    out = attach_unattributed(costs, [[1, 2]], compute)
    assert [c.forward_seconds for c in out] == pytest.approx([0.7, 1.5, 4.5])
    assert [c.backward_seconds for c in out] == pytest.approx([1.4, 3.0, 9.0])
    assert [c.dha_forward_seconds for c in out] == pytest.approx([0.7, 1.5, 4.5])
    # a block its units' products already fill adds nothing
    short = AnalyticCompute([BlockCost(0, 0, 3.5)], outside_forward_seconds=0.0, forward_flops=0.0)
    assert [c.forward_seconds for c in attach_unattributed(costs, [[1, 2]], short)] == [0.0, 1.0, 3.0]


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))  # blocks are found by having parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # scaling by a number saves nothing for backward: only the attention's tensors are saved
        return nn.functional.scaled_dot_product_attention(x * 1.0, x * 2.0, x * 3.0, is_causal=True)


def test_attention_counts_as_a_fused_kernel_by_hand():
    reference = torch.nn.functional.scaled_dot_product_attention
    with torch.device("meta"):
        model = nn.Sequential(Attention(), Attention())
        x = torch.zeros(1, 2, 4, 8, requires_grad=True)  # batch 1, 2 heads, 4 positions, head size 8
    cost = analytic_compute(model, list(model), lambda: model(x).sum(), TOY, efficiency=0.5).blocks[0]
    # query, key, value and output of 1 x 2 x 4 x 8 fp32 (256 bytes each) and a 1 x 2 x 4 fp32 log-sum-exp;
    # never the 4 x 4 score matrix of each head
    assert cost.activation_bytes == 4 * 256 + 32
    # QK^T and PV: 2 x 2 x (8 rows x 4 keys x 8) multiply-adds = 1,024 FLOPs at 500 FLOP/s
    assert cost.forward_seconds == pytest.approx(1024 / 500)
    assert torch.nn.functional.scaled_dot_product_attention is reference  # put back


def table(stdout: str, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header starts with ``header``, as stripped cells."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return rows


@pytest.mark.slow
def test_simulate_predicts_a_model_that_is_never_built(tmp_path):
    figure = tmp_path / "llama.png"
    result = subprocess.run(
        [sys.executable, "-m", "offload_strategy", "simulate", "model=llama_7b", "hardware=rtx4090", "--gpu-memory", "4GiB", "16GiB", "--nvme-memory", "1TB",
         "--findings", "--png", str(figure), "--largest-at-most", "64"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "6.74 B parameters" in out
    # every figure the predictions rest on is printed, with the machine's own (LoHan's RTX 4090 testbed, 768 GiB)
    assumptions = out.split("Assumptions:")[1].split("\n\n")[0]
    for what in ("GPU compute: matrix products at 50%", "memory-bound work (element-wise, norms, the loss) at 80% of its 1008 GB/s", "host memory: 729.60 GiB, 95% of the machine's 768.00 GiB", "NVMe: 931.32 GiB", "host <-> GPU",
                 "CPU optimizer: Adam", "bytes per parameter (bf16-true", "batch: 16 sequences x 128 tokens"):
        assert what in assumptions, (what, assumptions)
    rows = table(out, "| gpu_memory | policy")
    assert [(r[0], r[1]) for r in rows] == [("4.00 GiB", "fill"), ("4.00 GiB", "auto"), ("16.00 GiB", "fill"), ("16.00 GiB", "auto")]
    auto = [r for r in rows if r[1] == "auto"]
    for row, budget in zip(auto, (4, 16)):
        parameters, activations = (parse_size(part) for part in row[4].split(" + "))
        assert parameters + activations <= budget * 2**30  # the joint search stays within the GPU tier
        assert not row[9].startswith("-")  # it fits, so it has a throughput
    assert float(auto[1][8]) <= float(auto[0][8])  # more GPU tier, no slower
    # keeping every block's activations does not fit beside first-use placement: 2,048 tokens of a 7B model
    assert all("activations over budget" in r[9] for r in rows if r[1] == "fill")
    # the 32-block model itself fits the 16 GiB budget, and so does twice it (the search stops there)
    assert re.search(r"Largest model of this width within GPU 16.00 GiB, .*: at least 64 blocks", out), out
    assert "this one has 32" in out

    # MemFerry Fig. 3: in place wins for the embedding lookup, loses for GEMMs (which Alg. 1 never runs in place)
    kinds = {r[0]: r for r in table(out, "| layer kind")}
    assert kinds["embedding"][4] == "DHA" and kinds["linear (GEMM)"][4] == "on-GPU"
    assert kinds["linear (GEMM)"][5].startswith("0 of")
    study = [r for r in table(out, "| batch | tokens") if not r[2].startswith("does not fit")]
    assert len(study) >= 4
    # LoHan: PCIe-bound at the smallest batch, the curve turns once compute grows
    assert study[0][6].startswith("1") and study[-1][6].startswith("3")
    prose = " ".join(out.split())  # explained before each table, in words that need no paper
    assert "direct host access, DHA" in prose and "case 1, the link is the bottleneck" in prose
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(tmp_path.glob("*.part"))


@pytest.mark.slow
def test_simulate_reproduces_protrain_table4_directions(tmp_path):
    """ProTrain Table 4, rows A -> B (GPT-2 1B on an RTX 3090, batch 8 -> 64): a larger batch keeps
    fewer units resident and checkpoints more blocks. Here GPT-2 XL (1.5 B) on a 22 GiB GPU tier.
    At batch 32 every block is recomputed from its input in host memory: beside the loss's
    log-softmax and its backward's two gradients (12.27 GiB), the 48 inputs (4.7 GiB) no longer
    fit in the tier (the plan was refused before blocks could recompute from host memory); at 64
    those alone leave nothing of it for any plan."""
    result = subprocess.run(
        [sys.executable, "-m", "offload_strategy", "simulate", "model=gpt2_xl", "hardware=rtx3090", "--gpu-memory", "22GiB", "--findings",
         "data.seq_len=1024", "data.batch_size=16", "--largest-at-most", "64"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    study = table(result.stdout, "| batch | tokens")
    assert [int(r[0]) for r in study] == [4, 8, 16, 32, 64]
    # at 64 x 1024 tokens the loss's fp32 log-softmax over 50,257 tokens alone is 13.2 GB, its backward's two gradients 26.4 GB
    assert "does not fit" in study[-1][2] and "the backward's gradients (24.54 GiB)" in study[-1][2], study[-1]
    assert study[-2][4] == "0/48/0", study[-2]
    planned = study[:-1]
    persistent = [int(r[2]) for r in planned]
    kept, checkpointed = ([int(r[4].split("/")[k]) for r in planned] for k in (0, 1))
    assert persistent[0] > persistent[2]  # batch 4 against 16 (rows A and B: 2 and 16 a GPU)
    assert checkpointed[0] < checkpointed[-1] and checkpointed == sorted(checkpointed)
    assert kept == sorted(kept, reverse=True) and kept[0] > kept[-1]


def test_what_the_forward_keeps_outside_the_blocks_by_hand():
    """A linear before the blocks saves its input (2 x 3 x 4 fp32: 96 bytes) and the log-softmax
    after them its output (96): 192 bytes outside the blocks. The first linear's output is block
    0's input, which block 0's linear saves: the block's, not counted again."""
    with torch.device("meta"):
        first, blocks = nn.Linear(4, 4), [Block(), Block()]
        model = nn.Sequential(first, *blocks)
        x = torch.zeros(2, 3, 4)
    compute = analytic_compute(model, blocks, lambda: torch.log_softmax(model(x), -1).sum(), TOY)
    assert [c.activation_bytes for c in compute.blocks] == [192, 192]
    assert compute.outside_activation_bytes == 192


def test_a_machine_with_fewer_of_its_drives_runs_each_at_its_own_rates_up_to_the_arrays():
    """LoHan's RTX 4090 machine has twelve P5510 drives (6.5 GB/s read, 3.4 GB/s write each), an
    array at TeraIO's 60% / 62% of their sums: 46.57 / 25.11 GB/s. With three drives, each at its
    own rates: 19.5 / 10.2 GB/s (a quarter of the array's would be 11.64 / 6.28). With eight, the
    sums (52.0 / 27.2) pass the array's, which bounds them; with 24, the array's doubled. A spec
    without a drive's rates (the H100's one PM1733) scales the array's; a rate given with the count
    stays as given, and a drive's rate given with it is used."""
    twelve = known_hardware("rtx4090")
    assert (twelve.nvme_read_gbps, twelve.nvme_write_gbps) == pytest.approx((46.567, 25.108), abs=1e-3)
    rates = {n: (h.nvme_read_gbps, h.nvme_write_gbps) for n in (1, 3, 8, 12, 24) for h in [known_hardware("rtx4090", nvme_count=n)]}
    assert rates[1] == pytest.approx((6.5, 3.4))
    assert rates[3] == pytest.approx((19.5, 10.2))
    assert rates[8] == pytest.approx((twelve.nvme_read_gbps, twelve.nvme_write_gbps))
    assert rates[12] == (twelve.nvme_read_gbps, twelve.nvme_write_gbps)
    assert rates[24] == pytest.approx((2 * twelve.nvme_read_gbps, 2 * twelve.nvme_write_gbps))
    two = known_hardware("h100_80g", nvme_count=2)
    assert (two.nvme_read_gbps, two.nvme_write_gbps) == pytest.approx((14.0, 7.6))
    assert known_hardware("rtx4090", nvme_count=3, nvme_read_gbps=10.0).nvme_read_gbps == 10.0
    assert known_hardware("rtx4090", nvme_count=3, nvme_drive_read_gbps=5.0).nvme_read_gbps == pytest.approx(15.0)


# conf/model/gpt2_tiny.yaml's network: the step model's settings below are built from the package alone
TINY_GPT2 = {"vocab_size": 256, "n_positions": 256, "n_embd": 256, "n_layer": 4, "n_head": 4, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
             "bos_token_id": None, "eos_token_id": None}


def gpt2(hardware: HardwareSpec, batch: int, seq: int, precision: str = "bf16-true", loss_chunk_tokens: object = None, **config: object) -> sim.Model:
    """The step model of a GPT-2 (the tiny one, or ``config``'s shapes) trained at ``precision``, the GPU's products at 50% of its peak."""
    module = CausalLM("gpt2", {**TINY_GPT2, **config}, name="gpt2", loss_chunk_tokens=loss_chunk_tokens)
    pricing = Pricing(hardware, dtype=compute_dtype(precision), efficiency=0.5, half=precision == "bf16-true", mixed=precision.endswith("-mixed"))
    return sim.build_module(module, sim.Shape(batch, seq), pricing)


def auto_row(model: sim.Model, hardware: HardwareSpec, gpu: str, host: str, nvme: str = "0") -> sim.Row:
    """The joint search's row for one rank."""
    sharding, owners = sim.rank_sharding(model, 1)
    machine = sim.machine_of(hardware, parse_size(nvme))
    return sim.compare_policies(model, machine, parse_size(gpu), parse_size(host), parse_size(nvme), sharding, owners)[-1]


def lohan_row(model: sim.Model, hardware: HardwareSpec, gpu: str, host: str, nvme: str) -> sim.Row:
    """The row of LoHan's own configuration (``policy=lohan policy.placement=nvme``): every unit on NVMe, its activation search."""
    policy = sim.preset_row_policy(dataclasses.replace(PolicyConfig.coerce("lohan"), placement="nvme"), parse_size(nvme))
    sharding, owners = sim.rank_sharding(model, 1)
    machine = sim.machine_of(hardware, parse_size(nvme))
    return sim.policy_row(model, machine, parse_size(gpu), parse_size(host), parse_size(nvme), sharding, owners, policy)


def test_the_step_model_computes_for_as_long_as_the_blocks_and_the_rest_take():
    """What-if predictions price the step's compute from the units' times; those must hold the
    blocks' whole forward (attention's products and the memory-bound work, which no parameter
    accounts for) and the loss outside them. Before, the units held their matrix products alone
    and the step computed for less than its blocks' forward."""
    a100 = known_hardware("a100_80g")
    model = gpt2(a100, 4, 128)
    inside = {i for units in model.block_units for i in units}
    whole = sum(b.forward_seconds for b in model.blocks) + sum(c.forward_seconds for i, c in enumerate(model.costs) if i not in inside)
    assert sum(c.forward_seconds for c in model.costs) == pytest.approx(whole, rel=1e-9)
    assert sum(c.backward_seconds for c in model.costs) == pytest.approx(2 * whole, rel=1e-9)
    assert model.compute_seconds == pytest.approx(3 * whole, rel=1e-9)
    assert whole > 1.05 * model.forward_flops / (a100.peak_flops("bf16") * 0.5)  # a tiny model's step is largely memory-bound


def test_the_largest_model_is_the_deepest_the_auto_search_plans():
    """``Model.deeper`` repeats the first block with its units renumbered in execution order, and
    the largest model is the depth the auto rows' search plans within the budgets while one block
    more does not (a tiny GPT-2 in a 20 MiB host budget without NVMe)."""
    rtx3090 = known_hardware("rtx3090")
    model = gpt2(rtx3090, 2, 64)
    deeper = model.deeper(7)
    n_block = len(model.block_units[0])
    assert len(deeper.blocks) == 7 and [s.index for s in deeper.sizes] == list(range(len(deeper.sizes)))
    assert len(deeper.sizes) == len(model.sizes) + (7 - len(model.blocks)) * n_block
    assert deeper.block_units[1] == [i + n_block for i in deeper.block_units[0]]
    assert all(0 <= i < len(deeper.sizes) for group in deeper.co_resident for i in group)
    per_block = sum(model.costs[i].parameters for i in model.block_units[0])
    assert deeper.parameters == model.parameters + (7 - len(model.blocks)) * per_block

    machine, gpu, host = sim.machine_of(rtx3090, 0), parse_size("64MiB"), parse_size("20MiB")
    depth, parameters, plan = sim.largest_depth(model, machine, gpu, host, 0)
    assert depth > 0 and plan is not None and plan.fits and parameters == model.deeper(depth).parameters

    def planned(d: int) -> bool:
        return sim.compare_policies(model.deeper(d), machine, gpu, host, 0, None, [0] * len(model.deeper(d).sizes))[-1].fits

    assert planned(depth) and not planned(depth + 1)


def test_protrain_175b_on_four_machines_plans_with_a_copy_of_host_homes_per_machine():
    """ProTrain §5.4 (GPT 175B on 16 A100s in four machines, 100 Gb/s, 243.2 GiB of host per rank,
    batch 16 a rank): a copy of the host units' 16-bit parameters on every rank (326 GiB) cannot
    fit, and was refused before; one copy per machine costs each rank a quarter of it (81 GiB)
    beside its sixteenth of the states (122 GiB), and plans within the budget."""
    hardware = known_hardware("a100_80g").rank_share(4)  # four ranks a machine
    model = gpt2(hardware, 16, 1024, vocab_size=50257, n_positions=1024, n_embd=12288, n_layer=96, n_head=96)  # GPT-3 175B's shapes
    gpu, host = parse_size("72GiB"), parse_size("243.2GiB")

    def row(shared: bool) -> sim.Row:
        sharding, owners = sim.rank_sharding(model, 16, shared, machines=4)
        machine = sim.machine_of(hardware, 0, ranks=16, network=12.5e9, shard_states=True, shared_homes=shared, machines=4)
        return sim.compare_policies(model, machine, gpu, host, 0, sharding, owners)[-1]

    shared = row(True)
    assert shared.fits and 0 < shared.host <= host, shared
    copies = row(False)
    assert not copies.fits and "host_memory=243.20 GiB cannot hold" in copies.note, copies


def test_simulate_prices_a_chunked_loss_without_the_whole_logits():
    """With ``model.loss_chunk_tokens`` the meta forward runs the loss a chunk at a time under
    checkpointing: what the forward keeps after the last block loses the fp32 log-softmax over the
    vocabulary (4 x 128 tokens x 256 x 4 bytes = 512 KiB), and nothing else changes beside the
    blocks (the backward's room is a block's: twice its 4 x 128 x 1024 16-bit MLP tensor). The
    head's product runs once more in backward, and is priced there."""
    a100 = known_hardware("a100_80g")
    models = [gpt2(a100, 4, 128, loss_chunk_tokens=chunk) for chunk in (None, "auto", 64)]
    whole, auto, small = (m.beside for m in models)
    assert whole.after - auto.after >= 512 * 256 * 4 and auto == small
    assert whole.gradients == auto.gradients == 2 * 4 * 128 * 1024 * 2
    # backward runs the head again: the tied embedding's unit (the head's) computes its forward
    # three times a step, every other unit as before (twice its forward in backward)
    head = [i for i, u in enumerate(models[1].units) if u.name.endswith("wte")]
    assert len(head) == 1, [u.name for u in models[1].units]
    for i, c in enumerate(models[1].costs):
        assert c.backward_seconds == pytest.approx((3 if i in head else 2) * c.forward_seconds), i
    assert [c.backward_seconds for c in models[0].costs] == pytest.approx([2 * c.forward_seconds for c in models[0].costs])


def test_simulate_prices_bf16_mixed_blocks_as_autocast_keeps_them():
    """Under ``bf16-mixed`` a block keeps what autocast saves: less than in fp32 (its products'
    inputs are 16-bit casts), more than under ``bf16-true`` (norms and the residual stream stay
    fp32, and each product saves a 16-bit copy of its weight). Before, the meta forward ran in fp32
    and the mixed-precision rows counted the fp32 bytes."""
    a100 = known_hardware("a100_80g")
    saved = {precision: gpt2(a100, 4, 128, precision).blocks[0].activation_bytes for precision in ("32-true", "bf16-mixed", "bf16-true")}
    assert saved["bf16-true"] < saved["bf16-mixed"] < saved["32-true"]
    weights = 12 * 256 * 256  # the tiny GPT-2's block: four 256-wide products, 12 x 256^2 weights, each cast to 2 bytes
    assert saved["bf16-mixed"] - saved["bf16-true"] > 2 * weights


def test_a_gpu_tier_too_small_for_any_layout_is_refused_and_a_larger_one_planned():
    """A tiny GPT-2 at batch 4 x 64 (its loss a chunk at a time) saves 3.9 MiB per block and its
    backward needs 1 MiB of room, so in a 4 MiB GPU tier no layout of its blocks fits beside the
    parameters (refused, saying why), and an 8 MiB one plans it, checkpointing three of its four
    blocks. (tools/reproduce.py counts a setting its paper ran out of memory in as reproduced
    where the row is refused so.)"""
    rtx4090 = known_hardware("rtx4090")
    model = gpt2(rtx4090, 4, 64, loss_chunk_tokens="auto")
    small, large = (auto_row(model, rtx4090, gpu, "1GiB") for gpu in ("4MiB", "8MiB"))
    assert not small.fits and small.note.startswith("does not fit: the activations outside the blocks"), small
    assert large.fits and (large.homes, large.layout) == ("0/27/0", "1/3/0"), large


def test_simulate_prices_a_policy_that_fixes_every_home_as_the_runtime_places_it():
    """``policy=lohan policy.placement=nvme`` (LoHan's own configuration) gets a row of its own:
    every unit on NVMe, the layout LoHan's search chooses in what the parameters leave, within
    the GPU tier; its step is at least the drive's time to write every unit's states back. A
    placement the rows cannot price is refused, saying which they can."""
    from offload_strategy.planning.placement import minimum_gpu_bytes

    rtx4090 = known_hardware("rtx4090")
    model = gpt2(rtx4090, 4, 64, loss_chunk_tokens="auto")
    row = lohan_row(model, rtx4090, "16MiB", "1GiB", "1GiB")
    assert row.policy == "nvme+lohan" and row.fits, row
    assert row.homes == f"0/0/{len(model.sizes)}"
    assert row.gpu_parameters >= minimum_gpu_bytes(model.sizes, model.co_resident)
    assert row.gpu_parameters + row.gpu_activations <= parse_size("16MiB")
    written = sum(s.trainable_bytes * model.state_factor + s.nbytes for s in model.sizes if s.trainable_bytes)
    assert row.seconds >= written / (rtx4090.nvme_write_gbps * 1e9)
    auto = auto_row(model, rtx4090, "16MiB", "1GiB", "1GiB")
    assert auto.policy == "auto" and auto.homes != row.homes  # the joint search keeps this small model's units elsewhere
    with pytest.raises(SystemExit, match="placement=search"):
        sim.preset_row_policy(dataclasses.replace(PolicyConfig.coerce("lohan"), placement="layerwise"), parse_size("1GiB"))


def test_lohans_ssd_traffic_a_step_by_hand():
    """LoHan's traffic with every model state on its SSDs (Eq. 4-5): 16 bytes a parameter read and
    14 written a step, the drive simplex. At 16e-6 GB/s read and 14e-6 GB/s write, P parameters
    take P * (16 / 16e-6 + 14 / 14e-6) / 1e9 = 2P / 1000 seconds: what a published step on those
    drives cannot be shorter than."""
    from offload_strategy.planning.activations import Links
    from offload_strategy.planning.cost_model import Bandwidth

    links = Links.lohan(Bandwidth(h2d=0.0, d2h=0.0, nvme_read=16e3, nvme_write=14e3), 5_000_000)
    assert links.nvme_forward_seconds + links.nvme_backward_seconds == pytest.approx(2 * 5_000_000 / 1000)


def test_lohans_configuration_is_refused_where_its_profiling_steps_are_as_the_runtime_refuses_them():
    """A 24-block tiny GPT-2 at batch 16 x 64 in LoHan's configuration (every unit on NVMe) with
    a 24 MiB GPU tier and 64 MiB of host memory. The row is the running session's planning
    sequence on the shapes' profile, which refuses it in the first step as the runtime does: the
    least activation peak of the layouts, and of the profiling steps' own (the first block kept,
    the others recomputed), does not fit beside the streaming buffers; the refusal names the least
    gpu_memory. At that minimum the row fits, within the host budget, every unit on NVMe."""
    rtx4090 = known_hardware("rtx4090")
    model = gpt2(rtx4090, 16, 64, loss_chunk_tokens="auto", n_layer=24)
    refused = lohan_row(model, rtx4090, "24MiB", "64MiB", "1GiB")
    assert not refused.fits and "no layout of keep / checkpoint / swap fits" in refused.note, refused
    least = re.search(r"gpu_memory must be at least ([0-9.]+ MiB)", refused.note)
    assert least is not None, refused.note
    at_least = f"{math.ceil(float(least.group(1).split()[0]))}MiB"
    row = lohan_row(model, rtx4090, at_least, "64MiB", "1GiB")
    assert row.fits and row.homes == "0/0/147", row
    assert row.host <= parse_size("64MiB") and row.gpu_parameters + row.gpu_activations <= parse_size(at_least), row


def test_a_blocks_forward_flops_by_hand():
    """A tiny GPT-2 block (width 256, 64 tokens x 4) runs four matrix products over 12 x 256^2
    weights, 2 FLOPs a weight a token: 24 x 256^2 x 256 = 402,653,184, and attention's two
    products over 4 heads of 64, 2 x 2 x 4 x 64^2 x 256 = 16,777,216: 419,430,400 a block, what
    recomputing it runs again."""
    model = gpt2(known_hardware("rtx4090"), 4, 64)
    assert model.block_flops == (419_430_400,) * 4
    assert sum(model.block_flops) < model.forward_flops  # the head's product is outside them


def test_the_reproduction_table_of_the_papers_figures():
    """tools/reproduce.py as a user runs it, on four of its points (and LH-9b, the finding whose id LH-9 starts):

    - LH-9: LoHan's 13B at batch 32 saves 213 GB of activations with fused GELU; the estimate,
      each storage once and the model's GELU as that fused kernel, is within 20% (it was 1.95x
      with the eager GELU formula);
    - LH-11: LoHan's forward of 5.96 s, less what its memory-bound work takes at the card's memory
      bandwidth, sets the rate of the RTX 4090's matrix products: 96% of its dense peak (88% when
      every second of the forward was taken as the tensor cores'); LH-10b-48-6 is priced at that
      rate, and its ``offload-strategy simulate`` command carries it (TC-1's, at the default, does not);
    - LH-10b-48-6: a TFLOPS figure above what the model's compute alone gives at that rate is said
      to be so, the step that compute takes against the step the figure means (the model's FLOPs,
      forward and backward twice forward, over the figure); TC-1's step, longer than its compute, is not.
      The row itself is the running session's planning sequence, which refuses the setting in its
      first step (no activation peak it can reach fits the GPU)."""
    points = ("LH-9", "LH-11", "LH-10b-48-6", "TC-1")
    result = subprocess.run([sys.executable, str(ROOT / "tools/reproduce.py"), "--only", *points, "--commands"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    rows = {cells[0]: cells for line in out.splitlines() if line.startswith(("| LH-", "| TC-")) for cells in [[c.strip() for c in line.strip("|").split(" | ")]]}
    assert set(rows) == {*points, "LH-9b"}, out
    assert 0.8 <= float(rows["LH-9"][5]) <= 1.25, rows["LH-9"]
    rate = re.search(r"calibrates the GPU's rate \((96\.\d)% of its dense peak\)", rows["LH-11"][2])
    assert rate, rows["LH-11"]
    assert f"the GPU at {rate[1]}% of its peak, from LH-11" in rows["LH-10b-48-6"][2], rows["LH-10b-48-6"]
    # LH-10b-48-6 is refused as the runtime's first step refuses it (the least activation peak of the
    # layouts and of the profiling steps' own does not fit a 24 GB GPU at batch 48): a miss; TC-1 shown, not counted
    assert "activation bytes 1 of 1" in out and "throughput and step time 0 of 1" in out, out
    assert rows["LH-10b-48-6"][6].startswith("refused: no layout of keep / checkpoint / swap fits"), rows["LH-10b-48-6"]
    ceiling = re.search(r"above the GPU's compute alone in the model \(([\d.]+) at this rate, ([\d.]+) s a step against the published ([\d.]+) s\)",
                        rows["LH-10b-48-6"][2])
    assert ceiling and "above the GPU's compute alone" not in rows["TC-1"][2], (rows["LH-10b-48-6"], rows["TC-1"])
    alone, compute, step = (float(g) for g in ceiling.groups())
    assert compute > step and alone == pytest.approx(146.3 * step / compute, abs=0.06)
    # the step the figure means: 3 forwards of the 13B at 48 x 1024 tokens, by hand (products 2
    # FLOPs a weight a token, the tied head's included; attention's two, 4 x 1024 x 5120 a token a block)
    tokens = 48 * 1024
    flops = 3 * (2 * tokens * (12 * 40 * 5120**2 + 50257 * 5120) + 4 * 40 * 1024 * 5120 * tokens)
    assert step == pytest.approx(flops / 146.3e12, abs=0.01)
    commands = dict(line.split(": ", 1) for line in out.split("\n\n")[-1].splitlines() if line.startswith(("LH-", "TC-")))
    assert " --efficiency 0.96" in commands["LH-10b-48-6"] and "+hardware.nvme_count=6" in commands["LH-10b-48-6"], commands
    assert commands["TC-1"].startswith("offload-strategy simulate ") and "--efficiency" not in commands["TC-1"], commands
