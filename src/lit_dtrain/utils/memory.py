"""Activation memory, backward FLOPs and peak RSS: the measurements behind activation checkpointing.

* :func:`measure_activation_memory` runs a step under
  ``torch.distributed._tools.mem_tracker.MemTracker`` (CPU or CUDA tensors: its snapshots are per
  device, and ``ACT`` is summed over devices). Its figure is the ``ACT`` category of the peak
  snapshot; the largest ``ACT`` seen at any point and the bytes each given
  module keeps alive after its forward come with it. Tensors that op-level selective checkpointing
  keeps live in checkpoint's own storage, where ``saved_tensors_hooks`` never see them; counting
  with those hooks reports ``selective`` equal to ``full``, so they are not used here.
* :func:`measure_backward_flops` counts the FLOPs of ``loss.backward()`` (recomputation included)
  with ``torch.utils.flop_counter.FlopCounterMode``.
* :func:`reset_peak_rss` / :func:`peak_rss_bytes` read the process high-water mark (Linux ``VmHWM``,
  which ``/proc/self/clear_refs`` can reset, so several variants can be compared in one process); they live in
  :mod:`lit_dtrain.utils.rss`, which imports nothing heavy (this module's ``MemTracker`` import takes seconds).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState
from torch.utils.flop_counter import FlopCounterMode, flop_registry, get_shape, sdpa_backward_flop, sdpa_flop

from lit_dtrain.utils.rss import peak_rss_bytes, reset_peak_rss  # noqa: F401 - their import path before utils.rss


@dataclass
class ActivationMemory:
    """Bytes of activation memory of one forward + backward.

    ``peak_act``: ``ACT`` of MemTracker's peak snapshot (the moment the total tracked memory peaked);
    ``max_act``: the largest ``ACT`` at any moment; ``peak_total``: all tracked categories at the peak;
    ``retained``: per requested module, ``ACT`` after its forward minus ``ACT`` before it, summed over its calls;
    ``calls``: per requested module, how many times its forward ran.
    """

    peak_act: int
    max_act: int
    peak_total: int
    retained: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)


def _act(snapshot: dict) -> int:
    """``ACT`` bytes of a MemTracker snapshot ``{device: {category: bytes}}``, summed over devices."""
    return int(sum(s.get(_MemRefType.ACT, 0) for s in snapshot.values()))


class _NoHook:
    """The handle of a gradient hook never registered (MemTracker removes every handle it holds on exit)."""

    def remove(self) -> None:
        pass


_NO_HOOK = _NoHook()


class _ActivationTracker(MemTracker):
    """MemTracker that also remembers the largest ``ACT`` seen (its peak snapshot is taken at the
    peak of the total, which for checkpointed models is in backward, not where ``ACT`` peaks)."""

    def __init__(self) -> None:
        super().__init__()
        self.max_act = 0

    def _track_module_params_and_buffers(self, module: nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        # (torch 2.13 private) MemTracker registers a gradient hook on every parameter of a module it enters: a frozen
        # one (requires_grad=False: a fine-tune's embedding) raised "cannot register a hook on a tensor that doesn't
        # require gradient" and the budget probe failed; it never gets a gradient, so it is marked as hooked already
        for param in module.parameters():
            if not param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                self._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        # _curr_mem_snap: {device: {category: bytes}} -- MemTracker's running snapshot (private).
        self.max_act = max(self.max_act, _act(self._curr_mem_snap))
        return out


def measure_activation_memory(
    step_fn: Callable[[], object], track: nn.Module, modules: Sequence[nn.Module] = ()
) -> ActivationMemory:
    """Run ``step_fn`` (forward and backward) under MemTracker and return its activation memory.

    ``track`` is the model (its parameters and buffers are categorized as such, not as activations);
    ``modules`` are modules whose retained activation bytes are reported (e.g. the blocks).
    """
    tracker = _ActivationTracker()
    tracker.track_external(track)
    with tracker:
        step_fn()
    peak = tracker.get_tracker_snapshot("peak")
    retained, calls = [], []
    for module in modules:
        stats = tracker.memory_tracking.get(module)
        if stats is None:
            raise ValueError(f"module {type(module).__name__} did not run in step_fn; cannot report its activations")
        pre, post = stats.snapshots.get(_ModState.PRE_FW, []), stats.snapshots.get(_ModState.POST_FW, [])
        retained.append(sum(_act(after) - _act(before) for before, after in zip(pre, post)))
        calls.append(len(post))
    return ActivationMemory(
        peak_act=_act(peak),
        max_act=int(tracker.max_act),
        peak_total=int(sum(s.get("Total", 0) for s in peak.values())),
        retained=retained,
        calls=calls,
    )


_aten = torch.ops.aten
POINTWISE_OPS = (
    _aten.add, _aten.sub, _aten.mul, _aten.div, _aten.neg, _aten.pow, _aten.rsqrt, _aten.sqrt, _aten.exp,
    _aten.log, _aten.tanh, _aten.sigmoid, _aten.silu, _aten.gelu, _aten.relu, _aten.mean, _aten.sum,
    _aten._softmax, _aten._log_softmax, _aten.silu_backward, _aten.gelu_backward, _aten.threshold_backward,
    _aten.sigmoid_backward, _aten.tanh_backward, _aten._softmax_backward_data, _aten._log_softmax_backward_data,
    _aten.native_dropout, _aten.native_dropout_backward, _aten.native_layer_norm, _aten.native_layer_norm_backward,
)
"""Ops counted at one FLOP per output element when ``count_pointwise=True``. FlopCounterMode's own
registry counts only matmul-class ops (mm, bmm, addmm, convolution, SDPA), so norms, activations
and elementwise ops -- all that op-level selective checkpointing recomputes -- count zero there."""


def _pointwise_flops(*args, out_shape=None, **kwargs) -> int:
    # out_shape is one torch.Size, or a tuple of them for multi-output ops (dropout, layer norm).
    multi = isinstance(out_shape, (list, tuple)) and out_shape and not isinstance(out_shape[0], int)
    return sum(math.prod(s) for s in (out_shape if multi else [out_shape]) if s is not None)


def _with_kv_heads_expanded(formula: Callable, query_index: int) -> Callable:
    """Wrap an SDPA FLOP formula so that key and value (the two arguments after the query at ``query_index``,
    layout (B, H, T, D)) count with the query's head count, as the kernel computes grouped-query attention.
    Shapes or tensors are accepted; MHA shapes pass through unchanged."""

    def flops(*args, out_shape=None, **kwargs) -> int:
        args = [get_shape(a) for a in args]
        heads = args[query_index][1]
        for i in (query_index + 1, query_index + 2):  # key, value: (B, H_kv, T, D) -> (B, H_q, T, D)
            if args[i][1] != heads and heads % args[i][1] == 0:
                args[i] = (args[i][0], heads, *args[i][2:])
        return formula(*args, **kwargs)

    return flops


# Torch's SDPA formulas assert equal q/k/v head counts (torch 2.11; pytorch/pytorch#177169 lets 2.13 accept GQA), so
# a model with fewer k/v heads failed on CUDA under FlopCounterMode; these entries count k/v expanded. The CPU
# flash kernel is missing from FlopCounterMode's registry (torch 2.13): without it attention FLOPs read zero.
# _flash_attention_forward and kin (registered too) run inside the SDPA ops, below the counter, unseen.
_SDPA_QUERY_INDEX = {  # op name -> position of the query argument (backward ops take grad_out first)
    "_scaled_dot_product_flash_attention": 0,
    "_scaled_dot_product_flash_attention_backward": 1,
    "_scaled_dot_product_efficient_attention": 0,
    "_scaled_dot_product_efficient_attention_backward": 1,
    "_scaled_dot_product_cudnn_attention": 0,
    "_scaled_dot_product_cudnn_attention_backward": 1,
}
ATTENTION_FLOPS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _with_kv_heads_expanded(sdpa_flop, 0),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _with_kv_heads_expanded(sdpa_backward_flop, 1),
    **{
        getattr(_aten, name): _with_kv_heads_expanded(flop_registry[getattr(_aten, name)], query_index)
        for name, query_index in _SDPA_QUERY_INDEX.items()
        if hasattr(_aten, name) and getattr(_aten, name) in flop_registry
    },
}
"""FLOP formulas of the SDPA kernels for FlopCounterMode, k/v counted at the query's head count."""


def backward_flops_by_op(forward_fn: Callable[[], torch.Tensor], count_pointwise: bool = True) -> dict:
    """FLOPs of the backward pass of ``forward_fn()``'s loss per op (``OpOverloadPacket``), recomputation
    included. Leaves the gradients in ``.grad`` like any backward."""
    mapping = dict(ATTENTION_FLOPS)
    if count_pointwise:
        mapping.update(dict.fromkeys(POINTWISE_OPS, _pointwise_flops))
    loss = forward_fn()
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        loss.backward()
    return dict(counter.get_flop_counts().get("Global", {}))


def measure_backward_flops(forward_fn: Callable[[], torch.Tensor], count_pointwise: bool = False) -> int:
    """Total FLOPs of the backward pass of ``forward_fn()``'s loss, recomputation included.

    With ``count_pointwise=False`` it is FlopCounterMode's count (matmul-class ops only, attention through
    :data:`ATTENTION_FLOPS`); with
    ``count_pointwise=True`` the :data:`POINTWISE_OPS` add one FLOP per output element.
    """
    return int(sum(backward_flops_by_op(forward_fn, count_pointwise).values()))
