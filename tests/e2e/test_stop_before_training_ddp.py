"""2 gloo ranks of ``train.py trainer=ddp_cpu``, each sent SIGTERM in the fit's setup (before Lightning's handler):
the lines each rank gives. Before, a fresh start's ranks and a resume's rank 1 took SIGTERM's default action: exit
-15 (a shell's 143) and no line; only rank 0 of a resume said why (``LogsKeptUntilTraining``)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import PYTHON, ROOT, TINY, subprocess_env

# train.py, with a SIGTERM that each rank sends itself in LMDataModule.setup("fit") once both ranks are there (Lightning
# launches rank 1 as sys.argv again: this script, not train.py)
WRAPPER = '''
import os, signal, sys
import torch.distributed as dist
from lit_dtrain.data.datamodule import LMDataModule

_setup = LMDataModule.setup

def setup(self, stage=None):
    if stage == "fit":
        dist.barrier()
        os.kill(os.getpid(), signal.SIGTERM)
    return _setup(self, stage)

LMDataModule.setup = setup
sys.path.insert(0, {root!r})
train_py = os.path.join({root!r}, "train.py")
exec(compile(open(train_py).read(), train_py, "exec"), {{"__name__": "__main__", "__file__": train_py}})
'''


def _run(tmp_path: Path, corpus: Path, *args: str) -> subprocess.CompletedProcess:
    wrapper = tmp_path / "signalled_train.py"
    wrapper.write_text(WRAPPER.format(root=str(ROOT)))
    cmd = [PYTHON, str(wrapper), *TINY, "sample.max_new_tokens=0", "trainer=ddp_cpu", "run_name=r", "data=textfiles",
           f"data.sources.0.paths=[{corpus}]", *args]
    return subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True,
                          timeout=240)


def _lines(proc: subprocess.CompletedProcess, marker: str) -> list[str]:
    return [line.split(" - ", 1)[1] for line in (proc.stdout + proc.stderr).splitlines() if marker in line]


@pytest.mark.slow
def test_a_sigterm_in_a_fresh_starts_setup_is_said_on_every_rank(tmp_path, corpus):
    proc = _run(tmp_path, corpus)
    assert proc.returncode == 143, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(_lines(proc, "before training")) == [
        "[rank: 1] stopped by SIGTERM before training (a new run): nothing trained; run the same command again to "
        "start it; exiting with status 143 (not finished)",
        "stopped by SIGTERM before training (a new run): nothing trained, no checkpoint written; run the same command "
        "again to start it",
    ], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _lines(proc, "] exiting with status") == ["[rank: 0] exiting with status 143 (stopped by SIGTERM, not "
                                                     "finished)"]
    assert not list((tmp_path / "outputs").rglob("*.ckpt"))  # nothing trained, nothing saved
