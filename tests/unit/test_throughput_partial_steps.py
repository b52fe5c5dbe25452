"""The tokens an optimizer step trains where it has fewer micro-batches than ``accumulate_grad_batches``: an epoch's
last step when its batch count is no multiple of them (Lightning steps on an epoch's final batch), and a stop
mid-accumulation, whose micro-batches never step (``train/tokens`` in ``last.ckpt``, which a resume goes on from,
counted them). ``summary.json``'s ``tokens_per_sec`` counted every step as full
(``limit_train_batches=5``, 2 micro-batches a step: 6 steps trained 5120 tokens and it counted 6144, 20 % over)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

COMMON = ("trainer.accumulate_grad_batches=2", "trainer.log_every_n_steps=1", "sample.max_new_tokens=0")


def _clock(objects):
    from lit_dtrain.train_callbacks import TrainClock

    return next(c for c in objects["trainer"].callbacks if isinstance(c, TrainClock))


def _saved(cfg) -> tuple[dict, dict]:
    """last.ckpt's TrainClock and throughput callback states."""
    callbacks = torch.load(Path(cfg.paths.checkpoint_dir) / "last.ckpt", weights_only=True)["callbacks"]
    return callbacks["TrainClock"], next(v for k, v in callbacks.items() if "ThroughputMonitor" in k)


def test_an_epochs_short_last_step_counts_the_tokens_it_trained(tiny_cfg):
    from lit_dtrain.train import train

    cfg = tiny_cfg(*COMMON, "+trainer.limit_train_batches=5")
    metrics, objects = train(cfg)
    micro = cfg.data.batch_size * cfg.model.block_size
    assert metrics["steps"] == 6
    saved, throughput = _saved(cfg)
    summary = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
    # tokens/s x the training seconds: the tokens trained, two epochs of 5 micro-batches in 3 steps each (12 before)
    assert summary["tokens_per_sec"] * saved["train_seconds"] == pytest.approx(10 * micro, rel=0.1)
    assert _clock(objects).tokens == saved["tokens"] == throughput["tokens"] == 10 * micro  # train/tokens' count
    assert (summary["tokens"], summary["start_step"]) == (10 * micro, 0)  # compare_runs' rate without train/tokens


class _StopMidStep(L.Callback):
    """Sets ``should_stop`` after micro-batch 3 of a run with 2 a step (``max_time`` waits for the step's end)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == 2:
            trainer.should_stop = True


def test_a_stop_mid_accumulation_counts_only_the_steps_it_trained(tiny_cfg):
    from lit_dtrain.train import train

    cfg = tiny_cfg(*COMMON, "+callbacks.stop._target_=tests.unit.test_throughput_partial_steps._StopMidStep")
    metrics, objects = train(cfg)
    micro = cfg.data.batch_size * cfg.model.block_size
    assert metrics["steps"] == 1 and metrics["stopped"] == "should_stop"
    saved, throughput = _saved(cfg)
    assert throughput["tokens"] == 2 * micro  # the third micro-batch never stepped (3 counted before)
    # and so do the running totals a resume goes on from, train/batches, train/samples, train/lengths (3 micro-batches,
    # 3 x batch_size, 3 x micro: a resumed run's train/lengths at step 4 was 1024 for 896 tokens trained)
    assert (throughput["batches"], throughput["samples"], throughput["lengths"]) == (2, 2 * cfg.data.batch_size,
                                                                                     2 * micro)
    assert _clock(objects).tokens == saved["tokens"] == 2 * micro  # summary.json's tokens/s counts the same
