"""FourierSamplerCallback: what it logs (entropy, lr multiplier, top-band energy, non-finite counts) and when."""

from __future__ import annotations

import pytest
import torch

from lit_dtrain.callbacks import FourierSamplerCallback
from lit_dtrain.data.samplers import RandomSampler
from lit_dtrain.data.samplers import spectral as S
from tests.unit._fourier_helpers import _FakeTrainer, _observations, _Recorder, make

# ---- the callback and the trainer ----------------------------------------------------------------------------


def test_callback_rejects_other_samplers_and_missing_keys():
    cb = FourierSamplerCallback()
    with pytest.raises(TypeError, match="FourierSampler.*RandomSampler"):
        cb.sampler_of(_FakeTrainer(RandomSampler()))
    trainer = _FakeTrainer(make())
    trainer.global_step, trainer.accumulate_grad_batches = 1, 1
    with pytest.raises(KeyError, match="'token_loss'"):
        cb.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0), "index": torch.tensor([0])}, None, 0)
    with pytest.raises(KeyError, match="'index'"):
        cb.on_train_batch_end(trainer, None, {"token_loss": torch.rand(1, 8)}, None, 0)


def test_logged_entropy_is_of_the_distribution_the_batch_was_drawn_from():
    """On one process observe() applies its update at once: the entropy logged after it was the next draw's."""
    s = make(variant="magnitude", stages=False, uniform_floor=0.0)
    cb = FourierSamplerCallback(log_every_n_steps=1)
    trainer = _FakeTrainer(s)
    trainer.accumulate_grad_batches, trainer.log_every_n_steps = 1, 1
    module = _Recorder(trainer)
    drawn_from = []
    for step in range(4):
        idx = s.global_batch(step, 8)
        drawn_from.append(S.entropy(s.probabilities(step)))
        trainer.global_step = step
        cb.on_train_batch_start(trainer, module, None, step)
        trainer.global_step = step + 1  # Lightning advances it before on_train_batch_end
        token_loss = torch.rand(8, 32, generator=torch.Generator().manual_seed(step)) * (1 + idx[:, None] % 5)
        cb.on_train_batch_end(trainer, module, {"token_loss": token_loss, "index": idx}, None, step)
    assert len(set(drawn_from)) > 1  # the distribution does move
    assert [module.logged[step + 1]["fourier/prob_entropy"] for step in range(4)] == drawn_from


def _drive(cb, sampler, steps: int, trainer_every: int) -> _Recorder:
    """Run ``cb`` over ``steps`` optimizer steps of batches of 4 drawn from ``sampler``, as Lightning calls it."""
    trainer = _FakeTrainer(sampler)
    trainer.accumulate_grad_batches, trainer.log_every_n_steps = 1, trainer_every
    module = _Recorder(trainer)
    for step in range(steps):
        trainer.global_step = step
        cb.on_train_batch_start(trainer, module, None, step)
        trainer.global_step = step + 1  # Lightning advances it before on_train_batch_end
        idx = sampler.global_batch(step, 4)
        cb.on_train_batch_end(trainer, module, {"token_loss": torch.rand(4, 32), "index": idx}, None, step)
    return module


def test_logged_lr_multiplier_is_the_one_the_step_used():
    """fourier/lr_mult at step s is the multiplier of step s's update (the pre-step hook reads the step before
    Lightning advances global_step), like fourier/bands and fourier/mix of the same row, not step s + 1's."""
    s = make(step_unit=1)  # stages warmup [0, 5) x0.1, ramp [5, 20) x0.5
    module = _drive(FourierSamplerCallback(log_every_n_steps=1), s, steps=8, trainer_every=1)
    logged = [module.logged[step + 1]["fourier/lr_mult"] for step in range(8)]
    assert logged == [s.lr_multiplier(step) for step in range(8)] == [0.1] * 5 + [0.5] * 3


def test_logged_lr_multiplier_is_one_when_the_callback_does_not_apply_it():
    """With apply_lr_multiplier=False the updates use the unscaled LR, so fourier/lr_mult must say 1.0; it logged
    the stage's 0.1/0.5 although no step used them."""
    s = make(step_unit=1)
    module = _drive(FourierSamplerCallback(log_every_n_steps=1, apply_lr_multiplier=False), s, steps=8, trainer_every=1)
    assert [module.logged[step + 1]["fourier/lr_mult"] for step in range(8)] == [1.0] * 8


def test_trainer_log_every_n_steps_zero_learns_and_logs_nothing():
    """Lightning's log_every_n_steps=0 ("no step logging") made the callback divide by zero at its first batch
    (``global_step % 0``), so a run with data/sampler=fourier died; now the sampler learns and no fourier/* is
    written, as Lightning writes no step metrics."""
    s = make(stages=False)
    module = _drive(FourierSamplerCallback(), s, steps=4, trainer_every=0)
    assert module.logged == {}
    assert s.updates == 4


class _ListLogger:
    """A stand-in logger: ``(step, name, value)`` of every write, in order."""

    def __init__(self):
        self.rows: list[tuple[int, str, float]] = []

    def log_metrics(self, metrics, step):
        self.rows += [(step, name, value) for name, value in metrics.items()]

    def save(self):
        pass


def _drive_fixed(cb, sampler, losses: list[torch.Tensor], index: list[torch.Tensor], every: int = 1):
    """Run ``cb`` over one optimizer step per ``(losses[k], index[k])`` as Lightning calls it, with a logger."""
    trainer = _FakeTrainer(sampler)
    trainer.accumulate_grad_batches, trainer.log_every_n_steps = 1, every
    trainer.loggers = [_ListLogger()]
    module = _Recorder(trainer)
    for step, (loss, idx) in enumerate(zip(losses, index)):
        trainer.global_step = step
        cb.on_train_batch_start(trainer, module, None, step)
        trainer.global_step = step + 1  # Lightning advances it before on_train_batch_end
        cb.on_train_batch_end(trainer, module, {"token_loss": loss, "index": idx}, None, step)
    return trainer, module


@pytest.mark.parametrize("lag", [0, 1])
def test_the_nonfinite_warning_names_the_last_step_it_counted(lag):
    """The count grows when an update is applied; with lag=1 step s's is applied at step s + 1's end, where the
    warning said "up to step s + 1" although step s + 1's samples were not counted yet. It names the last step
    applied now: step 2 under both lags, written at step 2's end (lag=0) or step 3's (lag=1)."""
    import warnings

    obs = _observations(5, batch=4, T=32)
    losses = [loss.clone() for loss, _ in obs]
    losses[2][1, 5], losses[2][3] = float("nan"), float("inf")
    warned = {}
    cb, s = FourierSamplerCallback(), make(stages=False, lag=lag)
    trainer = _FakeTrainer(s)
    trainer.accumulate_grad_batches, trainer.log_every_n_steps = 1, 1
    module = _Recorder(trainer)
    for step, (loss, (_, idx)) in enumerate(zip(losses, obs)):
        trainer.global_step = step
        cb.on_train_batch_start(trainer, module, None, step)
        trainer.global_step = step + 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cb.on_train_batch_end(trainer, module, {"token_loss": loss, "index": idx}, None, step)
        warned[step] = [str(w.message) for w in caught if "NaN/inf" in str(w.message)]
    assert [step for step, messages in warned.items() if messages] == [2 + lag]
    assert warned[2 + lag] == ["FourierSampler: 2 sample(s) up to step 2 had a NaN/inf token loss; they are left out "
                               "of the sampling table (counted in fourier/nonfinite_skipped)"]


@pytest.mark.parametrize("every", [1, 2])
def test_lag_one_logs_the_top_band_energy_of_each_logged_step_once_it_has_landed(every):
    """With lag=1, fourier/top_band_energy was read off the GPU at every logged step (a wait for the step). It is
    now written under its own step when it has reached the host with that step's update (the next step's end; the
    last step's at train end): the same (step, value) pairs as with lag=0, where observe() reads it anyway."""
    obs = _observations(6, batch=4, T=32)
    losses, index = [loss for loss, _ in obs], [i for _, i in obs]
    written = {}
    for lag in (0, 1):
        cb = FourierSamplerCallback()
        trainer, module = _drive_fixed(cb, make(stages=False, lag=lag), losses, index, every=every)
        before_end = [(step, v) for step, name, v in trainer.loggers[0].rows if name == "fourier/top_band_energy"]
        cb.on_train_end(trainer, module)
        written[lag] = [(step, v) for step, name, v in trainer.loggers[0].rows if name == "fourier/top_band_energy"]
        logged_steps = [step for step in range(6) if (step + 1) % every == 0]
        assert [step for step, _ in written[lag]] == logged_steps
        # lag=1: each one a step late (on the host by then), the last one at train end
        assert before_end == written[lag][:len(logged_steps) - lag]
        if lag:
            calls = {k: v for k, v in module.logged.items() if "fourier/top_band_energy" in v}
            assert sorted(calls) == [step + 2 for step in logged_steps[:-1]]  # during step + 1 (global_step + 1)
            assert all(isinstance(v, float) for _, v in written[lag])
    assert written[1] == written[0]


@pytest.mark.parametrize("lag", [0, 1])
def test_logged_top_band_energy_is_the_mean_over_the_steps_micro_batches(lag):
    """Under gradient accumulation fourier/top_band_energy was the last micro-batch's value alone (lag 0: the stats of
    the last observe(); lag 1: the last update applied), 1/k of the step's windows. It is the mean over all of them,
    under both lags: here 2 micro-batches a step, whose top band energies differ by a factor of ~100."""
    obs = _observations(6, batch=4, T=32)
    cb, s = FourierSamplerCallback(), make(stages=False, lag=lag)
    trainer = _FakeTrainer(s)
    trainer.accumulate_grad_batches, trainer.log_every_n_steps = 2, 1
    trainer.loggers = [_ListLogger()]
    module = _Recorder(trainer)
    expected = []
    for step in range(3):
        micro = [(obs[2 * step][0] * 10.0, obs[2 * step][1]), obs[2 * step + 1]]
        reference = make(stages=False)
        expected.append(sum(reference.observe(loss, idx, step)["top_band_energy"] for loss, idx in micro) / 2)
        trainer.global_step = step
        for k, (loss, idx) in enumerate(micro):
            cb.on_train_batch_start(trainer, module, None, 2 * step + k)
            trainer.global_step = step + k  # advanced before the batch end of the step's last micro-batch only
            cb.on_train_batch_end(trainer, module, {"token_loss": loss, "index": idx}, None, 2 * step + k)
    cb.on_train_end(trainer, module)
    written = [(step, v) for step, name, v in trainer.loggers[0].rows if name == "fourier/top_band_energy"]
    assert [step for step, _ in written] == [0, 1, 2]
    for (_, value), mean in zip(written, expected):
        assert value == pytest.approx(mean, rel=1e-6)


def test_lag_one_logging_never_reads_the_token_loss_on_the_host():
    """As observe() (see the meta test above), the callback's logging under lag=1 must not read the step's token loss:
    a logged step with meta token losses (no data: any read fails) writes its row; float() of the energy failed."""
    s = make(stages=False, lag=1)
    loss, idx = _observations(1, batch=4, T=32)[0]
    trainer, module = _drive_fixed(FourierSamplerCallback(), s, [loss.to("meta")], [idx])
    row = {name: v for step, name, v in trainer.loggers[0].rows if step == 0}
    assert row["fourier/bands"] == s.bands_at(0) and "fourier/top_band_energy" not in row  # not landed yet
    assert s.updates == 0 and len(s._pending) == 1


def test_rows_follow_lightnings_logging_cadence():
    """fourier/* rows at the steps where Lightning writes train/loss, ``(k + 1) % log_every_n_steps == 0``, like the
    other callbacks (``_logging.on_log_cadence``); it also wrote a row at step 0, one off that cadence."""
    s = make(stages=False)
    module = _drive(FourierSamplerCallback(), s, steps=10, trainer_every=5)
    assert sorted(step - 1 for step in module.logged) == [4, 9]  # _Recorder keys: global_step after the step
    module = _drive(FourierSamplerCallback(log_every_n_steps=3), make(stages=False), steps=10, trainer_every=5)
    assert sorted(step - 1 for step in module.logged) == [2, 5, 8]


def test_lag_one_writes_the_owed_top_band_energy_when_a_stop_signal_ends_the_fit():
    """With lag=1 a logged step's fourier/top_band_energy is written at the next step's end. A SIGTERM stop saves at
    step k's end and ends the fit (Lightning's SIGTERMException, through on_exception), which dropped step k's value:
    the resumed run restores its update, not the value, so step k had no point in either run (a real 2-rank run
    killed at step 9: points 0..7, 10..13). It is written at the stop, as at train end; another error writes none."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    obs = _observations(4, batch=4, T=32)
    losses, index = [loss for loss, _ in obs], [i for _, i in obs]
    written = {}
    for name, exc in (("end", None), ("sigterm", SIGTERMException()), ("error", RuntimeError("boom"))):
        cb = FourierSamplerCallback()
        trainer, module = _drive_fixed(cb, make(stages=False, lag=1), losses, index)
        trainer.optimizers = []
        if exc is None:
            cb.on_train_end(trainer, module)
        else:
            cb.on_exception(trainer, module, exc)
        written[name] = [(step, v) for step, name_, v in trainer.loggers[0].rows if name_ == "fourier/top_band_energy"]
    assert [step for step, _ in written["end"]] == [0, 1, 2, 3]
    assert written["sigterm"] == written["end"]
    assert written["error"] == written["end"][:3]


def test_lag_one_writes_the_owed_top_band_energy_before_a_checkpoint_is_saved():
    """A checkpoint of step k holds step k's update, not its value: a SIGKILL after the save and before step k + 1's
    end lost step k's point for good (a real run killed at the start of the step after its step-8 checkpoint, then
    resumed: points 0..6 and 8..11 of 12), while a kill after that end kept it (written by the killed run under step
    k, which the resume's purge keeps). It is written when the checkpoint is saved, once (not again at the end)."""
    obs = _observations(4, batch=4, T=32)
    losses, index = [loss for loss, _ in obs], [i for _, i in obs]
    written = {}
    for name in ("end", "save"):
        cb = FourierSamplerCallback()
        trainer, module = _drive_fixed(cb, make(stages=False, lag=1), losses, index)
        trainer.optimizers = []
        if name == "save":
            cb.on_save_checkpoint(trainer, module, {})
            assert [s for s, n, _ in trainer.loggers[0].rows if n == "fourier/top_band_energy"] == [0, 1, 2, 3]
        cb.on_train_end(trainer, module)
        written[name] = [(step, v) for step, name_, v in trainer.loggers[0].rows if name_ == "fourier/top_band_energy"]
    assert [step for step, _ in written["end"]] == [0, 1, 2, 3]
    assert written["save"] == written["end"]
