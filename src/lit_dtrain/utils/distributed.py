"""Process-group helpers: tear the default group down before the interpreter exits (every backend), and name a
peer rank's error when a collective fails because that rank stopped."""

from __future__ import annotations

import atexit
import re
import signal
import time
from contextlib import contextmanager

import torch.distributed as dist

from lit_dtrain.utils.loop import fit_position
from lit_dtrain.utils.store_kept import note_peer_processes, note_record_use, store_kept_then_group_destroyed

_registered = False


def destroy_process_group_at_exit() -> None:
    """Register (once per process) an ``atexit`` handler that destroys the default process group.

    Lightning registers one for NCCL only. A gloo process group left alive can abort the process at exit
    ("terminate called without an active exception", SIGABRT, pytorch#190489): its worker threads outlive the
    interpreter. Two gloo ranks that ran a few all-reduces and exited without ``destroy_process_group`` aborted in
    2 of 20 runs here (torch 2.13, CPU), 0 of 20 with it, and one CI run of ``train.py -m`` with DDP failed so. The
    handler runs while the interpreter is still alive; a group already destroyed is left alone."""
    global _registered
    if not _registered:
        atexit.register(store_kept_then_group_destroyed)  # rank 0 keeps the store for a peer's read: store_kept.py
        _registered = True


def destroy_default_group(single_process_only: bool = False) -> bool:
    """Destroy the default process group if there is one (with ``single_process_only``: only a group of one rank);
    True when it did."""
    if dist.is_available() and dist.is_initialized() and not (single_process_only and dist.get_world_size() > 1):
        dist.destroy_process_group()
        return True
    return False


def can_set_collective_timeout() -> bool:
    """Whether :func:`set_collective_timeout` can change the default group's timeout (torch's private setter)."""
    return hasattr(dist.distributed_c10d, "_set_pg_timeout")


def set_collective_timeout(timeout) -> None:
    """Bound the default group's collectives (gloo, NCCL) and its store's waits by ``timeout`` from here on: after the
    first connection, which ``init_process_group``'s own timeout bounded (torch's private ``_set_pg_timeout``)."""
    dist.distributed_c10d._set_pg_timeout(timeout)
    dist.distributed_c10d._get_default_store().set_timeout(timeout)  # (a PrefixStore: its TCPStore's too)


# --- naming a peer rank's failure -------------------------------------------------------------------------------
# When one rank raises alone (a NaN loss on one rank under local SGD / DiLoCo, where gradients are not all-reduced),
# the others only learn of it when their next collective fails with gloo's "Connection closed by peer", which does
# not say why. The failing rank leaves one line in the process group's key-value store (the TCPStore every rank is
# already connected to; no collective, nothing on the healthy path) and a rank whose collective fails reads it.
# The process group (and its store) outlives a fit, so the records are kept per fit: a failure of an earlier fit in
# the same group, which its caller caught, must not be named as the cause of a later one. See begin_fit_records.
_FAILURE_KEY = "lit_dtrain/failed/fit{}/rank{}"
_FITS_KEY = "lit_dtrain/fits"
_EXIT_LINE_KEY, _EXIT_SEEN_KEY = "lit_dtrain/exit_line/rank{}", "lit_dtrain/exit_line_seen/rank{}"
_EXIT_REACHED_KEY = "lit_dtrain/exit_line_reached/rank0"  # rank 0 reached a refusal: its line comes
_INTERRUPTED = " was interrupted"  # a failure_line of a rank stopped by Ctrl-C or SIGTERM, not by an error
_fit_generation = 0  # this fit's index in the current store; every rank of the group computes the same one
_COLLECTIVE_HINTS = (
    "gloo",
    "nccl",
    "connection closed",
    "connection reset",
    "timed out",
    "timeout",
    "peer",
    "broken pipe",
)


class PeerRankFailedError(RuntimeError):
    """A collective failed because another rank had stopped with an error; the message names that rank and error
    (``failures``: the lines the peers recorded, none where no peer recorded one)."""

    def __init__(self, message: str, failures: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.failures = tuple(failures)


class FirstConnectionError(RuntimeError):
    """The ranks did not connect within ``strategy.connect_timeout_s``, or rank 0's port was taken."""


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective (a dead, hung or disconnected peer) rather than a local error.

    torch's distributed error types (NCCL's ``DistBackendError``, the store's ``DistStoreError``, a
    ``DistNetworkError``) are; gloo raises a plain ``RuntimeError`` ('[.../gloo/...pair.cc:553] Connection closed by
    peer', 'Timed out waiting 8000ms for recv'), which is one where torch's native code raised it (not a Python
    ``raise``: :func:`_raised_by_native_code`) and its text says so. A project's own ``RuntimeError("connection to the
    peer database timed out")`` raised on rank 1 at step 3 was read by its text alone as a collective failure: rank 1
    named no error of its own ('a collective failed (RuntimeError: connection to the peer database timed out) ...
    Another rank probably died or hung') and recorded none, so rank 0's line did not name it either. An error raised
    from a failed collective (``raise ... from``) is one too."""
    if isinstance(exc, (PeerRankFailedError, FirstConnectionError)):
        return False
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(exc, dist_error):
        return True
    if isinstance(exc, RuntimeError) and _raised_by_native_code(exc) and any(
            h in str(exc).lower() for h in _COLLECTIVE_HINTS):
        return True
    return exc.__cause__ is not None and is_collective_failure(exc.__cause__)


def _raised_by_native_code(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a call into native code (torch's C++: a collective, a ``Work``'s ``wait``, the
    store) rather than from a Python ``raise`` statement: the innermost frame of its traceback stopped at a call, not
    at a raise. Where the call was made does not matter (``Work.wait()`` is called from lit_dtrain's own samplers)."""
    import dis

    tb = exc.__traceback__
    if tb is None:  # never raised
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    op = next((i.opname for i in dis.get_instructions(tb.tb_frame.f_code) if i.offset == tb.tb_lasti), None)
    return op not in ("RAISE_VARARGS", "RERAISE", None)


def _store_and_rank():
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None, None
    try:
        return dist.distributed_c10d._get_default_store(), dist.get_rank()
    except Exception:  # noqa: BLE001 - best effort: a private torch API
        return None, None


def begin_fit_records() -> None:
    """Start this fit's failure records (call on every rank once per fit, after the process group exists).

    Each rank adds 1 to a counter in the store; ``(its value - 1) // world_size`` is the same fit index on every rank,
    because no rank can finish a fit (whose collectives need every rank) before the others have started it. One
    store request, answered at once: no collective and no waiting for the other ranks, so it cannot deadlock; nothing
    is deleted (the old records are a few short keys, and no rank reads them again). Should the store
    not answer, this rank keeps its previous index and at worst finds no record (the message then says that the
    peer's own output names the cause), never another fit's."""
    global _fit_generation
    store, _ = _store_and_rank()
    if store is None:
        return
    try:
        _fit_generation = (int(store.add(_FITS_KEY, 1)) - 1) // dist.get_world_size()
    except Exception:  # noqa: BLE001 - best effort, as recording and reading are
        pass


def record_rank_failure(exc: BaseException, where: str = "") -> None:
    """Leave ``exc``, come ``where`` (:func:`fit_position`), in the store for the other ranks (best effort, never
    raises). A failed collective is not recorded: it is the consequence of another rank's failure, not a cause."""
    if is_collective_failure(exc) or isinstance(exc, PeerRankFailedError) or getattr(exc, "left_by_a_peer", False):
        return  # a peer's refusal raised here (_setup_refusals): rank 0's stop left the store as it exited
    store, rank = _store_and_rank()
    if store is None:
        return
    try:
        store.set(_FAILURE_KEY.format(_fit_generation, rank), failure_line(exc, rank, where))
        note_record_use()  # rank 0, which holds the store, waits for this rank at exit (utils/store_kept.py)
    except Exception:  # noqa: BLE001 - the store may be gone already (its host rank exited)
        pass


def failure_line(exc: BaseException, rank: int, where: str = "") -> str:
    """The line a rank leaves for the others: its error's type and first line of text (``ValueError("\\nbad")`` left
    'ValueError:', an ``assert``'s empty one 'AssertionError:'), or that it was interrupted (Ctrl-C, SIGTERM): a
    ``KeyboardInterrupt`` on one rank (a second Ctrl-C) was named as the error to fix, and a SIGTERM to rank 0 before
    training (``logs_kept.StoppedBeforeTraining``) read 'rank 0 stopped: StoppedBeforeTraining: 143 ... fix that rank's
    error'."""
    if isinstance(exc, KeyboardInterrupt) or type(exc).__name__ == "SIGTERMException":  # Lightning's (a SystemExit)
        return f"rank {rank}{_INTERRUPTED}{where} ({type(exc).__name__})"
    if type(exc).__name__ == "StoppedBeforeTraining":  # (a SystemExit of 128 + the signal)
        return f"rank {rank}{_INTERRUPTED}{where} ({signal.Signals(exc.signum).name})"
    text = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")[:400]
    return f"rank {rank} stopped{where}: {type(exc).__name__}{': ' + text if text else ''}"


def only_interruptions(failures) -> bool:
    """Whether every recorded line is of a rank that was interrupted (:func:`failure_line`): nothing to fix there."""
    return bool(failures) and all(re.match(rf"rank \d+{_INTERRUPTED}", f) for f in failures)  # (not an error's text)


def peer_failures(wait_s: float = 1.0) -> list[str]:
    """The failures other ranks recorded with :func:`record_rank_failure` in this fit; waits up to ``wait_s`` for the
    first."""
    store, rank = _store_and_rank()
    if store is None:
        return []
    keys = [_FAILURE_KEY.format(_fit_generation, r) for r in range(dist.get_world_size()) if r != rank]
    deadline = time.monotonic() + wait_s
    try:
        while True:
            found = [store.get(k).decode(errors="replace") for k in keys if store.check([k])]
            if found or time.monotonic() >= deadline:
                note_record_use(bool(found))  # rank 0 waits for this rank at exit, when it recorded one
                return found
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store's host rank (rank 0) may be gone
        return []


def explain_collective_failure(exc: BaseException) -> PeerRankFailedError:
    """A :class:`PeerRankFailedError` for a failed collective: the peer's recorded error when there is one, else
    that a peer rank stopped and where its cause is to be found."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    first = (str(exc).splitlines() or [""])[0][:300]
    failures = peer_failures()
    if failures:
        cause = "; ".join(f.rstrip(". ") for f in failures)
        fix = "" if only_interruptions(failures) else "fix that rank's error, then "
        return PeerRankFailedError(
            f"rank {rank}: {cause}. This rank's next collective with that peer then failed "
            f"({type(exc).__name__}: {first}); {fix}resume with resume=auto", tuple(failures)
        )
    return PeerRankFailedError(
        f"rank {rank}: a collective failed ({type(exc).__name__}: {first}): a peer rank stopped, hung or lost its "
        "connection without a recorded error (killed, or it was rank 0, whose exit takes the record with it unless "
        "the job was launched with torchrun, whose agent keeps the store); that "
        "rank's own output (the first traceback in the log) names the cause. Resume with resume=auto"
    )


class RankFailureRecords:
    """Mixin for a Lightning strategy of several processes (put it before the strategy class): each fit starts its
    failure records once the process group exists (:func:`begin_fit_records`), and a rank that raises leaves its
    error for the others (:func:`record_rank_failure`), whose failed collective then names it (``train.py``'s
    ``CollectiveError``, :func:`naming_peer_failures`). Under lit_dtrain's plain DDP (``strategy=auto``/``ddp``) a
    rank 1 that raised alone (``OSError: No space left on device`` at step 4) left rank 0's last line at 'a collective
    failed at step 4 (... Connection closed by peer ...). Another rank probably died or hung'."""

    training_started = False  # (fit_position): from on_train_start on, global_step is the fit's step

    def setup_environment(self) -> None:
        super().setup_environment()  # the process group exists from here on
        self.training_started = False
        begin_fit_records()  # a peer's failure recorded in an earlier fit in this group is not this fit's

    def on_train_start(self) -> None:
        super().on_train_start()
        self.training_started = True

    def on_exception(self, exception: BaseException) -> None:
        module = self.lightning_module
        trainer = module.trainer if module is not None and module._trainer is not None else None
        record_rank_failure(exception, fit_position(trainer) if trainer is not None else "")
        note_peer_processes(self.launcher)  # rank 0 keeps the store at exit for live ranks only (utils/store_kept.py)
        super().on_exception(exception)

    # A failed collective of the step (DDP's gradient all-reduce in the closure's backward) or of a callback names the
    # peer's record in a fit of one's own too (PeerRankFailedError): there rank 0 got gloo's bare 'Connection closed
    # by peer' while rank 1's ValueError sat unread in the store (train.py's _fit named it).
    def optimizer_step(self, *args, **kwargs):
        with naming_peer_failures():
            return super().optimizer_step(*args, **kwargs)

    def reduce(self, *args, **kwargs):
        with naming_peer_failures():
            return super().reduce(*args, **kwargs)

    def all_gather(self, *args, **kwargs):
        with naming_peer_failures():
            return super().all_gather(*args, **kwargs)

    def broadcast(self, *args, **kwargs):
        with naming_peer_failures():
            return super().broadcast(*args, **kwargs)

    def barrier(self, *args, **kwargs):
        with naming_peer_failures():
            return super().barrier(*args, **kwargs)


@contextmanager
def naming_peer_failures():
    """Turn a failed collective inside the block into a :class:`PeerRankFailedError` naming the peer's error."""
    try:
        yield
    except Exception as exc:
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if distributed and is_collective_failure(exc):
            raise explain_collective_failure(exc) from exc
        raise


def all_gather_stacked(tensor):
    """Every rank's ``tensor`` (same shape on every rank), stacked in rank order: ``(world_size, *tensor.shape)``
    (``(1, ...)`` without a process group). What Lightning's ``strategy.all_gather`` returns, through
    ``torch.distributed.all_gather``: Lightning's goes through ``torch.distributed.nn.functional.all_gather``, which
    torch 2.13 deprecates with a ``FutureWarning`` printed on the run's console the first time (a spike exclusion or
    a stop signal under DDP). No autograd: these gathers carry decisions, not activations."""
    import torch

    if not (dist.is_available() and dist.is_initialized()):
        return tensor.unsqueeze(0)
    tensor = tensor.contiguous()
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    return torch.stack(gathered)


def print_once_across_ranks(line: str, file, wait_s: float = 2.0) -> None:
    """Print ``line`` (a run's last, one-line error) once for the ranks that reach it: every rank of a DDP run reaches
    the same refusal (a resume whose compressor changed; under torchrun a bad config value, before the process group
    exists) and each printed it, the user saw the line twice. Each rank leaves its line in the group's store (before
    the group: torchrun's agent store, :func:`_exit_line_store`). Rank 0 waits up to ``wait_s`` for the others' lines
    and prints its own, then shares it (so that a rank that exits after reading it cannot have torchrun stop rank 0
    before it printed); a rank other than 0 waits up to ``wait_s`` for rank 0's line, twice that once rank 0 has
    reached one, and prints nothing when it is the same. A line only some ranks give (the others differ, or give
    none: a refusal one rank alone reaches, a rank hung in a collective) is printed by each such rank with its
    ``[rank: N]`` label, so a rank that fails differently keeps its error; without a store (a single process, or a
    rank Lightning's launcher started, before the group) the line is printed, labelled on a rank other than 0."""
    from lightning.fabric.utilities.rank_zero import rank_prefixed_message

    store, rank, world_size = _exit_line_store()
    same_everywhere = store is not None and _same_line_everywhere(store, rank, world_size, line, wait_s)
    # labelled where some ranks alone give it; rank 0 without a store cannot tell (a single process: as before), nor
    # can torchrun's workers without the agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): each reads the same
    # config, and rank 1's duplicate was labelled as a refusal it alone gave
    alone = world_size > 1 and not same_everywhere and (store is not None or rank != 0 and not _torchrun_worker())
    if rank == 0 or not same_everywhere:
        print(rank_prefixed_message(line, rank if alone else None), file=file, flush=True)
    if store is not None and rank == 0:
        try:  # rank 0's process may hold the store: the others read its line before it exits
            store.set(_EXIT_LINE_KEY.format(0), line)
            deadline = time.monotonic() + wait_s  # (those that gave a line; the others read none)
            seen = [_EXIT_SEEN_KEY.format(r) for r in range(1, world_size) if store.check([_EXIT_LINE_KEY.format(r)])]
            while not store.check(seen) and time.monotonic() < deadline:
                time.sleep(0.05)
        except Exception:  # noqa: BLE001 - best effort
            pass


def _same_line_everywhere(store, rank: int, world_size: int, line: str, wait_s: float) -> bool:
    """Whether every rank gave ``line`` (rank 0: the others' lines, which they set first; another rank: rank 0's)."""
    try:
        store.set(_EXIT_LINE_KEY.format(rank) if rank else _EXIT_REACHED_KEY, line)
        wanted = [_EXIT_LINE_KEY.format(r) for r in (range(1, world_size) if rank == 0 else [0])]
        deadline = time.monotonic() + wait_s
        # another rank waits twice as long for rank 0's line only once rank 0 has reached a refusal: one rank 0 never
        # reaches (a refusal rank 1 alone gives) held rank 1's line back 4 s, not 2
        while not store.check(wanted) and time.monotonic() < deadline + (wait_s if rank and store.check(
                [_EXIT_REACHED_KEY]) else 0):
            time.sleep(0.05)
        same = store.check(wanted) and all(store.get(k).decode(errors="replace") == line for k in wanted)
        if rank:
            store.set(_EXIT_SEEN_KEY.format(rank), "1")
        return same
    except Exception:  # noqa: BLE001 - best effort: the store's host rank (rank 0) may be gone
        return False


def _torchrun_worker() -> bool:
    """Whether torchrun (torch elastic) started this process: it sets ``TORCHELASTIC_RUN_ID`` for its workers."""
    import os

    return "TORCHELASTIC_RUN_ID" in os.environ


def _exit_line_store():
    """``(store, rank, world_size)`` for :func:`print_once_across_ranks`: the process group's store; before the group
    exists, under torchrun with its agent's store (``TORCHELASTIC_USE_AGENT_STORE``, the default), a client of that
    store, as ``init_process_group`` makes one (torch's ``_create_c10d_store``); else ``(None, rank, world_size)``
    from the launcher's variables."""
    import os
    from datetime import timedelta

    from lightning.pytorch.utilities import rank_zero_only

    from lit_dtrain.utils.rank_zero import launched_world_size

    store, rank = _store_and_rank()
    if store is not None:
        return store, rank, dist.get_world_size()
    rank, world_size = rank_zero_only.rank or 0, launched_world_size()
    if world_size < 2 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return None, rank, world_size
    try:
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # a restarted worker's lines are its own
        return agent_store(f"lit_dtrain/before_group/attempt{restart}", timedelta(seconds=5)), rank, world_size
    except Exception:  # noqa: BLE001 - best effort: no agent store to reach
        return None, rank, world_size


def agent_store(prefix: str, timeout) -> dist.Store:
    """A client of torchrun's agent store (``MASTER_ADDR``:``MASTER_PORT``, as ``init_process_group`` makes one: torch's
    ``_create_c10d_store``) whose keys are under ``prefix``, so that they are this use's and this attempt's alone."""
    import os

    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    return dist.PrefixStore(prefix, client)
