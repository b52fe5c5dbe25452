"""PreemptionCheckpoint in a LightningModule of one's own: the checkpoint written on SIGTERM holds the state at the end
of the optimizer step, after every other callback has finished that step, whatever the callback order."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.utils.data import DataLoader

from lit_dtrain.callbacks import LossSpikeMonitor, PreemptionCheckpoint
from tests.toys import TinyMLP

SPIKE = 15  # the last optimizer step of epoch 0 (16 batches): a resume starts a fresh epoch, as the straight run does


class Own(TinyMLP):
    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        return loss * 100.0 if self.trainer.global_step == SPIKE else loss

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
        return DataLoader([{"x": x[i], "y": y[i], "index": torch.tensor(i)} for i in range(64)], batch_size=4)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class SigtermAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step, self.sent = step, False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and not self.sent:
            self.sent = True
            os.kill(os.getpid(), signal.SIGTERM)


def fit(tmp_path: Path, callbacks, ckpt_path=None) -> Own:
    module = Own()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=24, callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(module, ckpt_path=ckpt_path)
    return module


@pytest.mark.parametrize("action", ["skip", "rollback"])
def test_sigterm_during_a_spike_step_checkpoints_the_finished_step(tmp_path: Path, action: str) -> None:
    """Listed before LossSpikeMonitor (as in ``callbacks=[default,loss_spike]``), PreemptionCheckpoint saved inside
    its own on_train_batch_end, before the monitor's had recorded the spike: the checkpoint held num_spikes 0, no
    excluded samples and (rollback) the weights that were not rolled back, and the resumed run trained on the spike's
    samples again and ended elsewhere than the straight run."""

    def monitor():
        return LossSpikeMonitor(actions=[action], warmup_steps=5, snapshot_every=4, path=str(tmp_path / "s.jsonl"))

    straight_monitor = monitor()
    with pytest.warns(UserWarning, match="no sampler with exclude"):
        straight = fit(tmp_path, [straight_monitor])
    assert [e["step"] for e in straight_monitor.events] == [SPIKE] and straight_monitor.excluded == [60, 61, 62, 63]

    preemption = PreemptionCheckpoint(str(tmp_path / "ckpt"))
    with pytest.raises(SIGTERMException), pytest.warns(UserWarning, match="no sampler with exclude"):
        fit(tmp_path, [preemption, monitor(), SigtermAt(SPIKE)])
    assert preemption.saved_step == SPIKE + 1
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)["callbacks"]["LossSpikeMonitor"]
    assert state["num_spikes"] == 1 and state["excluded"].tolist() == [60, 61, 62, 63]

    resumed_monitor = monitor()
    with pytest.warns(UserWarning, match="no sampler with exclude"):
        resumed = fit(tmp_path, [resumed_monitor], ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed_monitor.num_spikes == 1 and resumed_monitor.excluded == straight_monitor.excluded
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


def test_ranks_agree_once_per_optimizer_step_and_save_at_its_end(tmp_path: Path) -> None:
    """Under DDP the ranks agree on 'any rank signalled' with one all-reduce at the last micro-batch of each optimizer
    step (before: one per micro-batch, 4 per step here), and a signal that comes mid-accumulation is saved at the
    step's end. A stand-in trainer counts the all-reduces: Lightning's CPU DDP runs them for real in
    tests/e2e/test_reliability.py."""
    from types import SimpleNamespace

    accumulate, decisions, saved = 4, [], []
    batch = {"idx": 0}
    trainer = SimpleNamespace(
        world_size=2, received_sigterm=False, global_step=0,
        strategy=SimpleNamespace(reduce_boolean_decision=lambda d, all=True: decisions.append(d) or d),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(
            _should_accumulate=lambda: (batch["idx"] + 1) % accumulate != 0)),
        _signal_connector=SimpleNamespace(received_sigterm=False), checkpoint_callbacks=[], max_steps=-1,
        save_checkpoint=lambda path, weights_only=False: saved.append((path, trainer.global_step)),
    )
    callback = PreemptionCheckpoint(dirpath=str(tmp_path))
    for idx in range(12):
        batch["idx"] = idx
        trainer.global_step = (idx + 1) // accumulate  # the optimizer step ran at the window's last micro-batch
        if idx == 5:  # SIGTERM during step 1's second micro-batch (what the signal handler records)
            callback.signalled = True
        callback.on_train_batch_end(trainer, None, None, None, idx)
        if idx == 6:
            assert not saved and not trainer._signal_connector.received_sigterm  # mid-step: no save, no exit yet
        if idx == 7:
            break
    assert decisions == [False, True]  # one all-reduce per optimizer step, the second with the signal
    assert saved == [(os.path.join(str(tmp_path), "last.ckpt"), 2)]  # at the end of the step it came in
    assert trainer._signal_connector.received_sigterm  # every rank now leaves the loop


def test_a_reused_callback_does_not_carry_a_signal_into_the_next_fit(tmp_path: Path) -> None:
    """The same PreemptionCheckpoint object in a second fit (a requeued job in one process, a sweep) starts with no
    signal. Before, its ``signalled`` flag from the first fit's SIGTERM stayed set: the second fit saved and stopped
    at its first step."""
    preemption = PreemptionCheckpoint(str(tmp_path / "ckpt"))
    with pytest.raises(SIGTERMException):
        fit(tmp_path, [preemption, SigtermAt(3)])
    assert preemption.saved_step == 4
    module = fit(tmp_path, [preemption])  # no signal this time: trains to max_steps
    assert module.trainer.global_step == 24 and preemption.saved_step is None


@pytest.mark.parametrize("preemption", [True, False])
def test_train_stopped_by_sigterm_exits_with_status_143_not_0(tiny_cfg, preemption, caplog):
    """A run that SIGTERM stopped has not finished. Lightning's SIGTERMException is a SystemExit with status 0, so
    ``train.py && compare_runs``, SLURM's ``afterok`` and a multirun's exit status read a preempted run as done.
    train() exits with 143 (128 + SIGTERM, what a shell reports for a process SIGTERM ended), writes no summary, and
    says so when no checkpoint was saved on the way out."""
    from lit_dtrain.train import train

    fault = ["+callbacks.fault._target_=tests.faults.KillAtStep", "+callbacks.fault.step=2",
             "+callbacks.fault.signal=SIGTERM"]
    off = [] if preemption else ["callbacks.preemption=null"]
    cfg = tiny_cfg("trainer.max_steps=6", "trainer.val_check_interval=6", *fault, *off)
    with pytest.raises(SystemExit) as stop:
        train(cfg)
    assert stop.value.code == 143
    out = Path(cfg.paths.output_dir)
    assert not (out / "summary.json").exists()
    saved = out / "checkpoints" / "last.ckpt"
    if preemption:
        assert torch.load(saved, weights_only=True)["global_step"] == 3  # the step during which the signal came
        assert "without a checkpoint" not in caplog.text
    else:
        assert not saved.exists()
        assert "stopped by SIGTERM at step" in caplog.text and "without a checkpoint" in caplog.text


@pytest.mark.parametrize("step", [0, 2], ids=["before_the_first_validation", "in_a_step_that_ends_with_one"])
def test_a_resume_after_a_stop_keeps_one_last_checkpoint(tiny_cfg, step):
    """ModelCheckpoint versions a last.ckpt it did not write itself: after a SIGTERM before the first validation,
    the resumed run wrote last-v1.ckpt at every validation, a full copy beside last.ckpt; after one in a step that
    ends with a (one-batch) validation, last-v1.ckpt came at once and the resume left last-v2.ckpt and the first
    step file too. PreemptionCheckpoint's last.ckpt is now ModelCheckpoint's last."""
    from lit_dtrain.train import train

    fault = ["+callbacks.fault._target_=tests.faults.KillAtStep", f"+callbacks.fault.step={step}",
             "+callbacks.fault.signal=SIGTERM"]
    cfg = tiny_cfg("trainer.max_steps=6", "trainer.val_check_interval=3", *fault)
    with pytest.raises(SystemExit):
        train(cfg)
    metrics, _ = train(tiny_cfg("trainer.max_steps=6", "trainer.val_check_interval=3", "resume=auto"))
    names = sorted(p.name for p in (Path(cfg.paths.checkpoint_dir)).iterdir())
    assert metrics["steps"] == 6 and names == ["last.ckpt", f"step000006-val{metrics['val_loss']:.4f}.ckpt"], names


@pytest.mark.parametrize("step", [2, 5], ids=["a_middle_step", "the_last_step"])
def test_a_sigterm_in_a_step_that_ends_with_a_validation_lets_it_run_in_full(tiny_cfg, step):
    """A SIGTERM during a step that ends with a validation (of several batches): Lightning's flag cut the validation
    after its first batch, and the resumed run took the step as validated: no val/loss at that step (metrics.csv) and
    no ModelCheckpoint file of it, so after one in the last step the run dir kept step 3's file (val 5.1267) as the
    best, where a straight run keeps step 6's (val 4.8636). The validation now runs in full before the fit stops with
    143; the run dir holds what a straight run's does."""
    import csv

    from lit_dtrain.train import train

    fault = ["+callbacks.fault._target_=tests.faults.KillAtStep", f"+callbacks.fault.step={step}",
             "+callbacks.fault.signal=SIGTERM"]
    run = ["trainer.max_steps=6", "trainer.val_check_interval=3", "data.max_val_windows=16", "data.val_batch_size=4",
           "logger=csv"]
    cfg = tiny_cfg(*run, *fault)
    with pytest.raises(SystemExit) as stop:
        train(cfg)
    assert stop.value.code == 143 and not (Path(cfg.paths.output_dir) / "summary.json").exists()
    metrics, _ = train(tiny_cfg(*run, "resume=auto"))
    straight, _ = train(tiny_cfg(*run, run="straight"))
    names = sorted(p.name for p in (Path(cfg.paths.checkpoint_dir)).iterdir())
    assert names == ["last.ckpt", f"step000006-val{straight['val_loss']:.4f}.ckpt"], names
    assert metrics["val_loss"] == straight["val_loss"]

    def val_points(run_dir: Path) -> list:
        rows = csv.DictReader(next(run_dir.rglob("metrics.csv")).open())
        return [(r["step"], r["val/loss"]) for r in rows if r.get("val/loss")]

    # at the last step also the final validation of the resume at max_steps (it logged at step 5, not 6)
    assert val_points(Path(cfg.paths.output_dir)) == val_points(Path(cfg.paths.output_dir).parent / "straight")


def test_a_sigterm_between_fit_and_the_final_validation_exits_with_143_and_the_handler_comes_back(tiny_cfg, caplog):
    """When fit ends Lightning puts back the SIGTERM handler from before it, so a SIGTERM in on_fit_end, while the
    final last.ckpt was written or the ranks agreed went to that handler: the default one killed the process (-15;
    under DDP the other rank then failed in its next collective), a handler of the caller's was called and the run
    went on to its validation and summary. Now it is recorded and train() exits with 143 after the final last.ckpt;
    the caller's handler is back when train() ends."""
    import signal

    from lit_dtrain.train import train

    callers = []

    def callers_handler(signum, frame):  # stands for the default handler, which would end this test process
        callers.append(signum)

    previous = signal.signal(signal.SIGTERM, callers_handler)
    try:
        cfg = tiny_cfg("trainer.max_steps=4", "trainer.val_check_interval=2",
                       "+callbacks.fault._target_=tests.faults.SignalAfterFit")
        with pytest.raises(SystemExit) as stop:
            train(cfg)
        assert signal.getsignal(signal.SIGTERM) is callers_handler
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stop.value.code == 143 and callers == []
    out = Path(cfg.paths.output_dir)
    assert not (out / "summary.json").exists()
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    assert "stopped by SIGTERM after the last step (4), whose last.ckpt is saved" in caplog.text


@pytest.mark.parametrize("stage", ["fit", "validate"])
def test_a_sigterm_during_the_last_validation_also_exits_with_status_143(tiny_cfg, stage, caplog):
    """A SIGTERM during the validation at the last step (inside fit: PreemptionCheckpoint's handler only records it,
    and no batch ends after it) was ignored: the run went on to its final validation, sample and summary, and in a
    multirun the next job started, still under the preemption. One during train()'s final trainer.validate ended
    it with Lightning's SIGTERMException, exit status 0. Both exit with 143 after the final last.ckpt is saved,
    before the final validation; resume=auto only validates that checkpoint and writes the summary."""
    from lit_dtrain.train import train

    fault = [
        "+callbacks.fault._target_=tests.faults.SignalInValidation",
        "+callbacks.fault.step=6",
        f"+callbacks.fault.stage={stage}",
    ]
    # several validation batches: Lightning's evaluation loop acts on a SIGTERM before a batch that is not the last
    cfg = tiny_cfg("trainer.max_steps=6", "trainer.val_check_interval=3", "data.val_batch_size=2", *fault)
    with pytest.raises(SystemExit) as stop:
        train(cfg)
    assert stop.value.code == 143
    out = Path(cfg.paths.output_dir)
    assert not (out / "summary.json").exists()
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 6
    assert "stopped by SIGTERM after the last step (6), whose last.ckpt is saved" in caplog.text
    metrics, _ = train(tiny_cfg("trainer.max_steps=6", "trainer.val_check_interval=3", "resume=auto"))
    assert metrics["steps"] == 6 and json.loads((out / "summary.json").read_text())["steps"] == 6


def test_a_rank_that_got_no_signal_stops_with_the_signal_of_the_rank_that_did(tmp_path: Path, monkeypatch) -> None:
    """Ctrl-C to rank 0 alone (``kill -INT <pid>``; SIGINT is not forwarded): rank 1 stopped with it at the agreed
    step but logged 'exiting with status 143 (stopped by SIGTERM ...)'. The ranks now agree on the signal (all_gather,
    once, when they stop), so rank 1 exits with 130 too."""
    from types import SimpleNamespace

    from lit_dtrain.sigterm_exit import stopped_by_sigterm

    gathered = []

    def all_gather(t):  # rank 0 got SIGINT (2), this rank none (0)
        gathered.append(int(t))
        return torch.tensor([int(signal.SIGINT), int(t)])

    monkeypatch.setattr("lit_dtrain.callbacks.preemption.all_gather_stacked", all_gather)
    trainer = SimpleNamespace(
        world_size=2, received_sigterm=False, global_step=3,
        strategy=SimpleNamespace(reduce_boolean_decision=lambda d, all=True: True),
        fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(_should_accumulate=lambda: False)),
        _signal_connector=SimpleNamespace(received_sigterm=False),
        save_checkpoint=lambda path, weights_only=False: None, checkpoint_callbacks=[], max_steps=-1,
    )
    callback = PreemptionCheckpoint(dirpath=str(tmp_path))
    callback.on_train_batch_end(trainer, None, None, None, 2)
    trainer.callbacks = [callback]
    assert gathered == [0] and callback.signum == signal.SIGINT and callback.saved_step == 3
    assert stopped_by_sigterm(trainer) == 130


def test_ctrl_c_in_a_project_of_ones_own_saves_and_exits_130_not_0(tmp_path: Path, caplog) -> None:
    """PreemptionCheckpoint in a plain Lightning project: Ctrl-C saves last.ckpt at the end of the step, and the fit
    ends with a SystemExit of status 130 (Lightning's SIGTERMException alone exits with 0, as if the run had
    finished; before this callback handled SIGINT, Lightning's KeyboardInterrupt path exited with 1, nothing saved).
    Its line says to resume with trainer.fit's ckpt_path (it named train()'s resume=auto, no setting here)."""

    class CtrlCAt(SigtermAt):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == self.step and not self.sent:
                self.sent = True
                os.kill(os.getpid(), signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as stop:
        fit(tmp_path, [CtrlCAt(3), PreemptionCheckpoint(dirpath=str(tmp_path))])
    assert stop.value.code == 130 and signal.getsignal(signal.SIGINT) is before
    assert torch.load(tmp_path / "last.ckpt", weights_only=True)["global_step"] == 4
    last = str(tmp_path / "last.ckpt")
    resume = f"Resume with trainer.fit(..., ckpt_path={last!r})."
    assert f"SIGINT received: saved {last} at step 4; exiting cleanly. {resume}" in caplog.text
    assert "resume=auto" not in caplog.text


def test_a_signal_ignored_when_training_starts_stays_ignored(tmp_path: Path) -> None:
    """`nohup python train.py`: SIGHUP is ignored, so that a logout does not stop the run. PreemptionCheckpoint
    handled it all the same, and the logout stopped the run at the next step (last.ckpt, exit status 129)."""

    class HangupAt(SigtermAt):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step == self.step and not self.sent:
                self.sent = True
                os.kill(os.getpid(), signal.SIGHUP)

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        callback = PreemptionCheckpoint(dirpath=str(tmp_path))
        fit(tmp_path, [HangupAt(3), callback])  # no SystemExit: trains on to max_steps
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
    assert callback.saved_step is None and callback.signum is None and not (tmp_path / "last.ckpt").exists()


def test_a_fit_in_another_thread_is_told_that_no_signal_is_caught(tmp_path: Path) -> None:
    """Python installs signal handlers only from the main thread: a fit run in a thread (a Ray Train worker, a
    notebook's background thread) took a SIGTERM with the process's default, killed with status 143, no last.ckpt and
    no word. Train start now says so, naming the thread; the process's handlers are left alone."""
    import threading
    import warnings

    before = signal.getsignal(signal.SIGTERM)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        worker = threading.Thread(target=fit, args=(tmp_path, [PreemptionCheckpoint(str(tmp_path / "ckpt"))]),
                                  name="trainer-thread")
        worker.start()
        worker.join()
    said = [str(w.message) for w in caught if "PreemptionCheckpoint" in str(w.message)]
    assert len(said) == 1 and "thread 'trainer-thread', not the main thread" in said[0]
    assert "is not caught here and saves nothing" in said[0] and "call trainer.fit from the main thread" in said[0]
    assert signal.getsignal(signal.SIGTERM) is before
