"""Rank 0's process holds the process group's store (under Lightning's launcher and any launch without torchrun's
agent store): when rank 0 fails alone, the others read its error there only once their next collective fails, which
it does when rank 0's process exits, store and all. A 2-rank resume that rank 0 alone refused at the checkpoint's load
left rank 1 with torch's ~30-frame C++ warning ``[c10d] recvValue failed ... Connection was likely closed`` and a line
that did not name rank 0's error (``a collective failed ... Another rank probably died or hung``).

:func:`keep_the_store_for_the_peers` runs at exit (``atexit``, before the group's teardown). On rank 0, where it
recorded an error of its own in this fit: it destroys the group (the others' collectives then fail at once) while it
keeps the store, and waits up to ``wait_s`` for each other rank to say it is done with the store. On another rank
that read a peer's record or recorded its own (so rank 0 waits for it): it says so. A rank that was interrupted (Ctrl-C,
SIGTERM) does not wait: Lightning's launcher has killed the others already, and a scheduler's grace period is short.
Nor for a peer whose process has ended (:func:`note_peer_processes`): it reads nothing more.
"""

from __future__ import annotations

import time

import torch.distributed as dist

_DONE_KEY = "lit_dtrain/store_done/fit{}/rank{}"
_used_in: int | None = None  # the fit in which this rank read a peer's record, or recorded its own error
_peer_processes: list = []  # rank 0's children under Lightning's launcher: the other ranks (note_peer_processes)


def note_peer_processes(launcher) -> None:
    """The other ranks' processes where this one launched them (Lightning's launcher, ``launcher.procs``): rank 0 stops
    keeping the store once one has ended. Lightning's observer SIGKILLs rank 0 within 5 s of a child's death, and
    rank 0, waiting 8 s for a rank 1 that was killed, exited with 137 where its own error's status was 1."""
    global _peer_processes
    _peer_processes = list(getattr(launcher, "procs", None) or [])


def note_record_use(used: bool = True) -> None:
    """This rank read a peer's failure record or left its own (``used``) in this fit: rank 0 waits for it at exit,
    where this fit is the process's last (a sweep's refused job, then jobs that ended well: rank 0 may be gone)."""
    global _used_in
    if used:
        from lit_dtrain.utils import distributed

        _used_in = distributed._fit_generation


def keep_the_store_for_the_peers(wait_s: float = 8.0) -> None:
    """See the module docstring. Best effort, never raises."""
    from lit_dtrain.utils import distributed as d

    store, rank = d._store_and_rank()
    if store is None:
        return
    try:
        if rank != 0:
            if _used_in == d._fit_generation:
                store.set(_DONE_KEY.format(d._fit_generation, rank), "1")
            return
        own = d._FAILURE_KEY.format(d._fit_generation, 0)
        if not store.check([own]) or d._INTERRUPTED in store.get(own).decode(errors="replace"):
            return
        others = [_DONE_KEY.format(d._fit_generation, r) for r in range(1, dist.get_world_size())]
        dist.destroy_process_group()  # its collectives' connections closed: the store stays, held here
        deadline = time.monotonic() + wait_s
        while not store.check(others) and time.monotonic() < deadline and not _a_peer_ended():
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - best effort: a peer's store may be gone (rank 0 ended)
        pass


def _a_peer_ended() -> bool:
    return any(p.poll() is not None for p in _peer_processes)


def store_kept_then_group_destroyed() -> None:
    """The ``atexit`` handler of ``utils.distributed.destroy_process_group_at_exit``:
    :func:`keep_the_store_for_the_peers`, then the default group destroyed (where that left one)."""
    from lit_dtrain.utils.distributed import destroy_default_group

    keep_the_store_for_the_peers()
    destroy_default_group()
