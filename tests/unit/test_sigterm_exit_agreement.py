"""``train()``'s end after a SIGTERM on several ranks (lit_dtrain.sigterm_exit), with the collectives stood in for:
a rank that got no signal stops with the rank that did, and a SIGTERM that Lightning flagged just before the final
validation is held there, not dropped."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch

from lit_dtrain.callbacks import PreemptionCheckpoint
from lit_dtrain.sigterm_exit import HoldSigtermInValidate, sigterm_after_the_last_step, stopped_by_sigterm


def two_ranks(other_rank_signalled: bool):
    """A ``reduce_boolean_decision`` of this rank and one other: all (``all=True``) or any of their decisions."""
    return lambda mine, all=True: (mine and other_rank_signalled) if all else (mine or other_rank_signalled)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_after_the_last_step_a_rank_that_got_no_signal_stops_with_the_signal_of_the_rank_that_did(
    sig, tmp_path, monkeypatch
):
    """Ctrl-C (or SIGTERM) to rank 1 alone in fit's last validation (the signal is only recorded there): the ranks
    agree to stop after fit, on any rank's signal (had they agreed on 'every rank got it', rank 0 would validate on
    and write summary.json while rank 1 exits), and on which signal: rank 0, which got none, exited with 143
    ('stopped by SIGTERM') where rank 1 exited with 130."""
    gathered = []

    def all_gather(t):  # rank 1 got the signal, this rank none (0)
        gathered.append(int(t))
        return torch.tensor([int(t), int(sig)])

    monkeypatch.setattr("lit_dtrain.sigterm_exit.all_gather_stacked", all_gather)
    trainer = SimpleNamespace(
        world_size=2, received_sigterm=False, global_step=6, callbacks=[PreemptionCheckpoint(dirpath=str(tmp_path))],
        strategy=SimpleNamespace(reduce_boolean_decision=two_ranks(True), root_device=torch.device("cpu")),
    )
    assert sigterm_after_the_last_step(trainer) and gathered == [0]
    assert stopped_by_sigterm(trainer, saved_last=True) == 128 + sig
    trainer.strategy.reduce_boolean_decision = two_ranks(False)  # no rank got one: none stops
    assert not sigterm_after_the_last_step(trainer)


class Connector:
    received_sigterm = False


class Trainer:
    """What HoldSigtermInValidate and sigterm_after_the_last_step read of a Lightning Trainer on one of 2 ranks."""

    def __init__(self, hold: HoldSigtermInValidate) -> None:
        self.state = SimpleNamespace(fn="validate")
        self.world_size, self.global_step, self.callbacks = 2, 6, [hold]
        self._signal_connector = Connector()
        self.strategy = SimpleNamespace(reduce_boolean_decision=two_ranks(False), root_device=torch.device("cpu"))

    @property
    def received_sigterm(self) -> bool:  # as Lightning's: its signal connector's flag
        return self._signal_connector.received_sigterm


def test_a_sigterm_flagged_before_the_final_validation_is_held_not_dropped(monkeypatch):
    """Lightning flagged a SIGTERM just before train()'s final validation: the hold clears the flag (it would stop
    this rank alone at its next validation batch) and keeps it, so that the ranks still agree to exit with 143
    after the validation; one that comes during it is recorded, and the handler from before comes back after."""
    monkeypatch.setattr("lit_dtrain.sigterm_exit.all_gather_stacked", lambda t: t.reshape(1))
    before = signal.getsignal(signal.SIGTERM)
    hold = HoldSigtermInValidate()
    trainer = Trainer(hold)
    trainer._signal_connector.received_sigterm = True
    hold.on_validation_start(trainer, None)
    hold.on_validation_end(trainer, None)
    assert not trainer.received_sigterm and hold.signalled
    assert sigterm_after_the_last_step(trainer) and stopped_by_sigterm(trainer) == 143

    hold = HoldSigtermInValidate()  # a SIGTERM during the validation itself
    trainer = Trainer(hold)
    hold.on_validation_start(trainer, None)
    try:
        assert not hold.signalled
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        hold.on_validation_end(trainer, None)
    assert hold.signalled and signal.getsignal(signal.SIGTERM) is before
    assert sigterm_after_the_last_step(trainer)


def test_a_stop_after_the_last_step_says_how_to_resume_this_run(tmp_path, caplog):
    """A SIGTERM in the final validation of job 5 of a 6-job sweep said `resume=auto validates it and writes
    summary.json`: a multirun's bare resume=auto is refused (it needs hydra.sweep.dir), and a single run's default
    name is its start time. The line names the run as PreemptionCheckpoint's own line does."""
    hint = "the same -m arguments and resume=auto 'hydra.sweep.dir=/out/multiruns/wvc'"
    trainer = SimpleNamespace(
        global_step=6, callbacks=[PreemptionCheckpoint(dirpath=str(tmp_path), resume_hint=hint)])
    with caplog.at_level("INFO", logger="lit_dtrain.train"):
        assert stopped_by_sigterm(trainer, saved_last=True) == 143
    assert f"whose last.ckpt is saved: resume with {hint} to validate it and write summary.json" in caplog.text


def test_a_stop_without_a_checkpoint_says_how_to_resume_this_run(monkeypatch, caplog):
    """A SIGTERM at step 70 of a run without PreemptionCheckpoint (callbacks.preemption=null) said `resume=auto
    continues from the last validation's checkpoint`: a single run's default name is its start time, so the bare
    resume=auto started a fresh run (a multirun refuses it without hydra.sweep.dir). It names the run now."""
    from hydra.core.hydra_config import HydraConfig

    import lit_dtrain.sweeps

    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(lit_dtrain.sweeps, "in_multirun", lambda: False)
    trainer = SimpleNamespace(global_step=70, callbacks=[])
    with caplog.at_level("INFO", logger="lit_dtrain.train"):
        assert stopped_by_sigterm(trainer, run_name="2026-12-06_16-20-19") == 143
    assert (
        "without a checkpoint (no PreemptionCheckpoint among the callbacks): to continue from the last validation's "
        "checkpoint, if any, resume with resume=auto run_name=2026-12-06_16-20-19 or ckpt_path=<that file>"
    ) in caplog.text


def test_a_stop_without_a_checkpoint_names_the_file_a_resume_continues_before_ckpt_path_that_file(
    tmp_path, monkeypatch, caplog
):
    """A run without PreemptionCheckpoint stopped at step 7 said 'resume with resume=auto run_name=nock or
    ckpt_path=<that file> to continue from the last validation's checkpoint, if any': <that file> before any file was
    named, beside a step-4 checkpoint it could have named. train() gives its checkpoint dir: the line names the file."""
    from hydra.core.hydra_config import HydraConfig

    import lit_dtrain.sweeps

    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(lit_dtrain.sweeps, "in_multirun", lambda: False)
    trainer = SimpleNamespace(global_step=7, callbacks=[])
    ckpt = tmp_path / "step000004-val4.9907.ckpt"
    torch.save({"global_step": 4, "state_dict": {"w": torch.zeros(2)}}, ckpt)
    with caplog.at_level("INFO", logger="lit_dtrain.train"):
        assert stopped_by_sigterm(trainer, run_name="nock", ckpt_dir=str(tmp_path)) == 143
    assert (
        "stopped by SIGTERM at step 7 without a checkpoint (no PreemptionCheckpoint among the callbacks): The newest "
        f"finite checkpoint is {ckpt} (step 4), which resume=auto continues: resume with resume=auto run_name=nock or "
        "ckpt_path=<that file>"
    ) in caplog.text
    caplog.clear()
    ckpt.unlink()
    with caplog.at_level("INFO", logger="lit_dtrain.train"):
        stopped_by_sigterm(trainer, run_name="nock", ckpt_dir=str(tmp_path))
    assert f"callbacks): {tmp_path} holds no resumable checkpoint: a resume has nothing to continue" in caplog.text
    assert "<that file>" not in caplog.text


@pytest.mark.parametrize(
    ("fast_dev_run", "reason"),
    [
        (3, "(fast_dev_run: PreemptionCheckpoint saves none)"),
        (False, "(PreemptionCheckpoint saves at a training step's end, and none ended after the signal)"),
    ],
)
def test_a_stop_without_a_checkpoint_beside_a_preemption_checkpoint_gives_the_true_reason(
    fast_dev_run, reason, tmp_path, caplog
):
    """`python train.py +trainer.fast_dev_run=3` signalled at step 1, and a run signalled in its sanity check (before
    any training step), both with the default PreemptionCheckpoint, said 'without a checkpoint (no
    PreemptionCheckpoint among the callbacks)': one was there and saved nothing. The line says why it saved none."""
    callback = PreemptionCheckpoint(dirpath=str(tmp_path), resume_hint="resume=auto run_name=fdr")
    trainer = SimpleNamespace(global_step=2, callbacks=[callback], fast_dev_run=fast_dev_run)
    with caplog.at_level("INFO", logger="lit_dtrain.train"):
        assert stopped_by_sigterm(trainer, run_name="fdr", ckpt_dir=str(tmp_path)) == 143
    assert f"stopped by SIGTERM at step 2 without a checkpoint {reason}: {tmp_path} holds no resumable" in caplog.text
    assert "no PreemptionCheckpoint among" not in caplog.text
