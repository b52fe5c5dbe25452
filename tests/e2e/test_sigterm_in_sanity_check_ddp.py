"""2 gloo ranks of ``train.py trainer=ddp_cpu trainer.num_sanity_val_steps=2``, sent SIGTERM in the sanity check's
first batch: Lightning's handler, the one there, broadcasts inside itself, once on rank 0 and twice on rank 1 (its own
signal and rank 0's forwarded copy); the ranks then waited in unlike collectives until ``strategy.collective_timeout_s``
and exited with 1 (rank 0: ``error: rank 0: a collective failed before training (... Connection closed by peer``).
``PreemptionCheckpoint`` takes the signals at the sanity check's start, and the ranks agree at its end: both stop
there with 143, as a single process does, with nothing trained."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, ROOT, TINY, subprocess_env

# train.py, with a stop signal that the ranks of RANKS send themselves in the sanity check's first validation batch
# (Lightning launches rank 1 as sys.argv again: this script, not train.py)
WRAPPER = '''
import os, signal, sys
import torch.distributed as dist
from lit_dtrain.module import LitLLM

_validation_step = LitLLM.validation_step

def validation_step(self, *args, **kwargs):
    if self.trainer.sanity_checking and not getattr(validation_step, "sent", False):
        validation_step.sent = True
        dist.barrier()
        if self.trainer.global_rank in {ranks!r}:
            os.kill(os.getpid(), signal.{signal})
    return _validation_step(self, *args, **kwargs)

LitLLM.validation_step = validation_step
sys.path.insert(0, {root!r})
train_py = os.path.join({root!r}, "train.py")
exec(compile(open(train_py).read(), train_py, "exec"), {{"__name__": "__main__", "__file__": train_py}})
'''


@pytest.mark.slow
@pytest.mark.parametrize(("ranks", "name"), [((0, 1), "SIGTERM"), ((1,), "SIGHUP")])
def test_a_stop_signal_in_the_sanity_check_stops_both_ranks_before_training(tmp_path: Path, corpus, ranks, name):
    wrapper = tmp_path / "signalled_train.py"
    wrapper.write_text(WRAPPER.format(root=str(ROOT), ranks=ranks, signal=name))
    cmd = [PYTHON, str(wrapper), *TINY, "sample.max_new_tokens=0", "trainer=ddp_cpu", "run_name=r", "data=textfiles",
           f"data.sources.0.paths=[{corpus}]", "trainer.num_sanity_val_steps=2", "trainer.limit_val_batches=2",
           "strategy.collective_timeout_s=30"]  # (a hang ends, failed, in 30 s)
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True,
                          timeout=200)
    out = proc.stdout + proc.stderr
    status = 143 if name == "SIGTERM" else 129
    assert proc.returncode == status, out[-3000:]
    assert "collective failed" not in out, out[-3000:]
    assert sorted(line.split(" - ", 1)[1] for line in out.splitlines() if "] exiting with status" in line) == [
        f"[rank: {r}] exiting with status {status} (stopped by {name}, not finished)" for r in (0, 1)], out[-3000:]
    assert f"stopped by {name} at step 0 without a checkpoint" in out, out[-3000:]
    assert not list((tmp_path / "outputs").rglob("*.ckpt"))  # nothing trained, nothing saved
