"""A causal LM's own loss beside the loss a chunk of tokens at a time, side by side in one run.

    python tools/bench_loss.py                                  # the table in docs/benchmarks.md
    python tools/bench_loss.py --vocab 128256 --width 1024 --seq-len 512

A GPT-2 built from its config with random weights (no downloads) runs forward and backward on
random tokens, alternating between the variants so that the machine's drift falls on each alike.
Reported per variant: what the forward keeps for backward in all (each storage once, as
``runtime/activations/saved_bytes.py`` counts it), of it what the loss keeps (the total less what the model
keeps up to its last hidden states), the largest tensor saved (the backward's gradients are
twice it), the median forward-and-backward time and its ratio to the model's own loss, and the
loss itself.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from offload_strategy import format_bytes  # noqa: E402
from offload_strategy.losses import chunked_causal_lm_loss, default_chunk_tokens  # noqa: E402
from offload_strategy.runtime.activations.saved_bytes import SavedBytes  # noqa: E402


def _model(args: argparse.Namespace) -> Any:
    import transformers

    config = transformers.GPT2Config(vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.width, n_layer=args.layers,
                                     n_head=max(1, args.width // 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _variants(model: Any, chunks: list[int]) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    def own(ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=ids).loss

    def chunked(chunk: Optional[int]) -> Callable[[torch.Tensor], torch.Tensor]:
        def loss(ids: torch.Tensor) -> torch.Tensor:
            hidden = model.base_model(input_ids=ids).last_hidden_state
            return chunked_causal_lm_loss(hidden, model.get_output_embeddings(), ids, chunk)
        return loss

    out = {"the model's own loss": own, "chunked, default size": chunked(None)}
    out.update({f"chunked, {c:,} tokens": chunked(c) for c in chunks})
    return out


def _saved(model: Any, loss: Callable[[torch.Tensor], torch.Tensor], ids: torch.Tensor) -> tuple[SavedBytes, int]:
    """What one forward saves for backward, and of it what it had saved by the last hidden states."""
    counted, before_head = SavedBytes(), []
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            counted.add(t)
        return t

    hook = model.base_model.register_forward_hook(lambda *_: before_head.append(counted.bytes))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss(ids).backward()
    finally:
        hook.remove()
    model.zero_grad(set_to_none=True)
    return counted, before_head[0]


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--chunks", type=int, nargs="*", default=[256], help="chunk sizes (tokens) beside the default")
    parser.add_argument("--steps", type=int, default=5, help="timed forward-and-backward passes per variant")
    args = parser.parse_args(argv)
    if min(args.vocab, args.width, args.layers, args.batch, args.seq_len, args.steps) < 1 or args.seq_len < 2:
        raise SystemExit("every size must be at least 1, and --seq-len at least 2 (the loss predicts the next token).")

    model = _model(args)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(1))
    variants = _variants(model, args.chunks)
    times: dict[str, list[float]] = {name: [] for name in variants}
    losses: dict[str, float] = {}
    for _ in range(args.steps + 1):  # the first round warms up
        for name, loss in variants.items():
            start = time.perf_counter()
            value = loss(ids)
            value.backward()
            times[name].append(time.perf_counter() - start)
            losses[name] = float(value.detach())
            model.zero_grad(set_to_none=True)
    tokens = args.batch * (args.seq_len - 1)
    print(f"GPT-2, {args.layers} blocks of {args.width}, vocabulary {args.vocab:,}, batch {args.batch} x {args.seq_len} "
          f"({tokens:,} tokens predicted; default chunk {default_chunk_tokens(tokens, args.width, args.vocab):,} tokens), "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    print("| loss | saved for backward | of it, the loss's | largest tensor saved | step (ms, median) | x own | loss value |")
    print("|---|---|---|---|---|---|---|")
    base = statistics.median(times["the model's own loss"][1:])
    for name, loss in variants.items():
        saved, before = _saved(model, loss, ids)
        median = statistics.median(times[name][1:])
        print(f"| {name} | {format_bytes(saved.bytes)} | {format_bytes(saved.bytes - before)} | {format_bytes(saved.largest)} | "
              f"{median * 1e3:.1f} | {median / base:.2f} | {losses[name]:.6f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
