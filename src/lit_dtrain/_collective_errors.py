"""A failed collective's one-line error (:class:`CollectiveError`), naming the error a peer rank recorded in the
process group's store (:mod:`lit_dtrain.utils.distributed`)."""

from __future__ import annotations

import contextlib

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

__all__ = ["CollectiveError", "collectives_named"]


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
            launcher = getattr(trainer.strategy, "launcher", None)
            if launcher is not None and hasattr(launcher, "kill"):  # do not wait for a hung child rank (nor be
                kill_launched_ranks(launcher)  # SIGKILLed by Lightning's observer of it, 5 s on: a multirun's job 1)
            named = e if isinstance(e, PeerRankFailedError) else explain_collective_failure(e)
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
