"""Accounted collectives and the DDP communication hook that runs a compressor.

:class:`Communicator` is the only place that calls ``torch.distributed``. It records the exact bytes
of every tensor it hands to a collective (the input this rank contributes: for ``all_gather`` its
own shard, not the gathered output; for ``all_to_all`` the pieces for the other ranks) and the wall time
during which any collective was in flight. With 2 ranks these bytes equal what each rank puts on the wire
(ring all-reduce of B bytes sends B per rank; all-gather of B bytes sends B); with W ranks ring all-reduce
sends 2 (W-1)/W x B and all-gather (W-1) x B.

:class:`CommSession` glues one compressor and/or one local-update rule to a DDP model: it is the
state object of :func:`compressed_comm_hook`, counts hook calls and steps, and turns per-step
records into the ``comm/*`` metrics. The Lightning strategy and ``scripts/bench_comm.py`` both use it.

:class:`Communicator` and :class:`LoopbackCommunicator` live in :mod:`._communicator` and are exported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lit_dtrain.strategies._communicator import (  # noqa: F401 - exported here, as before the split
    Communicator,
    LoopbackCommunicator,
    _all_gather_single,
    _union_seconds,
)
from lit_dtrain.strategies.compressors import Compressor, Segment, completed_future
from lit_dtrain.strategies.local_updates import LocalUpdate
from lit_dtrain.strategies.quantize import NoCompression


def bucket_segments(bucket: dist.GradBucket, names: dict[int, str]) -> list[Segment]:
    """Named segments of a DDP bucket, from where each gradient view sits in the flat buffer."""
    buffer = bucket.buffer()
    base, item = buffer.data_ptr(), buffer.element_size()
    segments = []
    for param, grad in zip(bucket.parameters(), bucket.gradients()):
        # a parameter of zero elements (a layer of width 0) has a view without data (data_ptr 0): it sits where the
        # one before it ends (the buffer holds the gradients in this order); every fit of such a model failed here
        end = segments[-1].offset + segments[-1].numel if segments else 0
        offset = (grad.data_ptr() - base) // item if grad.numel() else end
        if not 0 <= offset <= buffer.numel() - grad.numel():
            raise RuntimeError("a DDP bucket gradient is not a view into the bucket buffer; cannot compress it")
        segments.append(Segment(names[id(param)], offset, grad.numel(), tuple(grad.shape)))
    covered = sum(s.numel for s in segments)
    if covered != buffer.numel():
        raise RuntimeError(f"DDP bucket holds {buffer.numel()} values but its gradients cover {covered}")
    return segments


BOTH_MODES = ("a local-update rule skips the per-step gradient all-reduce, so a gradient compressor would never run: "
              "set strategy.compressor=null (compressor=None in Python); a codec for DiLoCo's pseudo-gradient goes in "
              "strategy.local_update.compressor")


class CommSession:
    """The state of one compressed (or local-update) DDP model: compressor, local rule, counters, metrics.

    Exactly one of ``compressor`` (per-step gradient all-reduce through a codec) and ``local_update``
    (no per-step gradient communication; parameters are synchronized every few steps) drives
    communication; with neither, gradients go through :class:`NoCompression` (fp32, accounted).
    Call :meth:`attach` once on the DDP model, :meth:`before_optimizer_step` and
    :meth:`after_optimizer_step` around every optimizer step.
    """

    def __init__(
        self,
        compressor: Compressor | None = None,
        local_update: LocalUpdate | None = None,
        comm: Communicator | None = None,
    ) -> None:
        if compressor is not None and local_update is not None:
            raise ValueError(BOTH_MODES)
        self.compressor = compressor if compressor is not None or local_update is not None else NoCompression()
        self.local_update = local_update
        self.comm = comm
        self.names: dict[int, str] = {}
        self.step = 0  # optimizer steps completed
        self.hook_calls = 0  # buckets seen by the hook (any mode)
        self.total_bytes = 0  # bytes handed to collectives, all steps
        self.total_dense_bytes = 0  # bytes plain DDP would have all-reduced (gradients' dtype), all steps
        self.total_time_ms = 0.0
        self._dense_this_step = 0
        self.last_step: dict = {}
        # The buckets of the latest step that sent gradients, as (name, offset, numel) in bucket order, saved with the
        # counters; after a restore, the first step's bucket is reduced as these (see reduce_bucket).
        self.bucket_layout: list[tuple[tuple[str, int, int], ...]] = []
        self._layout_step: int | None = None  # the step bucket_layout was recorded at (None: restored, or none yet)
        self._saved_layout: list[tuple[tuple[str, int, int], ...]] = []  # bucket_layout as restored
        self._restored_buckets: dict[str, int] | None = None  # name -> its saved bucket, until the next step ends

    # --- wiring -------------------------------------------------------------------------------
    def attach(self, ddp_model: nn.parallel.DistributedDataParallel, comm: Communicator | None = None) -> None:
        """Name the parameters and register :func:`compressed_comm_hook` on ``ddp_model`` (any device/backend)."""
        if comm is not None:
            self.comm = comm
        if self.comm is None:
            self.comm = Communicator(getattr(ddp_model, "process_group", None))
        self.names = {id(p): name for name, p in ddp_model.module.named_parameters()}
        ddp_model.register_comm_hook(self, compressed_comm_hook)

    @staticmethod
    def named_params(module: nn.Module) -> list[tuple[str, Tensor]]:
        """Trainable parameters by name (the local-update rules work on these), counting those that only
        ``LightningModule.toggle_optimizer`` switched off for another optimizer's step (manual optimization, a GAN):
        a sync in such a step averaged the toggled optimizer's parameters alone, so the others drifted apart."""
        toggled = getattr(module, "_param_requires_grad_state", None) or {}  # Lightning's: param -> its own flag
        return [(n, p) for n, p in module.named_parameters() if p.requires_grad or toggled.get(p, False)]

    def before_optimizer_step(self, named_params: Iterable[tuple[str, Tensor]]) -> None:
        """Lets a local-update rule snapshot the synchronized start point (DiLoCo's outer parameters)."""
        if self.local_update is not None:
            self.local_update.maybe_initialize(list(named_params))

    def after_optimizer_step(self, named_params: Iterable[tuple[str, Tensor]], force_sync: bool = False) -> dict:
        """Run the local-update rule, close the step's accounting, return the ``comm/*`` metrics."""
        synced = False
        if self.local_update is not None:
            synced = self.local_update.after_optimizer_step(list(named_params), self.comm, force_sync=force_sync)
        record = self.comm.take_step_record()
        self.step += 1
        self.total_bytes += record["bytes"]
        self.total_dense_bytes += self._dense_this_step
        self.total_time_ms += record["time_ms"]
        self.last_step = {
            "bytes": record["bytes"],
            "dense_bytes": self._dense_this_step,
            "time_ms": record["time_ms"],
            "collectives": record["collectives"],
            "sent_log": record["sent_log"],
            "synced": synced,
        }
        self._dense_this_step = 0
        self._restored_buckets = None  # from the second step on DDP's rebuilt buckets are the uninterrupted run's
        return self.metrics()

    def final_sync(self, named_params: Iterable[tuple[str, Tensor]]) -> bool:
        """Synchronize a local-update run outside an optimizer step (it stopped between syncs, or a validation
        follows a batch without a step); the bytes count in the totals. Returns synced."""
        if self.local_update is None:
            return False
        synced = self.local_update.sync_now(list(named_params), self.comm)
        record = self.comm.take_step_record()
        self.total_bytes += record["bytes"]
        self.total_time_ms += record["time_ms"]
        return synced

    def metrics(self) -> dict[str, float]:
        """``comm/bytes_per_step`` (last step, this rank), ``comm/compression_ratio`` (cumulative dense / sent;
        from the first step that sent something), ``comm/time_ms`` (last step, collectives in flight), and the
        averages over every step so far, logged or not (``comm/bytes_per_step_avg``, ``comm/time_ms_avg``)."""
        metrics = {
            "comm/bytes_per_step": float(self.last_step.get("bytes", 0)),
            "comm/bytes_per_step_avg": self.total_bytes / max(self.step, 1),
            "comm/time_ms": float(self.last_step.get("time_ms", 0.0)),
            # (the steps between logged ones are timed too: without it their time, checkpointed, reached no logger)
            "comm/time_ms_avg": self.total_time_ms / max(self.step, 1),
            "comm/hook_calls": float(self.hook_calls),
        }
        if self.total_bytes:  # before a local-update run's first sync nothing was sent: no ratio yet (not inf,
            # which flattened TensorBoard's axis for the whole run)
            metrics["comm/compression_ratio"] = self.total_dense_bytes / self.total_bytes
        if self.local_update is not None:  # syncs so far, and those forced before their period was over
            metrics["comm/syncs"] = float(self.local_update.num_syncs)
            metrics["comm/early_syncs"] = float(self.local_update.num_early_syncs)
        return metrics

    # --- reducing a bucket ----------------------------------------------------------------------
    def reduce_bucket(self, buffer: Tensor, segments: Sequence[Segment]) -> torch.futures.Future:
        """Average one DDP bucket through the compressor, and record its layout for :meth:`counters_state_dict`.

        The first step after a restore runs on DDP's initial bucket layout (torch 2.13: one bucket holding every
        gradient); DDP rebuilds its buckets after it. On 3 or more ranks gloo's all-reduce adds the ranks' values in
        an order that depends on where a value sits in the buffer and on the buffer's size (on 2 ranks a + b = b + a),
        so an all-reduce codec (none, fp16, bf16, PowerSGD, any codec's ``start_step`` warm-up) gave a resumed run
        other float roundings than the uninterrupted one (3e-8 in the parameters, 3 ranks). That step's bucket is
        therefore cut into the saved buckets, each laid out as saved and reduced on its own: blocking, once per start.
        """
        groups = self.record_bucket(segments)
        if groups is None:
            return self.compressor.reduce(buffer, segments, self.comm, self.step)
        by_name = {s.name: s for s in segments}
        for group in groups:
            sub = buffer.new_empty(sum(numel for _, _, numel in group))
            for name, offset, numel in group:
                sub[offset : offset + numel] = buffer[by_name[name].offset : by_name[name].offset + numel]
            sub_segments = [Segment(name, offset, numel, by_name[name].shape) for name, offset, numel in group]
            sub = self.compressor.reduce(sub, sub_segments, self.comm, self.step).wait()
            for name, offset, numel in group:
                buffer[by_name[name].offset : by_name[name].offset + numel] = sub[offset : offset + numel]
        return completed_future(buffer)

    def record_bucket(self, segments: Sequence[Segment]) -> list[tuple[tuple[str, int, int], ...]] | None:
        """Record the bucket ``segments``' layout (:meth:`counters_state_dict`). In the first step after a restore,
        where DDP hands its initial bucket, return the saved buckets it is made of, each counted in ``hook_calls`` as
        the uninterrupted run's hook call on it; else None. Local-update steps, which send nothing, call it too (their
        resumed ``comm/hook_calls`` stayed one below the uninterrupted run's)."""
        if self._layout_step != self.step:
            self.bucket_layout, self._layout_step = [], self.step
        groups = self._saved_buckets_of(segments)
        for bucket in groups or [tuple((s.name, s.offset, s.numel) for s in segments)]:
            self._record_bucket(bucket)
        if groups is not None:
            self.hook_calls += len(groups) - 1  # one call per saved bucket, as the uninterrupted run's hook made
        return groups

    def _record_bucket(self, bucket: tuple[tuple[str, int, int], ...]) -> None:
        if bucket not in self.bucket_layout:  # (a step whose micro-batches each sync reduces every bucket again)
            self.bucket_layout.append(bucket)

    def _saved_buckets_of(self, segments: Sequence[Segment]) -> list[tuple[tuple[str, int, int], ...]] | None:
        """The saved buckets this bucket is made of, when it is laid out otherwise (the first step after a restore);
        else None."""
        if self._restored_buckets is None or not segments:
            return None
        keys = {self._restored_buckets.get(s.name) for s in segments}
        if None in keys:
            return None
        groups = [self._saved_layout[k] for k in sorted(keys)]
        if {(name, numel) for g in groups for name, _, numel in g} != {(s.name, s.numel) for s in segments}:
            return None  # a saved bucket only partly here (or another size): not a union of saved buckets
        if len(groups) == 1 and groups[0] == tuple((s.name, s.offset, s.numel) for s in segments):
            return None  # laid out as saved
        return groups

    # --- state --------------------------------------------------------------------------------
    def counters_state_dict(self) -> dict:
        """Replicated counters (identical on every rank), and the latest step's bucket layout."""
        return {"step": self.step, "hook_calls": self.hook_calls, "total_bytes": self.total_bytes,
                "total_dense_bytes": self.total_dense_bytes, "total_time_ms": self.total_time_ms,
                "bucket_layout": [[list(entry) for entry in bucket] for bucket in self.bucket_layout]}

    def load_counters_state_dict(self, state: dict) -> None:
        self.step, self.hook_calls = int(state["step"]), int(state["hook_calls"])
        self.total_bytes, self.total_dense_bytes = int(state["total_bytes"]), int(state["total_dense_bytes"])
        self.total_time_ms = float(state["total_time_ms"])
        # absent from checkpoints written before it was kept: the first step then runs on DDP's initial buckets
        layout = [tuple((str(n), int(o), int(k)) for n, o, k in bucket) for bucket in state.get("bucket_layout", [])]
        self.bucket_layout, self._layout_step = layout, None
        self._saved_layout = layout
        self._restored_buckets = {name: i for i, bucket in enumerate(layout) for name, _, _ in bucket} or None


def compressed_comm_hook(session: CommSession, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP communication hook: average ``bucket`` through ``session.compressor``, or keep it local.

    Registered with ``DistributedDataParallel.register_comm_hook(session, compressed_comm_hook)``;
    works with gloo on CPU as with NCCL on CUDA.
    """
    session.hook_calls += 1
    buffer = bucket.buffer()
    session._dense_this_step += buffer.numel() * buffer.element_size()
    segments = bucket_segments(bucket, session.names)
    if session.local_update is not None:  # local step: no gradient communication at all
        session.record_bucket(segments)
        return completed_future(buffer)
    return session.reduce_bucket(buffer, segments)



# DDP's register_comm_hook compares these annotations with the real types; under
# `from __future__ import annotations` they would be strings and fail its check.
compressed_comm_hook.__annotations__.update(bucket=dist.GradBucket, session=CommSession)
compressed_comm_hook.__annotations__["return"] = torch.futures.Future[torch.Tensor]
