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


# train.py, with a SIGTERM to rank 0 alone as it builds the token cache (prepare_data: rank 0's, before the ranks'
# pre_setup barrier, where rank 1 waits)
CACHE_WRAPPER = '''
import os, signal, sys
import lit_dtrain.data.token_cache as token_cache

_tokenize_into = token_cache._tokenize_into

def tokenize_into(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return _tokenize_into(*args, **kwargs)

token_cache._tokenize_into = tokenize_into
sys.path.insert(0, {root!r})
train_py = os.path.join({root!r}, "train.py")
exec(compile(open(train_py).read(), train_py, "exec"), {{"__name__": "__main__", "__file__": train_py}})
'''


@pytest.mark.slow
def test_a_sigterm_to_rank_0_in_its_token_cache_build_stops_rank_1_too(tmp_path, corpus):
    """Rank 1 waited at the barrier in the store of rank 0's process, which had exited: torch's TCPStore warnings (two
    C++ stack traces), then 'error: rank 1: a collective failed before training (... Connection closed by peer ...)
    ... Resume with resume=auto', exit 1 (rank 0's 143 was the launch's status)."""
    wrapper = tmp_path / "signalled_train.py"
    wrapper.write_text(CACHE_WRAPPER.format(root=str(ROOT)))
    cmd = [PYTHON, str(wrapper), *TINY, "sample.max_new_tokens=0", "trainer=ddp_cpu", "run_name=r", "data=textfiles",
           f"data.sources.0.paths=[{corpus}]", "strategy.collective_timeout_s=30"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True,
                          timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 143, out[-3000:]
    assert "error:" not in out and "TCPStore" not in out, out[-3000:]
    assert "[rank: 1] stopped by SIGTERM before training (a new run): nothing trained; run the same command again to " \
           "start it; exiting with status 143 (not finished)" in _lines(proc, "before training"), out[-3000:]
    assert not [p for p in (tmp_path / "token_cache").rglob("*") if ".build-" in p.name]  # its temp dir removed
