"""When ``PreemptionCheckpoint`` takes the stop signals: as soon as Lightning has registered its handler in a fit
(before the strategy's ``barrier("run-stage")``, where no callback hook runs; the 2-rank run is
``tests/e2e/test_sigterm_at_train_start_ddp.py``), and not in a ``validate`` of the same trainer."""

from __future__ import annotations

import signal

import lightning as L

from lit_dtrain.callbacks import PreemptionCheckpoint
from tests.toys import TinyRegression


class _Validated(TinyRegression):
    def __init__(self, seen) -> None:
        super().__init__()
        self.seen = seen

    def validation_step(self, batch, batch_idx):
        return self.loss(batch)

    def val_dataloader(self):
        return super().train_dataloader()

    def train_dataloader(self):  # (the fit's data setup: after Lightning registered its handler, before any hook)
        self.seen._note(self.trainer)
        return super().train_dataloader()


class _HandlerSeen(L.Callback):
    """Whether PreemptionCheckpoint's handler is SIGTERM's at each stage's first hook."""

    def __init__(self, owner: PreemptionCheckpoint) -> None:
        self.preemption, self.seen = owner, []

    def _note(self, trainer) -> None:
        self.seen.append((str(trainer.state.fn.value), signal.getsignal(signal.SIGTERM) == self.preemption._on_sigterm))

    def on_fit_start(self, trainer, pl_module) -> None:
        self._note(trainer)

    def on_train_start(self, trainer, pl_module) -> None:
        self._note(trainer)

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.training:
            self._note(trainer)


def test_the_signals_are_taken_once_lightning_registers_its_handler_and_not_in_a_validate(tmp_path) -> None:
    """Lightning's handler, which broadcasts inside itself on several ranks, was SIGTERM's from its registration to
    the first callback's on_sanity_check_start or on_train_start (the strategy's barrier("run-stage"), the data's
    setup). Taken at the registration, they must not be in a validate after the fit (train() validates so): it took
    them with no on_train_end to give them back, and a next fit of the trainer found them taken and left Lightning's
    handler in place."""
    before = signal.getsignal(signal.SIGTERM)
    owner = PreemptionCheckpoint(str(tmp_path / "ckpt"))
    seen = _HandlerSeen(owner)
    trainer = L.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        callbacks=[owner, seen], default_root_dir=tmp_path)
    module = _Validated(seen)
    trainer.fit(module)
    trainer.validate(module, verbose=False)
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(module)
    # on_fit_start runs before Lightning registers its handler (StopsBeforeTraining's time in train())
    fit = [("fit", False), ("fit", True), ("fit", True)]  # on_fit_start, the data's setup, on_train_start
    assert seen.seen == [*fit, ("validate", False), *fit]
    assert signal.getsignal(signal.SIGTERM) == before
