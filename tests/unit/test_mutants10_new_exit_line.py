"""Exact results of ``print_once_across_ranks`` and its store where single-point mutants passed the 2-process tests
of tests/dist/test_exit_line_once.py (tenth hand mutation audit): each rank is a thread here, sharing one in-process
store (a ``HashStore``, as the group's store or torchrun's agent store holds the keys). Rank 0 waits for the ranks
that gave a line to read its own (and no longer for one that gave none), a rank other than 0 waits twice rank 0's
wait once rank 0 has reached a refusal (one wait otherwise), a line one rank of three gives otherwise is labelled on
rank 0 and on that rank, rank 0 without a store is not labelled, and the agent store's keys are the attempt's own."""

from __future__ import annotations

import io
import threading
import time

import pytest
import torch.distributed as dist

import lit_dtrain.utils.distributed as distributed
from lit_dtrain.utils.distributed import _EXIT_SEEN_KEY, print_once_across_ranks

LINE = "error: trainer.max_steps must be a positive step budget, got -5"


def _ranks(monkeypatch, lines, wait_s, delays=None):
    """Each rank's printed text, and the time rank 0's call took and whether rank 1's 'seen' key was set by then."""
    store, world, local = dist.HashStore(), len(lines), threading.local()
    monkeypatch.setattr(distributed, "_exit_line_store", lambda: (store, local.rank, world))
    printed, took = {}, {}

    def rank(r):
        local.rank = r
        time.sleep((delays or {}).get(r, 0.0))
        file, start = io.StringIO(), time.monotonic()
        print_once_across_ranks(lines[r], file, wait_s=wait_s)
        took[r] = (time.monotonic() - start, store.check([_EXIT_SEEN_KEY.format(1)]))
        printed[r] = file.getvalue()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world) if lines[r] is not None]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return printed, took


def test_rank_0_returns_only_after_the_other_rank_read_its_line(monkeypatch):
    """Rank 0's process may hold the store: it waits until each rank that gave a line has read rank 0's."""
    printed, took = _ranks(monkeypatch, [LINE, LINE], wait_s=5.0, delays={1: 0.0, 0: 0.3})
    assert printed == {0: LINE + "\n", 1: ""}
    elapsed, seen = took[0]
    assert seen and elapsed < 4.0  # not its whole wait: rank 1 said it read the line


def test_rank_0_does_not_wait_for_a_rank_that_gave_no_line(monkeypatch):
    """A rank hung in a collective gives none: rank 0 waits its wait_s for it once (the lines), not twice."""
    printed, took = _ranks(monkeypatch, [LINE, None], wait_s=1.0)
    assert printed == {0: f"[rank: 0] {LINE}\n"}
    assert 0.9 < took[0][0] < 1.8


def test_a_rank_other_than_0_waits_twice_rank_0s_wait_once_rank_0_reached_a_refusal(monkeypatch):
    """Rank 0 that reached the line and spent its own wait on a rank that gave none (rank 2, hung) shares it after
    more than one wait: rank 1 still reads it and prints nothing (rank 0 labels it: rank 2 gave none)."""
    printed, _ = _ranks(monkeypatch, [LINE, LINE, None], wait_s=1.0, delays={0: 0.3})
    assert printed == {0: f"[rank: 0] {LINE}\n", 1: ""}


def test_a_rank_other_than_0_waits_one_wait_for_a_rank_0_that_reached_no_refusal(monkeypatch):
    """A refusal rank 1 alone gives (rank 0 went on to the group): rank 1 prints it, labelled, after one wait."""
    printed, took = _ranks(monkeypatch, [None, LINE], wait_s=0.5)
    assert printed == {1: f"[rank: 1] {LINE}\n"}
    assert took[1][0] < 0.95


def test_a_line_one_of_three_ranks_gives_otherwise_is_labelled(monkeypatch):
    """Rank 0 compares every other rank's line (rank 1's alone matched); rank 1, which matched rank 0's, prints none."""
    other = "error: rank 2 reads another config"
    printed, _ = _ranks(monkeypatch, [LINE, LINE, other], wait_s=2.0)
    assert printed == {0: f"[rank: 0] {LINE}\n", 1: "", 2: f"[rank: 2] {other}\n"}


def test_rank_0_without_a_store_is_not_labelled_where_several_ranks_run(monkeypatch):
    """Rank 0 of Lightning's launcher before the group (WORLD_SIZE=2, no store): it cannot tell whether the others
    gave the line, so it prints it as a single process does; rank 1 there is labelled (the dist test's case)."""
    from lightning.pytorch.utilities import rank_zero_only

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    monkeypatch.setenv("WORLD_SIZE", "2")
    file = io.StringIO()
    print_once_across_ranks(LINE, file, wait_s=0.1)
    assert file.getvalue() == LINE + "\n"


@pytest.mark.parametrize("restart", ["0", "1"])
def test_before_the_group_each_torchrun_attempt_has_keys_of_its_own(monkeypatch, restart):
    """A restarted worker's line is its own: a dead attempt's line under the same key would be read as this one's."""
    from datetime import timedelta

    from lightning.pytorch.utilities import rank_zero_only

    from tests.conftest import free_port

    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    store, rank, world = distributed._exit_line_store()
    assert (rank, world) == (1, 2)
    store.set("k", "v")
    assert agent.get(f"lit_dtrain/before_group/attempt{restart}/k") == b"v"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")  # torchrun --no-agent-store (or none): no store
    assert distributed._exit_line_store() == (None, 1, 2)
    del agent
