"""What the programs in ``scripts/`` share beyond their flags and errors (:mod:`lit_dtrain.utils.args`)."""

from __future__ import annotations

import sys
from pathlib import Path


def import_beside(script_file: str) -> None:
    """Let the script whose ``__file__`` is ``script_file`` import the modules beside it (``scripts/compare_runs.py``
    its ``scripts/_compare_runs_labels.py``): put its dir on ``sys.path``. Python puts it there when the script runs
    as ``python scripts/compare_runs.py``, but not where a test (or another program) loads the script by its path
    with ``importlib.util.spec_from_file_location``."""
    here = str(Path(script_file).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)


def rotated(names: list, i: int) -> list:
    """``names`` rotated left by ``i`` (``[b, c, a]`` for ``i = 1``): the order of a benchmark's variants in round
    ``i``, so that over consecutive rounds each runs first once. A fixed order gave the first variant every round's
    cold start (the first run in the process, a cold cache): ``bench_optim_diag.py``'s ``none`` ran first, and with a
    new token cache its step ratios read 0.63-0.70 at ``--steps 2 --repeats 1``."""
    k = i % len(names)
    return names[k:] + names[:k]
