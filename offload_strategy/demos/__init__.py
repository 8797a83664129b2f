"""What the tests, the tools and the Hydra experiments train, inside the package as Lightning keeps
``lightning.pytorch.demos``: a ``transformers`` causal LM as a LightningModule, byte-level token
data (random, the standard library's sources, or the user's files), an in-memory logger, and the
models held out from the estimate's design.

``transformers`` is needed only to build a model, never to import this package."""

from .data import EpochShuffle, PythonStdlibText, SyntheticTokens, TextFiles, TokenDataModule, TokenWindows
from .held_out import HELD_OUT, HuggingFaceLM, SmallCNN, example_batch
from .loggers import MetricsRecorder
from .models import FAMILIES, PARAMETERS_ONLY, CausalLM, build_causal_lm, gpt2_config, max_positions

__all__ = [
    "FAMILIES", "HELD_OUT", "PARAMETERS_ONLY", "CausalLM", "EpochShuffle", "HuggingFaceLM", "MetricsRecorder", "PythonStdlibText", "SmallCNN",
    "SyntheticTokens", "TextFiles", "TokenDataModule", "TokenWindows", "build_causal_lm", "example_batch", "gpt2_config", "max_positions",
]
