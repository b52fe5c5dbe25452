"""Local-update rules: ranks step alone and synchronize parameters every ``H`` steps.

- :class:`LocalSGD` averages the parameters every ``sync_period`` steps (Stich 2019; torch's
  post-local SGD). ``adaptive=True`` grows the period while the parameter divergence across ranks
  at a sync stays at or under ``divergence_threshold`` and shrinks it when it rises above.
- :class:`DiLoCo` (Douillard et al. 2023) treats ``outer - local`` as a pseudo-gradient, averages it
  (optionally through a :class:`~lit_dtrain.strategies.compressors.Compressor`) and takes an outer
  Nesterov SGD step (lr 0.7, momentum 0.9 by default) on the outer parameters.

The inner optimizer is whatever the LightningModule configured; its state stays rank-local.
Plain objects: they only talk through a ``Communicator`` and keep their state in ``state_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lit_dtrain.callbacks._args import check_arg, finite_number, whole_at_least
from lit_dtrain.strategies.compressors import Compressor, Segment, segments_from_shapes
from lit_dtrain.utils.args import is_flag

if TYPE_CHECKING:
    from lit_dtrain.strategies.comm import Communicator

NamedParams = Sequence[tuple[str, Tensor]]


@torch.no_grad()
def flatten_params(named_params: NamedParams) -> tuple[Tensor, list[Segment]]:
    """A fresh flat copy of the parameters and their segments: fp32, or fp64 when a parameter is fp64 (``64-true``;
    in fp32 every sync rounded the fp64 weights to fp32, and DiLoCo kept fp32 outer parameters)."""
    dtype = torch.float64 if any(p.dtype == torch.float64 for _, p in named_params) else torch.float32
    flat = torch.cat([p.detach().to(dtype).reshape(-1) for _, p in named_params])
    return flat, segments_from_shapes([(n, tuple(p.shape)) for n, p in named_params])


@torch.no_grad()
def write_params(named_params: NamedParams, flat: Tensor) -> None:
    """Copy ``flat`` back into the parameters (casting to their dtype)."""
    offset = 0
    for _, p in named_params:
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


@torch.no_grad()
def restore_rank_params(module: torch.nn.Module, params: Mapping[str, Tensor], rule: LocalUpdate,
                        comm: Communicator) -> None:
    """Give this rank its own parameters from a local-update checkpoint (``params``: those trainable at the save).

    A layer frozen at the save and trainable now is not in ``params``: it keeps its loaded value, the same on every
    rank. Under local SGD a layer trainable at the save and frozen now gets this rank's copy too, and the first
    forward averages it (:meth:`LocalSGD.sync_if_trainable_changed`), as a fit that froze it at that step does; other
    rules train on from the frozen layer's loaded value (rank 0's)."""
    local_sgd = isinstance(rule, LocalSGD)
    saved = [(n, p) for n, p in module.named_parameters() if n in params and (p.requires_grad or local_sgd)]
    for name, p in saved:
        p.copy_(params[name])
    if local_sgd:
        rule.sync_if_trainable_changed(saved, comm)  # records them as the latest forward's: no sync yet


class LocalUpdate:
    """Base: counts steps and calls :meth:`synchronize` every ``period`` steps (or when forced)."""

    name = "base"

    def __init__(self, sync_period: int) -> None:
        check_arg(type(self).__name__, "sync_period", sync_period, whole_at_least(1), "an integer >= 1")
        self.sync_period = int(sync_period)
        self.period = int(sync_period)  # the current period (adaptive rules change it)
        self.step = 0
        self.steps_since_sync = 0
        self.num_syncs = 0
        self.num_early_syncs = 0  # syncs forced before the period was over (the last step, before a validation)

    def maybe_initialize(self, named_params: NamedParams) -> None:
        """Called before every optimizer step with the (still synchronized at step 0) parameters."""

    def synchronize(self, named_params: NamedParams, comm: Communicator, scheduled: bool = True) -> None:
        """Make all ranks' parameters equal. ``scheduled``: the period is over (False: a sync forced early)."""
        raise NotImplementedError

    def after_optimizer_step(self, named_params: NamedParams, comm: Communicator, force_sync: bool = False) -> bool:
        """Count the step; synchronize when the period is over (or ``force_sync`` and unsynced). Returns synced."""
        self.step += 1
        self.steps_since_sync += 1
        if self.steps_since_sync >= self.period:
            return self.sync_now(named_params, comm, scheduled=True)
        return self.sync_now(named_params, comm) if force_sync else False

    def sync_now(self, named_params: NamedParams, comm: Communicator, scheduled: bool = False) -> bool:
        """Synchronize now unless nothing happened since the last sync; the next period starts here. A sync that is
        not ``scheduled`` counts in ``num_early_syncs``. Returns whether it synchronized."""
        if self.steps_since_sync == 0:
            return False
        self.synchronize(named_params, comm, scheduled)
        self.steps_since_sync = 0
        self.num_syncs += 1
        self.num_early_syncs += not scheduled
        return True

    def state_dict(self) -> dict:
        """Replicated state (identical on every rank): counters and the current period."""
        return {"name": self.name, "step": self.step, "steps_since_sync": self.steps_since_sync,
                "num_syncs": self.num_syncs, "num_early_syncs": self.num_early_syncs, "period": self.period}

    def load_state_dict(self, state: dict) -> None:
        if state.get("name") != self.name:
            raise ValueError(f"local-update state is for {state.get('name')!r}, this rule is {self.name!r}")
        self.step, self.steps_since_sync = int(state["step"]), int(state["steps_since_sync"])
        self.num_syncs, self.period = int(state["num_syncs"]), self._restored_period(int(state["period"]))
        self.num_early_syncs = int(state.get("num_early_syncs", 0))  # absent from checkpoints of before its count

    def load_snapshot(self, state: dict) -> None:
        """:meth:`load_state_dict` of an in-memory snapshot (a loss-spike rollback), but the sync counts stay: the
        syncs since the snapshot were made, and their bytes are in the ``comm/*`` totals (``comm/syncs`` went down
        while ``comm/bytes_per_step_avg`` kept their bytes). The schedule (steps, period) is the snapshot's."""
        counts = self.num_syncs, self.num_early_syncs
        self.load_state_dict(state)
        self.num_syncs, self.num_early_syncs = counts

    def _restored_period(self, saved: int) -> int:
        """The period after a resume: a fixed period is configuration, so this run's ``sync_period`` wins."""
        return self.sync_period

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items()
                           if not k.startswith("_") and not isinstance(v, torch.Tensor) and v is not None)
        return f"{type(self).__name__}({fields})"

    def rank_local_state_dict(self) -> dict | None:
        """State that differs per rank (a pseudo-gradient compressor's residuals), or None."""
        return None

    def load_rank_local_state_dict(self, state: dict | None) -> None:
        pass


class LocalSGD(LocalUpdate):
    """Average parameters every ``sync_period`` steps; optionally adapt the period to the divergence.

    Divergence at a sync is ``mean_r ||theta_r - theta_mean||^2 / ||theta_mean||^2`` (one extra
    4-byte all-reduce). With ``adaptive=True`` the period is multiplied by ``growth_factor`` (up to
    ``max_period``) when the divergence is at or under ``divergence_threshold`` and divided by it
    (down to ``min_period``) when above, so it settles where one period's drift meets the threshold. A sync forced
    before the period is over (before a validation, at the last step) averages without measuring: its drift is that
    of fewer steps, and it grew the period after every early sync of a run that validates more often than it syncs.
    """

    name = "local_sgd"

    def __init__(
        self,
        sync_period: int = 8,
        adaptive: bool = False,
        min_period: int = 2,
        max_period: int = 64,
        divergence_threshold: float = 5e-3,
        growth_factor: int = 2,
    ) -> None:
        super().__init__(sync_period)
        check_arg("LocalSGD", "adaptive", adaptive, is_flag, "True or False")
        for name, value, least in (("min_period", min_period, 1), ("max_period", max_period, 1),
                                   ("growth_factor", growth_factor, 2)):
            check_arg("LocalSGD", name, value, whole_at_least(least), f"an integer >= {least}")
        check_arg("LocalSGD", "divergence_threshold", divergence_threshold, finite_number(lambda v: v > 0),
                  "a finite number > 0")
        if adaptive and not 1 <= int(min_period) <= self.sync_period <= int(max_period):  # "3": a count as text
            raise ValueError(f"LocalSGD: need 1 <= min_period <= sync_period <= max_period, got "
                             f"{min_period}, {sync_period}, {max_period}")
        self.adaptive = bool(adaptive)
        self.min_period, self.max_period = int(min_period), int(max_period)
        self.divergence_threshold = float(divergence_threshold)
        self.growth_factor = int(growth_factor)
        self.last_divergence = 0.0
        self._trained: NamedParams | None = None  # the parameters trainable at the latest forward
        if adaptive:
            self.name = "local_sgd_adaptive"

    def sync_if_trainable_changed(self, named_params: NamedParams, comm: Communicator) -> bool:
        """Before a forward: when what trains changed since the latest one (a layer frozen mid-fit) and the ranks
        stepped alone since the last sync, average the parameters that trained until now (an early sync).

        A sync averages only the trainable parameters, so a layer frozen between syncs kept each rank's own copy for
        good: a 2-rank fit that froze a layer 1 step after a sync ended with the ranks' copies 0.017 apart, and its
        checkpoints held rank 0's. Returns whether it synchronized."""
        before, self._trained = self._trained, list(named_params)
        if before is None or [n for n, _ in before] == [n for n, _ in self._trained]:
            return False
        return self.sync_now(before, comm)

    @torch.no_grad()
    def synchronize(self, named_params: NamedParams, comm: Communicator, scheduled: bool = True) -> None:
        flat, _ = flatten_params(named_params)
        adapt = self.adaptive and scheduled
        local = flat.clone() if adapt else None
        mean = comm.all_reduce_sum(flat).div_(comm.world_size)
        if adapt:
            sq = (local - mean).pow(2).sum().reshape(1)
            total = comm.all_reduce_sum(sq)
            self.last_divergence = float(total / comm.world_size / mean.pow(2).sum().clamp_min(1e-30))
            if self.last_divergence <= self.divergence_threshold:
                self.period = min(self.period * self.growth_factor, self.max_period)
            else:
                self.period = max(self.period // self.growth_factor, self.min_period)
        write_params(named_params, mean)

    def state_dict(self) -> dict:
        return {**super().state_dict(), "last_divergence": self.last_divergence}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.last_divergence = float(state["last_divergence"])

    def _restored_period(self, saved: int) -> int:
        # an adapted period is state, kept within this run's (possibly changed) bounds
        return min(max(saved, self.min_period), self.max_period) if self.adaptive else self.sync_period


class DiLoCo(LocalUpdate):
    """Inner optimizer for ``sync_period`` steps, then an outer Nesterov SGD step on the averaged pseudo-gradient.

    Outer state: the outer parameters (the last synchronized point) and the momentum buffer, both
    replicated. ``compressor`` (optional) compresses the pseudo-gradient all-reduce; its error-feedback
    residual is rank-local state.
    """

    name = "diloco"

    def __init__(
        self,
        sync_period: int = 16,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        compressor: Compressor | str | Mapping | None = None,
    ) -> None:
        super().__init__(sync_period)
        check_arg("DiLoCo", "outer_lr", outer_lr, finite_number(lambda v: v > 0), "a finite number > 0")
        check_arg("DiLoCo", "outer_momentum", outer_momentum, finite_number(lambda v: 0 <= v < 1), "in [0, 1)")
        check_arg("DiLoCo", "nesterov", nesterov, is_flag, "True or False")
        self.outer_lr, self.outer_momentum, self.nesterov = float(outer_lr), float(outer_momentum), bool(nesterov)
        # a name or {"name", **kwargs} as for the strategy's compressor (Hydra builds DiLoCo without build_local_update)
        from lit_dtrain.strategies.registry import build_compressor  # that module imports this one

        self.compressor = build_compressor(compressor)
        self.outer_params: Tensor | None = None  # flat fp32 (fp64 for a model with fp64 parameters)
        self.momentum: Tensor | None = None  # as outer_params
        self._pending: dict | None = None  # loaded per-name state, laid out at the first step
        self._segments: list[Segment] = []

    @torch.no_grad()
    def maybe_initialize(self, named_params: NamedParams) -> None:
        if self.outer_params is not None:
            return
        flat, segments = flatten_params(named_params)
        self._segments = segments
        if self._pending is None:
            self.outer_params, self.momentum = flat, torch.zeros_like(flat)
            return
        # A tensor without outer state was frozen when the state was saved and trains now (a layer unfrozen at a
        # resume): its synchronized point is its value, the same on every rank (loaded, then broadcast by DDP), and it
        # has not moved, so its momentum is zero: what the outer loop would hold had it tracked the tensor all along.
        # Before, the resume failed here (and a local-update resume at its per-rank restore, with a bare KeyError).
        outer, momentum = self._pending["outer_params"], self._pending["momentum"]
        values = [flat[s.offset : s.offset + s.numel] for s in segments]
        self.outer_params = torch.cat([outer[s.name].reshape(-1).to(flat) if s.name in outer else v
                                       for s, v in zip(segments, values)])
        self.momentum = torch.cat([momentum[s.name].reshape(-1).to(flat) if s.name in outer else torch.zeros_like(v)
                                   for s, v in zip(segments, values)])
        self._pending = None

    @torch.no_grad()
    def synchronize(self, named_params: NamedParams, comm: Communicator, scheduled: bool = True) -> None:
        self.maybe_initialize(named_params)
        flat, segments = flatten_params(named_params)
        if [(s.name, s.shape) for s in segments] != [(s.name, s.shape) for s in self._segments]:
            before, now = {s.name for s in self._segments}, {s.name for s in segments}
            raise RuntimeError(
                f"DiLoCo: the trainable parameters changed since its outer loop started ({len(before)} -> {len(now)}"
                f" tensors; new: {sorted(now - before)[:5]}, gone: {sorted(before - now)[:5]}): it keeps outer "
                "parameters for the ones trainable at the first step, so freeze or unfreeze layers only in a new fit"
            )
        pseudo_grad = self.outer_params - flat
        if self.compressor is not None:
            pseudo_grad = self.compressor.reduce(pseudo_grad, segments, comm, self.num_syncs).wait()
        else:
            pseudo_grad = comm.all_reduce_sum(pseudo_grad).div_(comm.world_size)
        self.momentum.mul_(self.outer_momentum).add_(pseudo_grad)
        update = pseudo_grad.add(self.momentum, alpha=self.outer_momentum) if self.nesterov else self.momentum
        self.outer_params.sub_(update, alpha=self.outer_lr)
        write_params(named_params, self.outer_params)

    def state_dict(self) -> dict:
        state = super().state_dict()
        if self.outer_params is None:
            state["outer_params"] = dict(self._pending["outer_params"]) if self._pending else {}
            state["momentum"] = dict(self._pending["momentum"]) if self._pending else {}
            return state
        segments = self._segments
        state["outer_params"] = {s.name: self.outer_params[s.offset : s.offset + s.numel].view(s.shape).cpu().clone()
                                 for s in segments}
        state["momentum"] = {s.name: self.momentum[s.offset : s.offset + s.numel].view(s.shape).cpu().clone()
                             for s in segments}
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.outer_params, self.momentum = None, None
        # a state from before the first step (LossSpikeMonitor's on_train_start snapshot) holds no outer parameters:
        # the next step starts the outer loop afresh from the parameters it finds, as a new run does
        self._pending = ({"outer_params": dict(state["outer_params"]), "momentum": dict(state["momentum"])}
                         if state["outer_params"] else None)

    def rank_local_state_dict(self) -> dict | None:
        return self.compressor.state_dict() if self.compressor is not None else None

    def load_rank_local_state_dict(self, state: dict | None) -> None:
        if self.compressor is not None and state is not None:
            self.compressor.load_state_dict(state)
