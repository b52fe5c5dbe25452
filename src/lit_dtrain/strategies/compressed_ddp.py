"""``CompressedDDPStrategy``: Lightning DDP whose gradient all-reduce goes through a compressor or a local-update rule.

Why a subclass: Lightning's ``DDPStrategy._register_ddp_hooks`` registers communication hooks only when
``root_device.type == "cuda"``, so on CPU/gloo a ``ddp_comm_hook`` is silently skipped. We register ours on every
device. Why the checkpoint overrides: torch's PowerSGD/post-local-SGD state is lost on resume (pytorch#75666,
#74556). Here every rank's compressor state (error-feedback residuals, PowerSGD Q matrices, call counters) is
gathered to rank 0 in :meth:`save_checkpoint` and written under ``checkpoint["lit_dtrain_comm"]`` with the
replicated local-update state (counters, period, DiLoCo outer parameters and momentum); :meth:`load_checkpoint` (run
on every rank before DDP wrapping) hands each rank its own part back. The strategy, not a companion callback, owns
this because only the strategy sees every rank at save time and exists before the model is wrapped; it also logs
``comm/*`` metrics from ``optimizer_step`` through ``LightningModule.log``. What a resume under another strategy
drops of that state, what one on another number of ranks keeps, and the warnings that say so are in
:mod:`.comm_checkpoint`; the state's gathering and hand-back in :mod:`._comm_state`.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lit_dtrain.callbacks._args import check_arg
from lit_dtrain.config_keys import TIMEOUT_INSTEAD, refuse_unknown_keywords
from lit_dtrain.errors import ConfigError
from lit_dtrain.strategies._comm_state import apply_comm_state, gather_comm_state, kept_for_a_resume
from lit_dtrain.strategies._connect import DEFAULT_CONNECT_S, FirstConnection
from lit_dtrain.strategies._setup_refusals import SetupRefusalsShared
from lit_dtrain.strategies.comm import CommSession, Communicator
from lit_dtrain.strategies.comm_checkpoint import (
    CHECKPOINT_KEY,
    dropped_comm_state_message,
    refused_resume_message,
    warn_if_comm_state_dropped,
)
from lit_dtrain.strategies.compressors import Compressor
from lit_dtrain.strategies.fit_end import (
    EpochLengthCheck,
    force_sync_after_batch,
    force_sync_this_step,
    note_checkpoint,
    only_ends_the_fit,
    refuse_validation_by_time,
    sync_before_a_validation_mid_accumulation,
    sync_or_warn_before_validation,
    warn_checkpoint_before_final_sync,
)
from lit_dtrain.strategies.local_updates import LocalSGD, LocalUpdate, restore_rank_params
from lit_dtrain.strategies.payload_overflow import naming_payload_overflow
from lit_dtrain.strategies.registry import build_compressor, build_local_update
from lit_dtrain.strategies.unused_params import advise_the_strategys_flag, globally_unused, reducer_parameter_ids
from lit_dtrain.strategies.without_effect import sync_flags, warn_about_settings_without_effect
from lit_dtrain.utils.args import is_flag, is_number
from lit_dtrain.utils.distributed import RankFailureRecords, destroy_process_group_at_exit, naming_peer_failures

__all__ = [
    "CHECKPOINT_KEY", "CompressedDDPStrategy", "collective_timeout", "dropped_comm_state_message",
    "register_strategies", "warn_if_comm_state_dropped",
]


_MOST_SECONDS = 1e9  # a collective timeout in int64 nanoseconds ends near 9.2e9 s


def collective_timeout(seconds: Any, caller: str | None = None, key: str = "collective_timeout_s") -> timedelta:
    """``collective_timeout_s`` as a ``timedelta``; a ValueError unless it is a number > 0 and <= 1e9 (a negative one
    reached torch's TCPStore as 'The client socket has timed out after -1000ms'). It names ``caller``'s argument
    (``make_ddp: collective_timeout_s ...``) where given, else the config key ``strategy.collective_timeout_s``, which
    :func:`~lit_dtrain.strategies.by_name.build_strategy` checks before it builds a config's strategy: a Python user's
    ``make_ddp(collective_timeout_s='60')`` was told of ``strategy.collective_timeout_s``, a key of train.py's."""
    ok = is_number(seconds) and seconds > 0  # np.int64(60) too
    name = f"{caller}: {key}" if caller else f"strategy.{key}"
    if not ok or seconds == float("inf"):
        raise ValueError(f"{name} must be a number of seconds > 0, got {seconds!r}")
    if seconds > _MOST_SECONDS:  # "no timeout" written large: 1e10 failed the first connection at once ('The client
        # socket has timed out after 10000000000000ms'), 1e20 was an OverflowError naming nothing
        raise ValueError(f"{name} must be at most 1e9 seconds (31 years; torch counts it in nanoseconds, and a longer "
                         f"one overflows), got {seconds!r}")
    return timedelta(seconds=float(seconds))


class CompressedDDPStrategy(SetupRefusalsShared, RankFailureRecords, FirstConnection, EpochLengthCheck, DDPStrategy):
    """DDP with compressed gradient all-reduce (fp16/bf16/int8/int4/PowerSGD/top-k/sign) or local updates.

    Args:
        compressor: gradient codec for the per-step all-reduce (instance, name or ``{"name", **kwargs}``);
            ``None`` with no ``local_update`` means uncompressed fp32 through the accounted hook.
        local_update: ``LocalSGD``/``DiLoCo`` (or its name/mapping): no per-step gradient all-reduce;
            parameters synchronize every ``sync_period`` steps. Exclusive with ``compressor``.
        collective_timeout_s: timeout of every collective (a dead rank fails the others after it).
        connect_timeout_s: how long the ranks' first connection waits for every rank (at least
            ``collective_timeout_s``).
        log_comm_metrics: log ``comm/bytes_per_step``, ``comm/compression_ratio``, ``comm/time_ms``, ...
        sync_on_last_step: (local updates; default true) synchronize at the fit's last step (``max_steps`` or
            ``max_epochs``) so the final model and its checkpoints are the synchronized model.
        sync_before_validation: (local updates; default true) synchronize before a validation inside the fit; off:
            each rank validates its own parameters (warned). Either one given under a per-step codec is warned.
        **kwargs: passed to Lightning's ``DDPStrategy`` (``start_method``, ``find_unused_parameters``, ...).
    """

    strategy_name = "ddp_compressed"

    def __init__(
        self,
        compressor: Compressor | str | Mapping | None = None,
        local_update: LocalUpdate | str | Mapping | None = None,
        collective_timeout_s: float = 1800.0,
        connect_timeout_s: float = DEFAULT_CONNECT_S,
        log_comm_metrics: bool = True,
        sync_on_last_step: bool | None = None,
        sync_before_validation: bool | None = None,
        **kwargs: Any,
    ) -> None:
        for key in ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period"):
            if kwargs.get(key) is not None:
                raise ValueError(f"CompressedDDPStrategy installs its own comm hook; remove {key}= "
                                 f"(use compressor=/local_update=)")
        refuse_unknown_keywords(type(self), kwargs, type(self).__name__,
                                "Lightning's DDPStrategy or torch's DistributedDataParallel", TIMEOUT_INSTEAD)
        for name, value, none_ok in (("log_comm_metrics", log_comm_metrics, False),  # bool("false") is True
                                     ("sync_on_last_step", sync_on_last_step, True),
                                     ("sync_before_validation", sync_before_validation, True)):
            check_arg(type(self).__name__, name, value, lambda v, n=none_ok: (n and v is None) or is_flag(v),
                      "True or False" + (" (or None: True)" if none_ok else ""))
        name = type(self).__name__
        super().__init__(timeout=collective_timeout(collective_timeout_s, name), **kwargs)
        self._connect_timeout = collective_timeout(connect_timeout_s, name, "connect_timeout_s")
        self.session = CommSession(build_compressor(compressor), build_local_update(local_update))
        self.log_comm_metrics = bool(log_comm_metrics)
        flags = sync_flags(self, sync_on_last_step, sync_before_validation)  # None: true; warned when they do nothing
        self.sync_on_last_step, self.sync_before_validation = flags
        self._rank_restore: dict | None = None  # this rank's params/optimizer state from a local-update checkpoint

    @property
    def _keeps_unused_residuals(self) -> bool:
        """Whether a step can leave parameters unused (``find_unused_parameters``) under an error-feedback codec."""
        c = self.compressor
        return bool(self._ddp_kwargs.get("find_unused_parameters")) and c is not None and c.error_feedback

    def _loss_scaler(self):
        """The enabled GradScaler of ``16-mixed`` when a compressor runs the gradient all-reduce, else None."""
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler if scaler is not None and self.compressor is not None and scaler.is_enabled() else None

    @property
    def compressor(self) -> Compressor | None:
        return self.session.compressor

    @property
    def local_update(self) -> LocalUpdate | None:
        return self.session.local_update

    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # the process group exists from here on (and this fit's failure records)
        destroy_process_group_at_exit()

    @override
    def setup(self, trainer) -> None:
        refuse_validation_by_time(self, trainer)  # on every rank, before any collective
        warn_about_settings_without_effect(self, trainer)
        self._state_before_early_sync = None  # an earlier fit's (_comm_state.kept_for_a_resume)
        super().setup(trainer)

    @override
    def _register_ddp_hooks(self) -> None:
        # Lightning only registers hooks on CUDA; ours runs on every device and backend.
        assert isinstance(self.model, DistributedDataParallel)
        self.session.attach(self.model, Communicator(group=None))
        self._reducer_ids = reducer_parameter_ids(self.model)  # for globally_unused, as trainable at the wrap
        self._check_restored_state_fits()
        if self._keeps_unused_residuals or self._loss_scaler() is not None:
            # each step's pre-step residuals (and codec state), for keep_residuals and for a step the GradScaler skips
            self.compressor.track_undo(True)
        params = (self._rank_restore or {}).pop("params", None)
        if params is not None:  # a resume under local updates: this rank's own parameters, not rank 0's
            restore_rank_params(self.lightning_module, params, self.local_update, self.session.comm)
        what = self.local_update if self.local_update is not None else self.compressor
        rank_zero_info(f"CompressedDDPStrategy: comm hook registered on {self.root_device.type} "
                       f"({dist.get_backend()}): {what!r}")

    def _check_restored_state_fits(self) -> None:
        """A ConfigError naming the checkpoint when a restored codec state holds parameters this model lacks (or
        residuals of another size): a model that loaded with another layout (``strict=False``, a renamed layer)."""
        numels = {name: p.numel() for name, p in self.lightning_module.named_parameters()}
        for codec in (self.compressor, getattr(self.local_update, "compressor", None)):
            try:
                if codec is not None:
                    codec.check_fits(numels)
            except ValueError as e:
                where = getattr(self.lightning_module._trainer, "ckpt_path", None) or "the restored state"
                raise ConfigError(f"{where}: {e}; resume it with the model that wrote it, or with strategy=ddp, "
                                  "which drops this state") from e

    def _tell_grad_scale(self) -> float | None:
        """Under 16-mixed tell the codec the scaler's scale (returned), else None. The buckets hold scale * grad, so
        the residuals must follow the scaler's changes of scale. As the fp32 the scaler holds: before its first step
        it reports init_scale as given (1000.1), after it as fp32 (1000.0999755859375), which read as a skip."""
        scaler = self._loss_scaler()
        if scaler is None:
            return None
        scale = torch.tensor(scaler.get_scale(), dtype=torch.float32).item()
        self.compressor.set_grad_scale(scale)
        return scale

    @override
    def backward(self, closure_loss, optimizer, *args, **kwargs):
        # the comm hook runs in this backward: under manual optimization (manual_backward) that is before
        # optimizer_step, so the codec is told the scale here too (under automatic optimization it already was)
        self._tell_grad_scale()
        output = super().backward(closure_loss, optimizer, *args, **kwargs)
        with naming_peer_failures():  # mid accumulation before a validation: sync before the batch's callbacks
            sync_before_a_validation_mid_accumulation(self)
        return output

    @override
    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        with naming_peer_failures():  # the closure's forward/backward (DDP's collectives) and a local-update sync
            return self._optimizer_step(optimizer, closure, model, **kwargs)

    def _optimizer_step(self, optimizer, closure, model=None, **kwargs):
        module = self.lightning_module
        named = CommSession.named_params(module)
        self.session.before_optimizer_step(named)
        scaler, scale = self._loss_scaler(), self._tell_grad_scale()
        with naming_payload_overflow(self.compressor, self.session.step, self.world_size):  # LitLLM's NonFiniteError
            output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if scaler is not None and float(scaler.get_scale()) < scale:
            # The GradScaler found inf/NaN in the reduced grads, the same on every rank, and skipped the step
            # everywhere (update() multiplies the scale by backoff_factor < 1 exactly then). The step's gradient is
            # discarded, as in plain DDP, so the comm hook's changes go too: every rank's residuals (and PowerSGD's
            # Qs, int8_rs's server residuals) are what they were before the step, also on the ranks whose own
            # gradient was finite and in the buckets that were finite.
            self.compressor.undo_step()
        elif self._keeps_unused_residuals:  # DDP dropped what the hook sent for a parameter no rank used (its grad
            # stays None, or zeros when zeroed in place): its error-feedback residual goes back to its pre-step value
            unused = globally_unused(self.model, self._reducer_ids, named, self.session.names)
            if unused:
                self.compressor.keep_residuals(unused)
        trainer = module.trainer if module is not None and module._trainer is not None else None
        # the fit's last step, or one a validation follows: the step's callbacks and checkpoints see the sync
        manual = module is not None and not module.automatic_optimization
        force = force_sync_this_step(self, trainer, manual)
        keep = force and only_ends_the_fit(self, trainer, counting=True)  # for an extension of the finished fit
        with kept_for_a_resume(self, trainer.global_step + 1 if keep else None, counting=True):
            metrics = self.session.after_optimizer_step(named, force_sync=force)
        if self.log_comm_metrics and trainer is not None and module._current_fx_name is not None:
            for key, value in metrics.items():
                module.log(key, value, on_step=True, on_epoch=False, sync_dist=False)
        return output

    @override
    def training_step(self, *args, **kwargs):
        if isinstance(self.local_update, LocalSGD):  # a layer frozen mid-fit: first average what trained until now
            with naming_peer_failures():
                named = CommSession.named_params(self.lightning_module)
                self.local_update.sync_if_trainable_changed(named, self.session.comm)
        output = super().training_step(*args, **kwargs)
        module = self.lightning_module
        trainer = module.trainer
        if not module.automatic_optimization and force_sync_after_batch(self, trainer):
            keep = only_ends_the_fit(self, trainer, counting=False)  # for an extension of the finished fit
            # after the batch's last optimizer step, before its callbacks
            with naming_peer_failures(), kept_for_a_resume(self, trainer.global_step if keep else None):
                self.session.final_sync(self.session.named_params(module))
        return output

    @override
    def on_validation_start(self) -> None:
        with naming_peer_failures():  # under local updates the ranks' parameters may differ now
            sync_or_warn_before_validation(self)
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        # a run stopped by epochs or early stopping may end between syncs: synchronize once more
        if self.local_update is not None and self.session.comm is not None:
            warn_checkpoint_before_final_sync(self)
            # for a checkpoint saved after the fit (trainer.save_checkpoint, as train.py does): an extension
            step = self.lightning_module.trainer.global_step if self.local_update.steps_since_sync else None
            with naming_peer_failures(), kept_for_a_resume(self, step):
                self.session.final_sync(CommSession.named_params(self.lightning_module))
        super().on_train_end()

    # --- a rank that fails alone ----------------------------------------------------------------------------
    # Under local updates one rank can raise alone (a NaN loss there: no gradient all-reduce spreads it). The other
    # ranks then fail in their next collective with gloo's 'Connection closed by peer', which does not say why. The
    # failing rank records its error in the process group's store (RankFailureRecords); a rank whose collective
    # fails (in the step, in a callback's reduce/all_gather/broadcast/barrier, or in the final sync) raises
    # PeerRankFailedError naming it.
    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)  # RankFailureRecords: recorded for the other ranks
        advise_the_strategys_flag(exception, type(self).__name__)  # not Lightning's plain DDP

    @override
    def reduce(self, tensor, group=None, reduce_op="mean"):
        with naming_peer_failures():
            return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def all_gather(self, tensor, group=None, sync_grads=False):
        with naming_peer_failures():
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def broadcast(self, obj, src=0):
        with naming_peer_failures():
            return super().broadcast(obj, src=src)

    @override
    def barrier(self, *args, **kwargs) -> None:
        with naming_peer_failures():
            return super().barrier(*args, **kwargs)

    # --- in-memory snapshots and step undo (LossSpikeMonitor's rollback and skip) ---------------
    def comm_local_state_dict(self) -> dict:
        """This rank's compressor and local-update state, with no collective (for in-memory snapshots)."""
        lu = self.local_update
        return {"compressor": self.compressor.state_dict() if self.compressor is not None else None,
                "local_update": lu.state_dict() if lu is not None else None,
                "local_update_rank": lu.rank_local_state_dict() if lu is not None else None}

    def load_comm_local_state_dict(self, state: dict, counts: bool = False) -> None:
        """Restore :meth:`comm_local_state_dict` output (residuals, PowerSGD's Qs, DiLoCo's outer state); the sync
        counts only with ``counts`` (a checkpoint's): a rollback does not un-make the syncs (and bytes) it discards."""
        if self.compressor is not None:
            self.compressor.load_state_dict(state["compressor"])
        if self.local_update is not None:
            (self.local_update.load_state_dict if counts else self.local_update.load_snapshot)(state["local_update"])
            self.local_update.load_rank_local_state_dict(state["local_update_rank"])

    def track_comm_undo(self) -> None:
        """Keep each step's pre-step compressor state, so :meth:`undo_comm_step` can drop a step after its
        backward (one extra copy of the error-feedback residuals)."""
        if self.compressor is not None:
            self.compressor.track_undo(True)

    def undo_comm_step(self) -> bool:
        """Undo what the latest step's comm hook changed: a skipped step's gradient leaves no trace in the
        error-feedback residual or PowerSGD's warm start. (Under local updates a skipped step has no
        per-step communication; it still counts toward the sync period.)"""
        return self.compressor.undo_step() if self.compressor is not None else False

    # --- checkpoint ----------------------------------------------------------------------------
    def comm_state_dict(self) -> dict:
        """Collective (call on every rank): each rank's counters and compressor state, plus the replicated
        local-update state (counters, period, DiLoCo outer parameters and momentum) from this rank."""
        return gather_comm_state(self)

    def load_comm_state_dict(self, state: dict) -> None:
        """Restore :meth:`comm_state_dict` output; each rank takes its own entry of ``per_rank``."""
        apply_comm_state(self, state)

    @override
    def load_optimizer_state_dict(self, checkpoint) -> None:
        mine = (self._rank_restore or {}).pop("optimizer_states", None)
        if mine is not None:  # a resume under local updates: this rank's own optimizer state
            checkpoint = {**checkpoint, "optimizer_states": mine}
        super().load_optimizer_state_dict(checkpoint)

    @override
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        checkpoint[CHECKPOINT_KEY] = self.comm_state_dict()  # collective: runs on every rank
        note_checkpoint(self, checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is None:
            rank_zero_warn(f"{checkpoint_path} has no {CHECKPOINT_KEY!r} entry (written without compression?); "
                           "compressor and local-update state start fresh")
        else:
            try:
                self.load_comm_state_dict(state)
            except ValueError as e:  # another preset, or state no world size splits: say which file and the ways out
                raise ConfigError(refused_resume_message(checkpoint_path, state, e)) from e
        return checkpoint


def register_strategies() -> None:
    """Register ``ddp_compressed`` (PowerSGD rank 4) and ``ddp_compressed_spawn`` in Lightning's registry."""
    from lightning.pytorch.strategies import StrategyRegistry

    for name, start_method in (("ddp_compressed", "popen"), ("ddp_compressed_spawn", "spawn")):
        if name not in StrategyRegistry:
            StrategyRegistry.register(
                name, CompressedDDPStrategy,
                description=f"DDP with PowerSGD rank-4 gradient compression (start_method={start_method!r})",
                compressor="powersgd", start_method=start_method,
            )
