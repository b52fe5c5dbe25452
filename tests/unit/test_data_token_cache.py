"""The token cache: reuse and rebuild, damaged caches, full disks, permissions, killed and concurrent builds."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from lit_dtrain.data import CorpusError, CorpusSource, build_token_cache
from tests.conftest import ROOT


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


def test_a_process_finding_a_damaged_cache_never_moves_aside_another_ones_rebuild(corpus, tmp_path, monkeypatch,
                                                                                  caplog):
    """Two builders find one damaged cache; B is paused between its check and its move while A moves it aside,
    rebuilds and holds the rebuild. B moved aside whatever was there, A's rebuild in use: two rebuilds, A's cache
    deleted under it. B now moves only the dir it checked, under its lock, and finds A's rebuild intact."""
    import threading

    from lit_dtrain.data import token_cache

    src, cache = CorpusSource(name="t", kind="files", paths=[str(corpus)]), tmp_path / "c"
    out_dir = Path(build_token_cache(src, cache, 33, progress=False).train.filename).parent
    with open(out_dir / "train.bin", "r+b") as f:  # a zeroed block, its size kept
        f.seek(64)
        f.write(bytes(256))
    b_checked, a_done, real, built = threading.Event(), threading.Event(), token_cache.cache_problem, {}

    def problem_of(path):
        problem = real(path)
        if threading.current_thread().name == "B" and not b_checked.is_set():
            b_checked.set()
            assert a_done.wait(60)
        return problem

    def build(name):
        if name == "A":
            assert b_checked.wait(60)
        splits = build_token_cache(src, cache, 33, progress=False)
        built[name] = splits, os.stat(out_dir).st_ino
        if name == "A":
            a_done.set()

    monkeypatch.setattr(token_cache, "cache_problem", problem_of)
    threads = [threading.Thread(target=build, args=(name,), name=name) for name in "AB"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert sorted(built) == ["A", "B"]
    assert built["A"][1] == built["B"][1] == os.stat(out_dir).st_ino  # one rebuild, A's, still in place
    assert len([r for r in caplog.records if "rebuilding it" in r.getMessage()]) == 1
    assert np.array_equal(built["A"][0].train, built["B"][0].train)
