"""Token data for the demo model: real text every machine has, random tokens, or the user's files.

Text is tokenised byte-level (vocabulary 256): no tokenizer to download, and real structure for
the loss to learn.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, Sampler


class EpochShuffle(Sampler[int]):
    """A fresh permutation every epoch, drawn from ``seed`` and the epoch number alone.

    Lightning calls ``set_epoch`` before each epoch, so a run resumed from a checkpoint sees the
    same batches in the same order as one that never stopped, whatever the global RNG did since.
    """

    def __init__(self, length: int, seed: int = 0) -> None:
        self.length = length
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.length, generator=generator).tolist())


class TokenWindows(Dataset):
    """Consecutive, non-overlapping windows of ``seq_len`` tokens from one long token stream."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        if tokens.numel() < seq_len:
            raise ValueError(f"{tokens.numel()} tokens cannot fill one window of seq_len={seq_len}; lower seq_len or give more data.")
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return self.tokens.numel() // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        return self.tokens[start : start + self.seq_len].long()


class TokenDataModule(L.LightningDataModule):
    """Serves ``[batch, seq_len]`` token batches; subclasses say where the tokens come from."""

    vocab_size = 256

    def __init__(self, seq_len: int = 128, batch_size: int = 16, num_workers: int = 0, shuffle_seed: int = 0) -> None:
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"data.{name}={value!r} must be a positive integer.")
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.shuffle_seed = shuffle_seed
        self.train_set: Optional[TokenWindows] = None
        self.val_set: Optional[TokenWindows] = None

    def load(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(train tokens, validation tokens) as 1-D integer tensors."""
        raise NotImplementedError

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is None:
            train, val = self.load()
            self.train_set = TokenWindows(train, self.seq_len)
            self.val_set = TokenWindows(val, self.seq_len)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        sampler = EpochShuffle(len(self.train_set), self.shuffle_seed)
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler, drop_last=True, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)


def _bytes_to_tokens(chunks: Iterable[bytes]) -> torch.Tensor:
    data = b"\n\n".join(chunks)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _split_files(files: list[Path], every: int, max_bytes: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Every ``every``-th file goes to validation (whole files, so nothing leaks across)."""
    train: list[bytes] = []
    val: list[bytes] = []
    budget = {"train": max_bytes, "val": None if max_bytes is None else max(max_bytes // every, 1)}
    used = {"train": 0, "val": 0}
    for index, path in enumerate(files):
        split = "val" if index % every == every - 1 else "train"
        limit = budget[split]
        if limit is not None and used[split] >= limit:
            if all((cap := budget[s]) is not None and used[s] >= cap for s in budget):
                break
            continue
        data = path.read_bytes()
        if limit is not None:
            data = data[: limit - used[split]]
        used[split] += len(data)
        (val if split == "val" else train).append(data)
    return _bytes_to_tokens(train), _bytes_to_tokens(val)


class PythonStdlibText(TokenDataModule):
    """The source files of this interpreter's standard library, byte-level.

    Args:
        max_bytes: cap on training bytes read (validation gets 1/``val_every`` of it).
        val_every: every n-th file (in sorted order) is held out for validation.
    """

    def __init__(self, seq_len: int = 128, batch_size: int = 16, num_workers: int = 0, shuffle_seed: int = 0,
                 max_bytes: Optional[int] = 8 * 1024**2, val_every: int = 20) -> None:
        super().__init__(seq_len, batch_size, num_workers, shuffle_seed)
        self.max_bytes = max_bytes
        self.val_every = val_every

    def load(self) -> tuple[torch.Tensor, torch.Tensor]:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts)
        if not files:
            raise FileNotFoundError(f"no Python source files under the standard library at {root}; use data=synthetic or data=text.")
        return _split_files(files, self.val_every, self.max_bytes)


class TextFiles(TokenDataModule):
    """A user's text: one file, or every file matching ``pattern`` under a directory.

    Args:
        path: a file or a directory.
        pattern: glob applied under a directory (``**/*.txt``).
        val_every: every n-th file is held out; a single file holds out its last 5%.
    """

    def __init__(self, path: str, pattern: str = "**/*", seq_len: int = 128, batch_size: int = 16, num_workers: int = 0, shuffle_seed: int = 0,
                 max_bytes: Optional[int] = None, val_every: int = 20) -> None:
        super().__init__(seq_len, batch_size, num_workers, shuffle_seed)
        self.path = Path(path).expanduser()
        self.pattern = pattern
        self.max_bytes = max_bytes
        self.val_every = val_every

    def load(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.path.exists():
            raise FileNotFoundError(f"data.path={str(self.path)!r} does not exist; give a text file or a directory of them.")
        if self.path.is_file():
            tokens = _bytes_to_tokens([self.path.read_bytes()[: self.max_bytes]])
            cut = int(tokens.numel() * 0.95)
            train, val = tokens[:cut], tokens[cut:]
        else:
            files = sorted(p for p in self.path.glob(self.pattern) if p.is_file())
            if len(files) < 2:
                raise ValueError(f"data.path={str(self.path)!r} with pattern {self.pattern!r} matches {len(files)} file(s); "
                                 "need at least 2 to hold one out for validation.")
            train, val = _split_files(files, min(self.val_every, len(files)), self.max_bytes)
        for split, tokens in (("training", train), ("validation", val)):
            if tokens.numel() < self.seq_len:
                raise ValueError(f"data.path={str(self.path)!r} gives {tokens.numel()} {split} tokens, fewer than one window of seq_len={self.seq_len}; "
                                 "give more text or lower seq_len.")
        return train, val


class SyntheticTokens(TokenDataModule):
    """Uniformly random tokens from a seeded generator: for speed runs, not for learning."""

    def __init__(self, seq_len: int = 128, batch_size: int = 16, num_workers: int = 0, shuffle_seed: int = 0, vocab_size: int = 256,
                 num_tokens: int = 2 * 1024**2, seed: int = 0) -> None:
        super().__init__(seq_len, batch_size, num_workers, shuffle_seed)
        self.vocab_size = vocab_size
        self.num_tokens = num_tokens
        self.seed = seed

    def load(self) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(self.seed)
        tokens = torch.randint(0, self.vocab_size, (self.num_tokens,), generator=generator, dtype=torch.int64)
        cut = int(self.num_tokens * 0.95)
        return tokens[:cut], tokens[cut:]
