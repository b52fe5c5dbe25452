"""Exact results of data/cache_pruning.py where single-point mutants passed test_token_cache_pruning.py,
test_token_cache_upkeep.py, test_mutants8_cache.py, test_user_project_pruning.py and test_data_token_cache.py (twelfth
hand mutation audit): a hold on a dir that is no built cache, or that was replaced while the hold waited for its lock,
is none; a damaged path that is a file is moved aside too; a ``corpus`` that is no string counts as none; a copy of
a hold holds nothing."""

from __future__ import annotations

import fcntl
import json
import os
import pickle
import threading
import time

from lit_dtrain.data.cache_pruning import CacheHold, _corpus_of, discard_if_damaged, hold_cache


def test_a_hold_is_none_for_a_dir_without_meta_json(tmp_path):
    (tmp_path / "c").mkdir()
    assert hold_cache(tmp_path / "c") is None
    (tmp_path / "c" / "meta.json").write_text("{}")
    hold = hold_cache(tmp_path / "c")
    assert isinstance(hold, CacheHold)
    assert pickle.loads(pickle.dumps(hold))._finalizer is None  # a copy holds no lock of its own
    hold.release()


def test_a_hold_on_a_dir_replaced_while_it_waited_for_the_lock_is_none(tmp_path, monkeypatch):
    """A pruner holds the dir exclusively and moves it aside, a rebuild puts a new one in its place: the hold that
    waited for the old dir's lock gives none (the caller builds or checks again), not a hold on the dir moved aside."""
    cache = tmp_path / ("text-" + "0" * 24)
    cache.mkdir()
    (cache / "meta.json").write_text("{}")
    fd = os.open(cache, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    got, locking, flock = [], threading.Event(), fcntl.flock

    def announced_flock(fd, operation):
        locking.set()  # the waiter has opened the old dir and asks for its lock
        return flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", announced_flock)
    waiter = threading.Thread(target=lambda: got.append(hold_cache(cache)))
    waiter.start()
    assert locking.wait(10)
    time.sleep(0.1)
    os.rename(cache, tmp_path / "aside")
    cache.mkdir()
    (cache / "meta.json").write_text("{}")
    os.close(fd)  # the pruner's lock goes
    waiter.join(10)
    assert got == [None]


def test_a_damaged_path_that_is_a_file_is_moved_aside(tmp_path):
    path = tmp_path / "text-cache"
    path.write_text("not a dir")
    moved = []
    assert discard_if_damaged(path, lambda p: "not a dir", moved.append) == "not a dir" and moved == [path]
    assert discard_if_damaged(tmp_path / "gone", lambda p: "gone", moved.append) is None and moved == [path]


def test_a_corpus_that_is_no_string_counts_as_none(tmp_path):
    (tmp_path / "meta.json").write_text(json.dumps({"corpus": 5}))
    assert _corpus_of(tmp_path) is None
    (tmp_path / "meta.json").write_text(json.dumps({"corpus": "paths=a"}))
    assert _corpus_of(tmp_path) == "paths=a"
