"""Sparsifying and 1-bit compressors: top-k with a dynamic ratio, and scaled sign. Both need error feedback.

Both are ``all_gather`` codecs: ranks choose different coordinates (top-k) or carry different scales
(sign), so payloads are gathered and each rank decodes and averages all of them in rank order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from lit_dtrain.callbacks._args import check_arg, finite_number, whole_at_least
from lit_dtrain.strategies.compressors import Compressor, Segment

_VALUE_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def topk_ratio_at(step: int, ratio: float, initial_ratio: float | None, ratio_warmup_steps: int) -> float:
    """Kept fraction at ``step``: exponential decay from ``initial_ratio`` to ``ratio`` over ``ratio_warmup_steps``.

    This is Deep Gradient Compression's sparsity warm-up (Lin et al. 2018: 75% -> 99.9% sparse over the
    first epochs), written as a pure function of the step so all ranks agree on ``k`` without talking.
    """
    if initial_ratio is None or ratio_warmup_steps <= 0 or step >= ratio_warmup_steps:
        return ratio
    return initial_ratio * (ratio / initial_ratio) ** (step / ratio_warmup_steps)


def exact_topk_indices(magnitude: Tensor, k: int, seed: int = 0, sample_size: int = 20_000) -> Tensor:
    """Indices of the ``k`` largest entries of a flat tensor; exact, ~4x faster than ``topk`` on CPU for small k/n.

    As in DGC, a threshold is estimated from a random sample, here at twice the wanted fraction so
    it almost always undershoots; the exact top-k is then taken among the (few) entries above it.
    If fewer than ``k`` entries pass, a lower threshold (8x the fraction) is tried, then plain ``topk``. The result
    is the true top-k either way:
    ``k`` distinct indices in no particular order, as ``topk(sorted=False)`` gives them. NaN ranks above every
    number on every path, as in ``topk``, so a bucket's NaN/inf is sent and the step is seen as non-finite everywhere.

    A threshold of 0 means the bucket is (nearly) all zeros (``magnitude >= 0`` would pass every entry,
    and a topk over the whole bucket cost 230-300 ms for 9M values): see :func:`_sparse_topk_indices`.
    """
    n = magnitude.numel()
    if 4 * k >= n or n <= sample_size:
        return magnitude.topk(k, sorted=False).indices
    gen = torch.Generator(device=magnitude.device).manual_seed(seed)
    sample = magnitude[torch.randint(0, n, (sample_size,), generator=gen, device=magnitude.device)]
    threshold = torch.quantile(sample, 1.0 - 2.0 * k / n)
    if threshold == 0:
        return _sparse_topk_indices(magnitude, k)
    # not (|x| < t) rather than |x| >= t: a NaN passes, as topk ranks it first (a NaN the sample missed was dropped
    # here while the other paths kept it; a non-finite bucket must reach every rank, see Compressor.reduce). A NaN
    # threshold (the sample hit a NaN) passes every entry: exact, at the cost of a full topk.
    candidates = (magnitude < threshold).logical_not_().nonzero().squeeze(1)
    if candidates.numel() >= k:
        return candidates[magnitude[candidates].topk(k, sorted=False).indices]
    # The sample overshot (fewer than k passed), which happens when it holds few entries above the threshold
    # (k * sample_size / n of order 1: at 1e-4 of 9.18M values, 1 call in 5). A threshold from the same sample at 8x
    # the wanted fraction, and with at least 64 sampled entries above it, is passed by k or more in practice; only if
    # not does topk run over the whole bucket.
    lower = torch.quantile(sample, max(0.0, 1.0 - max(8.0 * k / n, 64.0 / sample_size)))
    candidates = (magnitude < lower).logical_not_().nonzero().squeeze(1)
    if lower == 0 or candidates.numel() < k:
        return magnitude.topk(k, sorted=False).indices
    # sorted: in this regime (k < n / 64) a topk over the whole bucket returns its k values in descending order
    # (CPU: a partial sort), so the payload is byte-identical to the full topk this path replaces
    return candidates[magnitude[candidates].topk(k, sorted=True).indices]


def _sparse_topk_indices(magnitude: Tensor, k: int) -> Tensor:
    """Top-k of a non-negative flat tensor with few nonzeros: one ``nonzero`` pass, topk only among the nonzeros.

    With at most ``k`` nonzeros (an all-zero bucket among them) every nonzero is kept and the rest of the ``k``
    are the lowest-index zeros: the first ``k - m`` zeros lie in ``[0, k)`` because at most ``m`` of those
    ``k`` entries are nonzero. That is a true top-k, but not necessarily the zeros ``topk`` picks among ties,
    which depend on ``n`` and ``k`` (``arange(k)`` for some all-zero buckets, a run in the middle for others,
    e.g. n = 100000, k = 5000), so the indices sent may differ from ``topk``'s; their values are 0 either way,
    so the decoded gradient and the error-feedback residual compare equal (a ``-0.0`` may be sent as ``+0.0``).
    NaN counts as nonzero (and ``topk`` ranks it first), so it is kept.
    """
    nonzero = magnitude.nonzero().squeeze(1)  # ascending
    m = nonzero.numel()
    if m >= k:
        return nonzero[magnitude[nonzero].topk(k, sorted=False).indices]
    zeros = (magnitude[:k] == 0).nonzero().squeeze(1)[: k - m]
    return torch.cat([nonzero, zeros])


class TopK(Compressor):
    """Keep the ``k = ceil(ratio * numel)`` largest-magnitude entries of each buffer; gather values and indices.

    Payload per rank: ``k`` values (``value_dtype``) and ``k`` int32 indices, i.e. 8 bytes per kept
    value in fp32 (1% kept: 0.08 bytes/value, 50x less than fp32). Error feedback (on by default) keeps
    the dropped mass, so the sum of sent updates tracks the sum of gradients: the residual after any
    number of steps is what a single step would drop, not an accumulation. ``initial_ratio`` with
    ``ratio_warmup_steps`` enables the dynamic-ratio schedule of :func:`topk_ratio_at`.
    """

    name = "topk"

    def __init__(
        self,
        ratio: float = 0.01,
        error_feedback: bool = True,
        initial_ratio: float | None = None,
        ratio_warmup_steps: int = 0,
        value_dtype: str = "fp32",
        start_step: int = 0,
    ) -> None:
        check_arg("TopK", "ratio", ratio, finite_number(lambda v: 0.0 < v <= 1.0), "in (0, 1]")
        check_arg("TopK", "initial_ratio", initial_ratio, finite_number(lambda v: ratio <= v <= 1.0, none_ok=True),
                  f"in [ratio, 1] = [{ratio}, 1] or None")
        check_arg("TopK", "ratio_warmup_steps", ratio_warmup_steps, whole_at_least(0), "an integer >= 0")
        if value_dtype not in _VALUE_DTYPES:
            raise ValueError(f"TopK: value_dtype must be one of {sorted(_VALUE_DTYPES)}, got {value_dtype!r}")
        if (initial_ratio is None) != (int(ratio_warmup_steps) == 0):  # one without the other did nothing, silently
            given, needs = (("initial_ratio", "ratio_warmup_steps > 0") if initial_ratio is not None
                            else ("ratio_warmup_steps", "initial_ratio"))
            raise ValueError(f"TopK: {given} needs {needs} too (the kept fraction decays from initial_ratio to ratio "
                             f"over ratio_warmup_steps), got initial_ratio={initial_ratio!r}, "
                             f"ratio_warmup_steps={ratio_warmup_steps!r}")
        super().__init__(error_feedback=error_feedback, start_step=start_step)
        # as Python floats: np.float32(0.25) computed the schedule in float32 (k 474015 for 474016 at step 49 of 100,
        # 9.18M values) and a Fraction exactly, apart from the same value written 0.25
        self.ratio, self.initial_ratio = float(ratio), None if initial_ratio is None else float(initial_ratio)
        self.ratio_warmup_steps = int(ratio_warmup_steps)
        self.value_dtype_name = value_dtype
        # The selection groups (parameter names per DDP bucket) of the latest step, saved with the state: DDP runs
        # the first step after a start on its initial bucket layout (one bucket) and rebuilds its buckets after it,
        # so a resumed run's first step would select over other groups than the uninterrupted run. It selects over
        # the saved groups instead, when its bucket is a union of several of them.
        self._layout: list[tuple[str, ...]] = []
        self._layout_step: int | None = None
        self._restored_layout: dict[str, tuple[str, ...]] | None = None  # name -> its group, from load_state_dict
        self._restored_step: int | None = None

    @property
    def payload_may_overflow(self) -> bool:  # fp16 values overflow above 65504 (bf16 only next to fp32's maximum)
        return self.value_dtype_name != "fp32"

    def k_at(self, numel: int, step: int) -> int:
        """Number of values kept from a buffer of ``numel`` values at ``step``."""
        ratio = topk_ratio_at(step, self.ratio, self.initial_ratio, self.ratio_warmup_steps)
        return max(1, min(numel, math.ceil(ratio * numel))) if numel else 0  # an empty buffer sends nothing

    def _groups(self, segments: Sequence[Segment], step: int) -> list[list[Segment]] | None:
        """The restored groups this bucket is a union of (two or more), at the first step after a restore; else None.

        Records the groups selected over, per step, for :meth:`state_dict`."""
        if step != self._layout_step:
            self._layout, self._layout_step = [], step
        if self._restored_layout is not None and self._restored_step is None:
            self._restored_step = step
        elif self._restored_layout is not None and step != self._restored_step:
            self._restored_layout = None  # from the second step on DDP's rebuilt buckets are the groups
        groups = None
        if self._restored_layout is not None and segments:
            names = {s.name for s in segments}
            keys = {self._restored_layout.get(s.name) for s in segments}
            if None not in keys and len(keys) > 1 and all(set(k) <= names for k in keys):
                by_key: dict[tuple[str, ...], list[Segment]] = {}
                for s in segments:
                    by_key.setdefault(self._restored_layout[s.name], []).append(s)
                groups = list(by_key.values())
                self._layout.extend(by_key)  # the saved groups themselves, so a resume of a resume splits too
                return groups
        self._layout.append(tuple(s.name for s in segments))
        return None

    def reduce(self, flat: Tensor, segments: Sequence[Segment], comm, step: int) -> torch.futures.Future:
        if step < self.start_step:  # plain fp32 warm-up: record the buckets all the same, for a resume right after it
            self._groups(segments, step)
        return super().reduce(flat, segments, comm, step)

    def compress(self, x: Tensor, segments: Sequence[Segment], step: int) -> list[Tensor]:
        groups = self._groups(segments, step)
        if groups is None:  # the common case: the bucket is one selection group
            k = self.k_at(x.numel(), step)
            indices = exact_topk_indices(x.abs(), k, step)
        else:  # the first step after a resume, on DDP's initial bucket: select within each saved bucket
            parts = []
            for group in groups:
                where = torch.cat([torch.arange(s.offset, s.offset + s.numel, device=x.device) for s in group])
                part = x[where]
                parts.append(where[exact_topk_indices(part.abs(), self.k_at(part.numel(), step), step)])
            indices = torch.cat(parts)
            self.num_calls += len(groups) - 1  # one call per group, as the uninterrupted run's hook made
        return [x[indices].to(_VALUE_DTYPES[self.value_dtype_name]), indices.to(torch.int32)]

    def state_dict(self) -> dict:
        state = super().state_dict()
        state["bucket_layout"] = [list(group) for group in self._layout]
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        layout = state.get("bucket_layout") or []  # absent from checkpoints written before it was kept
        self._layout, self._layout_step = [tuple(g) for g in layout], None
        self._restored_layout = {name: tuple(g) for g in layout for name in g} or None
        self._restored_step = None

    def decompress(self, payload: Sequence[Tensor], segments: Sequence[Segment], numel: int) -> Tensor:
        values, indices = payload
        out = torch.zeros(numel, dtype=torch.float32, device=values.device)
        return out.index_put_((indices.long(),), values.float())

    def decompress_sum(self, payloads, segments: Sequence[Segment], numel: int) -> Tensor:
        """All ranks' sparse vectors scattered into one buffer (duplicate indices add up)."""
        out = torch.zeros(numel, dtype=torch.float32, device=payloads[0][0].device)
        for values, indices in payloads:
            out.index_add_(0, indices.long(), values.float())
        return out

    def extra_repr(self) -> str:
        return (f"ratio={self.ratio}, initial_ratio={self.initial_ratio}, "
                f"ratio_warmup_steps={self.ratio_warmup_steps}, value_dtype={self.value_dtype_name!r}, "
                + super().extra_repr())


_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_bits(mask: Tensor) -> Tensor:
    """Pack a flat bool tensor into ``ceil(n / 8)`` bytes (bit i of byte j is ``mask[8 j + i]``)."""
    if mask.device.type == "cpu":  # numpy's packbits is one C pass, ~5x faster than the torch ops below
        return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))
    pad = (-mask.numel()) % 8
    bits = torch.cat([mask, mask.new_zeros(pad)]) if pad else mask
    weights = _BIT_WEIGHTS.to(mask.device)
    return (bits.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: Tensor, numel: int) -> Tensor:
    """Inverse of :func:`pack_bits`: the first ``numel`` bits as a bool tensor."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[:, None] >> shifts) & 1).view(-1)[:numel].bool()


# byte -> its 8 bits as -1.0/+1.0: one gather decodes signs (3x faster than shifting and masking)
_SIGN_TABLE = ((torch.arange(256)[:, None] >> torch.arange(8)) & 1).float().mul_(2).sub_(1)


def unpack_signs(packed: Tensor, numel: int) -> Tensor:
    """The first ``numel`` packed bits as fp32 ``+1`` (bit set) / ``-1`` (bit clear)."""
    return _SIGN_TABLE.to(packed.device)[packed.int()].view(-1)[:numel]


class ScaledSign(Compressor):
    """Scaled sign with error feedback (EF-SignSGD, Karimireddy et al. 2019): 1 bit per value.

    Each parameter ``p`` in the buffer is sent as ``sign(p)`` packed 8 per byte and one fp32 scale
    ``||p||_1 / numel(p)``, so the decoded ``scale * sign`` has the same L1 norm as ``p``. Bytes per
    value: ``1/8 + 4 * num_params / numel`` (about 32x less than fp32). Without error feedback sign
    compression is biased and may not converge; it is on by default.
    """

    name = "sign"

    def __init__(self, error_feedback: bool = True, start_step: int = 0) -> None:
        super().__init__(error_feedback=error_feedback, start_step=start_step)

    def compress(self, x: Tensor, segments: Sequence[Segment], step: int) -> list[Tensor]:
        scales = torch.stack([x[s.offset : s.offset + s.numel].abs().mean() for s in segments])
        return [scales.float(), pack_bits(x >= 0)]

    def decompress(self, payload: Sequence[Tensor], segments: Sequence[Segment], numel: int) -> Tensor:
        scales, packed = payload
        out = unpack_signs(packed, numel).clone()
        for scale, s in zip(scales, segments):
            out[s.offset : s.offset + s.numel] *= scale
        return out
