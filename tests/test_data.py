import pytest
import torch

from offload_strategy.demos import EpochShuffle, PythonStdlibText, SyntheticTokens, TextFiles, TokenWindows


def test_token_windows_cover_the_stream_without_overlap():
    tokens = torch.arange(10, dtype=torch.uint8)
    windows = TokenWindows(tokens, 3)
    assert len(windows) == 3
    assert [windows[i].tolist() for i in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    assert windows[0].dtype == torch.long
    with pytest.raises(ValueError, match="cannot fill one window of seq_len=11"):
        TokenWindows(tokens, 11)


def test_epoch_shuffle_depends_on_seed_and_epoch_only():
    a, b = EpochShuffle(50, seed=3), EpochShuffle(50, seed=3)
    first = list(a)
    torch.manual_seed(123)  # the global RNG must not matter
    assert list(b) == first and sorted(first) == list(range(50))
    a.set_epoch(1)
    assert list(a) != first and sorted(a) == list(range(50))


def test_stdlib_split_holds_out_whole_files():
    data = PythonStdlibText(seq_len=64, batch_size=2, max_bytes=300_000, val_every=10)
    train, val = data.load()
    assert 0 < train.numel() <= 300_000 + 2 * 200  # separators between files
    assert 0 < val.numel() <= 30_000 + 2 * 200
    assert int(train.max()) < 256
    text = bytes(train[:2000].tolist()).decode("utf-8", errors="replace")
    assert "import" in text or "def " in text


def test_text_files_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TextFiles(path=str(tmp_path / "missing")).load()
    (tmp_path / "one.txt").write_text("x" * 10_000)
    with pytest.raises(ValueError, match="matches 1 file"):
        TextFiles(path=str(tmp_path)).load()
    short = tmp_path / "short.txt"
    short.write_text("tiny")
    with pytest.raises(ValueError, match="fewer than one window of seq_len=128"):
        TextFiles(path=str(short)).load()


def test_text_file_split(tmp_path):
    path = tmp_path / "book.txt"
    path.write_bytes(bytes(range(256)) * 40)
    train, val = TextFiles(path=str(path), seq_len=16).load()
    assert train.numel() + val.numel() == 256 * 40
    assert val.numel() == 256 * 40 - int(256 * 40 * 0.95)


def test_synthetic_is_seeded():
    a, _ = SyntheticTokens(num_tokens=1000, seed=1, vocab_size=50).load()
    b, _ = SyntheticTokens(num_tokens=1000, seed=1, vocab_size=50).load()
    assert torch.equal(a, b) and int(a.max()) < 50


@pytest.mark.parametrize("bad", [{"seq_len": 0}, {"batch_size": -2}])
def test_rejects_bad_shapes(bad):
    with pytest.raises(ValueError, match="must be a positive integer"):
        SyntheticTokens(**bad)
