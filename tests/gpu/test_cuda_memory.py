"""``MemoryMonitor`` on a CUDA GPU: the allocator's figures, and a peak that is each logging window's own.

    pytest -m gpu tests/gpu/test_cuda_memory.py

Written without a GPU to run it on (stop 45): the CPU half of the monitor is tested in
tests/unit/test_memory_monitor.py, the wiring of the CUDA half there with torch.cuda's counters stood in for.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from lit_dtrain.run_dirs import read_scalars

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

MiB = 1 << 20
BLOCK_MIB = 256


class HoldCudaBlock(L.Callback):
    """Holds ``BLOCK_MIB`` MiB of CUDA memory through optimizer step ``step``; records ``memory_allocated`` at its
    start."""

    def __init__(self, step: int) -> None:
        self.step, self.block, self.allocated_before = int(step), None, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step and self.block is None:
            self.allocated_before = torch.cuda.memory_allocated()
            self.block = torch.ones(BLOCK_MIB * MiB // 4, device="cuda")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.block = None


def test_the_window_peak_shows_a_step_that_held_256_mib_and_the_next_window_does_not(tiny_cfg) -> None:
    from lit_dtrain.train import train

    _, objs = train(tiny_cfg("trainer.accelerator=gpu", "trainer.devices=1", "trainer.log_every_n_steps=2",
                             "trainer.max_steps=6", "sample.max_new_tokens=0",
                             "+callbacks.hold._target_=tests.gpu.test_cuda_memory.HoldCudaBlock",
                             "+callbacks.hold.step=3"))
    hold = next(c for c in objs["trainer"].callbacks if isinstance(c, HoldCudaBlock))
    tb = {tag: dict(rows) for tag, rows in read_scalars(Path(objs["trainer"].default_root_dir)).items()
          if tag.startswith("memory/")}
    keys = ["memory/cuda_allocated_mib", "memory/cuda_peak_allocated_mib", "memory/cuda_reserved_mib",
            "memory/peak_rss_mib", "memory/rss_mib"]
    assert sorted(tb) == keys and all(sorted(tb[k]) == [1, 3, 5] for k in keys), tb
    peak = tb["memory/cuda_peak_allocated_mib"]
    assert peak[3] >= hold.allocated_before / MiB + BLOCK_MIB  # the block is in its window's peak
    assert tb["memory/cuda_allocated_mib"][3] >= BLOCK_MIB  # and still allocated at the row (freed after it)
    assert peak[5] <= peak[3] - BLOCK_MIB + 1  # reset after the row: the next window's peak is without it
    assert all(tb["memory/cuda_reserved_mib"][s] >= tb["memory/cuda_allocated_mib"][s] for s in (1, 3, 5))
