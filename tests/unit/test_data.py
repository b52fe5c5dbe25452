import builtins
import logging
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from lit_dtrain.data import ByteTokenizer, CorpusError, CorpusSource, LMDataModule, build_token_cache, stdlib_files
from tests.conftest import ROOT, make_corpus


def dm_for(corpus, tmp_path, **kw):
    kw.setdefault("block_size", 32)
    kw.setdefault("batch_size", 4)
    src = kw.pop("sources", [CorpusSource(name="t", kind="files", paths=[str(corpus)])])
    dm = LMDataModule(sources=src, cache_dir=str(tmp_path / "cache"), progress=False, **kw)
    dm.prepare_data()
    dm.setup()
    return dm


def drew_a_batch(dm):
    """``dm`` after one training batch: its state is a checkpoint's of a run that trained (micro_step 1)."""
    dm.next_train_batch()
    return dm


def test_tokenizer_roundtrip_any_bytes():
    tok = ByteTokenizer()
    ids = tok.encode("héllo\x00", add_eos=True)
    assert ids.dtype == np.uint16 and ids[-1] == tok.eos_id and ids.max() == 256
    assert tok.decode(ids[:-1]) == "héllo\x00"
    junk = bytes(range(256))
    assert tok.encode(junk).tolist() == list(range(256))
    assert isinstance(tok.decode(tok.encode(b"\xff\xfe")), str)  # invalid UTF-8 never raises


def test_stdlib_corpus_found_without_site_packages():
    files = stdlib_files()
    assert len(files) > 500
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)


def test_the_stdlib_corpus_does_not_list_site_packages(tmp_path, monkeypatch):
    """Every start listed all of site-packages (43k files below a stdlib with torch installed in it, 0.7-1.1 s per
    rank) only to leave its files out. Left-out dirs are no longer entered; the files are the same."""
    import sysconfig

    for rel in ("a.py", "notes.txt", "pkg/b.py", "pkg/deep/c.py", "site-packages/x/d.py", "pkg/dist-packages/e.py",
                "__pycache__/f.py", ".hidden/g.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(tmp_path)})
    listed, scandir = [], os.scandir
    monkeypatch.setattr(os, "scandir", lambda path=".": listed.append(os.fspath(path)) or scandir(path))
    files = stdlib_files()
    assert [str(f.relative_to(tmp_path)) for f in files] == [".hidden/g.py", "a.py", "pkg/b.py", "pkg/deep/c.py"]
    entered = {os.path.relpath(p, tmp_path) for p in listed}
    assert "pkg/deep" in entered and not [p for p in entered if "packages" in p or "__pycache__" in p]


def test_same_seed_same_batches_and_windows(corpus, tmp_path):
    a = dm_for(corpus, tmp_path, seed=3)
    b = dm_for(corpus, tmp_path, seed=3)
    c = dm_for(corpus, tmp_path, seed=4)
    for step in range(5):
        ba, bb = a.batch_for_step(step), b.batch_for_step(step)
        assert all(torch.equal(ba[k], bb[k]) for k in ba)
    assert not torch.equal(a.batch_for_step(0)["index"], c.batch_for_step(0)["index"])
    batch = a.batch_for_step(0)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])  # labels are inputs shifted by one
    i = int(batch["index"][0])
    stream = np.asarray(a.splits[0].train)
    assert batch["input_ids"][0].tolist() == stream[i * 32 : i * 32 + 32].tolist()  # stable window index


def test_rank_shards_are_disjoint_pieces_of_the_global_batch(corpus, tmp_path):
    dm = dm_for(corpus, tmp_path, seed=1)
    for step in range(4):
        r0 = dm.batch_for_step(step, rank=0, world_size=2)["index"]
        r1 = dm.batch_for_step(step, rank=1, world_size=2)["index"]
        glob = dm.sampler.global_batch(step, 8)
        assert torch.equal(torch.cat([r0, r1]), glob)
        # positions in the global batch are disjoint; with replacement an index may repeat, so compare slots
        assert r0.numel() == r1.numel() == 4


def test_the_training_stream_is_the_batches_of_micro_steps_0_1_2(corpus, tmp_path):
    """Micro-step s trains batch_for_step(s), from 0 on, as a resume, the spike records and the sampler's per-step
    draws assume; a stream shifted by one (step s drew batch s + 1) was still consistent across resumes, so no other
    test saw that batch 0 was never trained."""
    dm = dm_for(corpus, tmp_path, seed=1)
    drawn = [dm.next_train_batch()["index"] for _ in range(3)]
    assert dm.micro_step == 3
    for step, index in enumerate(drawn):
        assert torch.equal(index, dm.batch_for_step(step)["index"]), step


def test_a_limit_in_batches_validates_the_same_windows_on_any_number_of_ranks(corpus, tmp_path):
    """trainer.limit_val_batches=k: Lightning caps each rank's loader at k batches, so 2 ranks validated the first 2k
    batches' windows and 1 process the first k (the same weights: val loss 3.1999 on 2 ranks, 3.3406 on 1). Now the
    ranks share the windows of one process's first k batches, each running k batches or fewer."""
    dm = dm_for(corpus, tmp_path, max_val_windows=13, val_batch_size=3)
    for limit in (1, 2, 4, 10):
        dm.trainer = types.SimpleNamespace(global_rank=0, world_size=1, limit_val_batches=limit)
        (single,) = dm.val_dataloader()
        first = [int(i) for b in list(single)[:limit] for i in b["index"]]  # what Lightning's cap leaves one process
        for world in (2, 3):
            real, batches = [], []
            for rank in range(world):
                dm.trainer = types.SimpleNamespace(global_rank=rank, world_size=world, limit_val_batches=limit)
                (loader,) = dm.val_dataloader()
                shard = list(loader)
                batches.append(len(shard))
                real += [int(i) for b in shard for i, w in zip(b["index"], b["loss_weight"]) if float(w) == 1]
            assert sorted(real) == sorted(first), (limit, world)
            assert max(batches) <= limit, (limit, world)
    dm.trainer = types.SimpleNamespace(global_rank=0, world_size=2, limit_val_batches=1.0)  # Lightning's "all"
    (loader,) = dm.val_dataloader()
    assert len(loader.dataset) == 14  # 13 windows and one filler


def test_val_shards_hold_every_window_once_and_even_out_the_ranks(corpus, tmp_path):
    """Under data parallelism each rank validates its own windows: together every window exactly once, with
    weight 1; the ranks run equally many items (and batches), the padding that evens them out weighs 0."""
    for n in (1, 2, 5, 7, 8):
        dm = dm_for(corpus, tmp_path, max_val_windows=n, val_batch_size=3)
        (single,) = dm.val_dataloader()
        everything = [int(i) for b in single for i in b["index"]]
        assert len(everything) == n and all(float(w) == 1 for b in single for w in b["loss_weight"])
        for world in (2, 3, 4, 8):
            real, padding, items, batches = [], [], set(), set()
            for rank in range(world):
                dm.trainer = types.SimpleNamespace(global_rank=rank, world_size=world)
                (loader,) = dm.val_dataloader()
                # Lightning replaces any sampler of a distributed run that is not a DistributedSampler
                assert isinstance(loader.sampler, DistributedSampler)
                shard = list(loader)
                index = [int(i) for b in shard for i in b["index"]]
                weight = [float(w) for b in shard for w in b["loss_weight"]]
                assert set(weight) <= {0.0, 1.0}
                real += [i for i, w in zip(index, weight) if w == 1]
                padding += [i for i, w in zip(index, weight) if w == 0]
                items.add(len(index))
                batches.add(len(shard))
            assert sorted(real) == sorted(everything), (n, world)  # disjoint and complete
            assert items == {-(-n // world)} and len(batches) == 1, (n, world)  # same count on every rank
            assert len(padding) == world * -(-n // world) - n < world, (n, world)


def test_data_position_advances_and_restores(corpus, tmp_path):
    dm = dm_for(corpus, tmp_path)
    first = [dm.on_before_batch_transfer(0, 0)["index"] for _ in range(3)]
    state = dm.state_dict()
    nxt = dm.on_before_batch_transfer(0, 0)["index"]
    fresh = dm_for(corpus, tmp_path)
    fresh.load_state_dict(state)
    assert state["micro_step"] == 3
    assert torch.equal(fresh.on_before_batch_transfer(0, 0)["index"], nxt)
    assert not torch.equal(first[0], first[1])


def test_resuming_with_another_data_seed_warns(corpus, tmp_path, caplog, monkeypatch):
    """The checkpoint records the data seed, and a resume with another ``data.seed`` switched the data stream
    silently (the resumed run is no longer the interrupted one's continuation). Rank 0 alone says it, in train.log (a
    warnings.warn was printed by each rank of a 2-rank run, and not in train.log); every rank restores the state."""
    from lightning.pytorch.utilities import rank_zero_only

    dm = dm_for(corpus, tmp_path, seed=1)
    dm.on_before_batch_transfer(0, 0)
    for rank, count in ((1, 0), (0, 1)):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        other = dm_for(corpus, tmp_path, seed=2)
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
            other.load_state_dict(dm.state_dict())
        said = [r.getMessage() for r in caplog.records if "data seed" in r.getMessage()]
        assert len(said) == count and other.micro_step == 1  # the position is restored all the same
    assert "data seed 1, and this run's data.seed is 2" in said[0] and "set data.seed=1, or seed=1" in said[0]


def test_resuming_on_another_global_batch_warns(corpus, tmp_path, caplog, monkeypatch):
    """A resume on another number of ranks (compressed DDP resumes on any since 3d529cb; plain DDP always did) or with
    another data.batch_size trained on other global batches at the same LR without a word: the checkpoint records its
    global batch, and a resume whose batch differs says so and which data.batch_size keeps it."""
    def said(dm, state) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
            dm.load_state_dict(state)
        return [r.getMessage() for r in caplog.records if "global batches" in r.getMessage()]

    state = drew_a_batch(dm_for(corpus, tmp_path, batch_size=8)).state_dict()
    assert state["global_batch"] == 8 and state["accumulate_grad_batches"] == 1
    assert said(dm_for(corpus, tmp_path, batch_size=8), state) == []
    [message] = said(dm_for(corpus, tmp_path, batch_size=4), state)
    assert "global batches of 8 windows" in message
    assert "are 4 (data.batch_size=4 on 1 rank(s), accumulate_grad_batches=1)" in message
    assert "(data.batch_size=8 keeps its batch)" in message
    two_ranks = dm_for(corpus, tmp_path, batch_size=4)
    monkeypatch.setattr(two_ranks, "_world", lambda: (0, 2))
    assert said(two_ranks, state) == []  # 4 on each of 2 ranks: the same global batch of 8
    three_ranks = dm_for(corpus, tmp_path, batch_size=4)
    monkeypatch.setattr(three_ranks, "_world", lambda: (0, 3))
    [message] = said(three_ranks, state)
    assert "are 12 (data.batch_size=4 on 3 rank(s)" in message and "keeps" not in message  # 8 / 3: no whole size


def test_a_resume_that_keeps_its_global_batch_by_accumulation_stays_quiet(corpus, tmp_path, caplog, monkeypatch):
    """The step's batch is data.batch_size x ranks x trainer.accumulate_grad_batches: a checkpoint of batches of 8
    resumed with data.batch_size=4 trainer.accumulate_grad_batches=2 (the usual answer to an OOM) trains on the same 8
    windows a step, yet was told 'this run's are 4 ... data.batch_size=8 keeps its batch'; and batches of 8 resumed
    with accumulate_grad_batches=2 train on 16 a step without a word."""
    def said(dm, state, accumulation) -> list[str]:
        monkeypatch.setattr(dm, "_accumulation", lambda: accumulation, raising=False)
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
            dm.load_state_dict(state)
        return [r.getMessage() for r in caplog.records if "global batches" in r.getMessage()]

    state = drew_a_batch(dm_for(corpus, tmp_path, batch_size=8)).state_dict()
    assert said(dm_for(corpus, tmp_path, batch_size=4), state, 2) == []
    [message] = said(dm_for(corpus, tmp_path, batch_size=8), state, 2)
    assert "global batches of 8 windows" in message and "this run's are 16" in message
    assert "accumulate_grad_batches=2" in message and "(data.batch_size=4 keeps its batch)" in message
    accumulated = dm_for(corpus, tmp_path, batch_size=4)
    monkeypatch.setattr(accumulated, "_accumulation", lambda: 2, raising=False)
    state = drew_a_batch(accumulated).state_dict()  # 4 x 2 = 8 a step
    assert said(dm_for(corpus, tmp_path, batch_size=8), state, 1) == []
    [message] = said(dm_for(corpus, tmp_path, batch_size=4), state, 1)
    assert "global batches of 8 windows" in message and "this run's are 4" in message
    old = {k: v for k, v in state.items() if k != "accumulate_grad_batches"}  # a checkpoint from before: this run's
    assert said(dm_for(corpus, tmp_path, batch_size=4), old, 2) == []


def test_resuming_on_an_edited_corpus_warns(corpus, tmp_path, caplog):
    """A resume after a corpus file was edited (or block_size, val_fraction or max_val_windows changed) continued on
    other windows without a word, unlike one with another data seed; a resume on the same data stays silent."""
    def warned(dm, state) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
            dm.load_state_dict(state)
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("the checkpoint")]

    dm = dm_for(corpus, tmp_path)
    dm.on_before_batch_transfer(0, 0)
    assert warned(dm_for(corpus, tmp_path), dm.state_dict()) == []
    with open(corpus / "doc_003.txt", "a") as f:
        f.write("one more line\n")
    edited = dm_for(corpus, tmp_path)
    [message] = warned(edited, dm.state_dict())
    assert re.search(r"trained on dataset \w+, and this run's is \w+: the corpus .*changed since", message), message
    assert edited.micro_step == 1  # the position is restored all the same
    [message] = warned(dm_for(corpus, tmp_path, val_fraction=0.3), dm.state_dict())
    assert "data.block_size or data.val_fraction changed" in message
    # another data.max_val_windows: the same data, other validation windows (the best checkpoint's score is not
    # comparable); it resumed without a word
    state = edited.state_dict()
    [message] = warned(dm_for(corpus, tmp_path, max_val_windows=8), state)
    assert message.startswith("the checkpoint validated on up to 256 windows per source, and this run's "
                              "data.max_val_windows is 8: from here on val/loss is measured on other windows")
    # two caps above a source's val windows validate on all of them, the same windows: no warning (a corpus whose val
    # held 18 windows resumed with 128 after 64 was told that val/loss is measured on other windows)
    few = dm_for(corpus, tmp_path, max_val_windows=10_000)
    n = len(few.val_dataloader()[0].dataset)
    assert 8 < n < 10_000
    assert warned(dm_for(corpus, tmp_path, max_val_windows=n), few.state_dict()) == []
    [message] = warned(dm_for(corpus, tmp_path, max_val_windows=n - 1), few.state_dict())
    assert message.startswith(f"the checkpoint validated on up to 10000 windows per source, and this run's "
                              f"data.max_val_windows is {n - 1}: ")
    state.pop("max_val_windows")  # a checkpoint from before it was recorded
    assert warned(dm_for(corpus, tmp_path, max_val_windows=8), state) == []


def test_exclusions_are_never_drawn_and_persist(corpus, tmp_path):
    dm = dm_for(corpus, tmp_path)
    n = dm.num_train_samples
    dm.sampler.exclude(torch.arange(0, n - 2))
    drawn = torch.cat([dm.batch_for_step(s)["index"] for s in range(10)])
    assert set(drawn.tolist()) <= {n - 2, n - 1}
    again = dm_for(corpus, tmp_path)
    again.load_state_dict(dm.state_dict())
    assert set(again.batch_for_step(0)["index"].tolist()) <= {n - 2, n - 1}


def test_a_tail_split_says_that_val_shares_a_document_with_train(tmp_path, caplog):
    """Too few documents for a by-document split: val is the tail of the token stream, which cuts the last
    train document in two (its start is trained on). This was logged only at INFO as a cache detail."""
    few = make_corpus(tmp_path / "few", n_files=3, size=2000)
    src = CorpusSource(name="few", kind="files", paths=[str(few)])
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        splits = build_token_cache(src, tmp_path / "c", 33, progress=False)
    assert splits.meta["split"] == "by_tokens_tail"
    [message] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "data source 'few'" in message and "cuts a document in two" in message
    assert f"last {len(splits.val)} tokens" in message
    many = make_corpus(tmp_path / "many", n_files=60, size=2000)
    caplog.clear()
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        by_doc = build_token_cache(CorpusSource(name="many", kind="files", paths=[str(many)]), tmp_path / "c", 33,
                                   val_fraction=0.1, progress=False)
    assert by_doc.meta["split"] == "by_document" and not caplog.records


def test_a_val_fraction_that_leaves_no_training_window_is_named_not_a_short_corpus(tmp_path):
    """A corpus of 20 documents with data.val_fraction=0.999 (every document held out) was "too short: 42001 tokens",
    which blamed a corpus that has plenty; the setting that left training 43 tokens is named now."""
    corpus = make_corpus(tmp_path / "c", n_files=20, size=500)
    src = CorpusSource(name="t", kind="files", paths=[str(corpus)])
    total = sum(len((corpus / f"doc_{i:03d}.txt").read_bytes()) + 1 for i in range(20))
    held = int(total * 0.999)
    match = (rf"data source 't': data.val_fraction=0.999 holds out {held} of its {total} tokens for validation and "
             rf"leaves {total - held} to train on, less than one window of block_size\+1 = 65 tokens; lower data.val_f")
    with pytest.raises(CorpusError, match=match):
        build_token_cache(src, tmp_path / "cache", 65, val_fraction=0.999, progress=False)
    with pytest.raises(CorpusError, match=r"data source 't' is too short: .*block_size\+1 = 9000 tokens"):
        build_token_cache(src, tmp_path / "cache", 9000, val_fraction=0.999, progress=False)


def test_token_cache_reused_and_rebuilt_on_change(corpus, tmp_path):
    src = CorpusSource(name="t", kind="files", paths=[str(corpus)])
    a = build_token_cache(src, tmp_path / "c", 33, progress=False)
    b = build_token_cache(src, tmp_path / "c", 33, progress=False)
    assert a.train.filename == b.train.filename  # same key -> same files
    mtime = os.stat(a.train.filename).st_mtime_ns
    b2 = build_token_cache(src, tmp_path / "c", 33, progress=False)
    assert os.stat(b2.train.filename).st_mtime_ns == mtime  # not rewritten
    (corpus / "doc_000.txt").write_text("changed content " * 100)
    c = build_token_cache(src, tmp_path / "c", 33, progress=False)
    assert c.train.filename != a.train.filename
    assert len(list((tmp_path / "c").iterdir())) == 2


@pytest.mark.parametrize(
    "damage",
    ["truncate_even", "truncate_odd", "empty", "bad_meta", "missing_val", "missing_meta", "zeroed", "val_byte"],
)
def test_damaged_token_cache_is_rebuilt_not_read(corpus, tmp_path, damage, caplog):
    """A cache file truncated or damaged after the build was read as it was (training on a fraction of the
    corpus without a word) or failed with a raw numpy/json error; it is now detected and rebuilt. Damage that keeps
    the sizes (a zeroed block, one changed byte) was trained on too: the CRC-32s in meta.json catch it."""
    src = CorpusSource(name="t", kind="files", paths=[str(corpus)])
    good = build_token_cache(src, tmp_path / "c", 33, progress=False)
    expected = np.asarray(good.train).copy(), np.asarray(good.val).copy()
    out_dir = os.path.dirname(good.train.filename)
    del good
    train_bin, meta = os.path.join(out_dir, "train.bin"), os.path.join(out_dir, "meta.json")
    if damage == "truncate_even":
        os.truncate(train_bin, 1000)
    elif damage == "truncate_odd":
        os.truncate(train_bin, 999)
    elif damage == "empty":
        os.truncate(train_bin, 0)
    elif damage == "bad_meta":
        with open(meta, "w") as f:
            f.write('{"sou')
    elif damage == "missing_meta":  # was never rebuilt: "cannot write the token cache ...: Directory not empty"
        os.remove(meta)
    elif damage == "zeroed":  # a block of the file zeroed in place, its size kept
        with open(train_bin, "r+b") as f:
            f.seek(64)
            f.write(bytes(256))
    elif damage == "val_byte":
        with open(os.path.join(out_dir, "val.bin"), "r+b") as f:
            f.seek(3)
            byte = f.read(1)[0]
            f.seek(3)
            f.write(bytes([byte ^ 0x20]))
    else:
        os.remove(os.path.join(out_dir, "val.bin"))
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        again = build_token_cache(src, tmp_path / "c", 33, progress=False)
    named = {"zeroed": "train.bin has CRC-32", "val_byte": "val.bin has CRC-32"}.get(damage, "is damaged")
    assert any(named in r.getMessage() and "rebuilding it" in r.getMessage() for r in caplog.records)
    assert np.array_equal(np.asarray(again.train), expected[0])
    assert np.array_equal(np.asarray(again.val), expected[1])
    assert [p.name for p in (tmp_path / "c").iterdir()] == [os.path.basename(out_dir)]


def test_a_token_cache_built_before_crc32s_gets_them_at_its_first_load_and_is_not_rebuilt(corpus, tmp_path, caplog):
    """A new cache format (a new key) would have rebuilt every cache and made every checkpoint's sampler state
    (keyed by the caches' keys) refuse to resume. A cache whose meta.json has no CRC-32s keeps its dir: they are
    recorded at its first load, and damage after that is caught."""
    import json

    src = CorpusSource(name="t", kind="files", paths=[str(corpus)])
    built = build_token_cache(src, tmp_path / "c", 33, progress=False)
    out_dir, expected = Path(built.train.filename).parent, np.asarray(built.train).copy()
    del built
    meta_file = out_dir / "meta.json"
    meta = json.loads(meta_file.read_text())
    crcs = meta.pop("crc32")
    meta_file.write_text(json.dumps(meta))  # as a cache built before
    mtime = (out_dir / "train.bin").stat().st_mtime_ns
    with caplog.at_level("INFO", logger="lit_dtrain.data.corpus"):
        again = build_token_cache(src, tmp_path / "c", 33, progress=False)
    assert Path(again.train.filename).parent == out_dir and (out_dir / "train.bin").stat().st_mtime_ns == mtime
    assert json.loads(meta_file.read_text())["crc32"] == crcs and again.meta["crc32"] == crcs
    assert "recorded its files' CRC-32s" in caplog.text
    del again
    with open(out_dir / "train.bin", "r+b") as f:
        f.write(bytes(8))
    caplog.clear()
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        rebuilt = build_token_cache(src, tmp_path / "c", 33, progress=False)
    assert "train.bin has CRC-32" in caplog.text and np.array_equal(np.asarray(rebuilt.train), expected)


def test_a_token_cache_built_before_crc32s_in_a_read_only_cache_dir_is_still_read(corpus, tmp_path, monkeypatch,
                                                                                   caplog):
    import errno
    import json

    from lit_dtrain.data import cache_integrity

    src = CorpusSource(name="t", kind="files", paths=[str(corpus)])
    built = build_token_cache(src, tmp_path / "c", 33, progress=False)
    meta_file, expected = Path(built.train.filename).parent / "meta.json", np.asarray(built.train).copy()
    del built
    meta = json.loads(meta_file.read_text())
    meta.pop("crc32")
    meta_file.write_text(json.dumps(meta))

    def read_only(path, write):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(cache_integrity, "write_atomically", read_only)
    with caplog.at_level("INFO", logger="lit_dtrain.data.corpus"):
        again = build_token_cache(src, tmp_path / "c", 33, progress=False)
    assert np.array_equal(np.asarray(again.train), expected) and "crc32" not in json.loads(meta_file.read_text())
    assert "cannot be updated (Read-only file system): checked by sizes only" in caplog.text


def test_a_damaged_token_cache_that_cannot_be_moved_aside_is_an_error_not_read(corpus, tmp_path, monkeypatch, caplog):
    """In a read-only cache dir a damaged cache could not be moved aside: the warning said "rebuilding it", and the
    run then trained on the truncated token stream (a fraction of the corpus)."""
    from lit_dtrain.data import corpus as corpus_module

    src = CorpusSource(name="t", kind="files", paths=[str(corpus)])
    good = build_token_cache(src, tmp_path / "c", 33, progress=False)
    out_dir = os.path.dirname(good.train.filename)
    del good
    os.truncate(os.path.join(out_dir, "train.bin"), 1000)
    replace = os.replace

    def read_only_replace(src_path, dst_path):  # what a read-only (or root-owned) cache dir answers
        if os.fspath(src_path) == out_dir:
            raise PermissionError(13, "Permission denied")
        return replace(src_path, dst_path)

    monkeypatch.setattr(corpus_module.os, "replace", read_only_replace)
    match = rf"token cache '{re.escape(out_dir)}' of data source 't' is damaged \(train.bin holds 1000 bytes.*read-only"
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"), pytest.raises(CorpusError, match=match):
        build_token_cache(src, tmp_path / "c", 33, progress=False)
    assert not [r for r in caplog.records if "rebuilding" in r.getMessage()]
    assert os.path.getsize(os.path.join(out_dir, "train.bin")) == 1000  # left for the user to delete


def test_full_disk_while_writing_the_token_cache_is_named(corpus, tmp_path):
    """A cache dir on a full disk failed with numpy's bare "OSError: N requested and M written"; a read-only one
    is told to be made writable, not to free space."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mnt)]).returncode != 0:
        pytest.fail("cannot mount a tmpfs (the disk-full test needs root, which CI has)")
    try:
        src = CorpusSource(name="t", kind="files", paths=[str(corpus)])
        with pytest.raises(CorpusError, match=r"cannot write the token cache of data source 't' under .*tmpfs.*: "
                                              r".*free space there or point LIT_DTRAIN_CACHE"):
            build_token_cache(src, mnt, 33, progress=False)
        assert list(mnt.iterdir()) == []  # no half-written cache or temp dir left
        # a read-only cache dir: the message told to free space there
        assert subprocess.run(["mount", "-o", "remount,ro", str(mnt)]).returncode == 0
        with pytest.raises(CorpusError, match=r"tmpfs': Read-only file system; make it writable or point LIT_DTRAIN"):
            build_token_cache(src, mnt, 33, progress=False)
    finally:
        subprocess.run(["umount", "-l", str(mnt)])


@pytest.mark.parametrize("weight, match", [("abc", r"weight must be a number, got 'abc' \(str\)"),
                                           (float("inf"), "weight must be finite and >= 0, got inf"),
                                           (float("nan"), "weight must be finite and >= 0, got nan"),
                                           (-1.0, "weight must be finite and >= 0, got -1.0")])
def test_bad_source_weight_is_named(weight, match):
    """weight='abc' was a TypeError from '>=' and weight=inf made the mixture NaN (an IndexError mid-training)."""
    with pytest.raises(CorpusError, match=match):
        CorpusSource(name="t", kind="files", paths=["x"], weight=weight)


@pytest.mark.parametrize("value", [0, -1])
def test_bad_val_batch_size_is_named(corpus, tmp_path, value):
    with pytest.raises(ValueError, match=f"data.val_batch_size must be >= 1, got {value}"):
        LMDataModule(sources=[CorpusSource(name="t", kind="files", paths=[str(corpus)])], val_batch_size=value)


@pytest.mark.parametrize("key, value, message", [
    ("block_size", 64.5, "data.block_size must be an integer, got 64.5"),  # int() took it as 64
    ("block_size", "64", "data.block_size must be an integer, got '64'"),
    ("batch_size", True, "data.batch_size must be an integer, got True"),
    ("max_val_windows", 0, "data.max_val_windows must be >= 1, got 0"),
    ("seed", 1.5, "data.seed must be an integer, got 1.5"),
    ("val_fraction", "abc", "data.val_fraction must be a number in (0, 1) (the share of documents held out), got "
                            "'abc'"),
    ("val_fraction", 1.0, "data.val_fraction must be a number in (0, 1)"),
    ("val_fraction", float("nan"), "data.val_fraction must be a number in (0, 1)"),
])
def test_bad_numbers_given_to_the_python_api_are_named(corpus, key, value, message):
    """The CLI checks these keys' types; LMDataModule took block_size=64.5 as 64 and val_fraction='abc' failed with
    float()'s own message, naming no argument."""
    with pytest.raises(ValueError, match=re.escape(message)):
        LMDataModule(sources=[CorpusSource(name="t", kind="files", paths=[str(corpus)])], **{key: value})
    whole = LMDataModule(sources=[CorpusSource(name="t", kind="files", paths=[str(corpus)])], block_size=64.0, seed=-3)
    assert (whole.block_size, type(whole.block_size), whole.seed) == (64, int, -3)  # an integral float is that int


def test_split_is_by_document_and_deterministic(tmp_path):
    corpus = make_corpus(tmp_path / "big", n_files=60, size=2000)
    src = CorpusSource(name="t", kind="files", paths=[str(corpus)])
    a = build_token_cache(src, tmp_path / "c1", 33, val_fraction=0.1, progress=False)
    b = build_token_cache(src, tmp_path / "c2", 33, val_fraction=0.1, progress=False)
    assert a.meta["split"] == "by_document"
    assert np.array_equal(np.asarray(a.val), np.asarray(b.val))
    eos = ByteTokenizer.eos_id
    assert np.asarray(a.val)[-1] == eos and np.asarray(a.train)[-1] == eos  # whole documents


def test_mixture_weights_shape_the_draws(tmp_path):
    a = make_corpus(tmp_path / "a", n_files=6, size=4000, seed=1)
    b = make_corpus(tmp_path / "b", n_files=6, size=12000, seed=2)
    sources = [
        CorpusSource(name="a", kind="files", paths=[str(a)], weight=0.8),
        CorpusSource(name="b", kind="files", paths=[str(b)], weight=0.2),
    ]
    dm = dm_for(None, tmp_path, sources=sources, batch_size=64)
    idx = torch.cat([dm.batch_for_step(s)["index"] for s in range(40)]).numpy()
    share_a = float((dm.train_windows.source_of(idx) == 0).mean())
    assert 0.75 < share_a < 0.85, share_a
    assert len(dm.val_dataloader()) == 2 and dm.val_names == ["a", "b"]


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(CorpusError, match="does not exist"):
        dm_for(None, tmp_path, sources=[CorpusSource(name="x", kind="files", paths=[str(tmp_path / "nope")])])
    with pytest.raises(CorpusError, match="matched no files"):
        dm_for(None, tmp_path, sources=[CorpusSource(name="x", kind="files", paths=[str(tmp_path / "*.zzz")])])
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    with pytest.raises(CorpusError, match="is empty"):
        dm_for(None, tmp_path, sources=[CorpusSource(name="x", kind="files", paths=[str(empty)])])
    short = tmp_path / "short.txt"
    short.write_text("abc")
    # the file is named, and the tokens needed in all (a window for train and one for val)
    message = rf"too short: 4 tokens in 1 file\(s\) \({re.escape(repr(str(short)))}\), .*= 33 tokens, 66 in all"
    with pytest.raises(CorpusError, match=message):
        dm_for(None, tmp_path, sources=[CorpusSource(name="x", kind="files", paths=[str(short)])])
    with pytest.raises(CorpusError, match="kind"):
        CorpusSource(name="x", kind="web")
    # shell braces are literal characters to Python's glob: the message said only that nothing matched
    (tmp_path / "notes").mkdir()
    for name in ("a.md", "b.txt"):
        (tmp_path / "notes" / name).write_text("text " * 20)
    listed = re.escape(repr([f"{tmp_path}/notes/**/*.md", f"{tmp_path}/notes/**/*.txt"]))
    message = rf"no files matching '\*\.\{{md,txt}}' \(a glob has no .*in paths: {listed}\)"
    with pytest.raises(CorpusError, match=message):
        dm_for(None, tmp_path, sources=[CorpusSource(name="x", kind="files", paths=[str(tmp_path / "notes")],
                                                     pattern="*.{md,txt}")])
    listed = re.escape(repr([f"{tmp_path}/notes/*.md", f"{tmp_path}/notes/*.txt"]))
    with pytest.raises(CorpusError, match=rf"matched no files \(a glob has no .*in paths: {listed}\)"):
        dm_for(None, tmp_path, sources=[CorpusSource(name="x", kind="files", paths=[f"{tmp_path}/notes/*.{{md,txt}}"])])
    # a list or a number failed inside fit, in the directory walk ('list' object has no attribute 'startswith'),
    # '' as pathlib's "Unacceptable pattern: ''"
    for pattern in (["*.txt", "*.md"], 123, ""):
        match = rf"data source 'x': pattern must be one glob .*got {re.escape(repr(pattern))}"
        with pytest.raises(CorpusError, match=match):
            CorpusSource(name="x", kind="files", paths=[str(tmp_path)], pattern=pattern)


def test_a_missing_path_of_a_later_source_is_named_before_any_source_is_hashed(corpus, tmp_path, monkeypatch):
    """data=mixture with a missing path in its second source: the first source (the stdlib's 1790 files) was hashed,
    and on a first run tokenized, before the missing path was named. Every source's files are listed first now."""
    import lit_dtrain.data.token_cache as token_cache

    hashed = []
    monkeypatch.setattr(token_cache, "_hash_file", lambda path, *_: hashed.append(path) or (b"", 0, b"", 0))
    sources = [CorpusSource(name="a", kind="files", paths=[str(corpus)]),
               CorpusSource(name="b", kind="files", paths=[str(tmp_path / "nope")])]
    with pytest.raises(CorpusError, match=r"data source 'b': path .*nope' does not exist"):
        dm_for(None, tmp_path, sources=sources)
    assert hashed == []

def test_directory_sources_leave_out_hidden_paths_and_warn_about_binary_files(tmp_path, caplog):
    from lit_dtrain.data.corpus import CorpusSource, resolve_files
    from lit_dtrain.data.token_cache import build_token_cache

    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / ".git" / "objects").mkdir(parents=True)
    (repo / "README.md").write_text("hello " * 200)
    (repo / "src" / "a.py").write_text("x = 1\n" * 200)
    (repo / "src" / ".a.py.swp").write_bytes(b"swap")
    (repo / ".git" / "objects" / "ab").write_bytes(b"x\x9c\x00zlib" * 10)
    (repo / "blob.bin").write_bytes(b"\x00\x01" * 100)
    source = CorpusSource(name="repo", kind="files", paths=[str(repo)])
    assert [p.relative_to(repo).as_posix() for p in resolve_files(source)] == ["README.md", "blob.bin", "src/a.py"]
    # asked for by name, a hidden file is taken
    hidden = CorpusSource(name="h", kind="files", paths=[str(repo / "src" / ".a.py.swp")])
    assert resolve_files(hidden) == [repo / "src" / ".a.py.swp"]
    with caplog.at_level("WARNING"):
        build_token_cache(source, tmp_path / "cache", min_tokens=33, progress=False)
    assert "1 file(s) look binary" in caplog.text and "blob.bin" in caplog.text


def test_a_directory_of_only_hidden_files_says_so(tmp_path):
    """A directory whose only text files are dot files (or in a dot dir) was 'has no files matching '**/*'', with the
    hidden files mentioned only in an INFO line."""
    from lit_dtrain.data.corpus import CorpusSource, resolve_files

    notes = tmp_path / "notes"
    (notes / ".drafts").mkdir(parents=True)
    (notes / ".todo.txt").write_text("x " * 100)
    (notes / ".drafts" / "a.txt").write_text("y " * 100)
    with pytest.raises(CorpusError, match=r"directory '.*notes' has no files matching '.*' except 2 hidden "
                                          r"one\(s\) \(dot files or in dot dirs, e.g. '.*'\), which a directory "
                                          r"source leaves out"):
        resolve_files(CorpusSource(name="n", kind="files", paths=[str(notes)]))
    with pytest.raises(CorpusError, match=r"has no files matching '\*'$"):  # nothing at all: no hidden count
        (tmp_path / "empty").mkdir()
        resolve_files(CorpusSource(name="e", kind="files", paths=[str(tmp_path / "empty")]))
    assert resolve_files(CorpusSource(name="g", kind="files", paths=[str(notes / ".*")])) == [notes / ".todo.txt"]


def test_unreadable_file_is_named(tmp_path, monkeypatch):
    corpus = make_corpus(tmp_path / "c", n_files=3)
    bad = corpus / "doc_001.txt"
    real_open = builtins.open

    def fake_open(path, *a, **k):  # root ignores chmod, so simulate EACCES
        if str(path) == str(bad):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", fake_open)
    with pytest.raises(CorpusError, match="doc_001.txt.*Permission denied"):
        dm_for(corpus, tmp_path)


def test_zero_weight_source_is_validation_only(tmp_path):
    a = make_corpus(tmp_path / "a", n_files=6, size=4000, seed=1)
    b = make_corpus(tmp_path / "b", n_files=6, size=4000, seed=2)
    sources = [
        CorpusSource(name="new", kind="files", paths=[str(a)], weight=1.0),
        CorpusSource(name="old", kind="files", paths=[str(b)], weight=0.0),
    ]
    dm = dm_for(None, tmp_path, sources=sources, batch_size=32)
    idx = torch.cat([dm.batch_for_step(s)["index"] for s in range(10)]).numpy()
    assert (dm.train_windows.source_of(idx) == 0).all()  # never trained on
    assert len(dm.val_dataloader()) == 2  # but validated on
    with pytest.raises(CorpusError, match="every weight is 0"):
        dm_for(None, tmp_path, sources=[CorpusSource(name="x", kind="files", paths=[str(a)], weight=0.0)])


def test_all_zero_weights_fail_when_the_datamodule_is_built_before_tokenizing(tmp_path):
    """Every weight 0 (data=mixture data.sources.0.weight=0 data.sources.1.weight=0) used to be found in setup(),
    inside trainer.fit, after every source had been hashed and tokenized into the cache."""
    a = make_corpus(tmp_path / "a", n_files=2, size=500)
    sources = [CorpusSource(name="x", kind="files", paths=[str(a)], weight=0.0),
               CorpusSource(name="y", kind="stdlib", weight=0)]
    with pytest.raises(CorpusError, match=r"data.sources: every weight is 0 \(\['x', 'y'\]\); nothing to train on"):
        LMDataModule(sources=sources, block_size=16, batch_size=2, cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()


def test_paths_given_as_one_string_is_one_path_not_its_characters(tmp_path):
    """data.sources.0.paths=/my/corpus (no brackets) arrives as a str; iterating it made '/', 'm', 'y', ... paths:
    '/' is a directory, so the whole filesystem was walked (PermissionError at /proc/1/cwd as root)."""
    from lit_dtrain.data.corpus import resolve_files

    corpus = make_corpus(tmp_path / "c", n_files=3, size=200)
    source = CorpusSource(name="t", kind="files", paths=str(corpus))
    assert source.paths == [str(corpus)]
    assert [p.name for p in resolve_files(source)] == ["doc_000.txt", "doc_001.txt", "doc_002.txt"]
    with pytest.raises(CorpusError, match=r"data source 't': paths must be a list of files, directories or globs"):
        CorpusSource(name="t", kind="files", paths=3)


def test_mixture_prior_and_exclusions_are_drawn_from_a_cached_cdf():
    """Under a mixture prior (or exclusions) the sampler draws by inverse CDF from a cached table: the
    frequencies follow the prior, excluded samples are never drawn (not even at ``u = 1`` when the last
    sample is excluded), and the cache follows new exclusions and a restored state."""
    from lit_dtrain.data.samplers import RandomSampler
    from lit_dtrain.data.samplers.base import draw_from_cdf

    n = 600
    base = torch.where(torch.arange(n) < 200, 4.0, 1.0)  # the first third carries 2/3 of the mass
    s = RandomSampler()
    s.setup(n, base, seed=0)
    s.exclude([7, n - 1])
    draws = torch.cat([s.global_batch(step, 2048) for step in range(100)])
    freq = torch.bincount(draws, minlength=n).double() / draws.numel()
    assert freq[[7, n - 1]].sum() == 0
    target = base.double().masked_fill(s.excluded, 0.0)
    target /= target.sum()
    assert 0.5 * (freq - target).abs().sum().item() < 0.03  # total variation; sampling noise is ~0.01
    assert freq[:200].sum().item() == pytest.approx(target[:200].sum().item(), abs=0.01)
    # u = 1 happens when a draw rescales u (u / floor can round up to 1)
    top = torch.tensor([1.0 - 2.0**-53, 1.0], dtype=torch.float64)
    assert draw_from_cdf(s.target_cdf(), top).tolist() == [n - 2, n - 2]  # not the excluded last sample
    s.exclude([0])
    assert 0 not in torch.cat([s.global_batch(step, 4096) for step in range(20)]).tolist()
    other = RandomSampler()
    other.setup(n, base, seed=0)
    assert 0 in torch.cat([other.global_batch(step, 4096) for step in range(20)]).tolist()
    other.load_state_dict(s.state_dict())
    assert other.num_excluded == 3 and torch.equal(other.global_batch(5, 64), s.global_batch(5, 64))


def test_empty_files_warn_for_user_files_but_not_for_the_stdlib(tmp_path, monkeypatch, caplog):
    """The default corpus (the stdlib) always holds empty __init__.py files: no warning on every run."""
    import lit_dtrain.data.corpus as corpus_mod

    corpus = make_corpus(tmp_path / "c", n_files=3)
    (corpus / "empty.txt").write_text("")
    files = sorted(corpus.iterdir())
    with caplog.at_level("INFO", logger="lit_dtrain.data.corpus"):
        build_token_cache(CorpusSource(name="x", kind="files", paths=[str(corpus)]), tmp_path / "a", 33, progress=False)
    warned = [r for r in caplog.records if "empty file" in r.getMessage()]
    assert [r.levelname for r in warned] == ["WARNING"]
    caplog.clear()
    monkeypatch.setattr(corpus_mod, "stdlib_files", lambda: files)
    with caplog.at_level("INFO", logger="lit_dtrain.data.corpus"):
        build_token_cache(CorpusSource(name="stdlib", kind="stdlib"), tmp_path / "b", 33, progress=False)
    noted = [r for r in caplog.records if "empty file" in r.getMessage()]
    assert [r.levelname for r in noted] == ["INFO"]


@pytest.mark.parametrize("kind", ["random", "fourier"])
def test_excluding_every_weighted_sample_fails_even_when_zero_weight_samples_remain(kind):
    """A mixture with a validation-only (weight 0) source: once every window of the weighted sources is
    excluded, nothing is left to train on. The sampler used to go on drawing from a 0/0 (NaN) target: the
    RandomSampler returned index N (past the last window), the FourierSampler a weight-0 window."""
    from lit_dtrain.data.samplers import FourierSampler, RandomSampler

    base = torch.tensor([1.0] * 4 + [0.0] * 4)  # windows 4..7: a weight-0 source
    s = RandomSampler() if kind == "random" else FourierSampler(require_updates=False)
    s.setup(8, base, seed=0)
    s.exclude([0, 1, 2])
    assert set(s.global_batch(0, 64).tolist()) == {3}
    with pytest.raises(RuntimeError, match="nothing is left to train on"):
        s.exclude([3])


@pytest.mark.parametrize("index", [-1, 8])
def test_an_out_of_range_exclusion_is_refused_not_wrapped(index):
    """exclude([-1]) excluded the last sample (Python indexing), silently; 8 of 8 samples was an IndexError."""
    from lit_dtrain.data.samplers import RandomSampler

    s = RandomSampler()
    s.setup(8, None, seed=0)
    with pytest.raises(ValueError, match=f"exclude: sample index {index} is out of range for 8 samples"):
        s.exclude([2, index])
    assert s.num_excluded == 0 and not s.excluded.any()  # nothing half-applied


def test_decode_marks_ids_that_are_no_byte():
    """A model with vocab_size above 257 can sample ids the byte tokenizer has no byte for: they were dropped from
    the text without a trace; they are U+FFFD now, as an invalid byte sequence is."""
    tok = ByteTokenizer()
    assert tok.decode([300, -1, 65, tok.eos_id, 66]) == "\ufffd\ufffdA\nB"


def test_unigram_entropy_is_that_of_the_weighted_mixture_that_is_trained_on(tmp_path):
    """The context-free baseline is the entropy of the token distribution the sampler trains on: each
    source's unigram distribution in proportion to its weight; a weight-0 (validation-only) source is not
    part of it. It was the entropy of all train streams pooled (a 1:3 size ratio overrode 1:1 weights)."""
    for name, alphabet, n in (("x", "ab", 3), ("y", "cdefgh", 9)):
        (tmp_path / name).mkdir()
        for i in range(n):
            text = "".join(alphabet[(7 * j + i) % len(alphabet)] for j in range(3000))
            (tmp_path / name / f"{i}.txt").write_text(text)

    def entropy(p):
        p = p[p > 0] / p.sum()
        return float(-(p * np.log(p)).sum())

    def source(name, weight):
        return CorpusSource(name=name, kind="files", paths=[str(tmp_path / name)], weight=weight)

    for wx, wy in ((1.0, 0.0), (0.5, 0.5), (0.2, 0.8)):
        dm = dm_for(None, tmp_path, sources=[source("x", wx), source("y", wy)])
        counts = [np.bincount(np.asarray(s.train), minlength=257).astype(np.float64) for s in dm.splits]
        expected = entropy(wx * counts[0] / counts[0].sum() + wy * counts[1] / counts[1].sum())
        assert dm.unigram_entropy() == pytest.approx(expected, rel=1e-9), (wx, wy)
    one = dm_for(None, tmp_path, sources=[source("y", 3.0)])
    assert one.unigram_entropy() == pytest.approx(entropy(np.bincount(np.asarray(one.splits[0].train))), rel=1e-12)


def test_token_cache_directory_gets_the_umask_permissions_not_mkdtemps_0700(corpus, tmp_path):
    """The cache dir is built as a temp dir and renamed: it kept mkdtemp's 0700, so a cache shared by a
    team (LIT_DTRAIN_CACHE on a shared disk) was unreadable by everyone but its builder."""
    old = os.umask(0o022)
    try:
        splits = build_token_cache(CorpusSource(name="t", kind="files", paths=[str(corpus)]), tmp_path / "c", 33,
                                   progress=False)
    finally:
        os.umask(old)
    (out_dir,) = [p for p in (tmp_path / "c").iterdir()]
    assert out_dir.name.startswith("t-") and len(splits.train) > 0
    assert out_dir.stat().st_mode & 0o777 == 0o755
    assert all(f.stat().st_mode & 0o777 == 0o644 for f in out_dir.iterdir())


def test_exclusions_of_a_checkpoint_from_another_dataset_are_refused_not_misapplied():
    """Exclusions are window indices: restored into a dataset of another size (another corpus or block_size)
    they name unrelated windows. That used to exclude those silently (or fail with a bare IndexError when an
    index was past the end); the FourierSampler already refused such a state."""
    from lit_dtrain.data.samplers import RandomSampler

    a = RandomSampler()
    a.setup(1000)
    a.exclude([5, 900])
    state = a.state_dict()
    for n in (500, 950):
        b = RandomSampler()
        b.setup(n)
        with pytest.raises(ValueError, match=rf"covers 1000 samples but the dataset has {n}"):
            b.load_state_dict(state)
    legacy = {"excluded": state["excluded"]}  # a checkpoint from before num_samples was recorded
    b = RandomSampler()
    b.setup(500)
    with pytest.raises(ValueError, match="excluded sample index 900 is out of range for 500 samples"):
        b.load_state_dict(legacy)
    same = RandomSampler()
    same.setup(1000)
    same.load_state_dict(state)
    assert same.excluded.nonzero().flatten().tolist() == [5, 900]
    clean = RandomSampler()
    clean.setup(1000)
    other = RandomSampler()
    other.setup(700)
    other.load_state_dict(clean.state_dict())  # no exclusions: nothing to misapply, a resume may change the data
    assert other.num_excluded == 0


def test_train_batches_carry_the_samplers_importance_weights_for_their_own_shard(corpus, tmp_path):
    """A sampler with ``loss_weights`` (FourierSampler, importance_weights=True) puts each rank's weights, for
    that rank's indices, in the batch as ``loss_weight``; without weights the key is absent."""
    from lit_dtrain.data.samplers import FourierSampler

    s = FourierSampler(importance_weights=True, require_updates=False, stages=False, step_unit=1)
    dm = dm_for(corpus, tmp_path, sampler=s)
    n = len(dm.train_windows)
    idx = torch.arange(min(n, 64))
    s.observe(torch.rand(len(idx), 32, generator=torch.Generator().manual_seed(0)) + (idx % 5)[:, None], idx, 1)
    for rank in (0, 1):
        batch = dm.batch_for_step(3, rank=rank, world_size=2)
        want = s.loss_weights(batch["index"])
        assert batch["loss_weight"].shape == (4,) and torch.equal(batch["loss_weight"], want)
    assert len(set(s.loss_weights(torch.arange(n)).tolist())) > 1  # the weights differ across samples
    assert "loss_weight" not in dm_for(corpus, tmp_path).batch_for_step(3)


def three_source_mixture(tmp_path, **kw):
    """Sources a, b, c weighted 0.5/0.3/0.2 (a has the most windows: its windows weigh the least each)."""
    sources = [
        CorpusSource(
            name=name,
            kind="files",
            paths=[str(make_corpus(tmp_path / name, n_files=6, size=size, seed=i))],
            weight=weight,
        )
        for i, (name, size, weight) in enumerate((("a", 6000, 0.5), ("b", 3000, 0.3), ("c", 2000, 0.2)))
    ]
    return dm_for(None, tmp_path, sources=sources, val_fraction=0.2, **kw)


def source_shares(dm, steps: int) -> list[float]:
    idx = torch.cat([dm.batch_for_step(s)["index"] for s in range(steps)]).numpy()
    return np.bincount(dm.train_windows.source_of(idx), minlength=len(dm.sources)) / len(idx)


@pytest.mark.parametrize("kind", ["random", "fourier"])
def test_exclusions_keep_every_sources_share_of_a_mixture(tmp_path, kind):
    """Excluding windows (the loss-spike monitor's skip) renormalizes within their source: the mixture keeps
    its configured shares. The target was renormalized over all remaining windows, so excluding half of
    source a (weights 0.5/0.3/0.2) drew 0.336/0.399/0.266. A FourierSampler that has not learned anything
    draws its target; its importance part reweights samples (and sources) on purpose, as without exclusions."""
    from lit_dtrain.data.samplers import FourierSampler

    sampler = FourierSampler(require_updates=False) if kind == "fourier" else None
    dm = three_source_mixture(tmp_path, batch_size=256, sampler=sampler)
    offsets = dm.train_windows.offsets
    dm.sampler.exclude(torch.arange(offsets[0], offsets[0] + dm.train_windows.counts[0] // 2))
    target = dm.sampler.target_distribution()
    per_source = [float(target[a:b].sum()) for a, b in zip(offsets[:-1], offsets[1:])]
    assert per_source == pytest.approx([0.5, 0.3, 0.2], abs=1e-12)
    assert float(target[offsets[0] : offsets[0] + dm.train_windows.counts[0] // 2].sum()) == 0
    assert source_shares(dm, 40) == pytest.approx([0.5, 0.3, 0.2], abs=0.015)  # 10240 draws: noise ~0.005


def test_a_mixture_source_with_every_window_excluded_hands_its_share_to_the_others_and_warns(tmp_path, caplog):
    """Logged (in train.log: a warnings.warn under Lightning reached the console only), by rank 0 alone (every
    rank excluded the same windows, and a 2-rank run said it twice)."""
    dm = three_source_mixture(tmp_path, batch_size=256)
    offsets = dm.train_windows.offsets
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.data.samplers"):
        dm.sampler.exclude(torch.arange(offsets[0], offsets[1]))
    (line,) = [r.getMessage() for r in caplog.records if r.name == "lit_dtrain.data.samplers"]
    assert re.search(r"data source 'a': every training window .* excluded.*0\.5", line), line
    target = dm.sampler.target_distribution()
    assert [float(target[a:b].sum()) for a, b in zip(offsets[:-1], offsets[1:])] == pytest.approx([0, 0.6, 0.4])
    assert source_shares(dm, 20) == pytest.approx([0, 0.6, 0.4], abs=0.02)


def test_exclusions_of_a_checkpoint_written_before_per_source_shares_load_and_keep_the_shares(tmp_path):
    """The sampler state is unchanged ({"excluded": indices, "num_samples": N}, as the earlier code wrote it):
    such a checkpoint resumes with the same excluded windows, now drawn with every source's share kept."""
    dm = three_source_mixture(tmp_path, batch_size=256)
    n, first_half = dm.num_train_samples, torch.arange(dm.train_windows.counts[0] // 2)
    old_state = {"micro_step": 5, "seed": 0, "sampler": {"excluded": first_half.clone(), "num_samples": n}}
    resumed = three_source_mixture(tmp_path, batch_size=256)
    resumed.load_state_dict(old_state)
    assert resumed.micro_step == 5 and resumed.sampler.num_excluded == len(first_half)
    assert torch.equal(resumed.sampler.state_dict()["excluded"], first_half)
    assert source_shares(resumed, 40) == pytest.approx([0.5, 0.3, 0.2], abs=0.015)


def test_without_exclusions_a_mixture_draws_the_batches_of_before():
    """Per-source renormalization only acts on exclusions: the default draws are those of the earlier code
    (indices recorded from it, seed 7, windows 60/30/10 at weights 0.5/0.3/0.2)."""
    from lit_dtrain.data.samplers import FourierSampler, RandomSampler

    counts = torch.tensor([60, 30, 10])
    base = torch.repeat_interleave(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64) / counts, counts)
    s = RandomSampler()
    s.setup(100, base, seed=7, source_offsets=[0, 60, 90, 100], source_names=["a", "b", "c"])
    assert s.global_batch(3, 16).tolist() == [3, 98, 66, 31, 74, 91, 19, 35, 74, 62, 0, 91, 58, 5, 18, 65]
    f = FourierSampler(require_updates=False)
    f.setup(100, base, seed=7, source_offsets=[0, 60, 90, 100], source_names=["a", "b", "c"])
    assert f.global_batch(3, 16).tolist() == [31, 97, 61, 21, 70, 90, 8, 26, 70, 56, 5, 90, 52, 55, 7, 60]
    # a sampler that is not told the sources renormalizes over every window left, as before
    s = RandomSampler()
    s.setup(100, base, seed=7)
    s.exclude(torch.arange(0, 30))
    assert s.global_batch(3, 16).tolist() == [32, 98, 77, 53, 83, 93, 44, 56, 83, 74, 30, 93, 71, 34, 44, 76]


_SLOW_BUILD = """
import os, pathlib, sys, time
import lit_dtrain.data.corpus as corpus
import lit_dtrain.data.token_cache as token_cache
real_fsync = os.fsync
def slow_fsync(fd):  # the build is inside its temp dir now: say so, then wait for the release file
    pathlib.Path(sys.argv[3]).touch()
    while not pathlib.Path(sys.argv[4]).exists():
        time.sleep(0.05)
    real_fsync(fd)
corpus.os.fsync = slow_fsync
token_cache.build_token_cache(corpus.CorpusSource(name="t", kind="files", paths=[sys.argv[1]]), sys.argv[2], 33,
                              progress=False)
"""


def _slow_builder(corpus, cache, marker, release):
    """A build in a subprocess that touches ``marker`` once it is in its temp dir and waits there for ``release``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    args = [sys.executable, "-c", _SLOW_BUILD, str(corpus), str(cache), str(marker), str(release)]
    return subprocess.Popen(args, env=env)


def _wait_for(path, proc, seconds=60.0):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the builder never reached its fsync"
        time.sleep(0.05)


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_killed_cache_build_leaves_no_temp_dir_behind_after_the_next_build(corpus, tmp_path):
    """A SIGKILLed build (OOM killer, scancel) left its hidden temp dir (a full copy of the token streams) in
    the cache dir forever. A later build removes temp dirs whose builder (on this host) is dead, once nothing in
    them changed for 10 minutes."""
    from lit_dtrain.data.token_cache import STALE_DEAD_OWNER_SECONDS

    cache = tmp_path / "cache"
    proc = _slow_builder(corpus, cache, tmp_path / "marker", tmp_path / "never")
    try:
        _wait_for(tmp_path / "marker", proc)
    finally:
        proc.kill()
        proc.wait()
    (leftover,) = [p for p in cache.iterdir() if p.name.startswith(".")]
    source = CorpusSource(name="t", kind="files", paths=[str(corpus)])
    build_token_cache(source, cache, 33, progress=False)
    assert leftover.is_dir()  # changed a moment ago: maybe a builder whose pid this host cannot see
    _age(leftover, STALE_DEAD_OWNER_SECONDS + 60)
    build_token_cache(source, cache, 33, progress=False)
    assert [p.name for p in cache.iterdir() if p.name.startswith(".")] == []
    assert len([p for p in cache.iterdir()]) == 1


def _age(directory, seconds):
    """Set back the mtime of ``directory`` and of what it holds by ``seconds``."""
    then = time.time() - seconds
    for path in (directory, *directory.iterdir()):
        os.utime(path, (then, then))


@pytest.mark.slow  # three subprocesses import torch and lightning: ~20 s on 2 shared cores
def test_concurrent_cache_builds_make_one_cache_and_never_remove_a_live_builders_temp_dir(corpus, tmp_path):
    """Three builders of the same cache (DDP ranks on several nodes sharing a cache dir): two of them build and
    sweep stale temp dirs while the first is inside its temp dir; they leave it alone (it would fail), and all
    three end with one identical cache."""
    cache = tmp_path / "cache"
    first = _slow_builder(corpus, cache, tmp_path / "marker0", tmp_path / "release")
    try:
        _wait_for(tmp_path / "marker0", first)
        (live_temp,) = [p for p in cache.iterdir() if p.name.startswith(".")]
        others = [_slow_builder(corpus, cache, tmp_path / f"marker{i}", tmp_path / "marker0") for i in (1, 2)]
        assert [p.wait(timeout=120) for p in others] == [0, 0]
        # the one that wrote the cache swept (both did, before they looked for the cache) around a live temp dir
        assert live_temp.is_dir() and ((tmp_path / "marker1").exists() or (tmp_path / "marker2").exists())
    finally:
        (tmp_path / "release").touch()
    assert first.wait(timeout=120) == 0
    (built,) = list(cache.iterdir())
    again = build_token_cache(CorpusSource(name="t", kind="files", paths=[str(corpus)]), cache, 33, progress=False)
    assert [p.name for p in cache.iterdir()] == [built.name] and again.meta["train_tokens"] > 0


def test_temp_dirs_of_unknown_builders_are_removed_only_when_old(corpus, tmp_path):
    """A temp dir whose builder cannot be checked (named by the earlier code, or by another host sharing the
    cache) is removed once nothing in it changed for a day (one a day old but for a minute stays); a dead
    builder's of this host once it is 10 minutes old; a hidden dir not named like a temp dir never."""
    from lit_dtrain.data.token_cache import STALE_TEMP_SECONDS
    from lit_dtrain.data.token_cache import _host as _host_tag

    cache = tmp_path / "cache"
    cache.mkdir()
    key = "0123456789abcdef01234567"  # a cache dir is <name>-<24 hex digits>
    old_legacy, young_legacy = cache / f".t-{key}.k9x_2z", cache / f".t-{key}.young1"
    # another host whose name starts with this one's: its pid (dead here) must not be taken for one of ours
    other_host = cache / f".t-{key}.build-{_host_tag()}_2-{dead_pid()}-ab12"
    dead_here = cache / f".t-{key}.build-{_host_tag()}-{dead_pid()}-ab12"
    unrelated = cache / ".snapshot"  # not a token cache's temp dir: whatever its age, not ours to remove
    for d in (old_legacy, young_legacy, other_host, unrelated, dead_here):
        d.mkdir()
        (d / "train.bin").write_bytes(b"\0" * 10)
    for d in (old_legacy, unrelated, dead_here, other_host):
        _age(d, STALE_TEMP_SECONDS + 60 if d is not other_host else STALE_TEMP_SECONDS - 60)
    build_token_cache(CorpusSource(name="t", kind="files", paths=[str(corpus)]), cache, 33, progress=False)
    hidden = sorted(p.name for p in cache.iterdir() if p.name.startswith("."))
    assert hidden == sorted([young_legacy.name, other_host.name, unrelated.name])


@pytest.mark.parametrize("name", ["web/en", "a\\b", "", ".hidden", "my corpus", "a:b", 1.5])  # None: the default name
def test_a_source_name_that_breaks_metric_names_or_paths_is_a_config_error(tmp_path, name):
    """The name goes into the metric val/<name>/loss and the cache dir <name>-<key>: 'web/en' made the
    metric val/web/en/loss (one level deeper, not matched by monitors) and a subdirectory web/ in the cache
    dir; '.hidden' made a hidden cache dir; '' the metric val//loss. It was not checked."""
    sources = [{"name": "stdlib", "kind": "stdlib"}, {"name": name, "kind": "stdlib", "weight": 1.0}]
    with pytest.raises(CorpusError, match=rf"data.sources.1.name={name!r}".replace("\\", "\\\\") + r": .*letters"):
        LMDataModule(sources=sources, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(CorpusError, match=r"data source name=.*letters"):
        CorpusSource(name=name, kind="stdlib")
    assert not (tmp_path / "cache").exists()


def test_source_names_of_letters_digits_dots_dashes_and_unicode_are_accepted():
    for name in ("stdlib", "web-en_v2.1", "código", "x+y", "2024"):
        assert CorpusSource(name=name, kind="stdlib").name == name
    assert CorpusSource(name=2024, kind="stdlib").name == "2024"  # YAML's name: 2024


def test_a_bad_source_name_stops_train_before_tokenizing(tmp_path, corpus):
    from hydra.errors import InstantiationException

    from lit_dtrain.train import train
    from tests.conftest import compose_cfg

    cfg = compose_cfg(["data.sources.0.name=web/en"], tmp_path / "run", corpus)
    with pytest.raises((CorpusError, InstantiationException), match=r"data.sources.0.name='web/en'"):
        train(cfg)
    assert not (tmp_path / "token_cache").exists()


def test_a_file_reached_twice_is_one_document(tmp_path, monkeypatch, caplog):
    """The same file listed as a relative and an absolute path (paths=[corpus, /abs/corpus]), or reached through
    a symlink inside the corpus, was read once per spelling: 3 files became 6 documents (each trained on at twice
    its weight). Files are now de-duplicated by their real path; distinct files with equal bytes stay (they are
    data), but a warning names them."""
    from lit_dtrain.data.corpus import resolve_files

    corpus = make_corpus(tmp_path / "c", n_files=3, size=2000)
    (corpus / "sub").mkdir()
    (corpus / "sub" / "link.txt").symlink_to(corpus / "doc_000.txt")
    monkeypatch.chdir(tmp_path)
    source = CorpusSource(name="t", kind="files", paths=["c", str(corpus), "c/doc_001.txt", "./c/*.txt"])
    assert [str(p) for p in resolve_files(source)] == ["c/doc_000.txt", "c/doc_001.txt", "c/doc_002.txt"]
    (corpus / "copy.txt").write_bytes((corpus / "doc_002.txt").read_bytes())
    with caplog.at_level("INFO", logger="lit_dtrain.data.corpus"):
        splits = build_token_cache(source, tmp_path / "cache", 33, val_fraction=0.3, progress=False)
    assert splits.meta["documents"] == 4
    (warned,) = [r for r in caplog.records if "same bytes" in r.getMessage()]
    assert warned.levelname == "WARNING" and "c/copy.txt" in warned.getMessage()
    assert "c/doc_002.txt" in warned.getMessage()
    (noted,) = [r for r in caplog.records if "reached more than once" in r.getMessage()]
    assert "left out 6 path(s)" in noted.getMessage()  # 4 absolute spellings, the link twice


def test_a_hard_link_is_the_same_file_not_a_second_document(tmp_path, caplog):
    """A file with a second hard link in the corpus was read under both names: one document trained on twice (a
    "same bytes as another file" warning was all), while a symlink to it counted once."""
    from lit_dtrain.data.corpus import resolve_files

    corpus = make_corpus(tmp_path / "c", n_files=3, size=2000)
    os.link(corpus / "doc_001.txt", corpus / "zz_link.txt")
    (corpus / "copy.txt").write_bytes((corpus / "doc_002.txt").read_bytes())  # a copy is another file: kept
    source = CorpusSource(name="t", kind="files", paths=[str(corpus)])
    names = ["copy.txt", "doc_000.txt", "doc_001.txt", "doc_002.txt"]
    assert [p.name for p in resolve_files(source)] == names
    outside = tmp_path / "other.txt"
    os.link(corpus / "doc_000.txt", outside)  # the same file under two listed paths: its first spelling
    listed = CorpusSource(name="t", kind="files", paths=[str(outside), str(corpus / "doc_000.txt")])
    assert resolve_files(listed) == [outside]
    with caplog.at_level("INFO", logger="lit_dtrain.data.corpus"):
        splits = build_token_cache(source, tmp_path / "cache", 33, val_fraction=0.3, progress=False)
    assert splits.meta["documents"] == 4
    (noted,) = [r for r in caplog.records if "reached more than once" in r.getMessage()]
    assert "hard link" in noted.getMessage() and "zz_link.txt is " in noted.getMessage()


def test_an_existing_path_with_glob_characters_in_its_name_is_that_file(tmp_path):
    """paths=['notes [v2].txt'] was taken for a glob ('[v2]' a character class) and failed with "matched no
    files" though the file exists; a glob that fails on a '[' in a name now says how to match one."""
    from lit_dtrain.data.corpus import resolve_files

    corpus = make_corpus(tmp_path / "runs [v2]", n_files=2, size=500)
    (corpus / "notes [draft] *.txt").write_text("a draft " * 50)
    for path, expected in [
        (corpus / "notes [draft] *.txt", ["notes [draft] *.txt"]),
        (corpus, ["doc_000.txt", "doc_001.txt", "notes [draft] *.txt"]),
        (tmp_path / "runs [[]v2]" / "doc_*.txt", ["doc_000.txt", "doc_001.txt"]),  # the suggested escape
    ]:
        assert [p.name for p in resolve_files(CorpusSource(name="t", kind="files", paths=[str(path)]))] == expected
    glob_in_dir = str(tmp_path / "runs [v2]" / "*.txt")
    escaped = re.escape(repr(str(tmp_path / "runs [[]v2]" / "*.txt")))
    with pytest.raises(CorpusError, match=rf"matched no files \('\[' starts a character class .*'\[\[\]': {escaped}"):
        resolve_files(CorpusSource(name="t", kind="files", paths=[glob_in_dir]))


@pytest.mark.parametrize("kind", ["directory", "glob"])
def test_symlinks_whose_target_is_missing_are_named(tmp_path, caplog, kind):
    """A symlink in the corpus whose target is gone (an unmounted disk, a moved directory) was left out without a
    word: its text was missing from the corpus."""
    from lit_dtrain.data.corpus import resolve_files

    corpus = make_corpus(tmp_path / "c", n_files=2, size=500)
    (corpus / "gone.txt").symlink_to(tmp_path / "unmounted" / "big.txt")
    (corpus / ".hidden.txt").symlink_to(tmp_path / "unmounted" / "swap")  # left out as a dot file: no warning
    path = str(corpus) if kind == "directory" else str(corpus / "*.txt")
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        files = resolve_files(CorpusSource(name="t", kind="files", paths=[path]))
    assert [p.name for p in files] == ["doc_000.txt", "doc_001.txt"]
    (warned,) = [r.getMessage() for r in caplog.records]
    assert f"left out 1 symlink(s) under {path} whose target does not exist" in warned
    assert f"gone.txt -> {tmp_path / 'unmounted' / 'big.txt'}" in warned


def test_a_glob_that_matches_directories_says_so(tmp_path, caplog):
    """paths=["data/*"] over data/en/ and data/fr/ said "glob 'data/*' matched no files", and with a file next to
    the directories it dropped every file below them without a word: a glob takes files only."""
    from lit_dtrain.data.corpus import resolve_files

    for lang in ("en", "fr"):
        make_corpus(tmp_path / "data" / lang, n_files=2, size=300)
    only_dirs = CorpusSource(name="t", kind="files", paths=[str(tmp_path / "data" / "*")])
    with pytest.raises(CorpusError, match=r"glob '.*data/\*' matched 2 directories but no files.*data/\*/\*\*/\*"):
        resolve_files(only_dirs)
    (tmp_path / "data" / "README.txt").write_text("read me")
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        assert [p.name for p in resolve_files(only_dirs)] == ["README.txt"]
    assert "also matched 2 directories" in caplog.text and "left out" in caplog.text
    assert "add '" + str(tmp_path / "data" / "*" / "**" / "*") + "' to paths" in caplog.text
    suggested = CorpusSource(name="t", kind="files", paths=[str(tmp_path / "data" / p) for p in ("*", "*/**/*")])
    caplog.clear()
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        assert len(resolve_files(suggested)) == 5  # the suggestion adds every file below the directories
        assert len(resolve_files(CorpusSource(name="t", kind="files", paths=[str(tmp_path / "data" / "**")]))) == 5
    assert "matched" not in caplog.text  # a ** glob matches its files' directories: nothing left out, no warning


def test_the_token_cache_is_built_one_document_at_a_time(tmp_path):
    """Building held every file's bytes, then every token array, then their concatenation in memory at once:
    a 191 MB corpus peaked at 1.3 GB over the baseline (~7x the corpus), so a corpus of tens of GB could not be
    built. Now one document is in memory at a time (the peak stays near the largest file), and the streams are
    the same: each split is its documents' tokens in path order, and the tail split of a corpus too small for a
    by-document split is the tail of the whole stream."""
    import tracemalloc

    tok = ByteTokenizer()
    corpus = make_corpus(tmp_path / "c", n_files=40, size=100_000)  # 4 MB; 100 KB per file
    source = CorpusSource(name="t", kind="files", paths=[str(corpus)])
    tracemalloc.start()
    try:
        splits = build_token_cache(source, tmp_path / "cache", 33, val_fraction=0.2, progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_500_000, peak  # the old build: ~28 MB
    files = sorted(corpus.iterdir())
    docs = [tok.encode(f.read_bytes(), add_eos=True) for f in files]
    held_out = [ids for f, ids in zip(files, docs) if _is_val(f.read_bytes(), 0.2)]
    assert splits.meta["split"] == "by_document" and 0 < len(held_out) < len(docs)
    assert np.array_equal(splits.val, np.concatenate(held_out))
    assert np.array_equal(splits.train, np.concatenate([ids for ids in docs if not any(ids is h for h in held_out)]))
    for n_files, min_tokens in ((1, 33), (3, 4000)):  # too few documents: the tail of the stream is val
        small = make_corpus(tmp_path / f"s{n_files}", n_files=n_files, size=3000, seed=n_files)
        source = CorpusSource(name="s", kind="files", paths=[str(small)])
        got = build_token_cache(source, tmp_path / "cache", min_tokens, val_fraction=0.2, progress=False)
        stream = np.concatenate([tok.encode(f.read_bytes(), add_eos=True) for f in sorted(small.iterdir())])
        n_val = max(min_tokens, int(len(stream) * 0.2))
        assert got.meta["split"] == "by_tokens_tail"
        assert np.array_equal(got.train, stream[:-n_val]) and np.array_equal(got.val, stream[-n_val:])


def _is_val(data: bytes, val_fraction: float) -> bool:
    import hashlib

    from lit_dtrain.data.token_cache import _is_val_doc

    return _is_val_doc(hashlib.sha256(data).digest(), val_fraction)


def test_a_file_that_changes_between_hashing_and_tokenizing_is_named(tmp_path, monkeypatch):
    """The build reads each file twice (to hash it, then to tokenize it): bytes that changed in between would be
    cached under the key of the old ones, so the build stops, naming the file."""
    import lit_dtrain.data.reading as reading_mod
    import lit_dtrain.data.token_cache as token_cache_mod

    corpus = make_corpus(tmp_path / "c", n_files=3, size=2000)
    reads = {}
    real_chunks = reading_mod._chunks

    def chunks(path, *args):
        reads[path] = reads.get(path, 0) + 1
        yield from real_chunks(path, *args)
        if path.name == "doc_001.txt" and reads[path] == 2:
            yield b"appended meanwhile"

    monkeypatch.setattr(reading_mod, "_chunks", chunks)  # the hashing read
    monkeypatch.setattr(token_cache_mod, "_chunks", chunks)  # the tokenizing read
    with pytest.raises(CorpusError, match=r"doc_001.txt' changed while the token cache of data source 't' was built"):
        build_token_cache(CorpusSource(name="t", kind="files", paths=[str(corpus)]), tmp_path / "c2", 33)
    assert list((tmp_path / "c2").iterdir()) == []


def test_a_symlinked_directory_inside_a_corpus_directory_is_read(tmp_path):
    """corpus/shared -> ../shared: pathlib's rglob does not enter symlinked directories, so their files were left
    out without a word (while a symlinked file was read). They are read now; a link back up the tree (a loop)
    is entered once, and a file reached twice is one document."""
    from lit_dtrain.data.corpus import resolve_files

    corpus = make_corpus(tmp_path / "corpus", n_files=2, size=300)
    shared = make_corpus(tmp_path / "shared", n_files=2, size=300, seed=5)
    (shared / ".git").mkdir()
    (shared / ".git" / "HEAD").write_text("ref")
    (corpus / "shared").symlink_to(shared, target_is_directory=True)
    (corpus / "loop").symlink_to(corpus, target_is_directory=True)
    files = resolve_files(CorpusSource(name="t", kind="files", paths=[str(corpus)]))
    expected = ["doc_000.txt", "doc_001.txt", "shared/doc_000.txt", "shared/doc_001.txt"]
    assert [str(p.relative_to(corpus)) for p in files] == expected
    txt = resolve_files(CorpusSource(name="t", kind="files", paths=[str(corpus)], pattern="*_001.txt"))
    assert [str(p.relative_to(corpus)) for p in txt] == ["doc_001.txt", "shared/doc_001.txt"]


def test_a_directory_source_does_not_list_dot_dirs_and_reads_a_link_into_one(tmp_path, monkeypatch):
    """paths=[.] from a project dir: every start listed its .venv and .git (60k files, 0.8-1.7 s here) only to
    leave their files out. Dot dirs are not entered now. A visible link into one (docs -> .internal/docs) was left
    out too: the dot dir, entered first under its hidden name, made the link's real dir count as entered; and a dot
    link to a visible dir (.prev -> src) left out that whole dir the same way."""
    from lit_dtrain.data.corpus import resolve_files

    project = make_corpus(tmp_path / "project", n_files=1, size=300)
    for rel in (".venv/lib/site/x.py", ".git/objects/ab", ".internal/docs/a.txt", "src/.cache/c.txt", "src/b.txt"):
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).write_text("text\n" * 20)
    (project / "docs").symlink_to(".internal/docs", target_is_directory=True)
    (project / ".prev").symlink_to("src", target_is_directory=True)  # left out all of src/ too, entered first
    listed, iterdir = [], Path.iterdir
    monkeypatch.setattr(Path, "iterdir", lambda self: listed.append(self) or iterdir(self))
    files = resolve_files(CorpusSource(name="t", kind="files", paths=[str(project)]))
    assert [p.relative_to(project).as_posix() for p in files] == ["doc_000.txt", "docs/a.txt", "src/b.txt"]
    assert sorted(p.relative_to(project).as_posix() for p in listed) == [".", "docs", "src"]

def test_a_recursive_glob_enters_each_directory_once_through_links_back_up_the_tree(tmp_path, monkeypatch):
    """paths=['corpus/**/*.txt'] over a dir with links back up the tree: glob follows them without end, listing
    each dir 41 times for one link (up to the OS's symlink limit) and 2^40 times for two (a = ., b = .), a run that
    hung without a word. A ** walks each real dir once now, as a directory source does; dot dirs left out, as
    glob leaves them out."""
    from lit_dtrain.data.corpus import resolve_files

    corpus = make_corpus(tmp_path / "corpus", n_files=2, size=300)
    (corpus / "sub").mkdir()
    (corpus / "sub" / "c.txt").write_text("text " * 20)
    (corpus / ".git").mkdir()
    (corpus / ".git" / "d.txt").write_text("text " * 20)
    (corpus / "up").symlink_to(".", target_is_directory=True)
    listed, scandir, listdir = [], os.scandir, os.listdir
    monkeypatch.setattr(os, "scandir", lambda path=".": listed.append(os.path.realpath(path)) or scandir(path))
    monkeypatch.setattr(os, "listdir", lambda path=".": listed.append(os.path.realpath(path)) or listdir(path))
    for pattern, expected in (("**/*.txt", ["doc_000.txt", "doc_001.txt", "sub/c.txt"]), ("**", ["doc_000.txt",
                              "doc_001.txt", "sub/c.txt"]), ("*/**/*.txt", ["sub/c.txt", "up/doc_000.txt",
                                                                           "up/doc_001.txt"])):  # up/ is a dir too
        listed.clear()
        files = resolve_files(CorpusSource(name="t", kind="files", paths=[f"{corpus}/{pattern}"]))
        assert [p.relative_to(corpus).as_posix() for p in files] == expected, pattern
        assert 0 < max(listed.count(d) for d in set(listed)) <= 4, pattern  # to walk and to match, from each base

def test_a_bad_source_entry_names_its_key(tmp_path):
    """data=mixture without paths said "data source 'text': kind='files' needs a non-empty 'paths' list" (which of
    data.sources?), and a misspelled key (+data.sources.0.path=...) was a TypeError from the dataclass."""
    sources = [{"name": "stdlib", "kind": "stdlib"}, {"name": "text", "kind": "files", "paths": []}]
    no_paths = r"data.sources.1 \(data source 'text'\): kind='files' needs a non-empty 'paths' list.*sources.1.paths="
    with pytest.raises(CorpusError, match=no_paths):
        LMDataModule(sources=sources, cache_dir=str(tmp_path))
    unknown = r"data.sources.0 has an unknown key 'path' \(keys: name, kind, paths, weight, pattern\)"
    with pytest.raises(CorpusError, match=unknown):
        LMDataModule(sources=[{"name": "t", "kind": "files", "path": "~/corpus"}], cache_dir=str(tmp_path))


def test_an_empty_or_malformed_sources_list_is_named(tmp_path, corpus):
    """data.sources=[] trained on the stdlib corpus without a word (an empty list read as "not given"), and
    data.sources=[foo] failed with an AttributeError traceback in train()'s monitor check (ValueError from dict('foo')
    in LMDataModule)."""
    from hydra.errors import InstantiationException

    from lit_dtrain.train import train
    from tests.conftest import compose_cfg

    for sources in ([], (), "~/corpus", {"name": "t"}):
        with pytest.raises(CorpusError, match=r"data.sources must be a non-empty list of sources, got "):
            LMDataModule(sources=sources, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(CorpusError, match=r"data.sources.1 must be a mapping of a source's keys \(name, .*got 'foo'"):
        LMDataModule(sources=[{"name": "t", "kind": "stdlib"}, "foo"], cache_dir=str(tmp_path / "cache"))
    for override, match in [("data.sources=[]", r"data.sources must be a non-empty list"),
                            ("data.sources=[foo]", r"data.sources.0 must be a mapping")]:
        cfg = compose_cfg([override], tmp_path / "run", corpus)
        with pytest.raises((CorpusError, InstantiationException), match=match):
            train(cfg)
    assert not (tmp_path / "token_cache").exists()
    assert [s.name for s in LMDataModule(sources=None, cache_dir=str(tmp_path)).sources] == ["stdlib"]
    generated = (CorpusSource(name=n, kind="stdlib") for n in ("a", "b"))  # any iterable of sources
    assert [s.name for s in LMDataModule(sources=generated, cache_dir=str(tmp_path)).sources] == ["a", "b"]


def test_an_empty_cache_dir_is_refused_not_the_working_directory(tmp_path, corpus, monkeypatch):
    """cache_dir='' (LIT_DTRAIN_CACHE= did it through the configs, before paths read it as unset) wrote the token
    caches into the working dir."""
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    source = CorpusSource(name="t", kind="files", paths=[str(corpus)])
    for cache_dir in ("", "  "):
        with pytest.raises(CorpusError, match=r"data.cache_dir is empty \(' *'\): give .*LIT_DTRAIN_CACHE"):
            LMDataModule(sources=[source], block_size=32, cache_dir=cache_dir).prepare_data()
    assert list((tmp_path / "work").iterdir()) == []


def test_paths_given_to_a_stdlib_source_are_refused_not_ignored(tmp_path, corpus):
    """CorpusSource(name="web", paths=[...]) (kind defaults to 'stdlib'), or +data.sources.0.paths=[...] with
    data=stdlib, trained on the standard library and never read the paths."""
    with pytest.raises(CorpusError, match=r"data source 'web': kind='stdlib' reads .* takes no paths, got paths="):
        CorpusSource(name="web", paths=[str(corpus)])
    with pytest.raises(CorpusError, match=r"data.sources.0 \(data source 'stdlib'\): kind='stdlib' .*kind='files'"):
        LMDataModule(sources=[{"name": "stdlib", "kind": "stdlib", "paths": [str(corpus)]}], cache_dir=str(tmp_path))
    assert CorpusSource(name="s", kind="stdlib", paths=[]).paths == []  # an empty list is no paths
    # likewise a pattern (+data.sources.0.pattern='*.txt' with data=stdlib): it filters the files of directories only
    with pytest.raises(CorpusError, match=r"data.sources.0 \(data source 'stdlib'\): kind='stdlib' reads every \.py "
                                          r"file .* takes no pattern, got pattern='\*\.txt'"):
        LMDataModule(sources=[{"name": "stdlib", "kind": "stdlib", "pattern": "*.txt"}], cache_dir=str(tmp_path))
    assert CorpusSource(name="s", kind="stdlib", pattern="*").pattern == "*"  # the default is no pattern


def test_unigram_entropy_counts_tokens_in_chunks(tmp_path, monkeypatch):
    """The end-of-run summary's unigram_entropy ran np.bincount over the whole train stream, which copies the
    uint16 memmap to int64 first: 8 bytes per token (80 MB per 10M tokens, 80 GB for 10B) after training had
    finished. It counts in chunks now, with the same value."""
    import tracemalloc

    import lit_dtrain.data.windows as windows_mod

    dm = dm_for(make_corpus(tmp_path / "c", n_files=20, size=20_000), tmp_path, val_fraction=0.1)
    stream = np.asarray(dm.splits[0].train)
    assert len(stream) > 300_000
    counts = np.bincount(stream, minlength=dm.tokenizer.vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    monkeypatch.setattr(windows_mod, "COUNT_CHUNK_TOKENS", 4096, raising=False)
    tracemalloc.start()
    try:
        value = dm.unigram_entropy()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert value == pytest.approx(float(-(p * np.log(p)).sum()), rel=1e-12)
    assert peak < 300_000, peak  # the whole stream as int64: 2.4 MB


def test_a_huge_file_is_hashed_and_tokenized_in_chunks(tmp_path, monkeypatch):
    """One document was still read whole, then encoded, then copied to append EOS: a 10 GB file took ~50 GB.
    Files are now read in chunks (the byte tokenizer encodes byte by byte, so chunks encode as the whole does)."""
    import tracemalloc

    import lit_dtrain.data.reading as reading_mod

    big = tmp_path / "big.txt"
    big.write_bytes(("héllo wörld\r\n" * 300_000).encode())  # 4.2 MB, one document
    monkeypatch.setattr(reading_mod, "READ_CHUNK_BYTES", 1 << 16, raising=False)
    tracemalloc.start()
    try:
        splits = build_token_cache(CorpusSource(name="t", kind="files", paths=[str(big)]), tmp_path / "cache", 33,
                                   progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, peak  # whole: ~21 MB
    stream = ByteTokenizer().encode(big.read_bytes(), add_eos=True)
    assert np.array_equal(np.concatenate([splits.train, splits.val]), stream)


def cache_of_dir(corpus):
    """The token cache of one 'files' source over ``corpus`` (windows of 9 tokens), built beside it."""
    from lit_dtrain.data.corpus import CorpusSource
    from lit_dtrain.data.token_cache import build_token_cache

    source = CorpusSource(name="x", kind="files", paths=[str(corpus)])
    return build_token_cache(source, corpus.parent / "cache", min_tokens=9, progress=False)


@pytest.mark.parametrize(
    "data, named",
    [
        ("hello wörld ✓\n" * 100, None),  # UTF-8: no warning
        (b"\xff\xfe", "UTF-16"),  # a UTF-16 byte-order mark alone (an empty document saved by a UTF-16 editor)
        ("hello wörld ✓\n".encode("utf-16") * 100, "UTF-16"),  # with its BOM (little-endian here)
        ("\ufeffhello wörld ✓\n".encode("utf-16-be") * 100, "UTF-16"),
        ("hello wörld ✓\n".encode("utf-16-le") * 100, "UTF-16LE"),  # no BOM: told by its NUL pattern
        ("hello wörld ✓\n".encode("utf-16-be") * 100, "UTF-16BE"),
        ("hello wörld ✓\n".encode("utf-32") * 100, "UTF-32"),
        ("hello wörld ✓\n".encode("utf-32-le") * 100, "UTF-32LE"),
    ],
)
def test_utf16_and_utf32_files_are_named_with_how_to_convert_them(data, named, tmp_path, caplog):
    """A UTF-16 text file was reported as 'binary (NUL bytes)', and a lone UTF-16 BOM not at all: the byte tokenizer
    trains on a file's bytes as they are (its contract), so a UTF-16 corpus trains on a NUL after each ASCII
    character. The warning names the encoding and the iconv command that converts the file."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "plain.txt").write_text("some utf-8 text\n" * 20)
    odd = tmp_path / "c" / "odd.txt"
    odd.write_bytes(data if isinstance(data, bytes) else data.encode())
    with caplog.at_level("WARNING"):
        splits = cache_of_dir(tmp_path / "c")
    assert splits.meta["train_tokens"] + splits.meta["val_tokens"] == 16 * 20 + odd.stat().st_size + 2  # bytes + EOS
    assert "binary" not in caplog.text
    if named is None:
        assert "UTF-" not in caplog.text
    else:
        assert f"1 file(s) are {named} text" in caplog.text and str(odd) in caplog.text
        assert f"iconv -f {named} -t UTF-8" in caplog.text


def test_binary_files_are_not_taken_for_utf16(tmp_path, caplog):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "plain.txt").write_text("some utf-8 text\n" * 20)
    (tmp_path / "c" / "blob.bin").write_bytes(b"\x00\x01" * 100)  # decodes as UTF-16LE 'ĀĀĀ...': not text
    (tmp_path / "c" / "zeros.bin").write_bytes(bytes(64))
    (tmp_path / "c" / "rand.bin").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with caplog.at_level("WARNING"):
        cache_of_dir(tmp_path / "c")
    assert "3 file(s) look binary" in caplog.text and "UTF-" not in caplog.text


def test_a_pipe_as_a_corpus_path_is_refused_naming_it(tmp_path):
    """A corpus is read twice (hashed for the cache key, then tokenized). `paths=[<(zcat corpus.gz)]` (bash process
    substitution: /dev/fd/63, a pipe) read the data once, got nothing the second time and failed with "corpus file
    '/dev/fd/63' changed while the token cache ... was built; run again once the corpus is not being written",
    which running again does not fix; a named FIFO without a writer blocked the run forever."""
    from lit_dtrain.data.corpus import CorpusSource, resolve_files

    fifo = tmp_path / "corpus.fifo"
    os.mkfifo(fifo)
    match = r"data source 'x': path '.*corpus.fifo' is a pipe \(FIFO\), not a regular file: .*read twice.*to a file"
    with pytest.raises(CorpusError, match=match):
        resolve_files(CorpusSource(name="x", kind="files", paths=[str(fifo)]))


def test_files_that_are_not_utf8_are_named(tmp_path, caplog):
    """A corpus with Latin-1 (or cp1252) files beside UTF-8 ones trained on two encodings of every accented letter
    without a word: the byte tokenizer takes a file's bytes as they are. A file whose first 8 KiB are not valid
    UTF-8 is named in a warning, with the offending byte and the iconv command."""
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a_utf8.txt").write_text("café crème ✓\n" * 50)
    (tmp_path / "c" / "b_latin1.txt").write_bytes("déjà vu\n".encode("latin-1") * 50)
    (tmp_path / "c" / "c_cut.txt").write_bytes(b"a" + "é".encode() * 4096)  # the first 8 KiB end inside a character
    with caplog.at_level("WARNING"):
        cache_of_dir(tmp_path / "c")
    assert "1 file(s) are not UTF-8 text" in caplog.text and "b_latin1.txt" in caplog.text
    assert "byte 0xe9 at offset 1" in caplog.text and "iconv -f LATIN1 -t UTF-8" in caplog.text
    assert "a_utf8.txt" not in caplog.text and "c_cut.txt" not in caplog.text


def test_a_utf8_byte_order_mark_at_a_files_start_is_not_trained_on(tmp_path, monkeypatch, caplog):
    """A UTF-8 BOM (EF BB BF, written by Windows editors) was tokenized as 3 bytes at each such document's start,
    so the model learned to emit an invisible U+FEFF after EOS. It is left out as open(encoding='utf-8-sig') does;
    a U+FEFF elsewhere, and a BOM at a later chunk's start, stay byte for byte."""
    import codecs

    import lit_dtrain.data.reading as reading_mod

    monkeypatch.setattr(reading_mod, "READ_CHUNK_BYTES", 64)  # several chunks per file
    bom = codecs.BOM_UTF8
    text = b"a" * 61 + bom + "caf\u00e9 \ufeff end\n".encode() * 10  # the second chunk starts with a BOM's bytes
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "a_windows.txt").write_bytes(bom + text)
    (tmp_path / "c" / "b_unix.txt").write_bytes(text)
    (tmp_path / "c" / "c_only_bom.txt").write_bytes(bom)  # no text: an empty file
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        splits = cache_of_dir(tmp_path / "c")
    doc = ByteTokenizer().encode(text, add_eos=True)
    assert np.array_equal(np.concatenate([splits.train, splits.val]), np.concatenate([doc, doc]))
    assert splits.meta["documents"] == 2  # the BOM-only file counts as empty
    assert "skipped 1 empty file(s)" in caplog.text
    assert "have the same bytes as another file" in caplog.text  # the same document, held out together
