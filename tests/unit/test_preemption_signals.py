"""Ctrl-C (SIGINT) and a closed terminal (SIGHUP) stop ``train(cfg)`` as SIGTERM does: last.ckpt at the end of the
current optimizer step, exit status 128 + the signal, a line naming where it stopped; where nothing saves (the
final validation, the sample, a second Ctrl-C) a line names the checkpoint ``resume=auto`` continues from."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import pytest
import torch

from lit_dtrain.train import train


def kill_at(step: int, sig: str, key: str = "fault") -> list[str]:
    return [f"+callbacks.{key}._target_=tests.faults.KillAtStep", f"+callbacks.{key}.step={step}",
            f"+callbacks.{key}.signal={sig}"]


@pytest.mark.parametrize(("sig", "status"), [("SIGINT", 130), ("SIGHUP", 129)])
def test_ctrl_c_or_a_closed_terminal_mid_training_saves_the_step_and_exits_128_plus_the_signal(
    tiny_cfg, sig, status, caplog
):
    """Ctrl-C went to Lightning's KeyboardInterrupt path: 'Detected KeyboardInterrupt, attempting graceful
    shutdown ...', exit status 1, no checkpoint: every step since the last validation lost without a word. SIGHUP
    killed the process (-1), also with nothing saved. Both now save last.ckpt at the end of the step and exit with
    130 / 129; resume=auto continues from there, and the caller's handlers are back when train() ends."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGHUP)
    cfg = tiny_cfg("trainer.max_steps=6", "trainer.val_check_interval=6", *kill_at(2, sig))
    with pytest.raises(SystemExit) as stop:
        train(cfg)
    assert stop.value.code == status
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGHUP)) == before
    out = Path(cfg.paths.output_dir)
    assert not (out / "summary.json").exists()
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 3
    saved = f"{sig} received: saved {out / 'checkpoints' / 'last.ckpt'} at step 3; exiting cleanly"
    assert f"{saved}. Resume with resume=auto (same run_name" in caplog.text
    metrics, _ = train(tiny_cfg("trainer.max_steps=6", "trainer.val_check_interval=6", "resume=auto"))
    assert metrics["steps"] == 6


def test_ctrl_c_in_the_final_validation_exits_130_and_names_the_checkpoint_to_resume(tiny_cfg, caplog):
    """Lightning catches the KeyboardInterrupt in trainer.validate, ends with sys.exit(1) and leaves SIGINT ignored
    (signal.SIG_IGN) in the calling process for good. Now: exit status 130, one line naming the final last.ckpt
    that resume=auto continues from, and the SIGINT handler from before train()."""
    before = signal.getsignal(signal.SIGINT)
    fault = ["+callbacks.fault._target_=tests.faults.SignalInValidation", "+callbacks.fault.step=4",
             "+callbacks.fault.stage=validate", "+callbacks.fault.signal=SIGINT"]
    cfg = tiny_cfg("trainer.max_steps=4", "trainer.val_check_interval=4", *fault)
    with pytest.raises(SystemExit) as stop:
        train(cfg)
    assert stop.value.code == 130
    assert signal.getsignal(signal.SIGINT) is before
    last = Path(cfg.paths.checkpoint_dir) / "last.ckpt"
    assert f"interrupted by SIGINT (Ctrl-C); resume=auto continues from {last} (step 4)" in caplog.text
    metrics, _ = train(tiny_cfg("trainer.max_steps=4", "trainer.val_check_interval=4", "resume=auto"))
    assert metrics["steps"] == 4 and json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())


def test_a_second_ctrl_c_stops_at_once_and_says_nothing_was_saved(tiny_cfg, caplog):
    """A second Ctrl-C while the save is pending is the user's hard stop: KeyboardInterrupt at once (Lightning's
    shutdown), exit status 130 and a line saying there is no checkpoint (before: exit status 1, no word on it)."""
    cfg = tiny_cfg("trainer.max_steps=6", "trainer.val_check_interval=6", *kill_at(2, "SIGINT"),
                   *kill_at(2, "SIGINT", key="fault2"))
    with pytest.raises(SystemExit) as stop:
        train(cfg)
    assert stop.value.code == 130
    assert not (Path(cfg.paths.checkpoint_dir) / "last.ckpt").exists()
    assert "interrupted by SIGINT (Ctrl-C); no checkpoint in" in caplog.text


def test_ctrl_c_during_the_sample_exits_130_not_with_a_traceback(tiny_cfg, caplog, monkeypatch):
    """A KeyboardInterrupt outside Lightning (here the end-of-run sample; also the config checks before the trainer)
    came out of train() as a traceback. Now it is the same line and status as above."""
    import lit_dtrain.train as train_module

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "_generate_sample", interrupted)
    cfg = tiny_cfg("trainer.max_steps=2", "trainer.val_check_interval=2")
    with pytest.raises(SystemExit) as stop:
        train(cfg)
    assert stop.value.code == 130
    last = Path(cfg.paths.checkpoint_dir) / "last.ckpt"
    assert f"resume=auto continues from {last} (step 2)" in caplog.text


def test_ctrl_c_in_a_multirun_job_names_the_sweep_dir_to_resume(tmp_path, corpus, caplog):
    """Ctrl-C in a sweep job's end-of-run sample said only "resume=auto continues from <job 0's last.ckpt>": under -m
    a bare resume=auto is refused, it needs the sweep's hydra.sweep.dir, which the SIGTERM lines name."""
    from lit_dtrain.sigterm_exit import interrupted_by_ctrl_c
    from tests.unit._sweep_helpers import multirun_job

    sweep = tmp_path / "sweep"
    with multirun_job(sweep / "0", ["seed=1,2"], ["seed=1"], corpus) as cfg:
        assert interrupted_by_ctrl_c(cfg.paths.checkpoint_dir) == 130
    assert (f"interrupted by SIGINT (Ctrl-C); no checkpoint in {sweep / '0' / 'checkpoints'}: a new start trains from "
            f"step 0; resume with the same -m arguments and resume=auto hydra.sweep.dir={sweep}") in caplog.text


def test_ctrl_c_outside_training_labels_its_exit_line_with_the_rank(tmp_path, monkeypatch, caplog):
    """Ctrl-C to a 2-worker torchrun in its start-up (or in the end-of-run sample): each worker wrote the same
    unlabelled 'exiting with status 130' line, not saying whose it was; as the SIGTERM line, it has the rank now, and
    the 'interrupted by SIGINT' line is rank 0's alone."""
    from lightning.pytorch.utilities import rank_zero_only

    from lit_dtrain.sigterm_exit import interrupted_by_ctrl_c

    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's, before any process group
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    with caplog.at_level(logging.INFO):
        assert interrupted_by_ctrl_c(str(tmp_path / "checkpoints")) == 130
    # rank 0 alone says what was kept (each of 2 torchrun workers wrote the same unlabelled 'interrupted by SIGINT')
    assert caplog.messages == ["[rank: 1] exiting with status 130 (interrupted, not finished)"]
    monkeypatch.setenv("WORLD_SIZE", "1")  # a single process: as before
    caplog.clear()
    with caplog.at_level(logging.INFO):
        interrupted_by_ctrl_c(str(tmp_path / "checkpoints"))
    assert "exiting with status 130 (interrupted, not finished)" in caplog.messages


@pytest.mark.parametrize("fault", [["SignalAfterFit"], ["SignalInValidation", "+callbacks.fault.step=4"]])
def test_a_closed_terminal_after_fit_or_in_the_final_validation_exits_129_naming_sighup(tiny_cfg, fault, caplog):
    """SIGHUP after fit (while last.ckpt is saved) or in train()'s final validation, which SigtermRecorder records,
    was named SIGTERM: 'stopped by SIGTERM after the last step (4) ...', exit status 143 where PreemptionCheckpoint
    gives a SIGHUP in training 129."""
    cfg = tiny_cfg("trainer.max_steps=4", "trainer.val_check_interval=4", f"+callbacks.fault._target_=tests.faults."
                   f"{fault[0]}", *fault[1:], "+callbacks.fault.signal=SIGHUP")
    with pytest.raises(SystemExit) as stop:
        train(cfg)
    assert stop.value.code == 129
    assert "stopped by SIGHUP after the last step (4), whose last.ckpt is saved" in caplog.text
    assert not (Path(cfg.paths.output_dir) / "summary.json").exists()


@pytest.mark.parametrize("written", ["{tmp}/r1/last.ckpt", "~/r1/last.ckpt"])
def test_ctrl_c_before_a_start_from_another_runs_checkpoint_names_that_checkpoint(tmp_path, monkeypatch, caplog,
                                                                                  written):
    """Ctrl-C in the setup of ``train.py run_name=r2 ckpt_path=<r1's step-4 last.ckpt>`` said "no checkpoint in
    .../r2/checkpoints: a new start trains from step 0", where the same command starts again from that file; so it
    did for ``ckpt_path="~/r1.ckpt"``, which the start reads with ``~`` expanded."""
    from lit_dtrain.sigterm_exit import interrupted_by_ctrl_c

    monkeypatch.setenv("HOME", str(tmp_path))
    given = tmp_path / "r1" / "last.ckpt"
    given.parent.mkdir()
    given.write_bytes(b"a checkpoint")
    written = written.format(tmp=tmp_path)
    assert interrupted_by_ctrl_c(str(tmp_path / "r2" / "checkpoints"), written) == 130
    assert (f"interrupted by SIGINT (Ctrl-C); no checkpoint in {tmp_path / 'r2' / 'checkpoints'}: the same command "
            f"starts again from ckpt_path={written}") in caplog.text


def test_ctrl_c_before_a_decay_branch_trained_names_decay_branch_ckpt(tiny_cfg, caplog):
    """Ctrl-C in the setup of a branch (``decay_branch.ckpt=<a's step-4 last.ckpt> decay_branch.steps=2``) said "the
    same command starts again from ckpt_path=<file>": the branch sets ckpt_path itself, and a ckpt_path given beside
    it is refused ('set either decay_branch.ckpt or ckpt_path'). It names the key the command gave."""
    cfg = tiny_cfg("trainer.max_steps=4", "trainer.val_check_interval=4", run="a")
    train(cfg)
    source = Path(cfg.paths.checkpoint_dir) / "last.ckpt"
    branch = tiny_cfg(f"decay_branch.ckpt={source}", "decay_branch.steps=2", "trainer.val_check_interval=2",
                      "+callbacks.stop._target_=tests.faults.SignalInSetup", "+callbacks.stop.signal=SIGINT", run="b")
    with pytest.raises(SystemExit) as stop:
        train(branch)
    assert stop.value.code == 130
    assert (f"no checkpoint in {branch.paths.checkpoint_dir}: the same command starts again from "
            f"decay_branch.ckpt={source}") in caplog.text
