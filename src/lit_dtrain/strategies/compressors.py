"""Gradient compressors: plain objects with ``compress``/``decompress`` and a ``state_dict``.

A compressor works on one flat fp32 buffer (a DDP gradient bucket, or a flattened pseudo-gradient)
described by :class:`Segment` s, one per parameter. It knows nothing about Lightning and only talks
to the network through a :class:`~lit_dtrain.strategies.comm.Communicator`, so every codec here is
unit-testable in one process.

Two kinds of codec exist:

- ``collective = "all_reduce"``: the payload is linear (fp16/bf16 casts), so ranks sum payloads with
  one ``all_reduce``;
- ``collective = "all_gather"``: the payload is not summable (per-block scales, top-k indices, sign
  bits), so ranks ``all_gather`` the packed payload bytes and each rank decompresses and averages all
  of them in rank order, which keeps replicas bit-identical.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019) is generic: the rank adds its residual
``e`` to the gradient, compresses ``x = g + e`` and keeps ``e = x - decompress(compress(x))``.
Residuals are keyed by parameter name, not by DDP bucket index: DDP rebuilds its buckets after the
first iteration and again after every restart, which is why torch's bucket-keyed PowerSGD state
cannot survive a resume (pytorch#75666).

This module holds the base class and the payload helpers; the codecs are in ``quantize.py``
(:class:`NoCompression`, :class:`HalfPrecision`, :class:`BlockQuantizer`, whose names also import from
here), ``powersgd.py``, ``sparsify.py`` and ``sharded_quant.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lit_dtrain.callbacks._args import check_arg, whole_at_least
from lit_dtrain.utils.args import is_flag

if TYPE_CHECKING:
    from lit_dtrain.strategies.comm import Communicator


@dataclass(frozen=True)
class Segment:
    """One named parameter's slice ``[offset, offset + numel)`` of a flat buffer, with its shape."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]


def segments_from_shapes(named_shapes: Sequence[tuple[str, Sequence[int]]]) -> list[Segment]:
    """Back-to-back segments for ``[(name, shape), ...]`` (what a flattened parameter list looks like)."""
    segments, offset = [], 0
    for name, shape in named_shapes:
        numel = math.prod(shape)
        segments.append(Segment(name, offset, numel, tuple(shape)))
        offset += numel
    return segments


def all_finite(x: Tensor) -> bool:
    """Whether every value of ``x`` is finite. First from its sum (NaN and inf propagate through it): one reduction
    and a host sync on CUDA; ``isfinite(x).all()`` took 50x longer on CPU (72 ms against 1.5 ms for 9.18M values).
    A finite sum proves every value finite. A non-finite one (an overflow step, rare) is confirmed with the exact
    ``isfinite(x).all()``, since finite values can sum past the dtype's range (eight values of 1e38 in fp32)."""
    return math.isfinite(float(x.sum())) or bool(torch.isfinite(x).all())


def completed_future(value: Tensor) -> torch.futures.Future:
    """A ``torch.futures.Future`` that already holds ``value``."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def pack_payload(payload: Sequence[Tensor]) -> Tensor:
    """Concatenate payload tensors as raw bytes into one uint8 tensor (one collective per buffer)."""
    return torch.cat([t.contiguous().reshape(-1).view(torch.uint8) for t in payload])


def unpack_payload(packed: Tensor, like: Sequence[Tensor]) -> list[Tensor]:
    """Split a :func:`pack_payload` buffer back into tensors with the dtypes/shapes of ``like``."""
    out, offset = [], 0
    for t in like:
        nbytes = t.numel() * t.element_size()
        # clone(): a byte slice at an odd offset cannot be viewed as a wider dtype in place
        out.append(packed[offset : offset + nbytes].clone().view(t.dtype).view(t.shape))
        offset += nbytes
    if offset != packed.numel():
        raise ValueError(f"packed payload has {packed.numel()} bytes, the layout expects {offset}")
    return out


class Compressor:
    """Base class: error feedback, the uncompressed warm-up, the generic reduce, and the state.

    Subclasses implement :meth:`compress` (flat fp32 ``x`` -> list of payload tensors) and
    :meth:`decompress` (payload -> flat fp32 tensor of ``numel`` values), and set ``collective``.
    ``start_step`` runs plain fp32 all-reduce for the first steps (counted in the bytes, never hidden).
    ``num_calls`` counts compressed buffers: the proof that the hook ran.
    """

    name = "base"
    collective = "all_gather"

    def __init__(self, error_feedback: bool = False, start_step: int = 0) -> None:
        check_arg(type(self).__name__, "error_feedback", error_feedback, is_flag, "True or False")
        check_arg(type(self).__name__, "start_step", start_step, whole_at_least(0), "an integer >= 0")
        self.error_feedback = bool(error_feedback)
        self.start_step = int(start_step)
        self.residuals: dict[str, Tensor] = {}  # per parameter name; views into _flat_residuals
        self._flat_residuals: dict[tuple, Tensor] = {}
        self.num_calls = 0
        self.rank = 0  # this process's rank, set by reduce(); seeds rank-distinct noise
        self._undo: dict | None = None  # None: off; else the pre-step state of the latest step (see undo_step)
        self.grad_scale: float | None = None  # the GradScaler's loss scale the residuals are in (16-mixed), if any

    # --- codec -------------------------------------------------------------------------------
    def compress(self, x: Tensor, segments: Sequence[Segment], step: int) -> list[Tensor]:
        """Encode flat fp32 ``x`` into payload tensors."""
        raise NotImplementedError

    def decompress(self, payload: Sequence[Tensor], segments: Sequence[Segment], numel: int) -> Tensor:
        """Decode a payload into a flat fp32 tensor of ``numel`` values."""
        raise NotImplementedError

    def roundtrip(self, x: Tensor, segments: Sequence[Segment] | None = None, step: int = 0) -> Tensor:
        """``decompress(compress(x))`` for a tensor of any shape or strides (no error feedback, no communication).

        ``x`` is flattened (copied if non-contiguous) first; the result has ``x``'s shape.
        """
        flat = x.reshape(-1)
        segments = segments if segments is not None else [Segment("x", 0, flat.numel(), tuple(x.shape))]
        return self.decompress(self.compress(flat, segments, step), segments, flat.numel()).view(x.shape)

    # --- error feedback ----------------------------------------------------------------------
    def residual_buffer(self, segments: Sequence[Segment], like: Tensor) -> Tensor:
        """The flat fp32 residual of this buffer layout, updated in place by :meth:`reduce`.

        One flat buffer per layout (no gather/scatter per step); ``self.residuals[name]`` are views
        into it. A new layout (DDP rebuilt its buckets, or a restored state) is assembled once from
        the per-name residuals; layouts no name points to any more are dropped.
        """
        key = tuple((s.name, s.offset, s.numel) for s in segments)
        buffer = self._flat_residuals.get(key)
        if buffer is not None and buffer.device == like.device:
            return buffer
        buffer = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
        for s in segments:
            old = self.residuals.get(s.name)
            if old is not None:
                buffer[s.offset : s.offset + s.numel] = old.reshape(-1).to(buffer)
        for s in segments:
            self.residuals[s.name] = buffer[s.offset : s.offset + s.numel]
        self._flat_residuals[key] = buffer
        live = {r.untyped_storage().data_ptr() for r in self.residuals.values()}
        self._flat_residuals = {k: b for k, b in self._flat_residuals.items()
                                if b.untyped_storage().data_ptr() in live}
        if self._undo is not None:  # a dropped layout's pre-step copy too (DDP's first bucket: the residual again)
            kept = {b.data_ptr() for b in self._flat_residuals.values()}
            self._undo_copies = {ptr: copy for ptr, copy in self._undo_copies.items() if ptr in kept}
        return buffer

    def residual_for(self, segments: Sequence[Segment], like: Tensor) -> Tensor:
        """A flat copy of the residual of these segments (zeros where none is stored yet)."""
        out = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
        for s in segments:
            r = self.residuals.get(s.name)
            if r is not None:
                out[s.offset : s.offset + s.numel] = r.reshape(-1).to(out)
        return out

    def add_residual(self, segments: Sequence[Segment], x: Tensor) -> Tensor:
        """``x + e`` written into this layout's residual buffer (returned; it becomes the new residual).

        With :meth:`track_undo` on, the buffer's content before this step is kept first (:meth:`reduce` has
        already opened the step's undo record).
        """
        buffer = self.residual_buffer(segments, x)
        # once per buffer and step: a second reduce of it in the same step (accumulation that syncs every micro-batch)
        # must not overwrite the pre-step copy with the state between its micro-batches
        if self._undo is not None and not any(b is buffer for b, _ in self._undo["residuals"]):
            saved = self._undo_copies.get(buffer.data_ptr())  # reused every step: no allocation per step
            if saved is None or saved.shape != buffer.shape or saved.device != buffer.device:
                saved = self._undo_copies[buffer.data_ptr()] = torch.empty_like(buffer)
            self._undo["residuals"].append((buffer, saved.copy_(buffer)))
        return buffer.add_(x)

    def set_grad_scale(self, scale: float) -> None:
        """Tell the codec the loss scale of the coming step's gradients (``16-mixed``: the GradScaler's scale).

        Under a GradScaler the bucket holds ``scale * g``, so the error-feedback residual is kept in the units of the
        scale it was made under. The scaler halves the scale after an overflow (routinely, in the first steps) and
        doubles it after ``growth_interval`` good steps; without this the residual would then be added at 2x (or
        0.5x) its value. A change multiplies the residuals by ``new / old`` (exact for the scaler's powers of two)."""
        scale = float(scale)
        old, self.grad_scale = self.grad_scale, scale
        if old is None or old == scale or not math.isfinite(scale) or scale <= 0:
            return
        with torch.no_grad():  # disjoint views into the flat buffers, or standalone tensors (each once)
            for residual in {id(t): t for t in self._residual_tensors()}.values():
                residual.mul_(scale / old)

    def _residual_tensors(self) -> Iterator[Tensor]:
        """Every error-feedback tensor in the units of the loss scale (:meth:`set_grad_scale` rescales them), the undo
        record's copies too (one backward, two optimizer steps: a step undone after the first one grew the scale)."""
        yield from self.residuals.values()
        yield from (saved for _, saved in (self._undo or {}).get("residuals", []))

    # --- undoing a step (LossSpikeMonitor's skip) ----------------------------------------------
    def track_undo(self, enabled: bool = True) -> None:
        """Keep what each step changes (residuals, codec state) until the next step, for :meth:`undo_step`.

        Costs one copy of the residuals. A step dropped after its backward (a loss spike, or a step the GradScaler
        skipped for an inf/NaN on any rank) has already been folded into the residual by the comm hook, and would be
        applied in later steps without the undo (in part or in full, depending on the codec).
        """
        self._undo = {} if enabled else None
        self._undo_copies: dict[int, Tensor] = {}

    def _undo_begin(self, step: int) -> None:
        """Called by :meth:`reduce` first: the first call of a new step records the state before it."""
        if self._undo is not None and self._undo.get("step") != step:
            self._undo = {"step": step, "residuals": [], "num_calls": self.num_calls,
                          "codec": self._codec_undo_state()}

    def _codec_undo_state(self):
        """State other than the residuals that a step replaces (PowerSGD: its warm-start Qs)."""
        return None

    def _load_codec_undo_state(self, state) -> None:
        pass

    def undo_step(self) -> bool:
        """Put back the state from before the latest step's :meth:`reduce` calls. Returns whether it did.

        Call it on every rank after a step whose gradient was discarded: ``CompressedDDPStrategy`` does after a step
        the ``16-mixed`` GradScaler skipped, and ``LossSpikeMonitor``'s skip calls it through the strategy."""
        if not self._undo:
            return False
        for buffer, saved in self._undo["residuals"]:
            buffer.copy_(saved)
        self.num_calls = self._undo["num_calls"]  # it seeds stochastic rounding
        self._load_codec_undo_state(self._undo["codec"])
        self._undo = {}
        return True

    def keep_residuals(self, names: Sequence[str]) -> None:
        """Put the latest step's pre-step residual of the named parameters back (needs :meth:`track_undo` on).

        For parameters no rank used in the step (``find_unused_parameters=True``): their bucket slots were zero, so
        the hook sent part of their residual and kept the rest, and DDP then discarded what was sent with the unused
        gradient. Without this their residual drained without ever being applied."""
        saved_buffers = (self._undo or {}).get("residuals", [])  # (flat residual buffer, its pre-step copy)
        for name in names:
            residual = self.residuals.get(name)  # a view into one of the flat buffers
            if residual is None:
                continue
            for buffer, saved in saved_buffers:
                if residual.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
                    offset = (residual.data_ptr() - buffer.data_ptr()) // buffer.element_size()
                    residual.copy_(saved[offset : offset + residual.numel()].view_as(residual))
                    break

    # --- communication -----------------------------------------------------------------------
    payload_may_overflow = False  # whether a finite fp32 value can decode as inf (a cast to fp16)
    payload_overflow_step: int | None = None  # the latest step whose finite bucket (this rank's) decoded as +-inf
    payload_nan_step: int | None = None  # ... decoded with NaN: another rank's NaN gradient, or +inf and -inf summed

    def _note_overflow(self, finite_in: bool, result: Tensor, step: int) -> Tensor:
        """Record ``step`` when this rank's finite bucket decoded as inf (an fp16 payload overflowed here or on another
        rank), or with NaN (which no overflow alone gives but +inf plus -inf), so a NonFiniteError can name the codec
        (``payload_overflow_message``); ``result`` returned. A NaN check only on a non-finite decode."""
        if finite_in and not all_finite(result):
            if bool(result.isnan().any()):
                self.payload_nan_step = step
            else:
                self.payload_overflow_step = step
        return result

    def _subtract_sent(self, x: Tensor, sent: Tensor, flat: Tensor) -> None:
        """The new residual ``x - sent``, in place (``x = g + e``, ``flat`` holds ``g``).

        A payload whose dtype overflowed (fp16 holds at most 65504: a large gradient, or under 16-mixed a gradient
        times a loss scale of up to 65536) decodes as inf although ``x`` is finite. It is still sent, so the step is
        seen as an overflow everywhere (the GradScaler skips it; without one LitLLM stops with NonFiniteError), but
        ``x - inf`` would leave -inf in the residual and every later step would decode to inf. The step is dropped,
        so the residual goes back to ``e`` (as ``x - g``: up to one rounding of ``g + e``), as for a non-finite
        bucket. The check is one sum over the decoded bucket, paid only by codecs whose payload can overflow."""
        if self.payload_may_overflow and not all_finite(sent):
            x.sub_(flat.detach().float())
            return
        x.sub_(sent)

    def decompress_sum(self, payloads: Sequence[Sequence[Tensor]], segments: Sequence[Segment], numel: int) -> Tensor:
        """Sum of the decoded payloads of all ranks, in rank order (override to fuse)."""
        total = self.decompress(payloads[0], segments, numel)
        for payload in payloads[1:]:
            total += self.decompress(payload, segments, numel)
        return total

    def _begin_reduce(self, flat: Tensor, segments: Sequence[Segment], comm: Communicator,
                      step: int) -> tuple[Tensor, bool] | None:
        """What every :meth:`reduce` does first: open the step's undo record, count the call, and (after the
        uncompressed warm-up, else ``None``) return ``(x, error_feedback)``: ``x = g + e`` in the residual buffer
        (which becomes the new residual) when error feedback applies, else ``g`` in fp32.

        A non-finite bucket (a step the GradScaler will skip under 16-mixed) is sent as it is, so every rank sees the
        overflow, but it neither reads nor writes the residual: inf - inf would leave NaN there for good."""
        self._undo_begin(step)
        self.num_calls += 1
        self.rank = comm.rank
        if step < self.start_step:
            return None
        x = flat.detach().float()
        error_feedback = self.error_feedback and all_finite(x)
        return (self.add_residual(segments, x) if error_feedback else x), error_feedback

    def reduce(self, flat: Tensor, segments: Sequence[Segment], comm: Communicator, step: int) -> torch.futures.Future:
        """Average ``flat`` over ranks through this codec; the future holds ``flat`` overwritten with the mean."""
        begun = self._begin_reduce(flat, segments, comm, step)
        if begun is None:
            return comm.all_reduce_mean_async(flat)
        x, error_feedback = begun
        world, numel = comm.world_size, x.numel()
        finite_in = self.payload_may_overflow and all_finite(x)  # a sum (and one of the mean): fp16 payloads only
        if self.collective == "all_reduce":
            payload = self.compress(x, segments, step)
            if len(payload) != 1:
                raise RuntimeError(f"{self.name}: an all_reduce codec must produce exactly one payload tensor")
            payload[0].div_(world)  # in the payload dtype, as torch's fp16_compress_hook does
            if error_feedback:
                self._subtract_sent(x, self.decompress(payload, segments, numel).mul_(world), flat)

            def finish_sum(fut: torch.futures.Future) -> Tensor:
                return self._note_overflow(finite_in, flat.copy_(self.decompress([fut.value()], segments, numel)), step)

            return comm.all_reduce_sum_async(payload[0]).then(finish_sum)
        if self.collective != "all_gather":
            raise RuntimeError(f"{self.name}: unknown collective {self.collective!r}")
        payload = self.compress(x, segments, step)  # payload tensors never alias x
        if error_feedback:
            self._subtract_sent(x, self.decompress(payload, segments, numel), flat)

        def finish_gather(fut: torch.futures.Future) -> Tensor:
            gathered = fut.value()  # (world, nbytes); every replica sums in rank order
            payloads = [unpack_payload(gathered[rank], payload) for rank in range(world)]
            mean = self.decompress_sum(payloads, segments, numel).div_(world)
            return self._note_overflow(finite_in, flat.copy_(mean), step)

        return comm.all_gather_async(pack_payload(payload)).then(finish_gather)

    # --- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain dict (tensors, ints, strings): name, counters and the error-feedback residuals."""
        state = {
            "name": self.name,
            "num_calls": self.num_calls,
            "residuals": {k: v.detach().cpu().clone() for k, v in self.residuals.items()},
        }
        if self.grad_scale is not None:  # the loss scale the residuals are in (16-mixed)
            state["grad_scale"] = self.grad_scale
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` output; a state written by another compressor is an error."""
        if state.get("name") != self.name:
            raise ValueError(f"compressor state is for {state.get('name')!r}, this compressor is {self.name!r}")
        self.num_calls = int(state["num_calls"])
        self.residuals = {k: v.clone() for k, v in state["residuals"].items()}
        self.grad_scale = state.get("grad_scale")
        self._flat_residuals = {}
        if self._undo is not None:
            self._undo, self._undo_copies = {}, {}

    def _named_state(self) -> Iterator[tuple[str, str, Tensor]]:
        """``(kind, parameter name, tensor)`` of every per-parameter state (override to add a codec's own)."""
        for name, residual in self.residuals.items():
            yield "error-feedback residual", name, residual

    def check_fits(self, numels: Mapping[str, int]) -> None:
        """A ValueError unless the state holds only parameters of ``numels`` (name -> number of values), each
        residual with as many values. A state from another model (a renamed layer, ``strict=False``) was kept and
        re-saved but never applied, or failed at the first step as a bare size mismatch."""
        for kind, name, tensor in self._named_state():
            if name not in numels:
                raise ValueError(f"{self.name} compressor state holds the {kind} of {name!r}, a parameter this model "
                                 "does not have (a state written for another model?)")
            if kind == "error-feedback residual" and tensor.numel() != numels[name]:
                raise ValueError(f"{self.name} compressor state holds the {kind} of {name!r} with {tensor.numel()} "
                                 f"values; this model's has {numels[name]} (a state written for another model?)")

    def extra_repr(self) -> str:
        return f"error_feedback={self.error_feedback}, start_step={self.start_step}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"
