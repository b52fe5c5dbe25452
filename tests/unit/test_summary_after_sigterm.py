"""A run stopped by SIGTERM after its last step writes no summary.json; the resume=auto that follows only validates
last.ckpt. Its summary.json had train_loss and tokens_per_sec null: the checkpoint now carries them (TrainClock's
state) from the fit that trained the steps. Then its tokens_per_sec was the killed fit's and its wall_seconds the
validating start's own (0.25 s beside 768 tokens at 1682 tokens/s, 0.46 s of training): both are the killed
fit's now."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch


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

    clock = torch.load(Path(cfg.paths.checkpoint_dir) / "last.ckpt", weights_only=True)["callbacks"]["TrainClock"]
    assert summary["wall_seconds"] == pytest.approx(clock["wall_seconds"]), (summary, clock)  # the killed fit's
    train_seconds = 4 * cfg.data.batch_size * cfg.model.block_size / summary["tokens_per_sec"]
    assert 0 < train_seconds <= summary["wall_seconds"], summary  # its training within its fit
    assert summary.keys() >= {"val_loss", "val_ppl"} and "val/ppl" not in summary  # the perplexity once


def test_a_resume_that_only_validates_reports_one_fits_figures_and_says_so_once(tmp_path, caplog):
    """A 2-rank resume of a finished run printed 'the checkpoint is already at step 6 = trainer.max_steps: nothing to
    train, only validated' once per rank. The figures are the finished run's summary.json's, else the checkpoint's:
    its tokens/s and its wall time together, or neither (a checkpoint that kept no wall time)."""
    from types import SimpleNamespace

    from lit_dtrain.train_callbacks import TrainClock, figures_of_the_fit_that_trained

    figures = {"tokens_per_sec": 100.0, "wall_seconds": 9.0, "train_loss": 2.0}
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 4, "val_loss": 3.0, **figures}))
    for zero, lines in ((False, 0), (True, 1)):
        caplog.clear()
        with caplog.at_level("INFO", logger="lit_dtrain.train"):
            trainer = SimpleNamespace(global_step=4, is_global_zero=zero)
            assert figures_of_the_fit_that_trained(trainer, tmp_path, TrainClock(), 128) == figures
        assert len(caplog.records) == lines, caplog.records
    trainer = SimpleNamespace(global_step=6, is_global_zero=True)  # that summary.json is of step 4: not this end's
    clock = TrainClock()
    clock.load_state_dict({"train_loss": 2.5, "start_step": 2, "train_seconds": 0.5})  # an older checkpoint's state
    assert figures_of_the_fit_that_trained(trainer, tmp_path, clock, 128) == {"train_loss": 2.5}
    clock.load_state_dict({"train_loss": 2.5, "start_step": 2, "train_seconds": 0.5, "wall_seconds": 0.8})
    assert figures_of_the_fit_that_trained(trainer, tmp_path, clock, 128) == {
        "train_loss": 2.5, "tokens_per_sec": 4 * 128 / 0.5, "wall_seconds": 0.8, "tokens": 4 * 128, "start_step": 2}


def test_a_resume_that_only_validates_reports_the_tokens_its_fit_counted():
    """The checkpoint's tokens (an epoch's short last steps: 10 micro-batches of 128 in 6 steps of 2), not 6 full
    steps: 12 micro-batches' worth, 20 % over."""
    from types import SimpleNamespace

    from lit_dtrain.train_callbacks import TrainClock, figures_of_the_fit_that_trained

    clock = TrainClock()
    clock.load_state_dict({"train_loss": 2.5, "start_step": 0, "train_seconds": 0.5, "wall_seconds": 0.8,
                           "tokens": 10 * 128})
    trainer = SimpleNamespace(global_step=6, is_global_zero=False)
    figures = figures_of_the_fit_that_trained(trainer, Path("/nonexistent"), clock, 2 * 128)
    assert figures["tokens_per_sec"] == 10 * 128 / 0.5


def test_a_resume_that_only_validates_keeps_the_start_its_figures_are_of(tiny_cfg):
    """A sweep job (or run) finished in one start, then continued with resume=auto (the documented way to continue a
    killed sweep): its summary.json kept the fit's wall_seconds and tokens_per_sec but took the validating start's
    tokens 0 and start_step 4, so compare_runs.py gave its wall time as '(since step 4)' and its summary said 0
    tokens beside a rate. They describe the one fit that trained now: from step 0, all its tokens."""
    from lit_dtrain.train import train

    common = ("trainer.max_steps=4", "trainer.val_check_interval=2", "sample.max_new_tokens=0")
    cfg = tiny_cfg(*common)
    train(cfg)
    first = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
    assert first["start_step"] == 0 and first["tokens"] == 4 * cfg.data.batch_size * cfg.model.block_size
    train(tiny_cfg(*common, "resume=auto"))
    again = json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())
    keys = ("tokens", "start_step", "tokens_per_sec", "wall_seconds", "train_loss", "steps")
    assert {k: again[k] for k in keys} == {k: first[k] for k in keys}


def test_a_sigterm_in_a_finished_runs_sample_is_said_and_leaves_it_finished(tiny_cfg, caplog):
    """A SIGTERM in the end-of-run sample came after the ranks' last check for one, and was recorded without a word
    (in a sweep, the next jobs then ran: tests/e2e/test_sweeps.py). A single run is finished: train() returns, with
    its summary.json, says the signal came, and gives SIGTERM its handler from before back."""
    import logging

    from lit_dtrain.train import train

    cfg = tiny_cfg("+callbacks.fault._target_=tests.faults.SignalInSample")
    before = signal.getsignal(signal.SIGTERM)
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.train"):
        metrics, _ = train(cfg)
    assert metrics["steps"] == 6 and (Path(cfg.paths.output_dir) / "summary.json").is_file()
    assert "SIGTERM came after the run finished (summary.json is written): nothing was left to stop" in caplog.text
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_sigterm_in_a_fast_dev_runs_sample_does_not_say_summary_json_is_written(tiny_cfg, caplog, monkeypatch):
    """A fast_dev_run writes no summary.json and no checkpoint: the line said '(summary.json is written)' of a run dir
    holding only train.log, and in a sweep '(its finished jobs are only validated again)', where resume=auto finds
    no checkpoint and runs them again (as it did: 'resume=auto: no .../0/checkpoints/last.ckpt yet, starting fresh')."""
    import logging

    import lit_dtrain.sweeps
    from lit_dtrain.sigterm_exit import stop_after_a_late_sigterm
    from lit_dtrain.train import train

    cfg = tiny_cfg("+trainer.fast_dev_run=true", "+callbacks.fault._target_=tests.faults.SignalInSample")
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.train"):
        metrics, _ = train(cfg)
    assert metrics["steps"] == 1 and not (Path(cfg.paths.output_dir) / "summary.json").exists()
    said = "SIGTERM came after the run finished (fast_dev_run: no summary.json): nothing was left to stop"
    assert said in caplog.text and "summary.json is written" not in caplog.text
    caplog.clear()
    monkeypatch.setattr(lit_dtrain.sweeps, "in_multirun", lambda: True)
    monkeypatch.setattr("lit_dtrain.sigterm_exit.train_resume_hint", lambda run_name: "<hint>")
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.train"), pytest.raises(SystemExit) as stop:
        stop_after_a_late_sigterm(smoke_test=True)
    assert stop.value.code == 143
    assert ("stopped by SIGTERM after this job finished (fast_dev_run: no summary.json): the sweep's later jobs do not "
            "start; resume with <hint> (its finished jobs run again)") in caplog.text


@pytest.mark.parametrize("fault", [["SignalAfterFit"], ["SignalInValidation", "+callbacks.fault.step=1"]])
def test_a_signal_after_a_fast_dev_runs_fit_does_not_say_last_ckpt_is_saved(tiny_cfg, fault, caplog):
    """A fast_dev_run saves no last.ckpt: a SIGTERM after its fit (or in its final validation) said 'stopped by
    SIGTERM after the last step (1), whose last.ckpt is saved: resume with ... to validate it and write summary.json'
    of a run dir holding only train.log."""
    from lit_dtrain.train import train

    cfg = tiny_cfg("+trainer.fast_dev_run=true", f"+callbacks.fault._target_=tests.faults.{fault[0]}", *fault[1:])
    with pytest.raises(SystemExit) as stop:
        train(cfg)
    assert stop.value.code == 143 and not Path(cfg.paths.checkpoint_dir, "last.ckpt").exists()
    said = ("stopped by SIGTERM at step 1 without a checkpoint (fast_dev_run: PreemptionCheckpoint saves none): "
            f"{cfg.paths.checkpoint_dir} holds no resumable checkpoint: a resume has nothing to continue")
    assert said in caplog.text
    assert "last.ckpt is saved" not in caplog.text


def test_a_sigterm_in_the_sample_cuts_it_and_the_summary_comes_at_once(tiny_cfg, caplog):
    """The end-of-run sample went on to its last token after a SIGTERM (3000 tokens of a tiny model: 223 s to the
    exit under load, 25 s without a sample): past Slurm's 30 s grace the SIGKILL took the finished run before its
    summary.json. The signal cuts the sample: the model runs no more tokens, the summary is written, a line says where
    to sample the saved weights, and a bf16-true model is cast back from the fp32 it was sampled in."""
    import logging

    from lit_dtrain.train import train

    cfg = tiny_cfg("sample.max_new_tokens=400", "trainer.precision=bf16-true",
                   "+callbacks.count._target_=tests.unit.test_summary_after_sigterm.CountSampleTokens",
                   "+callbacks.fault._target_=tests.faults.SignalInSample")
    CountSampleTokens.tokens.clear()
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.train"):
        metrics, objects = train(cfg)
    assert len(CountSampleTokens.tokens) == 1  # the forward the signal came in (400 without the cut)
    assert metrics["steps"] == 6 and (Path(cfg.paths.output_dir) / "summary.json").is_file()
    ckpt = Path(cfg.paths.checkpoint_dir) / "last.ckpt"
    assert (f"no text sample: SIGTERM came while it was drawn; sample the saved weights: python scripts/generate.py "
            f"{ckpt}") in caplog.text
    assert "SIGTERM came after the run finished (summary.json is written)" in caplog.text
    assert {p.dtype for p in objects["model"].parameters()} == {torch.bfloat16}


class CountSampleTokens(L.Callback):
    """Count the model's forwards after ``train()``'s final validation (the end-of-run sample's tokens, one each)."""

    tokens: list = []

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "validate":
            model = getattr(pl_module.model, "_orig_mod", pl_module.model)
            model.tok_embeddings.register_forward_pre_hook(lambda *args: self.tokens.append(1))


def test_a_sigterm_before_the_sample_does_not_say_it_came_while_it_was_drawn(tiny_cfg, caplog):
    """A SIGTERM after the ranks' last agreement, while summary.json's unigram entropy was counted, skips the sample,
    which was then said to be cut: 'SIGTERM came while it was drawn' of a sample that never started."""
    import logging

    from lit_dtrain.train import train

    cfg = tiny_cfg("sample.max_new_tokens=400",
                   "+callbacks.count._target_=tests.unit.test_summary_after_sigterm.CountSampleTokens",
                   "+callbacks.fault._target_=tests.unit.test_summary_after_sigterm.SignalInUnigramEntropy")
    CountSampleTokens.tokens.clear()
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.train"):
        train(cfg)
    assert not CountSampleTokens.tokens  # not drawn at all
    assert "no text sample: SIGTERM came before it was drawn; sample the saved weights" in caplog.text
    assert "while it was drawn" not in caplog.text


class SignalInUnigramEntropy(L.Callback):
    """Send SIGTERM to this process in ``unigram_entropy`` after ``train()``'s final validation (before the sample)."""

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.state.fn == "validate":
            count = trainer.datamodule.unigram_entropy

            def signalled():
                os.kill(os.getpid(), signal.SIGTERM)
                return count()

            trainer.datamodule.unigram_entropy = signalled
