"""The scripts piped into a reader that stops early (``| head -n 2``): they end as ``cat`` does, without a traceback."""

from __future__ import annotations

import pytest

from tests.unit.test_script_checkpoint_errors import ROOT, _script, _tiny_checkpoint


def test_generate_piped_into_head_ends_quietly_as_cat_does(tmp_path):
    """`generate.py CKPT ... | head -n 2`: the write after head had gone ended in BrokenPipeError's traceback, status
    1. Now the script ends as cat does, killed by SIGPIPE (status 141 in a shell), without a traceback. Run as its own
    Python whose stdout is a pipe with no reader (Python ignores SIGPIPE there, as in a shell's pipeline). Not a fork
    of pytest: a forked child's first OpenMP region waited for good on the parent's thread team (the CPU attention
    kernel in the full suite)."""
    import os
    import signal
    import subprocess
    import sys

    ckpt = _tiny_checkpoint(tmp_path / "tiny.ckpt")
    read_end, write_end = os.pipe()
    os.close(read_end)  # head has gone
    try:
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), str(ckpt), "--prompt", "ab",
                               "--max-new-tokens", "2", "--device", "cpu"],
                              stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert proc.returncode == -signal.SIGPIPE, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("name", ["generate", "compare_runs", "spectrum"])
def test_every_script_whose_output_is_piped_ends_quietly_when_the_reader_goes(name):
    """`compare_runs.py RUNS | head -n 1` ended in BrokenPipeError's traceback, status 1, as generate.py did: the
    scripts that print tables or text run inside the same wrapper (the generate test above shows what it does)."""
    from lit_dtrain.utils.args import quiet_when_the_reader_goes

    main = _script(name).main
    assert main.__code__ is quiet_when_the_reader_goes(lambda: None).__code__, f"{name}.main is not wrapped"
