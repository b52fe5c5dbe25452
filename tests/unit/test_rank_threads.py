"""torch's intra-op threads on each CPU rank: lit_dtrain sets none itself and relies on Lightning's launcher.

``python train.py trainer=ddp_cpu`` re-launches ``train.py`` for rank 1 through Lightning's
``_SubprocessScriptLauncher``, whose ``launch`` (on every rank, before fit) gives torch ``max(1, cores // local
ranks)`` threads where ``OMP_NUM_THREADS`` is unset and leaves an explicit one alone (``_set_num_threads_if_needed``).
On the 2-core machine each of the 2 ranks ran 1 thread; with ``OMP_NUM_THREADS=2`` (2 threads per rank) the same
30-step run trained at 68 tokens/s instead of ~1600-2150 (``scripts/bench_threads.py``, docs/benchmarks.md "Torch
threads per rank"). These tests pin that the Trainer ``train()`` builds for 2 CPU processes (``strategy=auto``, a
compressed preset) gets that behaviour, without starting a process: its launcher is called as on a rank started from
outside (``LOCAL_RANK`` set), which sets the threads the same way. With the launcher's call removed they fail
(2 threads, not 1, on 2 cores).
"""

from __future__ import annotations

import os

import pytest
import torch


class _Launched(Exception):
    pass


def _threads_at_launch(tiny_cfg, monkeypatch, strategy: str, run: str) -> int:
    """The intra-op threads rank 1 of a 2-process ``trainer=ddp_cpu`` run has when its launcher starts fit."""
    import lit_dtrain.train as train_module

    def fit(trainer, *args):
        raise _Launched(trainer.strategy.launcher.launch(torch.get_num_threads))

    monkeypatch.setattr(train_module, "_fit", fit)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a rank started from outside: its launcher starts no other process
    with pytest.raises(_Launched) as reached:
        train_module.train(tiny_cfg("trainer=ddp_cpu", strategy, "sample.max_new_tokens=0", run=run))
    return reached.value.args[0]


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("strategy", ["strategy=auto", "strategy=ddp_compressed/int8"])
def test_each_cpu_rank_gets_its_share_of_the_cores_when_omp_num_threads_is_unset(tiny_cfg, monkeypatch, strategy,
                                                                                  restore_threads):
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # recorded, so that the value the launcher exports is undone
    monkeypatch.delenv("OMP_NUM_THREADS")
    torch.set_num_threads(cores)  # what a process started without OMP_NUM_THREADS has
    assert _threads_at_launch(tiny_cfg, monkeypatch, strategy, "unset") == max(1, cores // 2)
    assert os.environ["OMP_NUM_THREADS"] == str(max(1, cores // 2))  # and what the rank's own subprocesses inherit


def test_an_explicit_omp_num_threads_is_left_as_it_is(tiny_cfg, monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    torch.set_num_threads(3)  # what torch reads from OMP_NUM_THREADS=3 at start
    assert _threads_at_launch(tiny_cfg, monkeypatch, "strategy=auto", "explicit") == 3
