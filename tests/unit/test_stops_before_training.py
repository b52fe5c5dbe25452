"""A SIGTERM or SIGHUP before training (the fit's setup, the checkpoint's load) on a rank that keeps no logs: a fresh
start's, or rank 1 of a resume. It took the default action (-15, no line); the 2-rank launch is
``tests/e2e/test_stop_before_training_ddp.py``."""

from __future__ import annotations

import logging
import os
import signal

import pytest
from lightning.pytorch.utilities import rank_zero_only

from lit_dtrain.stops_before_training import StopsBeforeTraining


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lit_dtrain.logs_kept"]


@pytest.mark.parametrize("name", ["SIGTERM", "SIGHUP"])
def test_a_fresh_start_stopped_before_training_says_so(caplog, name):
    caplog.set_level(logging.INFO, logger="lit_dtrain")
    signum = getattr(signal, name)
    with pytest.raises(SystemExit, match=str(128 + signum)), StopsBeforeTraining():
        os.kill(os.getpid(), signum)
    assert signal.getsignal(signum) is signal.SIG_DFL  # put back
    assert _lines(caplog) == [
        f"stopped by {name} before training (a new run): nothing trained, no checkpoint written; run the same "
        "command again to start it",
        f"exiting with status {128 + signum} (stopped by {name}, not finished)",
    ]


def test_rank_1_of_a_resume_stopped_before_training_says_so_in_one_labelled_line(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="lit_dtrain")
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit, match="143"), StopsBeforeTraining(resumed_step=4):
        os.kill(os.getpid(), signal.SIGTERM)
    assert _lines(caplog) == [
        "[rank: 1] stopped by SIGTERM before training, resuming from step 4: nothing trained; run the same command "
        "again to resume from step 4; exiting with status 143 (not finished)",
    ]


def test_after_training_started_the_signal_is_not_its_own():
    """on_train_start hands the signals back (to the handler from before: here the default one)."""
    stops = StopsBeforeTraining()
    with stops:
        stops.on_train_start(None, None)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.parametrize("phase", ["check_own_builds", "instantiate"])
def test_a_signal_in_trains_config_checks_or_model_build_says_so(tiny_cfg, caplog, monkeypatch, phase):
    """A SIGTERM in train()'s config checks or its model's build (before the trainer's, where StopsBeforeTraining
    was entered) took the default action: -15 and no line."""
    import lit_dtrain.train as train_module

    caplog.set_level(logging.INFO, logger="lit_dtrain")
    cfg = tiny_cfg("trainer.max_steps=1", "sample.max_new_tokens=0")
    real = getattr(train_module, phase)

    def signalled(*args, **kwargs):
        if phase == "check_own_builds" or "build_llama" in str(args[0].get("_target_", "")):
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(train_module, phase, signalled)
    with pytest.raises(SystemExit, match="143"):
        train_module.train(cfg)
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # put back
    assert _lines(caplog) == [
        "stopped by SIGTERM before training (a new run): nothing trained, no checkpoint written; run the same "
        "command again to start it",
        "exiting with status 143 (stopped by SIGTERM, not finished)",
    ]


def test_a_stop_inside_a_nested_one_is_said_once(caplog):
    """train() holds one from its start and, on rank 0 of a resume, LogsKeptUntilTraining inside it: the inner one,
    which left the exception first, says it."""
    caplog.set_level(logging.INFO, logger="lit_dtrain")
    with pytest.raises(SystemExit, match="143"), StopsBeforeTraining(resumed_step=4):
        with StopsBeforeTraining(resumed_step=4):
            os.kill(os.getpid(), signal.SIGTERM)
    assert len(_lines(caplog)) == 2, _lines(caplog)


def test_a_signal_before_a_resume_auto_looked_for_its_checkpoint_says_neither_new_nor_resumed(tiny_cfg, caplog,
                                                                                               monkeypatch):
    """A SIGTERM in the config checks of a resume=auto start was told '(a new run) ... run the same command again to
    start it', also where the run dir held a checkpoint that the same command resumes: the checkpoint is looked for
    after the checks. Now such a stop says it came before that; once looked for, '(a new run)' or 'resuming from
    step N' as found."""
    import lit_dtrain.train as train_module

    caplog.set_level(logging.INFO, logger="lit_dtrain")
    overrides = ("trainer.max_steps=2", "sample.max_new_tokens=0", "run_name=r", "resume=auto")
    real = {name: getattr(train_module, name) for name in ("check_own_builds", "instantiate")}

    def stopped_in(phase: str) -> str:
        def signalled(*args, **kwargs):
            if phase == "check_own_builds" or "build_llama" in str(args[0].get("_target_", "")):
                os.kill(os.getpid(), signal.SIGTERM)
            return real[phase](*args, **kwargs)

        monkeypatch.setattr(train_module, phase, signalled)
        caplog.clear()
        with pytest.raises(SystemExit, match="143"):
            train_module.train(tiny_cfg(*overrides))
        monkeypatch.setattr(train_module, phase, real[phase])
        return _lines(caplog)[0]

    before = ("stopped by SIGTERM before training (before it looked for the checkpoint to resume from): nothing "
              "trained, no checkpoint written; run the same command again")
    assert stopped_in("check_own_builds") == before  # no checkpoint yet
    assert stopped_in("instantiate").startswith("stopped by SIGTERM before training (a new run): ")
    train_module.train(tiny_cfg("trainer.max_steps=1", "sample.max_new_tokens=0", "run_name=r"))
    assert stopped_in("check_own_builds") == before  # it was '(a new run)'
    assert stopped_in("instantiate").startswith("stopped by SIGTERM before training, resuming from step 1: ")
