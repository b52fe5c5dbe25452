"""2 gloo ranks of ``train.py trainer=ddp_cpu``, each sent SIGTERM in ``ModelCheckpoint.on_train_start``: after
Lightning's handler is registered, before ``PreemptionCheckpoint``'s own would have been (its ``on_train_start`` is
the last). Lightning's handler broadcasts inside itself, and rank 1 ran it twice (its own signal and rank 0's
forwarded copy) to rank 0's once: the extra broadcast met rank 0's next collective, and the ranks then waited in
unlike collectives until ``strategy.collective_timeout_s`` (1800 s by default), to exit with no checkpoint. A single
process saves at step 1 and exits 143; so do both ranks now."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests.conftest import PYTHON, ROOT, TINY, subprocess_env

# train.py, with a SIGTERM that each rank sends itself in ModelCheckpoint.on_train_start once both ranks are there
# (Lightning launches rank 1 as sys.argv again: this script, not train.py)
WRAPPER = '''
import os, signal, sys
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

_on_train_start = ModelCheckpoint.on_train_start

def on_train_start(self, trainer, pl_module):
    if not getattr(on_train_start, "sent", False):
        on_train_start.sent = True
        dist.barrier()
        os.kill(os.getpid(), signal.SIGTERM)
    return _on_train_start(self, trainer, pl_module)

ModelCheckpoint.on_train_start = on_train_start
sys.path.insert(0, {root!r})
train_py = os.path.join({root!r}, "train.py")
exec(compile(open(train_py).read(), train_py, "exec"), {{"__name__": "__main__", "__file__": train_py}})
'''


# train.py, with a SIGTERM to rank 0 alone as it comes to the strategy's barrier("run-stage"): Lightning has just
# registered its handler, and no callback hook runs before the barrier (nor, without a sanity check, before the data's
# setup and on_train_start); Lightning's handler forwards it to rank 1, once rank 1 is at that barrier too (its
# handler registered: sent earlier, rank 1 stops before training, 143, and rank 0's barrier fails, exit 1; the CI
# run at stop 50 met that race)
RUN_STAGE_WRAPPER = '''
import os, signal, sys, time
from lightning.pytorch.strategies.ddp import DDPStrategy

_barrier = DDPStrategy.barrier
MARK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank1_at_run_stage")  # beside this script

def barrier(self, name=None, *args, **kwargs):
    if name == "run-stage" and not getattr(barrier, "sent", False):
        barrier.sent = True
        if self.global_rank == 1:
            open(MARK, "w").close()
        else:
            deadline = time.monotonic() + 120
            while not os.path.exists(MARK) and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGTERM)
    return _barrier(self, name, *args, **kwargs)

DDPStrategy.barrier = barrier
sys.path.insert(0, {root!r})
train_py = os.path.join({root!r}, "train.py")
exec(compile(open(train_py).read(), train_py, "exec"), {{"__name__": "__main__", "__file__": train_py}})
'''


@pytest.mark.slow
@pytest.mark.parametrize("wrapper_text", [WRAPPER, RUN_STAGE_WRAPPER], ids=["on_train_start", "run_stage_barrier"])
def test_a_sigterm_in_an_earlier_callbacks_on_train_start_saves_on_both_ranks(tmp_path: Path, corpus, wrapper_text):
    """run_stage_barrier: rank 0 ran Lightning's handler once, rank 1 twice; the ranks waited in unlike collectives
    and exited 1 after collective_timeout_s, 'error: rank 0: a collective failed before training (... Timed out
    waiting 30000ms for send operation to complete)', no checkpoint. PreemptionCheckpoint now takes the signals as
    soon as Lightning has registered its handler."""
    wrapper = tmp_path / "signalled_train.py"
    wrapper.write_text(wrapper_text.format(root=str(ROOT)))
    cmd = [PYTHON, str(wrapper), *TINY, "sample.max_new_tokens=0", "trainer=ddp_cpu", "run_name=r", "data=textfiles",
           f"data.sources.0.paths=[{corpus}]", "strategy.collective_timeout_s=30"]  # (a hang ends, failed, in 30 s)
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True,
                          timeout=200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 143, out[-3000:]
    assert "SIGTERM received: saved " in out and "last.ckpt at step 1; exiting cleanly" in out, out[-3000:]
    assert sorted(line.split(" - ", 1)[1] for line in out.splitlines() if "] exiting with status" in line) == [
        f"[rank: {r}] exiting with status 143 (stopped by SIGTERM, not finished)" for r in (0, 1)], out[-3000:]
    ckpt = tmp_path / "outputs" / "runs" / "r" / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, map_location="cpu", weights_only=False)["global_step"] == 1
