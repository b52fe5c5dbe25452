"""Settings of :class:`~lit_dtrain.strategies.CompressedDDPStrategy` that do nothing, or nothing useful, in a run,
and the warnings that say so (rank 0, once per strategy).

- ``sync_on_last_step`` / ``sync_before_validation`` act only under a local-update rule: under a per-step codec the
  gradient is all-reduced every step and the ranks' parameters never differ, so setting them (``false`` included)
  changed nothing, without a word.
- ``adaptive`` local SGD whose validations come before its first period ends never adapts
  (:func:`~lit_dtrain.strategies.fit_end.warn_if_the_period_cannot_adapt`).
- A lossy codec on one process (``trainer=cpu strategy=ddp_compressed/int8``, or DiLoCo's pseudo-gradient codec) sends
  nothing, yet every step still trains on the decoded gradient (int8's rounding, top-k's dropped entries, error
  feedback): the loss of a lossy codec with no bytes saved. It stays what was asked for (a study of a codec's effect
  on the loss on one device is a use, and the checkpoint's codec state is then that of the run it resumes), and rank 0
  says how to train without it.
- The ``fp16`` / ``bf16`` codec under ``trainer.precision=bf16-true`` / ``16-true`` sends as many bytes as the
  16-bit gradients themselves (``comm/compression_ratio`` 1; ``fp16`` on bf16 gradients narrows their range too,
  ``bf16`` on fp16 gradients rounds them to 8 significant bits).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lit_dtrain.strategies.fit_end import warn_if_the_period_cannot_adapt
from lit_dtrain.strategies.quantize import HalfPrecision, NoCompression


def sync_flags(strategy: Any, sync_on_last_step: bool | None, sync_before_validation: bool | None) -> tuple[bool, bool]:
    """The two flags (None: true, the default); rank 0's warning naming those given under a per-step codec."""
    given = [key for key, value in (("sync_on_last_step", sync_on_last_step),
                                    ("sync_before_validation", sync_before_validation)) if value is not None]
    if given and strategy.local_update is None:
        verb = "act" if len(given) > 1 else "acts"
        rank_zero_warn(f"CompressedDDPStrategy: {' and '.join(given)} {verb} only under a local-update rule "
                       f"(local_sgd, diloco); with the compressor {strategy.compressor.name!r} every step all-reduces "
                       "the gradient and the ranks' parameters never differ, so the setting does nothing: remove it")
    return (True if sync_on_last_step is None else bool(sync_on_last_step),
            True if sync_before_validation is None else bool(sync_before_validation))


def warn_about_settings_without_effect(strategy: Any, trainer: Any) -> None:
    """Rank 0's warnings of the strategy's ``setup`` (the world size is known from there on)."""
    warn_if_the_period_cannot_adapt(strategy, trainer)
    codec = strategy.compressor if strategy.local_update is None else getattr(strategy.local_update, "compressor", None)
    if codec is None or isinstance(codec, NoCompression):
        return
    if strategy.world_size == 1:
        what = "gradient" if strategy.local_update is None else f"{strategy.local_update.name} pseudo-gradient"
        rank_zero_warn(f"CompressedDDPStrategy on 1 process: the {codec.name!r} codec sends nothing, yet training uses "
                       f"its decoded (lossy) {what}; comm/* count what a collective of 1 was handed, no bytes are "
                       "saved. To train without it use strategy=auto (or strategy=ddp_compressed/none); keep it only "
                       "to study the codec's effect on the loss")
    precision = getattr(getattr(strategy, "precision_plugin", None), "precision", None)
    grads = {"bf16-true": "bf16", "16-true": "fp16"}.get(precision)
    if isinstance(codec, HalfPrecision) and strategy.local_update is None and grads is not None:
        effect = ("and leaves them as they are" if grads == codec.name  # bf16 has the wider range, fp16 more bits
                  else "and rounds them to bf16's 8 significant bits (fp16 keeps 11)" if codec.name == "bf16"
                  else "and rounds them to fp16's range")
        rank_zero_warn(f"CompressedDDPStrategy: under trainer.precision={precision} the gradients are {grads} already: "
                       f"the {codec.name!r} codec sends as many bytes (comm/compression_ratio 1) {effect}; use "
                       "strategy=ddp_compressed/none, or int8 for 2x fewer bytes")
