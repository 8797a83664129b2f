"""The analytic activation estimate beside what a real forward saves, on this machine's CPU.

    python tools/validate_activations.py
    python tools/validate_activations.py --families gpt2 llama --batch 4 --seq 256

For each model family (the causal LMs the zoo builds, BERT's masked LM and T5's encoder-decoder),
a small model of the family's shape is built twice from one config: on the
meta device, where ``estimate/analytic.py`` counts what each block saves for backward from shapes
alone (attention as the fused kernels a GPU runs), and on the CPU with real tensors, where the same
forward is run and every storage a block saves is counted once (parameters excluded, as the
runtime does). The table gives the first block's bytes both ways, per token and hidden unit, and
the estimate's error; the model's step planning prices activations with the estimate.
``--precision bf16-mixed`` runs both forwards under mixed precision: the real one in
``torch.autocast`` on the CPU (as Lightning's plugin enters it, without its cast cache), the meta one
with ``estimate/analytic.py::Autocast`` given the CPU's op lists, which checks the emulation the
step model runs with the GPU's lists.

A second table runs one training step of each (forward and backward) and measures what the
backward holds beyond what the forward left (``estimate/live_bytes.py``: the bytes of tensors
the step's operations made, still alive), against twice the largest tensor the forward saved,
which the runtime and the step model plan beside every activation layout (``BesideBlocks``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import contextlib  # noqa: E402

import torch  # noqa: E402

from offload_strategy.demos import build_causal_lm  # noqa: E402
from offload_strategy.hardware import known_hardware  # noqa: E402
from offload_strategy.estimate.analytic import AUTOCAST_CPU, Autocast, analytic_compute  # noqa: E402
from offload_strategy.estimate.live_bytes import backward_beyond_forward  # noqa: E402
from offload_strategy.runtime.activations.policies import find_blocks  # noqa: E402

WIDTH, HEADS, LAYERS = 256, 4, 2
CONFIGS: dict[str, dict[str, Any]] = {
    "gpt2": dict(vocab_size=1024, n_positions=1024, n_embd=WIDTH, n_layer=LAYERS, n_head=HEADS),
    "opt": dict(vocab_size=1024, hidden_size=WIDTH, ffn_dim=4 * WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                max_position_embeddings=1024, word_embed_proj_dim=WIDTH),
    "llama": dict(vocab_size=1024, hidden_size=WIDTH, intermediate_size=688, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=HEADS, max_position_embeddings=1024),
    "mistral": dict(vocab_size=1024, hidden_size=WIDTH, intermediate_size=688, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    num_key_value_heads=2, max_position_embeddings=1024, sliding_window=None),
    # the encoder families: a masked LM with its tied output embedding, and an encoder-decoder
    # (its first block is the encoder's: relative position bias, attention as matrix products)
    "bert": dict(vocab_size=1024, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                 max_position_embeddings=1024, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    "t5": dict(vocab_size=1024, d_model=WIDTH, d_kv=WIDTH // HEADS, d_ff=4 * WIDTH, num_layers=LAYERS, num_heads=HEADS, dropout_rate=0.0,
               decoder_start_token_id=0, pad_token_id=0),
}


def build(family: str) -> torch.nn.Module:
    """A small model of ``family`` with random weights (on the current default device)."""
    if family == "bert":
        from transformers import BertConfig, BertForMaskedLM

        return BertForMaskedLM(BertConfig(**CONFIGS[family]))
    if family == "t5":
        from transformers import T5Config, T5ForConditionalGeneration

        return T5ForConditionalGeneration(T5Config(**CONFIGS[family]))
    return build_causal_lm(family, CONFIGS[family])


def estimated(family: str, batch: int, seq: int, mixed: bool = False) -> int:
    """The first block's saved bytes, from shapes on the meta device."""
    return estimate(family, batch, seq, mixed).blocks[0].activation_bytes


def estimate(family: str, batch: int, seq: int, mixed: bool = False) -> Any:
    """The analytic profile of ``family`` from shapes on the meta device."""
    with torch.device("meta"):
        model = build(family)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    autocast = Autocast(torch.bfloat16, AUTOCAST_CPU) if mixed else None
    return analytic_compute(model, find_blocks(model), lambda: model(input_ids=ids, labels=ids).loss, known_hardware("rtx4090"),
                            autocast=autocast)


def backward_gradients(family: str, batch: int, seq: int, mixed: bool = False) -> dict[str, Any]:
    """One training step of ``family`` on the CPU: the largest tensor its forward saved, and the
    most its backward held beyond what the forward left."""
    torch.manual_seed(0)
    model = build(family)
    ids = torch.randint(0, CONFIGS[family]["vocab_size"], (batch, seq))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False) if mixed else contextlib.nullcontext()

    def forward() -> torch.Tensor:
        with autocast:
            return model(input_ids=ids, labels=ids).loss

    measured, largest = backward_beyond_forward(model, forward)
    return {"family": family, "largest": largest, "measured": measured, "planned": 2 * largest,
            "estimated": estimate(family, batch, seq, mixed).beside.gradients}


def measured(family: str, batch: int, seq: int, mixed: bool = False) -> int:
    """The first block's saved bytes in a real forward on the CPU, each storage once."""
    torch.manual_seed(0)
    model = build(family)
    block = find_blocks(model)[0]
    parameters = {id(p) for p in model.parameters()}
    inside: list[bool] = [False]
    held: dict[int, torch.UntypedStorage] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        is_parameter = id(t) in parameters or (t._base is not None and id(t._base) in parameters)
        if inside[0] and not is_parameter:
            storage = t.untyped_storage()
            held.setdefault(storage.data_ptr(), storage)
        return t

    handles = [
        block.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)),
        block.register_forward_hook(lambda *_: inside.__setitem__(0, False)),
    ]
    ids = torch.randint(0, CONFIGS[family]["vocab_size"], (batch, seq))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False) if mixed else contextlib.nullcontext()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
            model(input_ids=ids, labels=ids).loss
    finally:
        for handle in handles:
            handle.remove()
    return sum(s.nbytes() for s in held.values())


def compare(families: list[str], batch: int, seq: int, mixed: bool = False) -> list[dict[str, Any]]:
    rows = []
    for family in families:
        estimate, real = estimated(family, batch, seq, mixed), measured(family, batch, seq, mixed)
        rows.append({"family": family, "estimated": estimate, "measured": real, "error": estimate / real - 1.0, "per_sbh": batch * seq * WIDTH})
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    args = parser.parse_args(argv)
    mixed = args.precision == "bf16-mixed"
    print(f"first block of each family, width {WIDTH}, {HEADS} heads, batch {args.batch} x {args.seq} tokens, {args.precision}, "
          f"torch {torch.__version__}\n")
    print("| family | estimated (bytes) | measured on CPU (bytes) | estimated / (s·b·h) | measured / (s·b·h) | error |")
    print("|---|---|---|---|---|---|")
    for r in compare(args.families, args.batch, args.seq, mixed):
        print(f"| {r['family']} | {r['estimated']:,} | {r['measured']:,} | {r['estimated'] / r['per_sbh']:.1f} | "
              f"{r['measured'] / r['per_sbh']:.1f} | {r['error']:+.1%} |")
    print("\nthe backward beyond what the forward left, one training step on the CPU\n")
    print("| family | largest saved tensor | backward measured | planned (twice the largest) | measured / planned | estimated from shapes |")
    print("|---|---|---|---|---|---|")
    for family in args.families:
        g = backward_gradients(family, args.batch, args.seq, mixed)
        print(f"| {family} | {g['largest']:,} | {g['measured']:,} | {g['planned']:,} | {g['measured'] / g['planned']:.2f} | {g['estimated']:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())


