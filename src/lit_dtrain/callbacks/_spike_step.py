"""The optimizer step as :class:`~lit_dtrain.callbacks.loss_spike.LossSpikeMonitor` sees it: measured, and dropped.

- :func:`step_measurements`: the step's loss, global grad norm and excluded-sample hits, with one all-reduce;
- :func:`drop_grads`: make the coming optimizer step a no-op (also under the ``16-mixed`` GradScaler);
- :func:`scaler_skips_step`: whether the GradScaler has already decided to skip the step;
- :func:`buffer_values`, :func:`restore_buffers`: the buffers from before the step, put back when it is dropped;
- :func:`nonfinite_grad_fix`: what ``LitLLM``'s stop at non-finite gradients tells the user to change.
"""

from __future__ import annotations

import math

import torch

from lit_dtrain.callbacks.adaptive_grad_clip import has_grad_scaler, is_sharded, local_grad_sumsq, loss_scale
from lit_dtrain.utils.words import counted


def step_measurements(trainer, optimizer, loss_sum: torch.Tensor, micro_batches: int, hit: torch.Tensor | None,
                      check_grad: bool) -> tuple[float, float | None, float]:
    """``(loss, grad_norm, hit_count)`` of this optimizer step, the same on every rank.

    ``loss_sum`` is the sum of the step's micro-batch losses on this rank, ``hit`` whether its batches held an
    excluded sample. One all-reduce of [loss, grad sumsq, hits] under DDP; ``loss`` is the mean over ranks,
    ``grad_norm`` None without ``check_grad``, and ``inf`` for non-finite grads unless a GradScaler handles them.
    """
    world = trainer.world_size
    params = [p for g in optimizer.param_groups for p in g["params"]]
    zero = torch.zeros((), device=loss_sum.device)
    grad_part = zero
    if check_grad:
        sumsq = local_grad_sumsq(params)
        sumsq = zero if sumsq is None else sumsq.to(zero.device) / loss_scale(trainer, optimizer) ** 2
        # DDP: every rank holds the same all-reduced grads, so the sum of sumsq/world is their sumsq
        grad_part = sumsq if is_sharded(trainer.strategy) else sumsq / world
    # Lightning divides every micro-batch's loss (so its gradient) by accumulate_grad_batches, also in a step with
    # fewer micro-batches (the last of an epoch whose batch count it does not divide): judge such a step by the
    # mean over the micro-batches it had, not at k/accumulate of its loss and grad norm.
    accumulate = int(getattr(trainer, "accumulate_grad_batches", 1) or 1)
    short = accumulate / micro_batches if 0 < micro_batches < accumulate else 1.0
    loss_sum = loss_sum.reshape(()) * short if short != 1.0 else loss_sum.reshape(())
    if short != 1.0:
        grad_part = grad_part * short**2
    hit = zero if hit is None else hit.float().to(zero.device)
    stats = torch.stack([loss_sum, grad_part, hit])
    if world > 1:
        stats = trainer.strategy.reduce(stats, reduce_op="sum")
    loss_total, grad_sumsq, hit_count = stats.tolist()
    grad_norm = math.sqrt(grad_sumsq) if check_grad and math.isfinite(grad_sumsq) else None
    if check_grad and not math.isfinite(grad_sumsq) and not has_grad_scaler(trainer):
        grad_norm = math.inf
    return loss_total / world, grad_norm, hit_count


def scaler_skips_step(trainer, optimizer) -> bool:
    """True when the GradScaler has already found inf/NaN grads for this step, so that it will not call
    ``optimizer.step`` (nor the optimizer's hooks). An optimizer that unscales inside ``step`` (fused Adam) is still
    called, hooks included, and is not flagged. Uses GradScaler's ``_per_optimizer_states``, as :func:`drop_grads`."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is None or not getattr(scaler, "is_enabled", lambda: True)():
        return False
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is not OptState.UNSCALED:
        return False
    return any(bool(found_inf.item()) for found_inf in state["found_inf_per_device"].values())


def drop_grads(trainer, optimizer) -> None:
    """Make the coming optimizer step a no-op: params and optimizer state stay bit-identical.

    torch optimizers skip params whose grad is None. Under ``16-mixed`` the GradScaler must also see an
    inf check for this step, or ``scaler.update()`` fails ("No inf checks were recorded"); so the grads are
    unscaled first where the optimizer would have done it inside ``step`` (fused Adam) and the step is marked
    as overflowed: the scaler then skips ``optimizer.step``. Its scale/growth tracker are restored afterwards.
    This uses GradScaler's per-optimizer state (``_per_optimizer_states``, torch.amp.grad_scaler), which
    has no public accessor.
    """
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None and getattr(scaler, "is_enabled", lambda: True)():
        from torch.amp.grad_scaler import OptState

        if scaler._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY:
            scaler.unscale_(optimizer)
        for found_inf in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
            found_inf.fill_(1.0)
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def buffer_values(module, reuse: list | None = None) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Every buffer of ``module`` and a copy of it, taken before the step's first forward: the forwards of a step that
    is then dropped update buffers too (BatchNorm's running statistics and batch counter), which no optimizer step
    undoes; :func:`restore_buffers` puts them back. ``reuse``: the previous step's list, whose copies are written
    over where they fit (a new one a step cost a CPU allocation's page faults: a 256 MiB buffer 180-550 ms of CPU
    a step, its copy into the kept one 35 ms)."""
    kept = {name: copy for name, _, copy in reuse or ()}
    values = []
    with torch.no_grad():
        for name, buffer in module.named_buffers():
            copy = kept.get(name)
            if copy is not None and _fits(copy, buffer):
                copy.copy_(buffer)
            else:
                copy = buffer.detach().clone()
            values.append((name, buffer, copy))
    return values


def _fits(copy: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether ``copy.copy_(buffer)`` makes what ``buffer.detach().clone()`` would: the same shape, strides, dtype
    and device, a plain dense tensor, and no storage shared with the buffer (a buffer set back whole by
    :func:`restore_buffers` is the copy itself)."""
    return (_dense(copy) and _dense(buffer) and copy.shape == buffer.shape and copy.stride() == buffer.stride()
            and copy.dtype == buffer.dtype and copy.device == buffer.device and buffer.numel() > 0
            and copy.untyped_storage().data_ptr() != buffer.untyped_storage().data_ptr())


def _dense(tensor: torch.Tensor) -> bool:
    """A plain dense tensor, with sizes and strides (a nested tensor's ``.shape`` raises: a nested buffer failed every
    step from the second, 'NestedTensorImpl doesn't support sizes')."""
    return tensor.layout == torch.strided and not tensor.is_nested and not tensor.is_quantized


def restore_buffers(module, values: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """Put back the buffers :func:`buffer_values` copied, in place (so that a DDP wrapper keeps broadcasting the same
    tensors) and in the dtype the buffer has now: FSDP's mixed precision casts the buffers it holds in place
    (``buffer.data = buffer.to(bf16)``) in a step's forward, and setting the float32 copy back whole undid that cast
    behind its back (a new float32 tensor where FSDP keeps bfloat16 ones). A buffer the module has since replaced by
    another tensor of another shape or dtype is set back whole, as is one that is no plain dense tensor (a nested
    tensor has no shape to compare: the skip failed)."""
    with torch.no_grad():
        for name, held, value in values:
            owner_path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_path)
            buffer = getattr(owner, leaf)
            if isinstance(buffer, torch.Tensor) and _dense(buffer) and _dense(value) and buffer.shape == value.shape \
                    and (buffer is held or buffer.dtype == value.dtype):
                buffer.copy_(value)
            else:
                setattr(owner, leaf, value.to(buffer.device) if isinstance(buffer, torch.Tensor) else value)


def is_last_step(trainer) -> bool:
    """Whether the optimizer step that just ended is the fit's last (``max_steps``, or the last batch of the last
    epoch)."""
    if trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step:
        return True
    epochs = trainer.max_epochs
    return bool(trainer.is_last_batch) and epochs is not None and 0 < epochs <= trainer.current_epoch + 1


def weights_finite(trainer, module) -> bool:
    """Whether every parameter of ``module`` is finite on every rank (one all-reduce under DDP: under a local-update
    rule the ranks' weights differ, and they must all take the same way)."""
    # isfinite, not a norm: a norm of finite fp16 weights (16-true) can overflow to inf; each rank's shard under FSDP
    params = [p.detach() for p in module.parameters() if p.numel()]
    # The all-reduce's flag lives on the strategy's device, as NCCL reduces CUDA tensors only: a rank whose FSDP shard
    # is empty has no parameter to take a device from (it took the CPU's), and a CPU-offloaded shard's is the CPU's.
    if trainer.world_size > 1:
        device = trainer.strategy.root_device
    else:
        device = params[0].device if params else torch.device("cpu")
    bad = torch.zeros((), device=device)
    for p in params:
        bad = bad + (~p.isfinite().all()).float().to(device)
    if trainer.world_size > 1:
        bad = trainer.strategy.reduce(bad, reduce_op="sum")
    return not bool(bad.item())


def refuse_poisoned_weights(trainer, module, step: int, when: str, monitor) -> None:
    """Raise :class:`~lit_dtrain.module.NonFiniteError` when the weights are no longer finite (``monitor``: the
    ``LossSpikeMonitor``, for its ``check_grad`` and ``actions``).

    An update with a NaN/inf gradient is applied where the monitor does not drop it: without ``check_grad`` it does
    not look at the gradients (a NaN gradient under a finite loss: an overflow in backward), and actions without
    ``skip``/``rollback`` drop nothing. With ``module.check_finite`` off nothing else stops it: every later loss is
    NaN, which ``skip`` dropped step after step, excluding the samples of healthy batches, and a run that ended within
    ``max_nonfinite`` steps of the update exited 0 with NaN weights. Checked only at a non-finite loss and after the
    last step, so it costs no pass over the weights or gradients per step."""
    from lit_dtrain.module import NonFiniteError

    if has_grad_scaler(trainer) or weights_finite(trainer, module):  # (16-mixed: the GradScaler skips such updates)
        return
    actions = monitor.actions
    if not monitor.check_grad:
        why, fix = "check_grad=false does not look for", "set check_grad=true (non-finite gradients are then dropped)"
    else:
        why, fix = f"actions {actions} do not drop", "add 'skip' to actions, or keep module.check_finite on"
    if "last" not in when and "rollback" not in actions:
        fix += ", or add 'rollback' to actions (it restores a snapshot from before the update)"
    raise NonFiniteError(
        f"LossSpikeMonitor: the weights are non-finite (NaN/inf) {when} (step {step}): an update with non-finite "
        f"gradients was applied, which {why} and skipping steps cannot undo; {fix}. Resume from a checkpoint written "
        f"before the update"
    )


def nonfinite_grad_fix(callbacks) -> str:
    """The change that lets a run go on past a step with non-finite gradients, for ``LitLLM``'s
    :class:`~lit_dtrain.module.NonFiniteError`: enable the ``LossSpikeMonitor``, or, where one of ``callbacks`` is
    configured but let the gradients through, the setting of it that did (``check_grad``, ``actions``)."""
    from lit_dtrain.callbacks.loss_spike import LossSpikeMonitor

    monitor = next((cb for cb in callbacks if isinstance(cb, LossSpikeMonitor)), None)
    if monitor is None:
        return "enable 'callbacks=[default,loss_spike]' to skip or roll back such steps"
    fixes = [] if monitor.check_grad else ["set its check_grad=true (false does not look at the gradients)"]
    if not {"skip", "rollback"} & set(monitor.actions):
        fixes.append(f"add 'skip' or 'rollback' to its actions ({list(monitor.actions)} drop no step)")
    if not fixes:  # (it drops every step with non-finite gradients before this stop looks)
        return "check why the LossSpikeMonitor did not drop the step"
    return f"the LossSpikeMonitor is on but let them through: {' and '.join(fixes)}"


def nonfinite_run_message(steps: list[int], max_nonfinite: int) -> str:
    """The start of ``NonFiniteError``'s message for a run of ``steps`` non-finite steps ("1 non-finite (NaN/inf)
    step, step 5", where it said "1 non-finite (NaN/inf) steps in a row, steps 5-5")."""
    where = f", step {steps[0]}" if len(steps) == 1 else f" in a row, steps {steps[0]}-{steps[-1]}"
    return (f"LossSpikeMonitor: {counted(len(steps), 'non-finite (NaN/inf) step')}{where} "
            f"(max_nonfinite={max_nonfinite})")


def spike_window_message(window) -> str:
    """The start of ``LossSpikeError``'s message for a full :class:`~lit_dtrain.callbacks._spike_stats.SpikeWindow`
    ("1 loss spike within 1 step (step 5, ...", where it said "1 loss spikes within 1 steps (steps [5], ...")."""
    steps = window.steps
    where = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps}"
    return (f"LossSpikeMonitor: {counted(len(steps), 'loss spike')} within {counted(window.window_steps, 'step')} "
            f"({where}, raise_after={window.max_spikes})")
