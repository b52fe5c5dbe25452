"""Tokens/s logging through Lightning's own ``ThroughputMonitor``.

``ThroughputMonitor`` needs to know how big a batch is; for the lit_dtrain batch contract the "items"
it counts are tokens, so ``train/device/items_per_sec`` is tokens/s of this rank (and
``train/device/samples_per_sec`` its sequences/s). With several ranks Lightning also logs the global
figures ``train/items_per_sec`` and ``train/samples_per_sec`` (the per-device rate times the world size).
Every micro-batch's tokens count; the rates are averaged over the last ``window_size`` optimizer steps.
``train/lengths`` counts this rank's tokens (rank 0's: with several ranks, a share of the step's), and ``train/tokens``
all ranks' together, each step's tokens times that start's number of ranks: both are running totals that a resume
(and a later ``fit`` of the same Trainer) goes on from, but only ``train/tokens`` stays the tokens trained across a
resume on another number of ranks (2 ranks resumed on 1 went on from rank 0's half; ``compare_runs.py --x tokens``
draws runs against it). A checkpoint keeps the totals (``train/batches``, ``train/samples``, ``train/lengths``,
``train/tokens``) of the optimizer steps taken: a stop mid-accumulation's unstepped micro-batches are in none of them
(its ``train/time`` keeps their seconds). With an ``LMDataModule`` of 2+ sources the row also holds
``data/share/<name>``: each source's share of the windows drawn so far (all ranks', across a resume;
``lit_dtrain.data._drawn_shares``).

Validation gets one row per validation, under the step where Lightning writes that validation's ``val/loss`` (on
the training axis: the optimizer step just taken, 0-based; ``trainer.validate`` after ``fit``: ``global_step``).
``validate/time``, ``validate/batches``, ``validate/samples`` and ``validate/lengths`` (tokens) are that validation's
totals, and ``validate/device/{batches,samples,items,flops}_per_sec`` (``validate/device/mfu``; with several ranks
also the global ``validate/*_per_sec``) its rates over all its batches. Lightning's monitor wrote a row every
``log_every_n_steps`` validation batches under its own count of them (steps 2, 4, 6, 8, ... across a fit's
validations, among the training steps 1, 3, 5; ``trainer.validate`` restarted at 2, with counts added to the
previous validation's), so in TensorBoard the curves went backwards and overlapped.

FLOP/s and MFU (``train/device/mfu``) need the device's peak FLOP/s. Lightning's table misses the H200 as it names
itself ("NVIDIA H200", "NVIDIA H200 NVL"; Lightning matches "sxm1"/"nvl1" only, and lists sparse figures for them),
and for the H100 NVL ("NVIDIA H100 NVL") it gives the figures of two bridged cards (bf16 1978.8e12, from NVIDIA's
preliminary sheet for the pair; one card's dense peak is 835.5e12: MFU read 0.42 of what it was), so
:func:`peak_flops_lightning_lacks` puts one card's dense figures in for those, in place of Lightning's;
``available_flops`` overrides the peak for any device.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from lightning.fabric.utilities.throughput import Throughput
from lightning.pytorch.callbacks import ThroughputMonitor
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lit_dtrain.callbacks._args import check_arg, finite_number, whole_at_least
from lit_dtrain.callbacks._state_keys import note_stage, state_is_for_fit
from lit_dtrain.data._drawn_shares import drawn_share_metrics
from lit_dtrain.utils.loop import logging_axis_step

TOKENS = "train/tokens"  # the tokens trained so far, all ranks together (a running total a resume goes on from)

# NVIDIA's dense peak FLOP/s (datasheets; the sparse figures are twice these) of GPUs Lightning does not recognise by
# the names torch reports. The H200 SXM has the H100 SXM's tensor cores (Lightning: 989.4e12 bf16 for the H100 SXM).
_DENSE_PEAK = {
    # one 94 GB H100 NVL card (datasheet: TF32 835, BF16 1671 with sparsity); Lightning's row is a bridged pair's
    "nvidia h100 nvl": {"64": 30e12, "32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "16": 835.5e12},
    "nvidia h200 nvl": {"64": 30e12, "32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "16": 835.5e12},
    "nvidia h200": {"64": 33.5e12, "32": 66.9e12, "tf32": 494.7e12, "bf16": 989.4e12, "16": 989.4e12},
}


def peak_flops_lightning_lacks(device_name: str, precision: str, matmul_precision: str = "high") -> float | None:
    """Dense peak FLOP/s of a GPU Lightning's table misses or gives other figures for, for a Trainer ``precision``
    ("bf16-mixed", "32-true", ...) and ``torch.get_float32_matmul_precision()``; None for any other device or
    precision (Lightning's figure then stands)."""
    table = _DENSE_PEAK.get(device_name.strip().lower())
    if table is None:
        return None
    kind = str(precision).split("-")[0]  # "bf16", "16", "32", "64" (a bare 32 or "32" too)
    if kind == "32" and matmul_precision != "highest":
        kind = "tf32"  # fp32 matmuls on tensor cores, as Lightning counts them on Ampere and later
    return table.get(kind)


def _input_ids(batch):
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if ids is None:
        got = f"a dict with keys {sorted(batch)}" if isinstance(batch, Mapping) else type(batch).__name__
        raise TypeError(
            f"token_throughput_monitor counts batches of the form {{'input_ids': Tensor[B, T]}}, got {got}; for other "
            "batches use Lightning's ThroughputMonitor(batch_size_fn=..., length_fn=...) directly"
        )
    return ids


def _batch_size(batch: dict) -> int:
    return int(_input_ids(batch).size(0))


def _tokens(batch: dict) -> int:
    return int(_input_ids(batch).numel())


class _StepWindowThroughputMonitor(ThroughputMonitor):
    """``window_size`` in optimizer steps for training. Lightning's window counts the batches it is updated with,
    micro-batches: with ``accumulate_grad_batches=A`` a window of ``n`` covered ``n / A`` steps (a fraction of one
    step for ``n < A``). Validation writes one row of totals and whole-validation rates when it ends, at the step of
    its ``val/loss`` (see the module docstring). A batch without ``input_ids`` is refused when a training batch
    starts, before it trains."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        # Lightning's monitor reads the batch at its end, after the optimizer step: check its form before it trains
        _input_ids(batch)
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def __init__(self, *args, peak_flops: float | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.peak_flops = peak_flops
        self._validation_flops: float | None = 0.0  # this validation's FLOPs so far (None: a batch had none)
        self._resumed: dict = {}  # the training totals of the checkpoint a fit resumes from
        # all ranks' training tokens at this fit's start (None: resumed from a count that lacks them), this rank's
        # count then, and the ranks: train/tokens is computed when logged or checkpointed, nothing added per batch
        self._tokens_at_start: int | None = 0
        self._lengths_at_start, self._ranks = 0, 1
        # this rank's counts at the last optimizer step (batches, samples, lengths): a stop mid-accumulation
        # (should_stop, Lightning's Timer) leaves the step's micro-batches untrained, and last.ckpt's counts, which a
        # resume goes on from, held them (train/tokens 384 where 2 micro-batches of 128 trained; train/batches and
        # train/lengths 8 and 1024 at step 4 for 7 micro-batches and 896 tokens trained)
        self._stepped = {"batches": 0, "samples": 0, "lengths": 0}
        self._time_at_start = 0.0  # the training seconds at this fit's start (the checkpoint's, on a resume)

    def _start(self, trainer) -> None:
        if trainer.state.stage != RunningStage.TRAINING:
            # count every validation, test and predict run from zero: Lightning resets only inside fit, so a second
            # trainer.validate(), trainer.test() or trainer.predict() added to the previous run's counts while its
            # clock restarted (test/samples 12, 16 for a second test of 8 samples)
            self._samples.pop(trainer.state.stage, None)
        if trainer.state.stage == RunningStage.VALIDATING:
            self._validation_flops = 0.0
        super()._start(trainer)
        stage, resumed = RunningStage.TRAINING, self._resumed
        if trainer.state.stage == stage:
            # a checkpoint written before train/tokens existed (or without this callback's state) does not tell
            # the tokens trained: none logged rather than a count from 0 mid-run
            tokens = resumed.get("tokens", None if trainer.global_step else 0)
            self._tokens_at_start = None if tokens is None else int(tokens)
            self._lengths_at_start, self._ranks = int(resumed.get("lengths", 0)), trainer.world_size
            self._stepped = {k: int(resumed.get(k, 0)) for k in self._stepped}
            self._time_at_start = float(resumed.get("time", 0.0))
        if trainer.state.stage == stage and resumed:
            # the running totals go on from the checkpoint's (Lightning counts from the fit's start: after a resume
            # train/time, train/batches, train/samples and train/lengths fell back to 0 mid-curve)
            self._resumed = {}
            self._batches[stage], self._samples[stage] = int(resumed["batches"]), int(resumed["samples"])
            self._lengths[stage] = int(resumed["lengths"])
            self._t0s[stage] -= float(resumed["time"])

    def _tokens(self) -> int | None:
        """All ranks' training tokens so far: this fit's start's, and this rank's since, times the ranks (every rank
        trains a batch of one shape: the datamodule splits one global batch evenly)."""
        if self._tokens_at_start is None:
            return None
        return self._tokens_at_start + (self._stepped["lengths"] - self._lengths_at_start) * self._ranks

    def state_dict(self) -> dict:
        stage = RunningStage.TRAINING
        if stage not in self._batches:  # (not rank 0, or no training batch counted yet)
            return dict(self._resumed)
        times = self._throughputs[stage]._time
        # no batch trained in this fit (a resume that EarlyStopping or max_time had ended): the checkpoint's time, not 0
        # the counts at the last optimizer step, not the micro-batches a stop mid-accumulation left unstepped; the
        # time is what training took, theirs included
        state = {"time": float(times[-1]) if times else self._time_at_start, **self._stepped}
        tokens = self._tokens()
        return state if tokens is None else {**state, "tokens": tokens}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_is_for_fit(self):
            self._resumed = dict(state_dict)

    def _compute(self, trainer, iter_num: int | None = None) -> None:
        # Lightning's, with train/tokens in the same row
        stage = trainer.state.stage
        if stage == RunningStage.TRAINING:  # Lightning computes at each optimizer step's last micro-batch
            self._stepped = {"batches": self._batches[stage], "samples": self._samples[stage],
                             "lengths": self._lengths.get(stage, 0)}
        if not trainer._logger_connector.should_update_logs:
            return
        throughput = self._throughputs[stage]
        metrics = {f"{stage.value}{throughput.separator}{k}": v for k, v in throughput.compute().items()}
        if stage == RunningStage.TRAINING and (tokens := self._tokens()) is not None:
            metrics[TOKENS] = float(tokens)
        if stage == RunningStage.TRAINING:  # a mixture's share of the windows drawn so far from each source
            metrics.update(drawn_share_metrics(trainer.datamodule))
        # at the step of Lightning's training row, named: given no step, the connector adds `epoch` to this row too,
        # a second `epoch` point at every logged step in TensorBoard
        step = logging_axis_step(trainer) if iter_num is None else iter_num
        trainer._logger_connector.log_metrics(metrics, step=step)

    @override
    @rank_zero_only
    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0):
        if trainer.sanity_checking:
            return
        # counted (Lightning's on_validation_end needs the clock to keep training time free of validation time), but
        # not written: the row comes at the end of the validation
        self._update(trainer, pl_module, batch, batch_idx)
        flops = getattr(pl_module, "flops_per_batch", None) if self._module_has_flops else None
        if flops is None or self._validation_flops is None:
            self._validation_flops = None  # no FLOPs for one batch: no FLOP/s for the validation
        else:
            self._validation_flops += flops

    @override
    @rank_zero_only
    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        super().on_validation_end(trainer, pl_module)
        stage = RunningStage.VALIDATING
        times = self._throughputs[stage]._time
        if not times:  # no validation batch ran
            return
        # the whole validation as one window: from (0 s, nothing counted) to its end
        whole = Throughput(available_flops=self.available_flops, world_size=trainer.world_size,
                           **{**self.kwargs, "window_size": 2})
        with_lengths = self.length_fn is not None
        whole.update(time=0.0, batches=0, samples=0, lengths=0 if with_lengths else None,
                     flops=None if self._validation_flops is None else 0)
        whole.update(time=times[-1], batches=self._batches[stage], samples=self._samples[stage],
                     lengths=self._lengths[stage] if with_lengths else None, flops=self._validation_flops)
        metrics = {f"{stage.value}{whole.separator}{k}": v for k, v in whole.compute().items()}
        # where Lightning writes this validation's val/loss, named: given no step, the connector adds `epoch` here too
        trainer._logger_connector.log_metrics(metrics, step=logging_axis_step(trainer))

    def setup(self, trainer, pl_module, stage: str) -> None:
        note_stage(self, stage)
        if stage == "fit" and not self._resumed and RunningStage.TRAINING in self._batches and trainer.global_step:
            # a later fit of this Trainer (max_steps raised, the next data stage) goes on from the earlier fits'
            # totals, as a resume from their checkpoint does (one loaded in this fit, after setup, still wins):
            # train/tokens stopped being logged and train/time, train/samples, ... fell back to 0 mid-curve (a fit
            # from step 0 again, as after Tuner.lr_find restored the trainer, counts from 0)
            self._resumed = self.state_dict()
        kept = dict(self._throughputs)
        super().setup(trainer, pl_module, stage)
        peak = self.peak_flops
        device = trainer.strategy.root_device
        if peak is None and device.type == "cuda":  # ours in place of Lightning's (a card pair's for the H100 NVL)
            peak = peak_flops_lightning_lacks(
                torch.cuda.get_device_name(device), str(trainer.precision), torch.get_float32_matmul_precision()
            )
        if peak is not None:
            self.available_flops = int(peak)
        accumulate = max(1, int(trainer.accumulate_grad_batches or 1))
        for run_stage in [s for s in self._throughputs if self._throughputs[s] is not kept.get(s)]:  # Lightning's new
            kwargs = self.kwargs  # ones (a validate() between two fits keeps the training window and its time)
            if run_stage == RunningStage.TRAINING and accumulate > 1:
                kwargs = {**self.kwargs, "window_size": self.kwargs.get("window_size", 100) * accumulate}
            self._throughputs[run_stage] = Throughput(
                available_flops=self.available_flops, world_size=trainer.world_size, **kwargs
            )


def token_throughput_monitor(window_size: int = 50, available_flops: float | None = None) -> ThroughputMonitor:
    """A ``ThroughputMonitor`` that counts sequences and tokens of ``{"input_ids": [B, T]}`` batches; the rates are
    averaged over the last ``window_size`` optimizer steps (validation: one row of totals and rates over the whole
    validation, at the step of its ``val/loss``). ``available_flops``: the peak FLOP/s of one device, for MFU (None:
    Lightning's table, or :func:`peak_flops_lightning_lacks`)."""
    # Lightning's Throughput asserts window_size > 1 in the monitor's setup, inside fit: a bare AssertionError
    check_arg("token_throughput_monitor", "window_size", window_size,  # np.int64(50) too (a value from an array)
              whole_at_least(2), "an integer >= 2 (steps averaged)")
    window_size = int(window_size)
    check_arg("token_throughput_monitor", "available_flops", available_flops,
              finite_number(lambda v: v > 0, none_ok=True), "> 0 (a finite number: FLOP/s of one device) or None")
    return _StepWindowThroughputMonitor(batch_size_fn=_batch_size, length_fn=_tokens, window_size=window_size,
                                        peak_flops=available_flops)
