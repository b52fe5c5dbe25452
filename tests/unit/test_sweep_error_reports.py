"""How a failed job is reported (``lit_dtrain.sweeps``): its error logged once in its own log, a bad input in one line
without a traceback (other errors keep theirs), a non-finite stop in one line with the traceback in the run's log,
and which errors count as a bad input. The jobs run in-process under a Hydra runtime config set up the way Hydra
sets it (see _sweep_helpers.py). (The resume and grid checks are in test_sweep_checks.py.)"""

from __future__ import annotations

import logging

import pytest
from hydra.errors import InstantiationException
from hydra.types import RunMode

from lit_dtrain.checkpoint import CheckpointError
from lit_dtrain.data.corpus import CorpusError
from lit_dtrain.sweeps import UserInputError, reports_user_errors, user_error
from lit_dtrain.train import ConfigError, train
from lit_dtrain.utils.distributed import FirstConnectionError
from tests.unit._sweep_helpers import multirun_job


def test_train_called_from_another_hydra_entry_logs_a_failed_jobs_error(tmp_path, corpus, caplog):
    """A failed sweep job's 'job N failed: Type: message' line, which Hydra's job logging writes to the job's log
    file and scripts/compare_runs.py shows as the job's error, was logged by the root train.py's wrapper only: a
    job of a Hydra app of one's own calling train(cfg) that failed left nothing in its log, and compare_runs
    listed it as 'no metrics logged'. train(cfg) logs it now, once; outside a multirun not to the console (the error
    ends the run; its log files get it: test_a_run_stopped_by_non_finite_values_is_one_line_...). A bad input (a
    ConfigError, a CorpusError that Hydra's instantiate wrapped) is logged in one line with its own type, any other
    error with its traceback."""
    job1 = tmp_path / "sweep" / "1"
    with multirun_job(job1, ["optimizer.lr=1e-3,-1"], ["optimizer.lr=-1"], corpus) as cfg:
        with pytest.raises(ConfigError, match="optimizer.lr must be > 0, got -1"):
            train(cfg)
    failed = [r for r in caplog.records if "failed" in r.getMessage()]
    assert [(r.name, r.levelno, r.getMessage()) for r in failed] == [
        ("lit_dtrain.train", logging.ERROR, "job 1 failed: ConfigError: optimizer.lr must be > 0, got -1")
    ]
    assert not failed[0].exc_info  # a bad value: the line says it all
    caplog.clear()
    # LMDataModule's CorpusError, inside Hydra's 'Error in call to target ...': the line showed only that first line
    with multirun_job(job1, ["data.sources.0.paths=[a],[]"], ["data.sources.0.paths=[]"], corpus) as cfg:
        with pytest.raises(InstantiationException):
            train(cfg)
    (failed,) = [r for r in caplog.records if "failed" in r.getMessage()]
    assert failed.getMessage().startswith("job 1 failed: CorpusError: data.sources.0 (data source 'text'): "
                                          "kind='files' needs a non-empty 'paths' list"), failed.getMessage()
    assert not failed.exc_info
    caplog.clear()
    stop = "+callbacks.stop._target_=lightning.pytorch.callbacks.EarlyStopping"  # no monitor: Lightning's TypeError
    with multirun_job(job1, [stop], [stop], corpus) as cfg:  # not a bad input of ours
        with pytest.raises(InstantiationException):
            train(cfg)
    (failed,) = [r for r in caplog.records if "failed" in r.getMessage()]
    assert failed.getMessage().startswith("job 1 failed: InstantiationException: Error in call to target")
    assert failed.exc_info[0] is InstantiationException  # with its traceback
    caplog.clear()
    with multirun_job(tmp_path / "runs" / "one", [], ["optimizer.lr=-1"], corpus, mode=RunMode.RUN) as cfg:
        with pytest.raises(ConfigError, match="optimizer.lr must be > 0, got -1"):
            train(cfg)
    assert not [r for r in caplog.records if "failed" in r.getMessage()]


def test_a_bad_input_is_reported_in_one_line_and_other_errors_keep_their_traceback(tmp_path, corpus, capsys,
                                                                                   monkeypatch):
    """The root train.py's wrapper: Hydra printed a ConfigError under its shortened traceback (about a dozen lines,
    the message last). A single run now prints 'error: <message>' alone and exits with status 1 (as before); a
    multirun job fails with a CompactHydraException, which Hydra reports as its message alone after the sweep; any
    other error, and every error under HYDRA_FULL_ERROR=1, goes on unchanged."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)

    def failing(error):
        def task(cfg):
            raise error
        return reports_user_errors(task)

    bad = ConfigError("data.seed must be an integer, got 'abc' (str)")
    with multirun_job(tmp_path / "runs" / "one", [], [], corpus, mode=RunMode.RUN) as cfg:
        with pytest.raises(SystemExit) as exit_:
            failing(bad)(cfg)
        assert exit_.value.code == 1
        assert capsys.readouterr().err == "error: data.seed must be an integer, got 'abc' (str)\n"
        bug = RuntimeError("a bug")
        with pytest.raises(RuntimeError) as raised:
            failing(bug)(cfg)
        assert raised.value is bug
        # the ranks' first connection timed out (strategy.connect_timeout_s): the last line of a 67-line traceback
        with pytest.raises(SystemExit) as exit_:
            failing(FirstConnectionError("rank 0: only 1 of 2 ranks connected within 3 s (...)"))(cfg)
        assert exit_.value.code == 1
        assert capsys.readouterr().err == "error: rank 0: only 1 of 2 ranks connected within 3 s (...)\n"
        monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
        with pytest.raises(ConfigError) as raised:
            failing(bad)(cfg)
        assert raised.value is bad and capsys.readouterr().err == ""
        monkeypatch.delenv("HYDRA_FULL_ERROR")
    with multirun_job(tmp_path / "sweep" / "0", ["seed=1,2"], ["seed=1"], corpus) as cfg:
        with pytest.raises(UserInputError, match=r"^error: data.seed must be an integer") as raised:
            failing(bad)(cfg)
        assert raised.value.__cause__ is bad and capsys.readouterr().err == ""


def test_a_run_stopped_by_non_finite_values_is_one_line_and_its_log_keeps_the_traceback(tmp_path, corpus, capsys,
                                                                                        monkeypatch):
    """`python train.py optimizer.lr=1e6 ...` stopped at step 1 with a NonFiniteError, which names the step and the
    tensors, under Hydra's 78-line traceback, and its train.log said nothing of it (only a sweep job logged its
    error there), so scripts/compare_runs.py listed the run as unfinished. It is one line on stderr now,
    'error: <message>', exit status 1 (a multirun job: Hydra's one-line report), and a single run's log files get
    'run failed: NonFiniteError: <message>' with the traceback; a bad input's line there has no traceback, and the
    console gets neither (the error line says it). A start refused in an earlier run's dir logs no failure there
    (a multirun job's line goes to the console only)."""
    from lit_dtrain.module import NonFiniteError
    from lit_dtrain.sweeps import logs_a_failed_job

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    stop = NonFiniteError("non-finite gradients at step 1 (train/loss=5.5); first bad parameter(s): ['w']")

    def failing(error):
        @logs_a_failed_job
        def task(cfg):
            raise error
        return reports_user_errors(task)

    log_file = tmp_path / "train.log"
    handler = logging.FileHandler(log_file)
    console = logging.StreamHandler()  # a StreamHandler that is no FileHandler: Hydra's console
    root = logging.getLogger()
    root.addHandler(handler)
    root.addHandler(console)
    try:
        with multirun_job(tmp_path / "runs" / "one", [], [], corpus, mode=RunMode.RUN) as cfg:
            with pytest.raises(SystemExit) as exit_:
                failing(stop)(cfg)
            assert exit_.value.code == 1
            assert capsys.readouterr().err == f"error: {stop}\n"  # the console handler wrote nothing either
            from lit_dtrain.callbacks.loss_spike import LossSpikeError  # the monitor's `raise` action: a stop asked for

            with pytest.raises(SystemExit):
                failing(LossSpikeError("LossSpikeMonitor: 2 loss spikes within 10 steps (steps [3, 5])"))(cfg)
            assert capsys.readouterr().err == "error: LossSpikeMonitor: 2 loss spikes within 10 steps (steps [3, 5])\n"
            with pytest.raises(SystemExit):
                failing(ConfigError("optimizer.lr must be > 0, got -1"))(cfg)
            assert capsys.readouterr().err == "error: optimizer.lr must be > 0, got -1\n"
            # a start refused in the dir of an earlier run (or of one still training there): that run did not fail
            (tmp_path / "runs" / "one").mkdir()
            (tmp_path / "runs" / "one" / "config_resolved.yaml").write_text("seed: 1\n")
            with pytest.raises(SystemExit):
                failing(ConfigError("run dir is in use"))(cfg)
            capsys.readouterr()
        with multirun_job(tmp_path / "sweep" / "0", ["seed=1,2"], ["seed=1"], corpus) as cfg:
            with pytest.raises(UserInputError, match=r"^error: non-finite gradients at step 1") as raised:
                failing(stop)(cfg)
            assert raised.value.__cause__ is stop
            capsys.readouterr()
            # a re-run sweep's job refused in the dir of its earlier (killed) run: on the console, not in that log,
            # where compare_runs read it as the earlier run's error
            (tmp_path / "sweep" / "0").mkdir()
            (tmp_path / "sweep" / "0" / "config_resolved.yaml").write_text("seed: 2\n")
            refused = "resume=auto: sweep/0 was trained with seed=2, this job sets seed=1"
            with pytest.raises(UserInputError, match=f"^error: {refused}"):
                failing(ConfigError(refused))(cfg)
            assert capsys.readouterr().err == f"job 0 failed: ConfigError: {refused}\n"
    finally:
        root.removeHandler(handler)
        root.removeHandler(console)
        handler.close()
    lines = log_file.read_text().splitlines()
    assert lines[0] == f"run failed: NonFiniteError: {stop}" and lines[1] == "Traceback (most recent call last):"
    assert f"lit_dtrain.module.NonFiniteError: {stop}" in lines
    after = lines[lines.index(f"lit_dtrain.module.NonFiniteError: {stop}") + 1:]
    assert after[0] == "run failed: LossSpikeError: LossSpikeMonitor: 2 loss spikes within 10 steps (steps [3, 5])"
    after = after[after.index("lit_dtrain.callbacks.loss_spike.LossSpikeError: LossSpikeMonitor: 2 loss spikes within "
                              "10 steps (steps [3, 5])") + 1:]
    assert after[0] == "run failed: ConfigError: optimizer.lr must be > 0, got -1"  # no traceback: the line says it
    assert after[1] == f"job 0 failed: NonFiniteError: {stop}" and after[2] == "Traceback (most recent call last):"
    assert not [line for line in after if "resume=auto" in line]


def test_which_errors_are_a_bad_input():
    """ConfigError, CorpusError (also inside Hydra's InstantiationException) and CheckpointError are; a checkpoint
    that could not be written is only for an OS error (a full disk), not for an object torch cannot pickle (a bug)."""
    corpus_error = CorpusError("data source 'text': path '/x' does not exist")
    try:
        raise InstantiationException("Error in call to target 'lit_dtrain.data.LMDataModule'") from corpus_error
    except InstantiationException as e:
        wrapped = e
    assert user_error(wrapped) is corpus_error
    unreadable = CheckpointError("checkpoint '/x.ckpt' is corrupt or unreadable: KeyError: 105")
    assert user_error(unreadable) is unreadable

    def write_error(cause):
        try:
            raise CheckpointError("could not write checkpoint '/x.ckpt': ...") from cause
        except CheckpointError as e:
            return e

    full = write_error(OSError(28, "No space left on device"))
    assert user_error(full) is full
    assert user_error(write_error(TypeError("cannot pickle 'generator' object"))) is None
    assert user_error(RuntimeError("a bug")) is None
    assert user_error(InstantiationException("Error in call to target")) is None

    def instantiation_error(cause, full_key=True):
        try:
            raise InstantiationException(f"Error in call to target 'x.Y':\n{cause!r}"
                                         + ("\nfull_key: callbacks.loss_spike" if full_key else "")) from cause
        except InstantiationException as e:
            return e

    # a constructor's argument check (a plain ValueError) is a bad input too: one line, after Hydra's node name
    check = ValueError("LossSpikeMonitor: method must be one of ('ema', 'median'), got 'mean'")
    named = user_error(instantiation_error(check))
    assert isinstance(named, ConfigError)
    assert str(named) == "callbacks.loss_spike: LossSpikeMonitor: method must be one of ('ema', 'median'), got 'mean'"
    assert str(user_error(instantiation_error(check, full_key=False))) == str(check)
    # other errors inside a constructor are not (a TypeError, a ValueError subclass from deeper down)
    assert user_error(instantiation_error(TypeError("unexpected keyword argument 'x'"))) is None
    assert user_error(instantiation_error(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad"))) is None


def test_the_job_that_started_a_rank_is_read_only_from_its_parent(monkeypatch):
    """Lightning's launcher starts rank 1 as rank 0's child, with rank 0's environment: the job noted there is the one
    whose fit started rank 1. A value inherited from elsewhere (a shell, an earlier sweep of this process's parent's
    parent) is not this sweep's: read as one, torchrun's rank 1 would have left its own refusals unreported."""
    import os

    from lit_dtrain import _job_failure_once as once

    monkeypatch.setenv(once.JOB_ENV, f"{os.getppid()}:3")
    assert once._job_of_parent() == 3
    monkeypatch.setenv(once.JOB_ENV, f"{os.getpid()}:3")  # this process's own note, not its parent's
    assert once._job_of_parent() is None
    monkeypatch.setenv(once.JOB_ENV, "3")  # no pid
    assert once._job_of_parent() is None


def test_a_ranks_failure_after_its_checks_goes_to_its_job_log_where_rank_0_wrote_the_record(tmp_path, corpus):
    """Rank 1 of a DDP sweep writes no config_resolved.yaml: rank 0 wrote it before the launcher started rank 1 (a
    job's first fit), so the file was the same before and after rank 1's failure, which was taken for a start refused
    in an earlier run's dir: rank 1's job log (train_ddp_process_1.log) never said why the job failed ('-m
    trainer=ddp_cpu trainer.limit_val_batches=0.001,1', refused at the fit's start on both ranks). A start that passed
    its checks (note_training_start, on every rank) logs it there."""
    from lit_dtrain._job_failure_once import note_training_start
    from lit_dtrain.sweeps import logs_a_failed_job

    refusal = ConfigError("trainer.limit_val_batches=0.001 leaves no validation batch")

    trains = []

    @logs_a_failed_job
    def task(cfg):
        if trains:
            note_training_start()
        raise refusal

    log_file = tmp_path / "train_ddp_process_1.log"
    handler = logging.FileHandler(log_file)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with multirun_job(tmp_path / "sweep" / "0", ["seed=1,2"], ["seed=1"], corpus) as cfg:
            (tmp_path / "sweep" / "0").mkdir()
            (tmp_path / "sweep" / "0" / "config_resolved.yaml").write_text("seed: 1\n")  # rank 0's, of this job
            with pytest.raises(ConfigError):  # refused in its checks (in an earlier run's dir): not its failure
                task(cfg)
            trains.append(True)
            with pytest.raises(ConfigError):  # refused after them: its own
                task(cfg)
    finally:
        root.removeHandler(handler)
        handler.close()
    assert log_file.read_text().splitlines() == [f"job 0 failed: ConfigError: {refusal}"]
