"""A run stopped by SIGTERM after its last step writes no summary.json; the resume=auto that follows only validates
last.ckpt. Its summary.json had train_loss and tokens_per_sec null: the checkpoint now carries them (TrainClock's
state) from the fit that trained the steps."""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import pytest


def test_a_resume_after_a_sigterm_past_the_last_step_keeps_the_training_figures(tiny_cfg):
    from lit_dtrain.train import train

    common = ("trainer.max_steps=4", "trainer.val_check_interval=2", "sample.max_new_tokens=0")
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # (the default would end this process)
    try:
        with pytest.raises(SystemExit) as stop:
            train(tiny_cfg(*common, "+callbacks.fault._target_=tests.faults.SignalAfterFit"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stop.value.code == 143
    cfg = tiny_cfg(*common, "resume=auto")
    metrics, _ = train(cfg)
    summary = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
    assert summary["steps"] == 4
    assert math.isfinite(summary["train_loss"]) and 0 < summary["train_loss"] < 10, summary
    assert summary["tokens_per_sec"] is not None and summary["tokens_per_sec"] > 0, summary
