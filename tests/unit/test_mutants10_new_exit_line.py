"""Exact results of ``print_once_across_ranks`` and its store where single-point mutants passed the 2-process tests
of tests/dist/test_exit_line_once.py (tenth hand mutation audit): each rank is a thread here, sharing one in-process
store (a ``HashStore``, as the group's store or torchrun's agent store holds the keys). Rank 0 waits for the ranks
that gave a line to read its own (and no longer for one that gave none), a rank other than 0 waits twice rank 0's
wait once rank 0 has reached a refusal (one wait otherwise), a line one rank of three gives otherwise is labelled on
rank 0 and on that rank, rank 0 without a store is not labelled, and the agent store's keys are the attempt's own.
The ranks' waits run on a virtual clock (:class:`_VirtualTime`): they asserted wall-clock times with 0.05 to 0.8 s
between the right wait and a wrong one (rank 1's one wait of 0.5 s against twice it, under ``< 0.95``; rank 0's
``0.9 < t < 1.8``), and the twice-the-wait case held only while rank 0's thread ran within 0.7 s of its 0.3 s delay:
on a loaded 2-core CI a thread that late fails the test, and a wrong wait can pass it."""

from __future__ import annotations

import io
import threading

import pytest
import torch.distributed as dist

import lit_dtrain.utils.distributed as distributed
from lit_dtrain.utils.distributed import _EXIT_SEEN_KEY, print_once_across_ranks

LINE = "error: trainer.max_steps must be a positive step budget, got -5"


class _VirtualTime:
    """``monotonic`` and ``sleep`` for the rank threads: the clock stands while any of them runs and moves, when all
    sleep, to the earliest wake-up, so each wait takes exactly its virtual seconds (and no wall time) whatever the
    machine's load; the order of events is the one those times give."""

    def __init__(self, threads: int) -> None:
        self._now, self._awake, self._sleepers = 0.0, threads, []
        self._cv = threading.Condition()

    def monotonic(self) -> float:
        return self._now

    def sleep(self, seconds: float) -> None:
        with self._cv:
            me = [self._now + max(seconds, 0.0), False]  # (wake-up time, woken)
            self._sleepers.append(me)
            self._awake -= 1
            self._advance()
            if not self._cv.wait_for(lambda: me[1], timeout=60):
                raise TimeoutError("a rank thread waits on something other than sleep")

    def done(self) -> None:
        with self._cv:
            self._awake -= 1
            self._advance()

    def _advance(self) -> None:
        if self._awake == 0 and self._sleepers:
            self._now = max(self._now, min(wake for wake, _ in self._sleepers))
            for sleeper in [s for s in self._sleepers if s[0] <= self._now]:
                sleeper[1] = True
                self._sleepers.remove(sleeper)
                self._awake += 1
            self._cv.notify_all()


def _ranks(monkeypatch, lines, wait_s, delays=None):
    """Each rank's printed text, and the (virtual) time each rank's call took and whether rank 1's 'seen' key was set
    by then."""
    store, world, local = dist.HashStore(), len(lines), threading.local()
    monkeypatch.setattr(distributed, "_exit_line_store", lambda: (store, local.rank, world))
    ranks = [r for r in range(world) if lines[r] is not None]
    clock = _VirtualTime(len(ranks))
    monkeypatch.setattr(distributed, "time", clock)
    printed, took = {}, {}

    def rank(r):
        local.rank = r
        try:
            clock.sleep((delays or {}).get(r, 0.0))
            file, start = io.StringIO(), clock.monotonic()
            print_once_across_ranks(lines[r], file, wait_s=wait_s)
            took[r] = (clock.monotonic() - start, store.check([_EXIT_SEEN_KEY.format(1)]))
            printed[r] = file.getvalue()
        finally:
            clock.done()

    threads = [threading.Thread(target=rank, args=(r,)) for r in ranks]
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
    assert seen and elapsed < 0.2  # not its whole wait of 5 s: rank 1 said it read the line (after 0.05 s)


def test_rank_0_does_not_wait_for_a_rank_that_gave_no_line(monkeypatch):
    """A rank hung in a collective gives none: rank 0 waits its wait_s for it once (the lines), not twice."""
    printed, took = _ranks(monkeypatch, [LINE, None], wait_s=1.0)
    assert printed == {0: f"[rank: 0] {LINE}\n"}
    assert took[0][0] == pytest.approx(1.0, abs=0.06)  # (in steps of 0.05 s; twice: 2.0)


def test_a_rank_other_than_0_waits_twice_rank_0s_wait_once_rank_0_reached_a_refusal(monkeypatch):
    """Rank 0 that reached the line and spent its own wait on a rank that gave none (rank 2, hung) shares it after
    more than one wait: rank 1 still reads it and prints nothing (rank 0 labels it: rank 2 gave none)."""
    printed, took = _ranks(monkeypatch, [LINE, LINE, None], wait_s=1.0, delays={0: 0.3})
    assert printed == {0: f"[rank: 0] {LINE}\n", 1: ""}
    assert 1.2 < took[1][0] < 1.5  # past one wait: rank 0 shared its line after 0.3 s and its own 1 s wait


def test_a_rank_other_than_0_waits_one_wait_for_a_rank_0_that_reached_no_refusal(monkeypatch):
    """A refusal rank 1 alone gives (rank 0 went on to the group): rank 1 prints it, labelled, after one wait."""
    printed, took = _ranks(monkeypatch, [None, LINE], wait_s=0.5)
    assert printed == {1: f"[rank: 1] {LINE}\n"}
    assert took[1][0] == pytest.approx(0.5, abs=0.06)  # (twice: 1.0)


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
