"""``WSDScheduler(total_steps=None)`` in a user's own Lightning project: the horizon is the trainer's planned optimizer
steps (``trainer.estimated_stepping_batches``), taken at each train start. Before, ``total_steps`` was required, and a
``Trainer(max_epochs=3)`` user computed ``epochs x ceil(batches / accumulate)`` by hand (``limit_train_batches``,
the ``DistributedSampler``'s share and the last partial accumulation included)."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch.utils.data import DataLoader, IterableDataset

from lit_dtrain.callbacks import WSDScheduler
from lit_dtrain.errors import ConfigError
from tests.unit._user_project_helpers import UpdateLRs, UserModule, _equal, fit, regression_data


@pytest.mark.parametrize(
    ("trainer_kwargs", "steps"),
    [
        ({"max_epochs": 3}, 24),  # 8 batches an epoch
        ({"max_epochs": 3, "limit_train_batches": 5}, 15),
        ({"max_epochs": 3, "accumulate_grad_batches": 3}, 9),  # ceil(8 / 3) = 3 steps an epoch, the last of 2 batches
        ({"max_epochs": 3, "max_steps": 10}, 10),
    ],
    ids=["epochs", "limit_train_batches", "accumulate3", "max_steps_first"],
)
def test_wsd_without_total_steps_decays_over_the_steps_the_trainer_takes(tmp_path: Path, trainer_kwargs, steps):
    """Every step uses the schedule of a horizon equal to the steps the fit takes: the decay (a quarter of them) ends
    on the last step, at min_lr_factor."""
    wsd, record = WSDScheduler(warmup_steps=2, decay_fraction=0.25, decay_type="linear"), UpdateLRs()
    trainer = fit(tmp_path, [wsd, record], **{"max_steps": -1, **trainer_kwargs})
    assert trainer.global_step == wsd.total_steps == steps and wsd.decay_steps == round(steps / 4)
    assert record.used[0] == [1e-2 * wsd.lr_factor(k) for k in range(steps)]
    assert record.used[0][-1] == 0.0 and record.used[0][-wsd.decay_steps - 1] == 1e-2
    fit(tmp_path, [wsd], max_steps=-1, max_epochs=1)  # the same callback in another fit: that fit's horizon
    assert wsd.total_steps == 8


def test_wsd_counts_the_steps_of_a_gradient_accumulation_schedule(tmp_path: Path) -> None:
    """GradientAccumulationScheduler({1: 2}) over 3 epochs of 8 batches takes 8 + 4 + 4 = 16 optimizer steps, where
    Lightning's estimate counts 24 (every epoch at the first epoch's accumulation). total_steps=None was refused; now
    the horizon is 16 and the decay ends on the last step. A given total_steps=18 ran its last step at 0.5 of the
    peak LR without a word (the horizon check was skipped beside the scheduler); now it is warned."""
    wsd, record = WSDScheduler(warmup_steps=2, decay_fraction=0.25, decay_type="linear"), UpdateLRs()
    trainer = fit(tmp_path, [wsd, record, GradientAccumulationScheduler({1: 2})], max_steps=-1, max_epochs=3)
    assert trainer.global_step == wsd.total_steps == 16 and wsd.decay_steps == 4
    assert record.used[0] == [1e-2 * wsd.lr_factor(k) for k in range(16)] and record.used[0][-1] == 0.0
    given = WSDScheduler(total_steps=18, warmup_steps=2, decay_steps=4, decay_type="linear")
    with pytest.warns(UserWarning, match=r"the trainer stops after 16 optimizer steps, inside the decay \(steps "
                                         r"14..17, total_steps=18\): its last step runs at 0.5 of the peak LR"):
        fit(tmp_path, [given, GradientAccumulationScheduler({1: 2})], max_steps=-1, max_epochs=3)


class StatefulLoader(DataLoader):
    """The user's DataLoader with a checkpointed state (a torchdata ``StatefulDataLoader`` has one)."""

    loaded = None

    def state_dict(self) -> dict:
        return {"position": "saved"}

    def load_state_dict(self, state_dict: dict) -> None:
        self.loaded = state_dict


class StatefulData(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        self.loader = StatefulLoader(regression_data().dataset, batch_size=8)
        return self.loader


def test_wsd_without_total_steps_resumes_bitwise_and_a_longer_trainer_extends_it(tmp_path: Path, caplog):
    """The horizon taken is in the callback's state. A resume with the same trainer takes the same one (weights and
    state bitwise those of the straight run) and restores a stateful DataLoader's state: the horizon taken at fit
    start set the loader up before Lightning's restore, which then never loaded its state (Lightning #20550), so the
    data restarted where its DataLoader starts. A resume with a larger ``max_epochs`` extends the schedule, as a
    larger ``total_steps`` does: the stable phase goes on and the decay moves to the new end (logged)."""
    straight_cb, straight = WSDScheduler(warmup_steps=2, decay_fraction=0.25), UserModule(groups=True)
    fit(tmp_path / "a", [straight_cb], straight, max_steps=-1, max_epochs=3, save_every=8, datamodule=StatefulData())
    (ckpt,) = (tmp_path / "a" / "ckpt").glob("*step=8.ckpt")  # an epoch's end, in the stable phase
    assert torch.load(ckpt, weights_only=True)["callbacks"][straight_cb.state_key]["total_steps"] == 24
    resumed_cb, resumed = WSDScheduler(warmup_steps=2, decay_fraction=0.25), UserModule(groups=True)
    data = StatefulData()
    fit(tmp_path / "b", [resumed_cb], resumed, max_steps=-1, max_epochs=3, ckpt_path=str(ckpt), datamodule=data)
    assert data.loader.loaded == {"position": "saved"}
    assert _equal(resumed_cb.state_dict(), straight_cb.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(straight.state_dict().values(), resumed.state_dict().values()))

    extended, record = WSDScheduler(warmup_steps=2, decay_fraction=0.25), UpdateLRs()
    with caplog.at_level(logging.INFO, logger="lit_dtrain.callbacks.wsd"), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        trainer = fit(tmp_path / "c", [extended, record], UserModule(groups=True), max_steps=-1, max_epochs=4,
                      ckpt_path=str(ckpt), datamodule=StatefulData())
    assert [str(m.message) for m in w if "WSDScheduler(total_steps=None)" in str(m.message)] == []  # same LR
    assert trainer.global_step == extended.total_steps == 32 and extended.decay_steps == 8
    assert record.used[0] == [1e-2 * extended.lr_factor(k) for k in range(8, 32)]
    assert record.used[0][15] == 1e-2 and record.used[0][-1] == 0.0  # step 23, straight's last (LR 0), at the peak
    assert "resuming with a changed schedule (saved, now): {'total_steps': (24, 32), 'decay_steps': (6, 8)}" in (
        caplog.text)


@pytest.mark.parametrize(("epochs", "limit", "moved"), [(4, None, "jumps up"), (3, None, None), (3, 6, "drops")],
                         ids=["decayed_extended", "same_trainer", "horizon_shrank"])
def test_wsd_without_total_steps_warns_when_a_resumes_horizon_moves_the_lr(tmp_path: Path, epochs, limit, moved):
    """The trainer's count can change under a resume without the user touching the schedule (limit_train_batches,
    more processes, another dataset length), or with it (a finished run's max_epochs raised): when the checkpoint's
    next step then gets another LR than its run would have used, a warning names both LRs and the horizon to pass;
    the same trainer is quiet. (An info log line only, which a user's project does not show, said nothing.)"""
    first = WSDScheduler(warmup_steps=2, decay_fraction=0.5)
    fit(tmp_path / "a", [first], max_steps=-1, max_epochs=3, save_every=4)  # horizon 24, decay over steps 12..23
    step = 24 if moved == "jumps up" else 12  # decayed (LR 0), or inside the decay
    (ckpt,) = (tmp_path / "a" / "ckpt").glob(f"*step={step}.ckpt")
    resumed = WSDScheduler(warmup_steps=2, decay_fraction=0.5)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fit(tmp_path / "b", [resumed], max_steps=-1, max_epochs=epochs, limit_train_batches=limit, ckpt_path=str(ckpt))
    said = [str(m.message) for m in w if "WSDScheduler(total_steps=None)" in str(m.message)]
    if moved is None:
        assert said == []
        return
    before, now = first.lr_factor(step), resumed.lr_factor(step)
    assert said == [
        f"WSDScheduler(total_steps=None) takes its horizon from trainer.estimated_stepping_batches: this fit plans "
        f"{resumed.total_steps} optimizer steps, the checkpoint's run planned 24 (max_steps/max_epochs, "
        f"limit_train_batches, the number of processes or the data's length changed), so its next step {step} runs at "
        f"{now:.4g} of the peak LR, not the {before:.4g} its run would have used (the LR {moved}). To keep "
        f"its schedule, pass total_steps=24"
    ]


class Unsized(IterableDataset):
    def __iter__(self):
        yield from regression_data().dataset


@pytest.mark.parametrize(
    ("trainer_kwargs", "module", "data", "match"),
    [
        ({"max_epochs": -1}, UserModule, regression_data, r"which is inf here \(max_steps=-1, max_epochs=-1\)"),
        ({"max_epochs": 2}, UserModule, lambda: DataLoader(Unsized(), batch_size=8),
         r"which is -1 here \(max_steps=-1, max_epochs=2 and the train DataLoader has no length\)"),
        ({"max_epochs": 2}, lambda: UserModule(manual=True), regression_data, r"under manual optimization counts"),
    ],
    ids=["no_end", "unsized_loader", "manual_optimization"],
)
def test_wsd_without_total_steps_refuses_a_trainer_whose_steps_are_unknown(tmp_path: Path, trainer_kwargs, module,
                                                                           data, match):
    """A one-line ConfigError at train start, before a step trains, naming total_steps."""
    user = module()
    callbacks = [WSDScheduler(decay_steps=2), *trainer_kwargs.pop("callbacks", [])]
    trainer = L.Trainer(accelerator="cpu", max_steps=-1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **trainer_kwargs)
    with pytest.raises(ConfigError, match=rf"^WSDScheduler\(total_steps=None\) takes its horizon .*{match}.*"
                                          r"give total_steps=<"):
        trainer.fit(user, data())
    assert user.steps_run == 0


def test_wsd_warns_when_a_step_past_its_horizon_starts_that_the_estimate_did_not_plan(tmp_path: Path):
    """Lightning's estimate counts every epoch at the current epoch length, also those trained before a resume that
    changed it: a 3-epoch run of 8-step epochs resumed after its first epoch with 4-step epochs (another
    limit_train_batches; more processes do the same) takes the horizon 3 x 4 = 12, but the fit runs to step 16. Its
    steps 12..15 ran at LR 0 without a word; a warning now says so when step 12 starts."""
    fit(tmp_path / "a", [WSDScheduler(warmup_steps=2, decay_fraction=0.25)], max_steps=-1, max_epochs=3, save_every=8)
    (ckpt,) = (tmp_path / "a" / "ckpt").glob("*step=8.ckpt")
    wsd, record = WSDScheduler(warmup_steps=2, decay_fraction=0.25), UpdateLRs()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = fit(tmp_path / "b", [wsd, record], max_steps=-1, max_epochs=3, limit_train_batches=4,
                      ckpt_path=str(ckpt))
    assert wsd.total_steps == 12 and trainer.global_step == 16 and record.used[0][4:] == [0.0] * 4  # steps 12..15
    assert [str(w.message) for w in caught if "past total_steps" in str(w.message)] == [
        "WSDScheduler: the fit goes on past total_steps=12 (step 12; at train start trainer.estimated_stepping_batches "
        "was 12, which counts every epoch at the current epoch length, also those trained before a resume that changed "
        "it): its remaining steps run at min_lr_factor=0.0 of the peak LR. Pass total_steps=<the fit's last step + 1>, "
        "or stop the trainer at max_steps=12"
    ]


def test_wsd_without_total_steps_warns_when_a_second_fit_of_the_same_trainer_moves_the_lr(tmp_path: Path) -> None:
    """trainer.fit again on the same Trainer with max_epochs raised goes on from its global_step: the schedule took
    the new horizon and the decayed LR (0 at step 7) jumped to the peak at step 8 without a word."""
    wsd = WSDScheduler(decay_fraction=0.25)
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[wsd])
    module = UserModule()
    trainer.fit(module, regression_data())  # 8 steps, decay over steps 6..7
    trainer.fit_loop.max_epochs = 2
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        trainer.fit(module, regression_data())
    assert trainer.global_step == 16
    said = [str(m.message) for m in w if "WSDScheduler(total_steps=None)" in str(m.message)]
    assert len(said) == 1 and (
        "this fit plans 16 optimizer steps, the previous fit of this Trainer planned 8 (max_steps/max_epochs, "
        "limit_train_batches, the number of processes or the data's length changed), so its next step 8 runs at 1 of "
        "the peak LR, not the 0 its run would have used (the LR jumps up). To keep its schedule, pass total_steps=8"
    ) in said[0]


@pytest.mark.parametrize("total_steps", [None, 8], ids=["from_trainer", "given"])
def test_wsd_under_fast_dev_run_runs_the_warmup_and_gives_no_horizon_advice(tmp_path: Path, caplog, total_steps):
    """Trainer(fast_dev_run=n) replaces max_steps by n: WSDScheduler(total_steps=None) took n as the run's horizon and
    refused the smoke test (fast_dev_run=True: ``ValueError: ... warmup_steps=2 + decay_steps=0 > total_steps=1``;
    fast_dev_run=3: ``... 2 + 2 > 3``), and a given total_steps=8 was told 'For the decay in this fit, set
    total_steps=2'. Its steps run the schedule's warmup now (then the peak LR), with no such line."""
    wsd, record = WSDScheduler(total_steps=total_steps, warmup_steps=2, decay_fraction=0.5), UpdateLRs()
    with caplog.at_level(logging.INFO), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        trainer = fit(tmp_path, [wsd, record], fast_dev_run=3)
    assert trainer.global_step == 3 and record.used[0] == [0.5e-2, 1e-2, 1e-2]
    said = caplog.text + "".join(str(m.message) for m in w)
    assert "set total_steps" not in said.lower() and "fit stopped" not in said
