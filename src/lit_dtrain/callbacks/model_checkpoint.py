"""Lightning's ``ModelCheckpoint`` whose ``last.ckpt`` is the state of the newest save point, as before lightning 2.6.

From lightning 2.6 ``ModelCheckpoint(save_last=True)`` rewrites ``last.ckpt`` only at a save point where a top-k
checkpoint was saved too (its ``on_validation_end``: "Only save last checkpoint if a checkpoint was actually saved in
this step"). With ``monitor=val/loss`` and ``save_top_k=1`` that is a validation whose loss is a new best, so once the
loss stalls, rises or is noisy, ``last.ckpt`` stays at the best step: a run killed later (SIGKILL, the OOM killer, a
node failure, an exception) resumed with ``resume=auto`` from there and trained every step since again. Here
``last.ckpt`` is written at every validation the callback saves at (and at every train-epoch-end save point), whether
or not the top-k checkpoint changed. A validation is a save point as in Lightning: in an epoch that ``every_n_epochs``
selects (1 when no trigger is given). With ``every_n_train_steps`` or ``train_time_interval`` alone (``every_n_epochs``
then 0) or ``every_n_epochs=2``, a validation outside that schedule writes nothing (it wrote ``last.ckpt`` at every
validation: with ``every_n_train_steps=1000`` and a validation every 100 steps, ten times the checkpoint I/O asked for).

A run dir that was moved or renamed (``mv outputs/runs/a outputs/runs/b``, then ``run_name=b resume=auto``) resumes
its checkpoint state too: Lightning restores it only where the saved ``dirpath`` is this one, so the resumed run
wrote ``last-v1.ckpt`` beside ``last.ckpt`` and never removed the old top-k files (two step files with
``save_top_k=1``). Where the saved file names are found in this ``dirpath``, the saved paths are read in it.

Under gradient accumulation a save at a train batch's end (``train_time_interval``) waits for the end of the optimizer
step: Lightning's saved at the first micro-batch past the interval, mid-step, without the gradients accumulated so far,
so a resume from that file ran its next step on the step's remaining micro-batches only (3 of 4, its loss still
divided by 4) and ended off a straight run (``every_n_train_steps`` saves at a step's end already). So does the save at
a validation that Lightning runs mid-step (a project's ``val_check_interval`` in micro-batches that is no multiple of
``accumulate_grad_batches``; ``train.py`` scales it to steps): it is made at that step's end, with the validation's
metrics (a fit stopped at that validation saves there), unless that step ends with a validation of its own, which
saves with its metrics (the deferred save took the file first, ranked by the older weights' loss).

An ``every_n_train_steps`` save at a step that ends with a validation is made at that validation's end (as Lightning
does for an epoch's last batch), with its ``val/loss``: Lightning's, at the batch's end, named and ranked the file by
the previous validation's loss, and a resume from it skipped that validation (Lightning takes a checkpoint saved at a
train batch's end as past it), so after a kill during it a resumed run never ran it, and the run's last top-k file was
not written (``resume=auto`` had no ``val/loss`` at the next save point, and the fit ended before a validation).
One at an epoch's last batch that no validation follows (a ``val_check_interval`` in batches that does not divide the
epoch) is made there: Lightning's waited for the validation it takes to follow an epoch's last batch, so that step was
in no file (with ``every_n_train_steps=3`` over 2 epochs of 9 batches, a validation every 4: ``last.ckpt`` at step 15).

A fit that resumed ``last.ckpt`` itself and trained no step (a finished run's ``resume=auto``) leaves it as it is:
Lightning's save at train end rewrote it with its ``Timer`` grown by that fit's brief run, so the time a
``trainer.max_time`` run had counted crept on at each such start (:func:`resumed_and_trained_nothing`).

One object given to a new Trainer (built before a sweep loop) starts fresh, as the other callbacks do: its ``dirpath``
from that Trainer unless one was given, and no top-k (``ModelCheckpoint._start_fresh``); its ``ckpt_path="last"`` looks
in that Trainer's run dir (``ModelCheckpoint._find_last_checkpoints``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint as _LightningModelCheckpoint
from typing_extensions import override

from lit_dtrain.callbacks._args import check_arg, whole_at_least
from lit_dtrain.callbacks._state_keys import note_stage, state_is_for_fit
from lit_dtrain.utils.args import is_flag
from lit_dtrain.utils.loop import mid_accumulation, reopen_epoch_end
from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger(__name__)


class ModelCheckpoint(_LightningModelCheckpoint):
    """``lightning.pytorch.callbacks.ModelCheckpoint`` (same arguments, files and checkpoint state) that writes
    ``last.ckpt`` at every validation it saves at when ``save_last=True``, not only when the top-k checkpoint
    changed. A drop-in replacement in a Lightning project of one's own."""

    @functools.wraps(_LightningModelCheckpoint.__init__)  # Lightning's signature (the config's argument check reads it)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Lightning's own checks let every_n_train_steps=2.5 save at steps 5, 10 (global_step % 2.5), True count as 1
        # and verbose="false" print; save_top_k="abc" was "'<' not supported between instances of 'str' and 'int'"
        given = inspect.signature(_LightningModelCheckpoint.__init__).bind(self, *args, **kwargs)
        given.apply_defaults()
        given = given.arguments
        for name, least in (("every_n_train_steps", 0), ("every_n_epochs", 0), ("save_top_k", -1)):
            count = whole_at_least(least, none_ok=name != "save_top_k")  # not "3": Lightning compares it with 0
            check_arg("ModelCheckpoint", name, given[name], lambda v, c=count: not isinstance(v, str) and c(v),
                      f"an integer >= {least}" + (" or None" if name != "save_top_k" else ""))
        for name in ("verbose", "save_on_exception", "save_weights_only", "auto_insert_metric_name",
                     "enable_version_counter", "save_on_train_epoch_end", "save_last"):
            check_arg("ModelCheckpoint", name, given[name], lambda v: v is None or is_flag(v) or v == "link",
                      "True or False" + (" or 'link'" if name == "save_last" else "") + " (or None: the default)")
        super().__init__(*args, **kwargs)
        self._dirpath_from_trainer: str | None = None  # the dirpath setup took from a Trainer (none was given)
        self._save_at_step_end = False  # a validation ran mid-step: its save comes at that step's end
        self.resumed_file_is_own = False  # the fit resumed resume=auto's choice: its top-k may drop that file too

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loop = trainer.fit_loop.epoch_loop
        if mid_accumulation(trainer):  # mid-step: its accumulated grads are in no checkpoint
            return
        ends_with_validation = loop._should_check_val_fx(trainer.fit_loop._data_fetcher)
        if self._save_at_step_end:  # a validation's save, now at the end of the step it ran in
            self._save_at_step_end = False
            if not ends_with_validation:  # else that validation of this step's weights saves, with its own metrics
                self._save_at_validation(trainer)
        if (self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0
                and not self._should_skip_saving_checkpoint(trainer)
                and not self._should_save_on_train_epoch_end(trainer)
                and ends_with_validation):
            self._defer_save_until_validation = True  # Lightning's own deferral: saved at that validation's end
            return
        deferred = self._defer_save_until_validation
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._defer_save_until_validation and not deferred and not ends_with_validation:
            # Lightning defers a save at an epoch's last batch to the validation it takes to follow it, which a
            # val_check_interval in batches that does not divide the epoch never runs: the fit's last step was in no
            # file (every_n_train_steps=1, a validation every 4 of 9 batches: last.ckpt at step 8 of 9)
            candidates = self._monitor_candidates(trainer)
            if self.monitor in candidates:  # (a monitor no validation has logged yet waits for one, as Lightning's)
                self._defer_save_until_validation = False
                if not self._should_skip_saving_checkpoint(trainer):
                    self._save_topk_checkpoint(trainer, candidates)
                    self._save_last_checkpoint(trainer, candidates)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # a validation after a micro-batch that is not its step's last (a val_check_interval in batches that is no
        # multiple of accumulate_grad_batches) saves at that step's end: the file held a step half accumulated, whose
        # grads are in no checkpoint, and a resume from it ran that step on its remaining micro-batches
        self._save_at_step_end = trainer.state.fn == "fit" and not trainer.sanity_checking and mid_accumulation(trainer)
        if not self._save_at_step_end:
            self._save_at_validation(trainer)

    def _save_at_validation(self, trainer: L.Trainer) -> None:
        super().on_validation_end(trainer, trainer.lightning_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_behind(trainer)

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._save_at_step_end:  # the fit stopped mid-step (should_stop at that validation): save what it holds
            self._save_at_step_end = False
            self._save_at_validation(trainer)
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_behind(trainer)

    def _save_last_if_behind(self, trainer: L.Trainer) -> None:
        # _should_skip_saving_checkpoint is also true when this step was saved already (top-k or last): then
        # Lightning wrote last.ckpt itself
        save_point = self._every_n_epochs >= 1 and (trainer.current_epoch + 1) % self._every_n_epochs == 0
        if self.save_last is True and save_point and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        note_stage(self, stage)
        if stage == "fit":
            self._save_at_step_end = False  # (a fit that raised after a mid-step validation owes no save)
        if stage == "fit" and trainer.global_step == 0:  # (before a ckpt_path's state is loaded)
            self._start_fresh()
        given = self.dirpath is not None
        super().setup(trainer, pl_module, stage)
        if not given:
            self._dirpath_from_trainer = self.dirpath

    def _start_fresh(self) -> None:
        """Forget the files of a fit that another Trainer ran with this object (a sweep loop, a next stage): Lightning
        kept its dirpath (taken from the first Trainer's ``default_root_dir``) and its top-k, so a second Trainer's fit
        wrote into the first run's ``checkpoints/``, over its ``epoch=0-step=8.ckpt`` (same name), ranked against its
        scores, and left its own run dir without a file. A given ``dirpath`` stays (the version counter then keeps
        both runs' files apart), as does the state of a second fit of the same Trainer (``global_step`` > 0)."""
        if self.dirpath is not None and self.dirpath == self._dirpath_from_trainer:
            self.dirpath = None  # taken from this fit's Trainer again
        self._last_global_step_saved, self._last_time_checked, self._last_checkpoint_saved = 0, None, ""
        self.current_score, self.best_model_score, self.best_k_models = None, None, {}
        self.best_model_path = self.kth_best_model_path = self.last_model_path = ""
        self.kth_value = torch.tensor(torch.inf if self.mode == "min" else -torch.inf)
        self._defer_save_until_validation = False
        self._over_top_k = []

    @override
    def _find_last_checkpoints(self, trainer: L.Trainer) -> set[str]:
        """The ``last`` files of ``ckpt_path="last"``, which Lightning looks for before ``setup``: for a new Trainer
        (``global_step`` 0, as :meth:`_start_fresh` judges) in its own run dir, not the one a previous Trainer gave
        this object (a sweep loop passing ``ckpt_path="last"`` to every fit resumed the first run's ``last.ckpt`` in
        the second run, which trained no step)."""
        if trainer.global_step != 0 or self.dirpath is None or self.dirpath != self._dirpath_from_trainer:
            return super()._find_last_checkpoints(trainer)
        kept, self.dirpath = self.dirpath, None
        try:
            return super()._find_last_checkpoints(trainer)
        finally:
            self.dirpath = kept

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_is_for_fit(self):
            return
        super().load_state_dict(moved_dirpath_state(state_dict, self.dirpath))
        self._over_top_k = keep_top_k(self)

    @override
    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        # (before the loops' state is restored from it) a fit under max_steps resumed from an epoch-end save ran every
        # later epoch one ahead: another DistributedSampler order, and with max_epochs an epoch short
        if trainer.state.fn == "fit" and trainer.max_steps != -1:
            reopen_epoch_end(checkpoint)  # (a second ModelCheckpoint finds it rewritten: no epoch-end form)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning's writes last.ckpt here when none was written yet, also under fast_dev_run ("checkpointing is
        # suppressed"): a smoke test's step-1 last.ckpt in the run's dirpath, which the real run's ckpt_path="last"
        # then resumed (it trained 3 of its 4 steps, from the smoke test's weights)
        if trainer.fast_dev_run:
            return
        last = self.format_checkpoint_name(self._monitor_candidates(trainer), self.CHECKPOINT_NAME_LAST)
        if self.save_last and resumed_and_trained_nothing(trainer.ckpt_path, last, trainer.global_step,
                                                          getattr(self, "_train_start_step", None)):
            return
        super().on_train_end(trainer, pl_module)

    @override
    def _should_remove_checkpoint(self, trainer: L.Trainer, previous: str, current: str) -> bool:
        # Lightning keeps the file the fit resumed from. resume=auto resumes a step file where a kill left no
        # last.ckpt or one a validation behind (resume.py): that file is this run's own top-k file, which a straight
        # run removes when a better one is saved; kept, it stayed in the dir for good beside the later best. Only
        # once a newer file is saved (current): cut from an over-full top-k at train start, it could be the only
        # file of its step, which a kill before the next save would then have lost
        if super()._should_remove_checkpoint(trainer, previous, current):
            return True
        return bool(current) and previous != current and self._own_resumed_file(trainer, previous)

    def _own_resumed_file(self, trainer: L.Trainer, path: str) -> bool:
        """Whether ``path`` is the file the fit resumed from, resume=auto's choice in this dirpath."""
        return (self.resumed_file_is_own and trainer.ckpt_path is not None
                and os.path.abspath(path) == os.path.abspath(trainer.ckpt_path)
                and os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.dirpath or ""))

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._train_start_step = trainer.global_step
        self._resumed_over_top_k = []  # the file resumed from, cut here: removed at the fit's first save
        for path in getattr(self, "_over_top_k", ()):  # in this dirpath, not the file resumed from: Lightning's rule
            if self._should_remove_checkpoint(trainer, path, ""):
                trainer.strategy.remove_checkpoint(path)
            elif self._own_resumed_file(trainer, path):  # the only file of its step until the fit saves
                self._resumed_over_top_k.append(path)
        self._over_top_k = []

    @override
    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        super()._save_checkpoint(trainer, filepath)
        # cut from the top-k at train start, it was no longer tracked: it stayed for good beside the new top-k
        for path in getattr(self, "_resumed_over_top_k", ()):
            if self._should_remove_checkpoint(trainer, path, filepath):
                trainer.strategy.remove_checkpoint(path)
        self._resumed_over_top_k = []


def own_the_resumed_file(callbacks: list) -> None:
    """Let each :class:`ModelCheckpoint` of ``callbacks`` remove the file its fit resumes from where its top-k drops
    it: ``resume=auto``'s choice, this run's own checkpoint (Lightning keeps a resumed file for good)."""
    for callback in callbacks:
        if isinstance(callback, ModelCheckpoint):
            callback.resumed_file_is_own = True


def resumed_and_trained_nothing(ckpt_path, path: str, step: int, start_step: int | None) -> bool:
    """Whether a fit resumed the file ``path`` itself (``ckpt_path``: the file it restored) and trained no step
    (``step`` is still its ``start_step``), so that a save of ``path`` would change only what that brief fit counted:
    Lightning's ``Timer`` grew by it (a run EarlyStopping stopped, with ``trainer.max_time`` set, counted 53.946 s,
    53.947 s, 53.951 s of training after three starts that trained nothing). A fit from another file (a step
    checkpoint, the one ``resume=auto`` took where ``last.ckpt`` is damaged) still writes ``path``."""
    if not ckpt_path or start_step is None or step != start_step:
        return False
    try:
        return os.path.samefile(ckpt_path, path)
    except OSError:  # path is not there (yet)
        return False


def moved_dirpath_state(state: dict[str, Any], dirpath: str | None) -> dict[str, Any]:
    """``ModelCheckpoint``'s saved ``state`` with its paths read in ``dirpath`` where it was saved in another
    directory whose files are here now (the run dir was moved or copied); else ``state`` as it is."""
    old = state.get("dirpath")
    if not old or not dirpath or os.path.abspath(old) == os.path.abspath(dirpath):
        return state

    def here(path):
        return os.path.join(dirpath, os.path.basename(path)) if path and os.path.dirname(path) == old else path

    named = [state.get("last_model_path"), *(state.get("best_k_models") or {})]
    if not any(p and here(p) != p and os.path.isfile(here(p)) for p in named):
        return state  # another run's checkpoint (a start from it in a new run dir): Lightning restores no paths
    log_once(log, logging.INFO,  # every rank reads the moved paths: rank 0 says it
             "ModelCheckpoint: the checkpoint was saved in %s; its files are read in %s (the run dir moved)", old,
             dirpath)
    paths = ("best_model_path", "kth_best_model_path", "last_model_path")
    return {**state, "dirpath": dirpath, **{k: here(state.get(k)) for k in paths if k in state},
            "best_k_models": {here(p): v for p, v in (state.get("best_k_models") or {}).items()}}



def keep_top_k(callback: _LightningModelCheckpoint) -> list[str]:
    """Cut a restored top-k (``best_k_models``) to the callback's ``save_top_k`` (at least 1) where it holds more (a
    resume with a lower ``save_top_k``), keeping the best by ``mode``; the paths left out, whose files are to be
    removed. Lightning prunes only where the top-k holds exactly ``save_top_k`` files: resumed with ``save_top_k=1``
    from a run with -1, it kept every step file of the run and every later one (5 files after 15 steps)."""
    k, scores = callback.save_top_k, callback.best_k_models
    if k < 1 or len(scores) <= k:
        return []
    ranked = sorted(scores, key=lambda p: float(scores[p]), reverse=callback.mode == "max")
    keep, drop = ranked[:k], ranked[k:]
    callback.best_k_models = {p: scores[p] for p in keep}
    callback.best_model_path, callback.best_model_score = keep[0], scores[keep[0]]
    callback.kth_best_model_path, callback.kth_value = keep[-1], scores[keep[-1]]
    log_once(log, logging.WARNING,  # every rank restores and cuts the same top-k: rank 0 says it
             "ModelCheckpoint: save_top_k=%d, and the checkpoint's top-k holds %d files: removing %s", k, len(scores),
             ", ".join(os.path.basename(p) for p in drop))
    return drop
