"""A failed collective's one-line error (:class:`CollectiveError`), naming the error a peer rank recorded in the
process group's store (:mod:`lit_dtrain.utils.distributed`)."""

from __future__ import annotations

import contextlib
import re
import signal

import lightning as L

from lit_dtrain.utils.distributed import (
    PeerRankFailedError,
    explain_collective_failure,
    fit_position,
    is_collective_failure,
    only_interruptions,
    record_rank_failure,
)
from lit_dtrain.utils.launcher_watch import kill_launched_ranks

__all__ = ["CollectiveError", "collectives_named", "interrupting_signal"]


class CollectiveError(RuntimeError):
    """A collective failed or timed out: another rank died, hung, or the network broke."""


@contextlib.contextmanager
def collectives_named(trainer: L.Trainer, record: bool = False):
    """A failed collective in the block raises :class:`CollectiveError`, naming the error a peer rank recorded; with
    ``record`` (after ``fit``, whose strategy's ``on_exception`` records) this rank's own error is left for the others:
    rank 0's disk full in the final ``last.ckpt`` left rank 1 with gloo's traceback, 'Connection closed by peer'."""
    try:
        yield
    except BaseException as e:
        where = fit_position(trainer)  # ' at step N'; before training, the step being resumed (global_step reads 0)
        if trainer.world_size > 1 and isinstance(e, RuntimeError) and (
                is_collective_failure(e) or isinstance(e, PeerRankFailedError)):
            named = e if isinstance(e, PeerRankFailedError) else explain_collective_failure(e)
            signum = _stopped_before_training(trainer, named.failures)
            launcher = getattr(trainer.strategy, "launcher", None)
            if launcher is not None and hasattr(launcher, "kill"):  # do not wait for a hung child rank (nor be
                # SIGKILLed by Lightning's observer of it, 5 s on: a multirun's job 1); one stopped by a signal ends
                kill_launched_ranks(launcher, grace_s=0.0 if signum is None else 5.0)  # by itself, with its line
            if signum is not None:  # peers stopped by a signal before training: this rank's stop, not its failure
                raise _stop(signum) from e
            # gloo's error under a strategy's PeerRankFailedError, whose text is a line like this one ('rank 0: a
            # collective failed before training (PeerRankFailedError: rank 0: a collective failed (RuntimeError: ...')
            failed = e.__cause__ if isinstance(e, PeerRankFailedError) and e.__cause__ is not None else e
            if named.failures:  # a rank that raised alone: its error, not 'another rank probably died or hung'
                fix = "" if only_interruptions(named.failures) else "fix that rank's error. "  # (Ctrl-C: no error)
                raise CollectiveError(
                    f"rank {trainer.global_rank}: {'; '.join(f.rstrip('. ') for f in named.failures)}; this rank's "
                    f"next collective then failed{where} ({type(failed).__name__}: "
                    f"{str(failed).splitlines()[0][:200]}): {fix}Resume with resume=auto."
                ) from e
            raise CollectiveError(
                f"rank {trainer.global_rank}: a collective failed{where} "
                f"({type(failed).__name__}: {str(failed).splitlines()[0][:300]}). Another rank probably died or hung; "
                "the collective timeout is strategy.collective_timeout_s. Resume with resume=auto."
            ) from e
        if record and isinstance(e, (Exception, KeyboardInterrupt)):
            record_rank_failure(e, where)
        raise


def interrupting_signal(failures) -> int | None:
    """The highest stop signal that the lines of ranks that were only interrupted name (``failure_line``: a signal's
    name, Lightning's ``SIGTERMException`` for SIGTERM, ``KeyboardInterrupt`` for SIGINT); None where a line is an
    error's, or there is none."""
    if not only_interruptions(failures):
        return None
    named = {"SIGTERMException": signal.SIGTERM, "KeyboardInterrupt": signal.SIGINT}
    found = [re.search(r"\((\w+)\)$", f.rstrip(". ")) for f in failures]
    signums = [named.get(m.group(1)) or getattr(signal, m.group(1), None) if m else None for m in found]
    return None if None in signums else int(max(signums))


def _stopped_before_training(trainer: L.Trainer, failures) -> int | None:
    """The stop signal to exit with where the peers that this rank's failed collective names were only stopped by a
    signal before training (and this rank's fit has not trained either), the highest of theirs and this rank's own, or
    by Ctrl-C in a validation (``train()``'s final one: SIGINT, for train()'s 130 naming the checkpoint); else None.
    A SIGTERM to rank 1 alone in the fit's setup (or rank 0's, forwarded to rank 1 before its handler was registered)
    ended rank 1 with 143 and rank 0 with 1, 'error: rank 0: rank 1 was interrupted before training (SIGTERM); this
    rank's next collective then failed'."""
    signum = interrupting_signal(failures)
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    before_training = fn == "fit" and not getattr(trainer.strategy, "training_started", True)
    # train()'s final validation, where a peer's SIGTERM is only recorded: a Ctrl-C to rank 1 alone ended rank 0 with
    # 1, 'error: rank 0: rank 1 was interrupted at step 6 (KeyboardInterrupt); this rank's next collective then failed'
    if fn == "validate" and signum == signal.SIGINT:
        return signum
    if signum is None or not before_training:
        return None
    from lit_dtrain.callbacks.preemption import PreemptionCheckpoint

    own = [c.signum for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint) and c.signum]
    return max([signum, *own])


def _stop(signum: int) -> BaseException:
    """What a stop by ``signum`` before training raises: ``KeyboardInterrupt`` for SIGINT (``train()`` says it and
    exits 130), else ``StoppedBeforeTraining`` (128 + the signal, with its line)."""
    from lit_dtrain.stops_before_training import StoppedBeforeTraining

    return KeyboardInterrupt() if signum == signal.SIGINT else StoppedBeforeTraining(signum)
