"""lit_dtrain destroys the default process group at exit for every backend (Lightning does so for NCCL only)."""

from __future__ import annotations

import subprocess
import textwrap

import pytest

from tests.conftest import PYTHON, ROOT

SCRIPT = textwrap.dedent("""
    import atexit, sys
    import torch.distributed as dist

    # registered first, so it runs last (atexit is LIFO): what the interpreter's own teardown will meet
    atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
    from lit_dtrain.utils.distributed import destroy_process_group_at_exit

    before = atexit._ncallbacks()
    if sys.argv[2] == "1":
        destroy_process_group_at_exit()
        destroy_process_group_at_exit()  # once per process, however often it is called
    print("handlers added:", atexit._ncallbacks() - before, flush=True)
""")


@pytest.mark.parametrize("register", [True, False])
def test_the_gloo_group_is_destroyed_before_the_interpreter_exits(tmp_path, register):
    """A gloo group left alive can abort the process at exit (SIGABRT, "terminate called without an active
    exception"): 2 of 20 two-rank scripts here, and one CI run of ``train.py -m`` with DDP."""
    proc = subprocess.run([PYTHON, "-c", SCRIPT, str(tmp_path / "store"), "1" if register else "0"],
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert f"initialized at exit: {not register}" in lines, proc.stdout
    assert f"handlers added: {int(register)}" in lines, proc.stdout
