"""Name the codec when a step stops on non-finite gradients that only its fp16 payload made.

The fp16 codec (``HalfPrecision(dtype="fp16")``) and top-k with ``value_dtype: fp16`` send values that fp16 holds up to
65504. A finite gradient past that (a loss spike, with the clip applied only after the reduce) decodes as inf on
every rank. Under ``16-mixed`` the GradScaler skips such a step; under ``32-true`` or ``bf16-mixed`` LitLLM stops with
``NonFiniteError: non-finite gradients ... lower the LR``, where fp32 DDP and the clip would have trained on (2 gloo
ranks, a loss x 1e7 at step 3: ``none`` and ``bf16`` went on, ``fp16`` stopped). The codec notes the step at which
a bucket finite on this rank decoded non-finite (``Compressor.payload_overflow_step``), and the error says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


def payload_overflow_message(codec, world_size: int, nan: bool = False) -> str:
    """What the error adds: the codec, the bound its payload held, and the ways out. ``nan``: the decoded bucket held
    NaN, which an overflow alone does not give (it decodes as inf) but another rank's NaN gradient (a NaN loss there)
    or +inf and -inf summed does: said as either, not as the codec's for certain."""
    dtype = getattr(codec, "value_dtype_name", None)
    if dtype is not None:  # top-k: kept values cast to value_dtype, summed after decoding
        bound = "a kept value above 65504" if dtype == "fp16" else f"a kept value past {dtype}'s range"
        fix = "strategy.compressor.value_dtype=fp32" + (" (or bf16)" if dtype == "fp16" else "")
    else:  # fp16 all-reduce: the payload is g / world_size, summed in fp16
        bound = f"a gradient value above 65504 x {world_size} ranks"
        fix = "strategy.compressor=bf16 (fp32's range at the same bytes)"
    what = f"the {codec.name!r} codec's payload overflowed {dtype or 'fp16'} ({bound} on some rank decodes as inf)"
    if nan:
        return (f" This rank's gradients were finite but decoded with NaN: another rank's were non-finite (see its "
                f"error), or {what.replace('decodes as inf', 'decodes as inf, +inf and -inf sum to NaN')}. If every "
                f"rank's were finite, use {fix}, or 'callbacks=[default,loss_spike]' to skip such steps.")
    return (f" This rank's gradients were finite: {what}, a step fp32 DDP and the gradient clip would have taken. Use "
            f"{fix}, or 'callbacks=[default,loss_spike]' to skip such steps.")


@contextmanager
def naming_payload_overflow(codec, step: int, world_size: int) -> Iterator[None]:
    """Add :func:`payload_overflow_message` to a ``FloatingPointError`` (LitLLM's ``NonFiniteError``) raised inside,
    when ``codec`` noted a payload overflow (or a NaN decode of a finite bucket) at ``step``."""
    try:
        yield
    except FloatingPointError as e:
        noted = codec is not None and step in (codec.payload_overflow_step, codec.payload_nan_step)
        if noted and e.args and isinstance(e.args[0], str):
            nan = codec.payload_overflow_step != step
            e.args = (e.args[0] + payload_overflow_message(codec, world_size, nan), *e.args[1:])
        raise
