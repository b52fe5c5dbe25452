"""A token-cache build stopped by SIGTERM or SIGHUP removes its temp dir before the process ends.

Their default action ends the process at once, with no ``finally`` run: a build stopped by ``kill``, a closed
terminal or a scheduler's SIGTERM left its hidden temp dir (up to twice the corpus' size) until a later build's
sweep removed it, 10 minutes after its builder died. While the build runs, a signal whose action is the default
unwinds it instead (its ``finally`` removes the temp dir), and the signal is then sent again with its default
action, so the process ends as it did (status 143 or 129). A signal with a handler of its own (Lightning's, the
run's) or ignored (``nohup``) is left to it.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


class _StopSignal(BaseException):
    """Raised by the handler in the build; not an Exception, so that no ``except Exception`` swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextmanager
def unwound_by_stop_signals():
    """Within the block, SIGTERM and SIGHUP (where their action is the default) raise in the main thread, so the
    block's ``finally`` clauses run; on leaving, the handlers are put back and the signal is delivered again."""
    if threading.current_thread() is not threading.main_thread():  # signal.signal works in the main thread only
        yield
        return
    received: list[int] = []

    def on_signal(signum, frame):
        if not received:  # a second signal while the first unwinds (in an rmtree) must not cut the cleanup short
            received.append(signum)
            raise _StopSignal(signum)

    previous = {}
    for signum in STOP_SIGNALS:
        if signal.getsignal(signum) is signal.SIG_DFL:
            previous[signum] = signal.signal(signum, on_signal)
    try:
        yield
    except _StopSignal:
        pass
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:  # the default action again: the process ends as the signal would have ended it
        os.kill(os.getpid(), received[0])
        raise SystemExit(128 + received[0])  # only if the signal is blocked in this thread
