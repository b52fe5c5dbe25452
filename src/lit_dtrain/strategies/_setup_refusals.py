"""A rank that fails before Lightning's ``pre_setup`` barrier (in ``prepare_data``: the token cache's build) has every
rank refuse the fit with its error, at once.

Lightning runs ``prepare_data`` on each node's local rank 0 alone, then every rank meets at
``strategy.barrier("pre_setup")``. A rank whose ``prepare_data`` raised never came there: in a single run the others
failed when its process ended (each rank printed a line of its own: rank 0 the error, rank 1 'rank 0 stopped before
training: CorpusError: ...; this rank's next collective then failed'), and in a DDP multirun, whose ranks run every
job in one process each, rank 0 went on to job 1 while rank 1 waited in job 0's barrier for
``strategy.collective_timeout_s`` (30 min by default): the sweep then ended with rank 0's 'a collective failed ...
Another rank probably died or hung', and job 1, which would have trained, did not. Here the failing rank leaves its
error in the process group's store and the barrier waits in the store for every rank or such an error: the others
raise it too (the same error where it is a bad input, :func:`lit_dtrain.sweeps.user_error`, so it is reported once),
and a sweep's next job runs on the group, which no rank left. A store, not a collective: a rank that failed before
the barrier may have left the others in another collective (the ``log_dir`` broadcast), which must not pair with
this one."""

from __future__ import annotations

import contextlib
import pickle
import time
from datetime import timedelta

import torch.distributed as dist

from lit_dtrain.utils import distributed as _records
from lit_dtrain.utils.distributed import (
    FirstConnectionError,
    PeerRankFailedError,
    _store_and_rank,
    failure_line,
    is_collective_failure,
)

_KEY = "lit_dtrain/pre_setup/fit{}/{}"


class PeerFailedBeforeSetup(RuntimeError):
    """Another rank raised before the ranks' setup an error that is no bad input (its traceback is in its output)."""


class SetupRefusalsShared:
    """Mixin for a Lightning strategy of several processes, before ``RankFailureRecords`` (whose ``setup_environment``
    numbers the fit): see the module's docstring. ``_timeout`` bounds the wait, as it bounds Lightning's barrier."""

    _before_pre_setup = False

    def setup_environment(self) -> None:
        super().setup_environment()
        self._before_pre_setup = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    def barrier(self, name: str | None = None, *args, **kwargs):
        if name == "pre_setup" and self._before_pre_setup:
            self._before_pre_setup = False
            raise_a_peers_refusal(getattr(self, "_timeout", None))
        return super().barrier(name, *args, **kwargs)

    def on_exception(self, exception: BaseException) -> None:
        if self._before_pre_setup:  # this rank will not come to the barrier: the others learn why, there
            self._before_pre_setup = False
            leave_refusal(exception)
        super().on_exception(exception)


def leave_refusal(exception: BaseException) -> None:
    """Leave ``exception`` (an ``Exception`` that is not a failed collective) in the store for this fit's
    ``pre_setup`` barrier: pickled where it is a bad input (the other ranks raise the same error), else its line."""
    from lit_dtrain.stops_before_training import StoppedBeforeTraining
    from lit_dtrain.sweeps import user_error

    stopped = isinstance(exception, StoppedBeforeTraining)  # a stop signal to this rank alone (its token cache build)
    if not stopped and (not isinstance(exception, Exception) or is_collective_failure(exception) or isinstance(
            exception, (PeerRankFailedError, FirstConnectionError))):  # (an interruption: the launchers' signals)
        return
    store, rank = _store_and_rank()  # (the group's store: torch private, behind that function)
    if store is None:
        return
    payload = pickle.dumps(exception) if stopped else None
    if (error := None if stopped else user_error(exception)) is not None:
        payload = _pickled_bad_input(error, user_error)
    if payload is None:
        line = f"{failure_line(exception, rank, ' before training')} (its traceback is in that rank's output)"
        payload = pickle.dumps(PeerFailedBeforeSetup(line))
    try:
        store.set(_KEY.format(_records._fit_generation, f"refused/rank{rank}"), payload)
        if stopped:  # this process, which may hold the store, exits at once (an error's line waits for the others')
            seen = [_KEY.format(_records._fit_generation, f"seen/rank{r}") for r in range(dist.get_world_size())
                    if r != rank]
            deadline = time.monotonic() + 2.0
            while not store.check(seen) and time.monotonic() < deadline:
                time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store may be gone: the others' barrier fails as it did
        pass


def _pickled_bad_input(error: BaseException, user_error) -> bytes | None:
    """``error`` pickled, or where its class cannot be built again from its arguments (one of one's own, such as a
    ``CorpusError`` subclass whose ``__init__`` takes other arguments), the same message as the nearest of its base
    classes that is a bad input too: the other ranks give the same one-line error, printed once (it was
    ``PeerFailedBeforeSetup``, no bad input, whose traceback rank 1 printed beside rank 0's labelled line, and which
    said that rank 0's traceback was in its output: there was none), or one built again from its arguments with
    another message. None where no such class is found."""
    for cls in type(error).__mro__:
        try:
            copy = error if cls is type(error) else cls(str(error))
            if user_error(copy) is not copy:
                continue
            payload = pickle.dumps(copy)
            # built again with another message (an __init__ whose second argument has a default): rank 1 said 'shard
            # shard 3 is missing from /data/shards is missing from /data/shards' beside rank 0's line
            if str(pickle.loads(payload)) == str(error):
                return payload
        except Exception:  # noqa: BLE001 - not built again from its arguments, or not from a message alone
            continue
    return None


def raise_a_peers_refusal(timeout: timedelta | None) -> None:
    """Wait in the store until every rank has come to this fit's ``pre_setup`` barrier (then return) or one has left
    its refusal (:func:`leave_refusal`: raised here), for ``timeout`` at most; a store that does not answer is left
    to the barrier itself."""
    store, rank = _store_and_rank()
    if store is None:
        return
    world_size = dist.get_world_size()
    arrived, refused = _KEY.format(_records._fit_generation, "arrived"), [
        _KEY.format(_records._fit_generation, f"refused/rank{r}") for r in range(world_size) if r != rank]
    deadline = time.monotonic() + (timeout.total_seconds() if timeout is not None else 1800.0)
    refusal = None
    try:
        store.add(arrived, 1)
        while refusal is None and store.add(arrived, 0) < world_size and time.monotonic() < deadline:
            if found := next((key for key in refused if store.check([key])), None):
                refusal = store.get(found)
                store.set(_KEY.format(_records._fit_generation, f"seen/rank{rank}"), "1")
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store does not answer: the barrier fails as it did
        return
    if refusal is not None:
        peers = pickle.loads(refusal)
        with contextlib.suppress(AttributeError):  # not left for the others again: its rank is leaving with the store
            peers.left_by_a_peer = True
        raise peers
