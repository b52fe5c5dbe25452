"""The token cache's upkeep: the offsets its encoding warnings name, and the bound on how many caches a cache dir
keeps (old caches of an edited corpus are pruned; a cache in use by a live process never is)."""

from __future__ import annotations

import codecs
import signal

import pytest

from lit_dtrain.data import CorpusSource, build_token_cache
from tests.unit._data_helpers import files_source


def test_the_offset_of_a_non_utf8_byte_counts_a_byte_order_mark(tmp_path, caplog):
    """A Latin-1 file that starts with a UTF-8 BOM: the warning named the byte 3 before it is (the BOM is left
    out of the text, and the offset was counted in the text); it names the byte's offset in the file now."""
    data = codecs.BOM_UTF8 + "café\n".encode("latin-1") * 400
    (tmp_path / "a.txt").write_bytes(data)
    with caplog.at_level("WARNING"):
        build_token_cache(files_source(tmp_path / "a.txt"), tmp_path / "cache", min_tokens=9, progress=False)
    assert data.index(b"\xe9") == 6
    assert "byte 0xe9 at offset 6" in caplog.text


BUILD_SCRIPT = """
import signal, sys, time
from pathlib import Path
import numpy as np
from lit_dtrain.data import ByteTokenizer, CorpusSource, build_token_cache

root, pause, ignore_hup = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
if ignore_hup:  # as under nohup
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

class SlowTokenizer(ByteTokenizer):  # holds the build inside its temp dir while the test signals
    def encode(self, data, add_eos=False):
        (root / "inside").touch()
        time.sleep(pause)
        return super().encode(data, add_eos=add_eos)

source = CorpusSource(name="x", kind="files", paths=[str(root / "corpus")])
build_token_cache(source, root / "cache", min_tokens=9, tokenizer=SlowTokenizer(), progress=False)
print("built")
"""


def _start_build(tmp_path, pause: float, ignore_hup: bool = False):
    import os
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT, make_corpus

    make_corpus(tmp_path / "corpus", n_files=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", BUILD_SCRIPT, str(tmp_path), str(pause), str(int(ignore_hup))],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "inside").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the build never started"
        time.sleep(0.05)
    assert [p.name for p in (tmp_path / "cache").iterdir() if ".build-" in p.name]  # its temp dir, mid-build
    return proc


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_during_a_cache_build_removes_its_temp_dir(tmp_path, signum):
    """SIGTERM (kill, a scheduler) or SIGHUP (a closed terminal) during a token-cache build ended the process at
    once and left its hidden temp dir, up to twice the corpus' size, until a later build's sweep 10 minutes after.
    The build now removes it, then the signal ends the process as before (killed by that signal)."""
    proc = _start_build(tmp_path, pause=60)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signum, err
    assert "built" not in out
    assert list((tmp_path / "cache").iterdir()) == []


def test_an_ignored_sighup_during_a_cache_build_stays_ignored(tmp_path):
    """Under nohup SIGHUP is ignored: the build goes on and the cache is built."""
    proc = _start_build(tmp_path, pause=0.5, ignore_hup=True)
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "built" in out
    assert [p.name.startswith("x-") for p in (tmp_path / "cache").iterdir()] == [True]


def _caches(cache_dir, name="x"):
    return sorted(p.name for p in cache_dir.iterdir() if p.name.startswith(f"{name}-"))


def _edit(corpus, i):
    (corpus / "edited.txt").write_text(f"edit number {i}\n" * 40)


def test_old_caches_of_an_edited_corpus_are_pruned_to_the_most_recently_used(tmp_path, caplog):
    """Each edit of a corpus left a new cache beside the old ones (about twice the corpus' size each) and nothing
    removed them. With keep=2 the cache dir holds the 2 most recently used caches of a source name; the removal is
    logged with the bytes freed; another source name's caches are not counted against it, nor those of another corpus
    with the same name (data=textfiles names every corpus 'text': another project's cache was removed, and rebuilt at
    its next run)."""
    import gc
    import os
    import time

    from tests.conftest import make_corpus

    corpus = make_corpus(tmp_path / "corpus", n_files=3)
    cache = tmp_path / "cache"
    other = build_token_cache(files_source(corpus, "other"), cache, min_tokens=9, progress=False, keep=1)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "a.txt").write_text("another project's corpus\n" * 40)
    elsewhere = build_token_cache(files_source(tmp_path / "elsewhere"), cache, min_tokens=9, progress=False, keep=2)
    elsewhere = os.path.basename(os.path.dirname(elsewhere.train.filename))
    gc.collect()
    keys = []
    for i in range(4):
        _edit(corpus, i)
        with caplog.at_level("INFO"):
            splits = build_token_cache(files_source(corpus), cache, min_tokens=9, progress=False, keep=2)
        keys.append(os.path.basename(os.path.dirname(splits.train.filename)))
        del splits
        gc.collect()  # released: no longer in use
        time.sleep(0.02)  # distinct mtimes
    assert _caches(cache) == sorted([*keys[-2:], elsewhere])
    assert len(set(keys)) == 4
    assert _caches(cache, "other") == [os.path.basename(os.path.dirname(other.train.filename))]
    assert "token caches of data source 'x': removed 1 not among the 2 most recently used" in caplog.text
    assert keys[0] in caplog.text and " MB, last used " in caplog.text
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # nothing left aside

    # a reuse counts as a use: the older of the two is reused, then a new edit removes the other one
    _edit(corpus, 2)
    build_token_cache(files_source(corpus), cache, min_tokens=9, progress=False, keep=2)
    gc.collect()
    time.sleep(0.02)
    _edit(corpus, 9)
    newest = build_token_cache(files_source(corpus), cache, min_tokens=9, progress=False, keep=2)
    assert _caches(cache) == sorted([keys[2], os.path.basename(os.path.dirname(newest.train.filename)), elsewhere])


def test_a_cache_in_use_by_a_live_process_is_never_pruned(tmp_path, caplog):
    """A run that trains on a cache holds it (a shared lock on its dir, while its TokenSplits lives): another
    process's pruning leaves it and says so. Once that process is gone, it is pruned."""
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT, make_corpus

    corpus = make_corpus(tmp_path / "corpus", n_files=3)
    cache = tmp_path / "cache"
    _edit(corpus, 0)
    script = (
        "import sys\nfrom lit_dtrain.data import CorpusSource, build_token_cache\n"
        f"s = build_token_cache(CorpusSource(name='x', kind='files', paths=[{str(corpus)!r}]), {str(cache)!r}, "
        "min_tokens=9, progress=False)\nprint('held', flush=True)\nsys.stdin.read()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    holder = subprocess.Popen([sys.executable, "-c", script], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        held = _caches(cache)
        _edit(corpus, 1)
        with caplog.at_level("INFO"):
            build_token_cache(files_source(corpus), cache, min_tokens=9, progress=False, keep=1)
        assert held[0] in _caches(cache) and len(_caches(cache)) == 2
        assert f"kept 1 in use by another process beyond data.cache_keep=1: {held[0]}" in caplog.text
    finally:
        holder.communicate("", timeout=60)
    build_token_cache(files_source(corpus), cache, min_tokens=9, progress=False, keep=1)
    assert held[0] not in _caches(cache) and len(_caches(cache)) == 1


def test_a_cache_pruned_between_its_check_and_its_hold_is_built_again(tmp_path, monkeypatch):
    """If another process prunes the cache after this one found it intact and before it holds it, the load does
    not memory-map a removed cache: it builds it again."""
    from lit_dtrain.data import cache_pruning, token_cache
    from tests.conftest import make_corpus

    corpus = make_corpus(tmp_path / "corpus", n_files=3)
    cache = tmp_path / "cache"
    first = build_token_cache(files_source(corpus), cache, min_tokens=9, progress=False)
    expected = first.train.tolist()
    del first
    real_hold, calls = cache_pruning.hold_cache, []

    def hold_after_a_prune(out_dir):
        calls.append(out_dir)
        if len(calls) == 1:
            token_cache._discard(out_dir)  # what a pruner does, between the check and the hold
        return real_hold(out_dir)

    monkeypatch.setattr(token_cache, "hold_cache", hold_after_a_prune)
    again = build_token_cache(files_source(corpus), cache, min_tokens=9, progress=False)
    assert len(calls) == 2 and again.train.tolist() == expected


@pytest.mark.parametrize("keep", [0, -1, 1.5, "2"])
def test_cache_keep_must_be_a_positive_whole_number(tmp_path, keep):
    from lit_dtrain.data import LMDataModule

    with pytest.raises((ValueError, TypeError), match="data.cache_keep"):
        LMDataModule(cache_dir=str(tmp_path), cache_keep=keep)


def test_token_splits_copy_and_pickle_without_their_hold(tmp_path):
    """A copy of a loaded cache (pickled to a spawned process, deepcopied) holds no lock of its own: releasing it
    leaves the original's hold, so the cache stays protected while the original lives."""
    import copy
    import fcntl
    import os
    import pickle

    from tests.conftest import make_corpus

    splits = build_token_cache(files_source(make_corpus(tmp_path / "c", n_files=3)), tmp_path / "cache", min_tokens=9,
                               progress=False)
    for twin in (copy.deepcopy(splits), pickle.loads(pickle.dumps(splits))):
        assert twin.hold is not None and twin.train.tolist() == splits.train.tolist()
        twin.hold.release()
        del twin
    fd = os.open(os.path.dirname(splits.train.filename), os.O_RDONLY)
    try:
        with pytest.raises(BlockingIOError):  # still held
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        splits.hold.release()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released with the original
    finally:
        os.close(fd)


def test_caches_that_cannot_be_locked_are_kept_and_said_so(tmp_path, monkeypatch, caplog):
    """Where the file system has no locks (NFS refuses an exclusive flock on a read-only fd: EBADF), whether a cache
    is in use cannot be told: it is kept, and the log says why (not 'in use by another process')."""
    import errno
    import fcntl
    import gc

    from lit_dtrain.data import cache_pruning
    from tests.conftest import make_corpus

    corpus = make_corpus(tmp_path / "corpus", n_files=3)
    _edit(corpus, 0)
    build_token_cache(files_source(corpus), tmp_path / "cache", min_tokens=9, progress=False)
    gc.collect()

    real_flock = fcntl.flock

    def flock(fd, op):
        if op & fcntl.LOCK_EX:
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real_flock(fd, op)

    monkeypatch.setattr(cache_pruning.fcntl, "flock", flock)
    _edit(corpus, 1)
    with caplog.at_level("INFO"):
        build_token_cache(files_source(corpus), tmp_path / "cache", min_tokens=9, progress=False, keep=1)
    assert len(_caches(tmp_path / "cache")) == 2
    assert "kept 1 beyond data.cache_keep=1, which cannot be locked here" in caplog.text
    assert "Bad file descriptor" in caplog.text and "in use by another process" not in caplog.text


def test_the_run_outputs_inside_a_corpus_dir_are_not_read_as_corpus(tmp_path, caplog):
    """paths=[.] from a project dir that holds outputs/: the previous runs' checkpoints and logs were corpus text,
    and the run's own train.log, written while the corpus was read, failed the build with 'changed while the token
    cache ... was built; run again', which no rerun fixes. data.exclude_dirs (the configs: the run outputs' root)
    leaves them out; the configs pass paths.log_dir."""
    from lit_dtrain.data import LMDataModule
    from tests.conftest import compose_cfg, make_corpus

    corpus = make_corpus(tmp_path / "proj", n_files=3)
    run = corpus / "outputs" / "runs" / "r1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(b"PK\0\0" * 1000)
    (run / "train.log").write_text("[INFO] step 1 loss 5.5\n" * 100)
    with caplog.at_level("WARNING"):
        dm = LMDataModule(sources=[files_source(corpus)], block_size=8, cache_dir=str(tmp_path / "cache"),
                          progress=False, exclude_dirs=str(corpus / "outputs"))
        dm.prepare_data()
    assert dm.splits[0].meta["documents"] == 3
    assert "left out 2 file(s) under" in caplog.text and "run outputs (data.exclude_dirs)" in caplog.text
    assert "look binary" not in caplog.text
    cfg = compose_cfg([], tmp_path / "run", corpus)
    assert list(cfg.data.exclude_dirs) == [cfg.paths.log_dir] and cfg.paths.log_dir


def test_a_corpus_of_fewer_windows_than_a_batch_is_warned_about(tmp_path, caplog):
    """40 bytes with block_size 16 and batch 4: one training window, so every batch was that window 4 times, and the
    loss fell to 0 by memorizing it, without a word. A warning says so; a corpus of a batch or more says nothing."""
    from lit_dtrain.data import LMDataModule

    (tmp_path / "tiny.txt").write_text("x" * 40)
    (tmp_path / "big.txt").write_text("y" * 400)
    for name, expected in (("tiny.txt", 1), ("big.txt", None)):
        dm = LMDataModule(sources=[files_source(tmp_path / name, name.split(".")[0])], block_size=16, batch_size=4,
                          cache_dir=str(tmp_path / "cache"), progress=False)
        dm.prepare_data()
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):  # in train.log (a warnings.warn was not)
            dm.setup()
        said = [r.getMessage() for r in caplog.records if "fewer than one global batch" in r.getMessage()]
        if expected is None:
            assert not said and len(dm.train_windows) >= 4
        else:
            assert len(dm.train_windows) == expected and len(said) == 1
            assert "holds 1 window(s) of block_size+1 = 17 tokens, fewer than one global batch of 4" in said[0]



def test_a_trained_source_of_fewer_windows_than_a_batch_is_warned_about_beside_a_validation_only_one(tmp_path, caplog):
    """A weight-0 source is validation only: its windows are never drawn. A tiny trained source (1 window) beside a
    large weight-0 one (23 windows) repeated its one window in every batch without a word, as the warning counted
    every source's windows."""
    from lit_dtrain.data import LMDataModule

    (tmp_path / "tiny.txt").write_text("x" * 40)
    (tmp_path / "big.txt").write_text("y" * 400)
    sources = [files_source(tmp_path / "tiny.txt", "tiny"), files_source(tmp_path / "big.txt", "big")]
    sources[1].weight = 0.0
    dm = LMDataModule(sources=sources, block_size=16, batch_size=4, cache_dir=str(tmp_path / "cache"), progress=False)
    dm.prepare_data()
    caplog.clear()
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        dm.setup()
    said = [r.getMessage() for r in caplog.records if "fewer than one global batch" in r.getMessage()]
    assert dm.train_windows.counts.tolist() == [1, 23]
    assert len(said) == 1
    assert ("holds 1 window(s) of block_size+1 = 17 tokens in its sources of weight > 0, fewer than one global batch "
            "of 4") in said[0]


def test_the_corpus_of_a_cache_tells_pythons_stdlibs_and_paths_apart(monkeypatch):
    """Caches are pruned per source name and corpus: two Pythons' stdlibs (venvs of 3.11 and 3.12 sharing the cache
    dir, both sources named 'stdlib') are two corpora, as are two dirs of one name; an edit keeps the corpus."""
    import sysconfig

    from lit_dtrain.data.token_cache import corpus_id

    here = corpus_id(CorpusSource())
    assert corpus_id(files_source("/data/a")) != corpus_id(files_source("/data/b"))
    assert corpus_id(files_source("/data/a")) == corpus_id(files_source("/data/./a"))
    paths = {**sysconfig.get_paths(), "stdlib": "/opt/other-python/lib/python3.99"}
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: paths)
    assert corpus_id(CorpusSource()) != here


def test_a_by_document_split_that_holds_out_most_of_the_text_is_warned_about_at_every_load(tmp_path, caplog):
    """val_fraction=0.02 holds out whole documents: a large file whose hash falls in val took most of the corpus'
    tokens out of training (78%), and the split was only in the cache's INFO line at its build (the run trained on 22%
    of the text without a word). A warning names the share and the file, at every load of the cache."""
    for i in range(20):
        (tmp_path / "c" / f"note{i:02d}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "c" / f"note{i:02d}.txt").write_text(f"note {i}\n" * 100)
    book = tmp_path / "c" / "book.txt"
    book.write_text("book 19\n" + "lorem ipsum dolor sit amet\n" * 2000)  # its content hash puts it in val at 0.02
    for _ in range(2):  # the build, then a reuse of the cache
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
            splits = build_token_cache(files_source(tmp_path / "c"), tmp_path / "cache", 33, 0.02, progress=False)
        assert splits.meta["split"] == "by_document" and len(splits.val) == book.stat().st_size + 1
        [message] = [r.getMessage() for r in caplog.records]
        share = len(splits.val) / (len(splits.val) + len(splits.train))
        assert share > 0.75 and f"the 1 held out are {100 * share:.1f}% of its tokens" in message
        assert f"the largest held out is {book} ({book.stat().st_size} bytes)" in message
    caplog.clear()
    book.write_text("book 0\n" + "lorem ipsum dolor sit amet\n" * 2000)  # the same size, in train
    with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
        splits = build_token_cache(files_source(tmp_path / "c"), tmp_path / "cache", 33, 0.02, progress=False)
    assert splits.meta["split"] == "by_tokens_tail"  # no note is held out: too few documents, its own warning
    assert "holds out whole documents" not in caplog.text


def test_a_file_name_that_is_not_utf8_is_logged_not_lost(tmp_path):
    """A binary file named in Latin-1 (b'bin\\xe9.dat'): its warning was lost to a UTF-8 log stream ('--- Logging
    error ---', UnicodeEncodeError: surrogates not allowed, and a traceback); the name's byte is written as \\xe9."""
    import io
    import logging
    import os

    for i in range(3):
        (tmp_path / f"t{i}.txt").write_text(f"text {i}\n" * 40)
    with open(os.path.join(os.fsencode(tmp_path), b"bin\xe9.dat"), "wb") as f:
        f.write(b"\0\1\2" * 40)
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    handler, logger = logging.StreamHandler(stream), logging.getLogger("lit_dtrain.data.corpus")
    handler.handleError = lambda record: (_ for _ in ()).throw(AssertionError(f"not written: {record.msg[:40]}"))
    logger.addHandler(handler)
    try:
        build_token_cache(files_source(tmp_path), tmp_path / "cache", 33, progress=False)
    finally:
        logger.removeHandler(handler)
    assert f"look binary (NUL bytes), e.g. {tmp_path}/bin\\xe9.dat;" in stream.buffer.getvalue().decode()
