"""Exact results of the windows over token streams (lit_dtrain.data.windows) where single-point mutants passed
test_data_file_contents.py and test_data_batches.py: a stream of exactly k windows' tokens counted k windows (the
last one short), validation items read past the end, and a dataset key that ignored the sources' order, a stream
that is no cache, or a source name with a dash."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lit_dtrain.data.token_cache import TokenSplits
from lit_dtrain.data.windows import WindowSet, _ValWindows, dataset_key


def test_a_window_needs_block_size_plus_one_tokens_so_a_stream_of_k_blocks_holds_k_minus_one():
    """A window is block_size + 1 tokens (its inputs and their next-token labels), and window j starts at
    j * block_size: 32 tokens make 3 windows of 8 (the 4th would need token 32), 33 make 4."""
    for n_tokens, windows in ((32, 3), (33, 4), (9, 1), (8, 0)):
        ws = WindowSet([np.arange(n_tokens)], 8)
        assert len(ws) == windows, n_tokens
        if windows:
            last = ws.gather([windows - 1])[0]
            assert last.tolist() == list(range((windows - 1) * 8, windows * 8 + 1))


def test_windows_of_two_streams_are_numbered_on_from_the_first():
    ws = WindowSet([np.arange(17), np.arange(100, 125)], 8)  # 2 windows, then 3
    assert ws.counts.tolist() == [2, 3] and len(ws) == 5
    assert ws.source_of(np.arange(5)).tolist() == [0, 0, 1, 1, 1]
    assert ws.gather([1, 2])[:, 0].tolist() == [8, 100]


def test_validation_items_stop_at_the_fillers_end():
    """Two real windows and one filler: item 2 is a copy of window 0 weighted 0, item 3 is past the end (iterating
    the dataset by index, as Python's old protocol does, yields 3 items)."""
    ws = WindowSet([np.arange(40)], 8)
    val = _ValWindows(ws, np.array([3, 1]), padding=1)
    items = list(val)
    assert len(items) == 3
    assert [float(x["loss_weight"]) for x in items] == [1.0, 1.0, 0.0]
    assert [int(x["index"]) for x in items] == [3, 1, 3]
    assert torch.equal(items[2]["input_ids"], items[0]["input_ids"])
    with pytest.raises(IndexError, match=r"validation item 3 out of range \[0, 3\)"):
        val[3]


def _splits(root, dir_name: str, name: str = "s") -> TokenSplits:
    d = root / dir_name
    d.mkdir(parents=True)
    for split in ("train", "val"):
        np.arange(20, dtype=np.uint16).tofile(d / f"{split}.bin")
    train = np.memmap(d / "train.bin", dtype=np.uint16, mode="r")
    val = np.memmap(d / "val.bin", dtype=np.uint16, mode="r")
    return TokenSplits(name, train, val, {})


def test_the_dataset_key_follows_the_caches_content_keys_in_order(tmp_path):
    """The key names which windows a sampler's table indexes: the caches' content keys (the part of the cache
    dir's name after the last '-'), in source order, as the window indices follow that order."""
    a = _splits(tmp_path / "1", "web-text-aaaa1111")  # a source name with a dash
    b = _splits(tmp_path / "1", "code-bbbb2222")
    key = dataset_key([a, b])
    assert key is not None and len(key) == 16
    assert dataset_key([b, a]) != key  # the same sources in the other order number their windows otherwise
    # the same content under another source name (a dash in it or not) is the same windows
    assert dataset_key([_splits(tmp_path / "2", "webtext-aaaa1111"), _splits(tmp_path / "2", "my-code-bbbb2222")]) \
        == key
    plain = TokenSplits("p", np.arange(20, dtype=np.uint16), np.arange(20, dtype=np.uint16), {})  # no cache file
    assert dataset_key([a, plain]) is None and dataset_key([plain, b]) is None


def _split_files(tmp, train: list[int], val: list[int]):
    np.asarray(train, dtype=np.uint16).tofile(tmp / "train.bin")
    np.asarray(val, dtype=np.uint16).tofile(tmp / "val.bin")


@pytest.mark.parametrize("n_train, n_val, n_tail", [
    (10, 5, 8),  # the tail of train joins val
    (10, 10, 4),  # the head of val joins train
    (10, 5, 5),  # val is the tail already
    (10, 0, 3),  # every document was train
    (0, 12, 5),  # every document was val
    (6, 4, 50),  # the tail covers the stream: all of it val
])
def test_the_tail_split_is_the_stream_cut_before_its_last_n_tail_tokens(tmp_path, n_train, n_val, n_tail):
    """_split_tail rewrites train.bin + val.bin (the by-document split) as the stream train + val cut before its last
    n_tail tokens, whichever way the tokens move between the files."""
    from lit_dtrain.data._split_tail import _split_tail

    stream = list(range(1, n_train + n_val + 1))
    _split_files(tmp_path, stream[:n_train], stream[n_train:])
    cut = max(0, len(stream) - n_tail)
    assert _split_tail(tmp_path, n_train, n_val, n_tail) == (cut, len(stream) - cut)
    assert np.fromfile(tmp_path / "train.bin", dtype=np.uint16).tolist() == stream[:cut]
    assert np.fromfile(tmp_path / "val.bin", dtype=np.uint16).tolist() == stream[cut:]
