"""2 gloo ranks of ``train.py trainer=ddp_cpu`` stopped while rank 0 waits for rank 1 to connect (Lightning's launcher:
rank 1 is rank 0's child, still importing or building its model). Torch's rendezvous waits in C++, where no Python
handler runs: a SIGTERM to rank 0 there was acted on only once rank 1 connected, and rank 1 then printed torch's
TCPStore C++ traces and 'error: rank 1: a collective failed before training (DistNetworkError: Failed to recv ...)',
exit 1; a SIGTERM to rank 1 alone ended rank 0 with 137 and no line (Lightning's observer of its child ranks). Both
now stop every rank with 143 and its line (``lit_dtrain.strategies._rendezvous``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, ROOT, TINY, subprocess_env

# rank 1 waits in its model build (StopsBeforeTraining's handler registered) until a signal ends the wait, having
# said it is there; with SIGNAL_RANK_1, it sends itself SIGTERM there. Rank 0 sends itself SIGTERM once rank 1 is in
# its model build and rank 0 in its strategy's setup_environment, where it waits for rank 1 to connect.
WRAPPER = '''
import os, signal, sys, threading, time
import lit_dtrain.train as T
from lit_dtrain.strategies._connect import FirstConnection

MARK, SIGNAL_RANK_1 = {mark!r}, {signal_rank_1!r}
if os.environ.get("LOCAL_RANK", "0") == "1":
    _instantiate = T.instantiate

    def instantiate(cfg, *args, **kwargs):
        if str(cfg.get("_target_", "")).startswith("lit_dtrain.models"):
            open(MARK, "w").close()
            if SIGNAL_RANK_1:
                os.kill(os.getpid(), signal.SIGTERM)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.05)
        return _instantiate(cfg, *args, **kwargs)

    T.instantiate = instantiate
elif not SIGNAL_RANK_1:
    _setup_environment = FirstConnection.setup_environment

    def when_rank_1_builds():
        while not os.path.exists(MARK):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    def setup_environment(self):
        threading.Thread(target=when_rank_1_builds, daemon=True).start()
        return _setup_environment(self)

    FirstConnection.setup_environment = setup_environment
sys.path.insert(0, {root!r})
train_py = os.path.join({root!r}, "train.py")
exec(compile(open(train_py).read(), train_py, "exec"), {{"__name__": "__main__", "__file__": train_py}})
'''


def _run(tmp_path: Path, corpus: Path, signal_rank_1: bool) -> tuple[subprocess.CompletedProcess, str]:
    wrapper = tmp_path / "signalled_train.py"
    wrapper.write_text(WRAPPER.format(root=str(ROOT), mark=str(tmp_path / "rank1_builds"), signal_rank_1=signal_rank_1))
    cmd = [PYTHON, str(wrapper), *TINY, "sample.max_new_tokens=0", "trainer=ddp_cpu", "run_name=r", "data=textfiles",
           f"data.sources.0.paths=[{corpus}]"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True,
                          timeout=240)
    return proc, proc.stdout + proc.stderr


def _lines(out: str, marker: str) -> list[str]:
    return sorted(line.split(" - ", 1)[1] for line in out.splitlines() if marker in line)


RANK_1_STOPPED = ("[rank: 1] stopped by SIGTERM before training (a new run): nothing trained; run the same command "
                  "again to start it; exiting with status 143 (not finished)")
RANK_0_STOPPED = ("stopped by SIGTERM before training (a new run): nothing trained, no checkpoint written; run the "
                  "same command again to start it")


@pytest.mark.slow
@pytest.mark.parametrize("signal_rank_1", [False, True], ids=["rank_0", "rank_1"])
def test_a_sigterm_to_one_rank_while_rank_0_waits_for_rank_1_to_connect_stops_both_with_their_lines(
        tmp_path, corpus, signal_rank_1):
    proc, out = _run(tmp_path, corpus, signal_rank_1)
    assert proc.returncode == 143, out[-3000:]
    assert "error:" not in out and "TCPStore" not in out and "Child process" not in out, out[-3000:]
    assert _lines(out, "before training") == [RANK_1_STOPPED, RANK_0_STOPPED], out[-3000:]
    # (rank 0's exit line lost its label where Lightning's teardown had deleted WORLD_SIZE)
    assert _lines(out, "exiting with status 143 (stopped") == ["[rank: 0] exiting with status 143 (stopped by SIGTERM, "
                                                               "not finished)"], out[-3000:]
    assert _lines(out, "before the ranks connected") == (
        ["rank 1 was stopped by SIGTERM before the ranks connected (exit status 143): this rank stops with it"]
        if signal_rank_1 else []), out[-3000:]
    assert not list((tmp_path / "outputs").rglob("*.ckpt"))  # nothing trained, nothing saved
