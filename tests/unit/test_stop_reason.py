"""summary.json says why the run stopped. A run that EarlyStopping stopped at step 4 of 20 wrote the summary of a
finished one (less its steps), and its resume=auto trained on to the next validation and stopped again (steps 6); a
max_time stop's resume, which Lightning's Timer stops at once, said 'already at step 2 = trainer.max_steps' of a run
with max_steps=200. An early-stopped run is finished: its resume only validates, and says why."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_dtrain.stop_reason import stop_reason

EARLY_STOPPING = (
    "+callbacks.early_stopping._target_=lightning.pytorch.callbacks.EarlyStopping",
    "+callbacks.early_stopping.monitor=val/loss",
    "+callbacks.early_stopping.patience=1",
    "+callbacks.early_stopping.min_delta=10",  # no validation improves by 10: the second one stops the run
)


def _summary(cfg) -> dict:
    return json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text())


def test_an_early_stopped_run_says_so_and_its_resume_only_validates(tiny_cfg, caplog, capsys):
    from lit_dtrain.train import train

    common = ("trainer.max_steps=20", "trainer.val_check_interval=2", "sample.max_new_tokens=0", *EARLY_STOPPING)
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.train"):
        metrics, _ = train(tiny_cfg(*common))
    cfg = tiny_cfg(*common)
    last = Path(cfg.paths.checkpoint_dir) / "last.ckpt"
    assert ("the fit stopped (early_stopping) after 4 of trainer.max_steps=20 optimizer steps, its last at 1 of the "
            "peak LR, before its schedule's end (0 at step 19): its weights are not annealed. To decay them "
            f"(scheduler=wsd), branch: decay_branch.ckpt={last} decay_branch.steps=N") in caplog.text
    caplog.clear()
    assert metrics["steps"] == 4 and _summary(cfg)["stopped"] == "early_stopping"
    assert capsys.readouterr().out.rstrip().endswith("stopped=early_stopping")
    weights = torch.load(Path(cfg.paths.checkpoint_dir) / "last.ckpt", weights_only=True)["state_dict"]
    saved = last.read_bytes()
    with caplog.at_level(logging.INFO, logger="lit_dtrain.train"):
        metrics, objects = train(tiny_cfg(*common, "resume=auto"))
    summary = _summary(cfg)
    assert metrics["steps"] == summary["steps"] == 4 and summary["stopped"] == "early_stopping"
    # left as it was: Lightning's ModelCheckpoint and train() each saved it again, with the Timer grown by this
    # start's brief fit (53.946 s, 53.947 s, 53.951 s of training after three such starts of a real run)
    assert last.read_bytes() == saved
    after = objects["module"].state_dict()
    assert all(torch.equal(after[k], v) for k, v in weights.items())  # no step trained
    assert "the checkpoint at step 4 is of a run that EarlyStopping stopped" in caplog.text
    assert "its weights are not annealed" not in caplog.text  # (a start that trained no step)
    # a decay branch from it trains its decay, all of it: EarlyStopping, restored at its patience, stopped it at its
    # first validation (step 6 of 8) that did not improve
    with caplog.at_level(logging.INFO, logger="lit_dtrain.train"):
        metrics, _ = train(tiny_cfg(*common, f"decay_branch.ckpt={last}", "decay_branch.steps=4", run="branch"))
    assert metrics["steps"] == 8 and metrics["stopped"] == "max_steps"
    assert "decay_branch: EarlyStopping left out" in caplog.text
    # leaving EarlyStopping out trains on, to max_steps
    metrics, _ = train(tiny_cfg("trainer.max_steps=6", "trainer.val_check_interval=2", "sample.max_new_tokens=0",
                                "resume=auto"))
    assert metrics["steps"] == 6 and _summary(cfg)["stopped"] == "max_steps"


def _trainer(**kw) -> SimpleNamespace:
    base = {"max_steps": 20, "global_step": 4, "early_stopping_callbacks": [], "callbacks": [], "max_epochs": -1,
            "current_epoch": 0}
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(("kw", "reason"), [
    ({"global_step": 20}, "max_steps"),
    ({"max_steps": -1, "max_epochs": 2, "current_epoch": 2}, "max_epochs"),
    ({}, "should_stop"),
])
def test_stop_reasons(kw, reason):
    assert stop_reason(_trainer(**kw)) == reason


def test_an_early_stopping_that_stopped_is_the_reason_and_max_steps_wins():
    stopper = EarlyStopping(monitor="val/loss")
    assert stop_reason(_trainer(early_stopping_callbacks=[stopper])) == "should_stop"  # it did not stop the run
    stopper.stopping_reason = EarlyStoppingReason.PATIENCE_EXHAUSTED  # (stopped_epoch stays 0 in epoch 0)
    assert stop_reason(_trainer(early_stopping_callbacks=[stopper])) == "early_stopping"
    assert stop_reason(_trainer(early_stopping_callbacks=[stopper], global_step=20)) == "max_steps"


def test_a_max_time_resume_names_the_time_to_raise_trainer_max_time_past():
    """A run of trainer.max_time=4 s whose first step took 11 s was told 'Raise trainer.max_time to train on'; raised
    to 8 s it trained no step again. The line names the training time the Timer counted, as max_time is typed."""
    from lightning.pytorch.callbacks import Timer

    from lit_dtrain.stop_reason import nothing_trained

    timer = Timer(duration="00:00:00:04")
    timer.load_state_dict({"time_elapsed": {"train": 93784.2}})  # 1 day 2:03:04.2, the checkpoint's count
    line = nothing_trained("max_time", 1, _trainer(callbacks=[timer]))
    assert "counted 01:02:03:05 of training" in line and line.endswith("Raise trainer.max_time past 01:02:03:05 to "
                                                                       "train on")


def test_every_rank_s_early_stopping_says_it_stopped_where_one_rank_s_did():
    """EarlyStopping sets its stopping_reason on the rank that decided alone: on a metric that differs between ranks
    (monitor=train/loss), a 2-rank run that rank 1 stopped at step 8 of 20 said stopped=should_stop (rank 0's state,
    which last.ckpt holds) and its resume=auto trained on to step 12. After fit the ranks gather their reasons."""
    from lit_dtrain.stop_reason import agree_on_early_stop

    def on_rank_0(rank_1_reason: EarlyStoppingReason) -> tuple[EarlyStopping, str]:
        stopper = EarlyStopping(monitor="train/loss")  # rank 0's: it did not decide
        gathered = []
        def all_gather(mine: torch.Tensor) -> torch.Tensor:  # rank 0's reasons and rank 1's, as (ranks, callbacks)
            gathered.append(mine)
            return torch.stack([mine, torch.full_like(mine, rank_1_reason.value)])

        strategy = SimpleNamespace(root_device=torch.device("cpu"), all_gather=all_gather)
        trainer = _trainer(early_stopping_callbacks=[stopper], world_size=2, strategy=strategy, global_step=8)
        agree_on_early_stop(trainer)
        assert len(gathered) == 1  # one gather a fit
        return stopper, stop_reason(trainer)

    stopper, reason = on_rank_0(EarlyStoppingReason.PATIENCE_EXHAUSTED)
    assert stopper.stopping_reason == EarlyStoppingReason.PATIENCE_EXHAUSTED and reason == "early_stopping"
    assert stopper.state_dict()["stopping_reason"] == EarlyStoppingReason.PATIENCE_EXHAUSTED.value  # last.ckpt's
    stopper, reason = on_rank_0(EarlyStoppingReason.NOT_STOPPED)
    assert stopper.stopping_reason == EarlyStoppingReason.NOT_STOPPED and reason == "should_stop"


def test_the_wsd_callback_s_early_stop_advice_under_train_py_is_the_decay_branch(tiny_cfg):
    """With the WSDScheduler callback ('~scheduler' 'callbacks=[default,wsd]'), an early-stopped run was told 'To
    decay them, resume from its last checkpoint with WSDScheduler(total_steps=4 + D, decay_steps=D)', which under
    train.py trains no step (KeepEarlyStop), and its resume, which trained none, said it again. Now it names the
    decay branch, which decays it, and a fit that trained no step says nothing."""
    import warnings

    from lit_dtrain.train import train

    common = ("~scheduler._target_", "~scheduler._partial_", "callbacks=[default,wsd]",  # (tiny_cfg's warmup kept)
              "trainer.max_steps=20", "trainer.val_check_interval=2", "sample.max_new_tokens=0", *EARLY_STOPPING)

    def said(*overrides: str, run: str = "run") -> tuple[dict, list[str]]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            metrics, _ = train(tiny_cfg(*common, *overrides, run=run))
        return metrics, [str(w.message) for w in caught if "WSDScheduler: the fit stopped" in str(w.message)]

    metrics, lines = said()
    last = Path(tiny_cfg(*common).paths.checkpoint_dir) / "last.ckpt"
    assert metrics["steps"] == 4 and len(lines) == 1, lines
    assert lines[0].startswith("WSDScheduler: the fit stopped after 4 optimizer steps of the 20 it planned")
    assert lines[0].endswith(f"To decay them, branch: decay_branch.ckpt={last} decay_branch.steps=N")
    metrics, lines = said("resume=auto")
    assert metrics["steps"] == 4 and lines == []  # trained no step: stop_reason's line names the branch
    metrics, lines = said(f"decay_branch.ckpt={last}", "decay_branch.steps=2", run="branch")
    assert metrics["steps"] == 6 and metrics["stopped"] == "max_steps" and lines == []
    # end to end (tested through their functions before): summary.json's start_step is the branch's step, and the
    # branch's steps 4..5 hold no step the default log_every_n_steps=10 logs, so it logs every 2, to its last (5)
    assert _summary(tiny_cfg(run="branch"))["start_step"] == 4
    events = EventAccumulator(str(Path(tiny_cfg(run="branch").paths.output_dir) / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [5] == [e.step for e in events.Scalars("lr-AdamW/decay")]


def test_a_max_time_stop_s_decay_branch_names_the_time_its_timer_needs(caplog):
    """A run trainer.max_time=00:00:00:03 stopped at step 3 of 200 (its first steps took 14 s) was told to branch:
    decay_branch.ckpt=... decay_branch.steps=N; that branch, with the run's max_time, trained no step (3 -> 3): its
    Timer goes on from the checkpoint's 14 s. The line names the max_time the branch needs."""
    from lightning.pytorch.callbacks import Timer

    from lit_dtrain.stop_reason import warn_if_the_schedule_did_not_end

    timer = Timer(duration="00:00:00:03")
    timer.load_state_dict({"time_elapsed": {"train": 13.2}})
    scheduler = SimpleNamespace(lr_lambdas=[lambda step: 1.0 if step < 160 else 0.0])
    trainer = _trainer(global_step=3, max_steps=200, callbacks=[timer],
                       lr_scheduler_configs=[SimpleNamespace(scheduler=scheduler)])
    for stopped, tail in [("max_time", " trainer.max_time=<past 00:00:00:14>"), ("early_stopping", "")]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lit_dtrain.train"):
            warn_if_the_schedule_did_not_end(trainer, stopped, 0, "run/checkpoints/last.ckpt")
        assert caplog.messages[-1].endswith(f"branch: decay_branch.ckpt=run/checkpoints/last.ckpt "
                                            f"decay_branch.steps=N{tail}"), caplog.messages


def test_a_stop_inside_the_warmup_is_told_to_train_past_it_before_a_decay_branch(caplog):
    """A real run trainer.max_time=00:00:00:06 stopped at step 2 of 2000, inside its warmup of 100 steps (LR at 0.02
    of the peak), was told to branch: decay_branch.ckpt=... decay_branch.steps=N; that branch (N=1000) was refused,
    'decay_branch.ckpt is at step 2, inside the warmup', and a short one (N=10) took it and jumped the LR up to the
    peak. The line now says the checkpoint is inside the warmup, and to train past it first; past it, as before."""
    from functools import partial

    from lightning.pytorch.callbacks import Timer

    from lit_dtrain.schedules.lr import wsd_lr_factor
    from lit_dtrain.stop_reason import warn_if_the_schedule_did_not_end

    factor = partial(wsd_lr_factor, total_steps=2000, warmup_steps=100, decay_steps=400)
    timer = Timer(duration="00:00:00:06")
    timer.load_state_dict({"time_elapsed": {"train": 14.5}})
    configs = [SimpleNamespace(scheduler=SimpleNamespace(lr_lambdas=[factor]))]
    for step, stopped, message in [
        (2, "max_time", "the fit stopped (max_time) after 2 of trainer.max_steps=2000 optimizer steps, inside its "
         "warmup of 100 steps (its last at 0.02 of the peak LR): its weights are not annealed, and a decay branch "
         "does not take a checkpoint inside the warmup (refused there, or it decays from the peak LR, above this "
         "one). To anneal them, train on to step 100 or later first (resume=auto trainer.max_time=<past "
         "00:00:00:15>), then branch from a checkpoint there: decay_branch.ckpt=<that last.ckpt> "
         "decay_branch.steps=N"),
        (99, "early_stopping", "train on to step 100 or later first (resume=auto with EarlyStopping left out)"),
        (100, "early_stopping", "its last at 1 of the peak LR, before its schedule's end (0 at step 1999): its "
         "weights are not annealed. To decay them (scheduler=wsd), branch: decay_branch.ckpt=run/last.ckpt "
         "decay_branch.steps=N"),
    ]:
        trainer = _trainer(global_step=step, max_steps=2000, callbacks=[timer], lr_scheduler_configs=configs)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lit_dtrain.train"):
            warn_if_the_schedule_did_not_end(trainer, stopped, 0, "run/last.ckpt")
        assert message in caplog.messages[-1], caplog.messages


def test_a_fast_dev_run_resume_that_trains_nothing_says_why():
    """``resume=auto +trainer.fast_dev_run=true trainer.max_steps=8`` in a run dir whose last.ckpt is at step 4 said
    'the checkpoint is already at step 4 = trainer.max_steps', of a run with max_steps=8: Lightning runs a smoke
    test's first step of a fit (its max_steps=1), which a resume at step 4 is past. It says so, and what to do."""
    from types import SimpleNamespace

    from lit_dtrain.stop_reason import nothing_trained

    line = nothing_trained("max_steps", 4, SimpleNamespace(fast_dev_run=True))
    assert line.startswith("trainer.fast_dev_run runs a fit's first 1 step(s) (Lightning's max_steps=1), and the "
                           "checkpoint is at step 4: nothing to train")
    assert "leave resume and ckpt_path out" in line
    assert nothing_trained("max_steps", 4, SimpleNamespace(fast_dev_run=0)).endswith("= trainer.max_steps: nothing "
                                                                                       "to train, only validated")
