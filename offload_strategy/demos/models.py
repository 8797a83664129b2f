"""Causal language models built from configs with random weights: the model the tests, the tools
and the Hydra experiments train.

The model families come from ``transformers`` (an extra of the experiments, never a dependency of
the library; it is imported only when a model is built). Nothing is downloaded: every model is
built from its config alone.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import lightning as L
import torch
from torch import nn

from ..losses import chunked_causal_lm_loss
from ..estimate.analytic import routed_shares

# family name -> transformers config class
FAMILIES = {
    "gpt2": "GPT2Config",
    "opt": "OPTConfig",
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "mixtral": "MixtralConfig",
}

# The parameters' runtime alone (the `fill` preset): first-use placement, every block's activations
# kept. The tests and tools that measure parameter offloading size the emulated GPU tier for
# parameters, which the default policy would (rightly) refuse once it counts the activations too.
PARAMETERS_ONLY = {"name": "auto", "placement": "fill", "activations": "keep"}


def gpt2_config(layers: int, width: int, positions: int = 256) -> dict[str, Any]:
    """A GPT-2 of ``layers`` x ``width`` over 256 byte tokens, without dropout."""
    return {
        "vocab_size": 256, "n_positions": positions, "n_embd": width, "n_layer": layers, "n_head": max(1, width // 64),
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": None, "eos_token_id": None,
    }


def build_causal_lm(family: str, config: dict[str, Any]) -> nn.Module:
    """A ``transformers`` causal LM of ``family`` with random weights, from ``config`` alone."""
    if family not in FAMILIES:
        raise ValueError(f"model family {family!r} is not known; choose one of {', '.join(FAMILIES)}.")
    import transformers

    config_cls = getattr(transformers, FAMILIES[family])
    return transformers.AutoModelForCausalLM.from_config(config_cls(**config))


def _shape(config: Any) -> tuple[int, int]:
    """(layers, hidden size) of a transformers config, whatever the family calls them."""
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    return int(layers), int(hidden)


def max_positions(config: Any) -> Optional[int]:
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    return None


class CausalLM(L.LightningModule):
    """Next-token prediction on batches of token ids ``[batch, seq]``.

    The network is built in :meth:`configure_model`, so constructing the module is cheap and a
    strategy can decide where the weights are created.

    Args:
        family: ``gpt2``, ``opt``, ``llama``, ``mistral`` or ``mixtral``.
        config: keyword arguments of the family's ``transformers`` config.
        name: a short name for tables and logs.
        lr, weight_decay, betas, warmup_steps: AdamW with linear warm-up and cosine decay to 10%.
        loss_chunk_tokens: compute the loss a chunk of tokens at a time
            (:func:`offload_strategy.losses.chunked_causal_lm_loss`), so that the fp32 logits of
            the whole batch never exist: ``"auto"`` sizes the chunks so that one chunk's logits
            are no larger than the hidden states, a number gives the tokens per chunk; ``None``
            (the default) takes the model's own loss.
    """

    def __init__(
        self,
        family: str,
        config: dict[str, Any],
        name: str = "",
        lr: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        loss_chunk_tokens: Optional[Union[int, str]] = None,
    ) -> None:
        super().__init__()
        if family not in FAMILIES:
            raise ValueError(f"model family {family!r} is not known; choose one of {', '.join(FAMILIES)}.")
        if not (loss_chunk_tokens in (None, "auto") or (isinstance(loss_chunk_tokens, int) and loss_chunk_tokens > 0)):
            raise ValueError(f"loss_chunk_tokens={loss_chunk_tokens!r}: give a positive number of tokens, 'auto', or None for the model's own loss.")
        if loss_chunk_tokens is not None and config.get("output_router_logits"):
            raise ValueError("loss_chunk_tokens computes the language model's loss alone and would leave out the router's auxiliary loss "
                             "(output_router_logits=True); drop one of the two.")
        self.save_hyperparameters()
        self.family = family
        self.model_config = dict(config)
        self.name = name or family
        self.model: Optional[nn.Module] = None
        # read by Lightning's ThroughputMonitor after every batch (set per batch in the steps)
        self.flops_per_batch: Optional[int] = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = build_causal_lm(self.family, self.model_config)

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @property
    def active_parameters(self) -> int:
        """Parameters each token multiplies: all of them, except in a mixture of experts, where a
        token meets only the experts its router picks (Mixtral-8x7B: 12.9 B of 46.7 B)."""
        shares = routed_shares(self.modules())
        return round(sum(p.numel() * shares.get(id(p), 1.0) for p in self.parameters()))

    def flops_per_token(self, seq_len: int, backward: bool = True) -> int:
        """Matmul FLOPs per token: 2N forward (4N more with backward) plus attention scores.

        The standard estimate (Kaplan et al. 2020; PaLM appendix B): 6N + 12·L·H·T per token for a
        training step, N (active) parameters, L layers, hidden size H, sequence length T.
        """
        assert self.model is not None
        layers, hidden = _shape(self.model.config)
        per_token = 2 * self.active_parameters + 4 * layers * hidden * seq_len
        return per_token * 3 if backward else per_token

    def _loss(self, batch: torch.Tensor) -> torch.Tensor:
        assert self.model is not None, "configure_model() has not run"
        chunk = self.hparams.get("loss_chunk_tokens")
        if chunk is None:
            return self.model(input_ids=batch, labels=batch).loss
        model: Any = self.model  # a transformers model: its methods are not typed as callables
        hidden = model.base_model(input_ids=batch).last_hidden_state  # as the model's own forward calls it
        return chunked_causal_lm_loss(hidden, model.get_output_embeddings(), batch, None if chunk == "auto" else int(chunk))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.flops_per_batch = self.flops_per_token(batch.shape[1]) * batch.numel()
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.flops_per_batch = self.flops_per_token(batch.shape[1], backward=False) * batch.numel()
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, on_step=False, on_epoch=True)
        return loss

    def configure_optimizers(self) -> Any:
        # No weight decay on biases and norms (every parameter of fewer than 2 dims), as usual.
        hparams: Any = self.hparams  # Lightning's AttributeDict
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=hparams.lr,
            betas=tuple(hparams.betas),
        )
        total = max(1, int(self.trainer.estimated_stepping_batches)) if self._trainer is not None else 1
        warmup = hparams.warmup_steps

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
