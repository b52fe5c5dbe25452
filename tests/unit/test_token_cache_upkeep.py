"""The token cache's upkeep: the offsets its encoding warnings name, and the bound on how many caches a cache dir
keeps (old caches of an edited corpus are pruned; a cache in use by a live process never is)."""

from __future__ import annotations

import codecs
import signal

import pytest

from lit_dtrain.data import CorpusSource, build_token_cache


def files_source(path, name="x") -> CorpusSource:
    return CorpusSource(name=name, kind="files", paths=[str(path)])


def test_the_offset_of_a_non_utf8_byte_counts_a_byte_order_mark(tmp_path, caplog):
    """A Latin-1 file that starts with a UTF-8 BOM: the warning named the byte 3 before it is (the BOM is left
    out of the text, and the offset was counted in the text); it names the byte's offset in the file now."""
    data = codecs.BOM_UTF8 + "café\n".encode("latin-1") * 400
    (tmp_path / "a.txt").write_bytes(data)
    with caplog.at_level("WARNING"):
        build_token_cache(files_source(tmp_path / "a.txt"), tmp_path / "cache", min_tokens=9, progress=False)
    assert data.index(b"\xe9") == 6
    assert "byte 0xe9 at offset 6" in caplog.text


BUILD_SCRIPT = """
import signal, sys, time
from pathlib import Path
import numpy as np
from lit_dtrain.data import ByteTokenizer, CorpusSource, build_token_cache

root, pause, ignore_hup = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
if ignore_hup:  # as under nohup
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

class SlowTokenizer(ByteTokenizer):  # holds the build inside its temp dir while the test signals
    def encode(self, data, add_eos=False):
        (root / "inside").touch()
        time.sleep(pause)
        return super().encode(data, add_eos=add_eos)

source = CorpusSource(name="x", kind="files", paths=[str(root / "corpus")])
build_token_cache(source, root / "cache", min_tokens=9, tokenizer=SlowTokenizer(), progress=False)
print("built")
"""


def _start_build(tmp_path, pause: float, ignore_hup: bool = False):
    import os
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT, make_corpus

    make_corpus(tmp_path / "corpus", n_files=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", BUILD_SCRIPT, str(tmp_path), str(pause), str(int(ignore_hup))],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "inside").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the build never started"
        time.sleep(0.05)
    assert [p.name for p in (tmp_path / "cache").iterdir() if ".build-" in p.name]  # its temp dir, mid-build
    return proc


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stop_signal_during_a_cache_build_removes_its_temp_dir(tmp_path, signum):
    """SIGTERM (kill, a scheduler) or SIGHUP (a closed terminal) during a token-cache build ended the process at
    once and left its hidden temp dir, up to twice the corpus' size, until a later build's sweep 10 minutes after.
    The build now removes it, then the signal ends the process as before (killed by that signal)."""
    proc = _start_build(tmp_path, pause=60)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == -signum, err
    assert "built" not in out
    assert list((tmp_path / "cache").iterdir()) == []


def test_an_ignored_sighup_during_a_cache_build_stays_ignored(tmp_path):
    """Under nohup SIGHUP is ignored: the build goes on and the cache is built."""
    proc = _start_build(tmp_path, pause=0.5, ignore_hup=True)
    proc.send_signal(signal.SIGHUP)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "built" in out
    assert [p.name.startswith("x-") for p in (tmp_path / "cache").iterdir()] == [True]
