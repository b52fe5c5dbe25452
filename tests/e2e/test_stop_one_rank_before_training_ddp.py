"""2 gloo ranks of ``train.py trainer=ddp_cpu`` where a stop signal reaches rank 1 alone before training: rank 1 in
the fit's setup, or rank 0's SIGTERM at Lightning's ``barrier("run-stage")``, forwarded to a rank 1 that has not
registered its handler yet. Rank 1 stopped with 143 and its line; rank 0's next collective failed and it exited 1,
'error: rank 0: rank 1 was interrupted before training (SIGTERM); this rank's next collective then failed ...'. Both
ranks now stop with 143 and the stop's line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, ROOT, TINY, subprocess_env

# rank 1 alone sends itself SIGTERM in LMDataModule.setup("fit"), after the ranks' pre_setup barrier (Lightning
# launches rank 1 as sys.argv again: this script, not train.py)
IN_SETUP = '''
import os, signal
from lit_dtrain.data.datamodule import LMDataModule

_setup = LMDataModule.setup

def setup(self, stage=None):
    if stage == "fit" and self.trainer.global_rank == 1:
        os.kill(os.getpid(), signal.SIGTERM)
    return _setup(self, stage)

LMDataModule.setup = setup
'''

# rank 0 sends itself SIGTERM at barrier("run-stage"), its handler registered (PreemptionCheckpoint's forwards it to
# rank 1); rank 1 waits before registering its own until that copy comes (StopsBeforeTraining's handler ends the wait)
AT_RUN_STAGE = '''
import os, signal, time
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector

_barrier, _register = DDPStrategy.barrier, _SignalConnector.register_signal_handlers

def barrier(self, name=None, *args, **kwargs):
    if name == "run-stage" and self.global_rank == 0 and not getattr(barrier, "sent", False):
        barrier.sent = True
        os.kill(os.getpid(), signal.SIGTERM)
    return _barrier(self, name, *args, **kwargs)

def register_signal_handlers(self):
    if self.trainer.global_rank == 1:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            time.sleep(0.05)
    return _register(self)

DDPStrategy.barrier, _SignalConnector.register_signal_handlers = barrier, register_signal_handlers
'''

TRAIN = '''
import os, sys
sys.path.insert(0, {root!r})
train_py = os.path.join({root!r}, "train.py")
exec(compile(open(train_py).read(), train_py, "exec"), {{"__name__": "__main__", "__file__": train_py}})
'''


@pytest.mark.slow
@pytest.mark.parametrize("patch", [IN_SETUP, AT_RUN_STAGE], ids=["rank1_in_setup", "forwarded_at_run_stage"])
def test_a_stop_signal_to_rank_1_alone_before_training_stops_both_ranks(tmp_path: Path, corpus, patch):
    wrapper = tmp_path / "signalled_train.py"
    wrapper.write_text(patch + TRAIN.format(root=str(ROOT)))
    cmd = [PYTHON, str(wrapper), *TINY, "sample.max_new_tokens=0", "trainer=ddp_cpu", "run_name=r", "data=textfiles",
           f"data.sources.0.paths=[{corpus}]", "strategy.collective_timeout_s=30"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True,
                          timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 143, out[-3000:]
    assert "error:" not in out, out[-3000:]
    assert sorted(line.split(" - ", 1)[1] for line in out.splitlines() if "before training" in line) == [
        "[rank: 1] stopped by SIGTERM before training (a new run): nothing trained; run the same command again to "
        "start it; exiting with status 143 (not finished)",
        "stopped by SIGTERM before training (a new run): nothing trained, no checkpoint written; run the same command "
        "again to start it",
    ], out[-3000:]
    assert [line.split(" - ", 1)[1] for line in out.splitlines() if "] exiting with status" in line] == [
        "[rank: 0] exiting with status 143 (stopped by SIGTERM, not finished)"], out[-3000:]
    assert not list((tmp_path / "outputs").rglob("*.ckpt"))  # nothing trained, nothing saved
