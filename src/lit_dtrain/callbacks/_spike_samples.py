"""The sample indices behind :class:`~lit_dtrain.callbacks.loss_spike.LossSpikeMonitor`'s exclusions.

A spike dropped by ``skip`` or ``rollback`` excludes the sample ``index`` values of its batch (the batch key
``index``: each sample's integer index in the dataset) from the datamodule's sampler, so that they are never
trained on again. Without a sampler that has ``exclude()``, a later step whose batch holds an excluded index
is skipped instead. Here: reading the batch's indices, gathering them from every rank, finding the sampler,
and refusing an exclusion that leaves nothing to train on.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Collection, Mapping, Sequence

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import SequentialSampler

from lit_dtrain.utils.distributed import all_gather_stacked
from lit_dtrain.utils.words import counted, plural

DROP_ACTIONS = {"skip", "rollback"}  # the actions that exclude the spike's samples, so need the batch's indices


def batch_sample_indices(batch, actions: Sequence[str]) -> torch.Tensor | None:
    """The batch's ``index`` as a flat integer tensor, else None where ``actions`` do not need it.

    With ``skip`` or ``rollback`` a batch without the key ``index`` is a KeyError, and one whose ``index`` holds no
    integer sample indices a TypeError; both name the batch's content and the way out."""
    raw = batch.get("index") if isinstance(batch, Mapping) else None
    if raw is None:
        if DROP_ACTIONS & set(actions):
            keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise KeyError(f"LossSpikeMonitor with actions {actions} needs the batch key 'index' "
                           f"(sample indices, LongTensor[B]) to exclude a spike's samples; got {keys}. Add it to "
                           f"the batch, or use actions without 'skip'/'rollback', e.g. actions=['log', "
                           f"'lr_cooldown']")
        return None
    # (string ids or float values failed in ``torch.as_tensor`` with "too many dimensions 'str'", even with ``log``)
    try:
        index = torch.as_tensor(raw).detach().reshape(-1)
    except (TypeError, ValueError, RuntimeError):
        index = None
    integer = index is not None and not (index.dtype.is_floating_point or index.dtype.is_complex)
    if integer and index.dtype != torch.bool:
        return index
    if DROP_ACTIONS & set(actions):
        first = raw[0] if isinstance(raw, (list, tuple)) and raw else None
        got = f"{index.dtype} values" if index is not None else f"{type(raw).__name__} of {type(first).__name__}"
        raise TypeError(
            f"LossSpikeMonitor with actions {actions} needs the batch key 'index' to hold integer sample "
            f"indices (LongTensor[B]: your Dataset returns each sample's int index under 'index'); got {got}. "
            f"Return the integer index under 'index', or use actions without 'skip'/'rollback', e.g. "
            f"actions=['log', 'lr_cooldown']"
        )
    return None  # only recorded in the events: left out


def gather_indices(trainer, indices: list[torch.Tensor]) -> list[int]:
    """This step's sample indices of every rank (an all-gather under DDP), as ints, rank by rank.

    The ranks may hold different numbers of samples (a user's own per-rank shards, ``use_distributed_sampler=False``,
    whose last batches differ): the sizes are gathered first and each rank's indices padded to the largest. (An
    all-gather of unequal tensors read past the shorter rank's indices, so excluded samples that were never in the
    batch, while gloo aborted the other rank: "Received data size doesn't match expected size".)"""
    if not indices:
        return []
    local = torch.cat(indices).reshape(-1)
    if trainer.world_size == 1:
        return [int(i) for i in local.tolist()]
    sizes = all_gather_stacked(torch.tensor([local.numel()], device=local.device)).reshape(-1).tolist()
    padded = local.new_zeros(max(sizes))
    padded[: local.numel()] = local
    gathered = all_gather_stacked(padded).reshape(len(sizes), -1)
    return [int(i) for rank, n in enumerate(sizes) for i in gathered[rank, : int(n)].tolist()]


def exclusion_sampler(trainer):
    """``(sampler, num_train_samples)``: the datamodule's sampler when it has ``exclude()`` (else None), and
    without one the size of a plain train DataLoader's dataset (None when it has none)."""
    sampler = getattr(trainer.datamodule, "sampler", None) if trainer.datamodule is not None else None
    sampler = sampler if callable(getattr(sampler, "exclude", None)) else None
    num_train_samples = None
    if sampler is None:
        try:
            loader = trainer.train_dataloader
            num_train_samples = len(loader.dataset)
        except (AttributeError, TypeError, NotImplementedError):
            pass  # an iterable dataset, or several train loaders: no size to compare the exclusions with
        else:  # a sequential loader cut by limit_train_batches draws only its first batches, every epoch: all 8
            # samples of limit_train_batches=2 excluded (of 64) skipped every later step, and the run exited 0
            batches, size = getattr(trainer, "num_training_batches", math.inf), getattr(loader, "batch_size", None)
            if type(getattr(loader, "sampler", None)) is SequentialSampler and size and math.isfinite(batches):
                num_train_samples = min(num_train_samples, int(batches) * size)
    return sampler, num_train_samples


def raise_together(trainer, mine: str | None, theirs: str) -> None:
    """Raise ``RuntimeError(mine)`` on every rank when any rank has a reason ``mine`` to stop (else nothing).

    Called in lockstep (the monitor's decisions are the same on every rank), with each rank's own check: a user's own
    per-rank shards (a plain DataLoader, ``use_distributed_sampler=False``) differ in size, so one rank's exclusions
    can cover its shard while another's do not. Before, that rank raised alone and the others failed in their next
    collective (gloo: "Connection closed by peer") or waited for NCCL's timeout. A rank without a reason of its own
    raises ``theirs``."""
    stopping = int(mine is not None)
    if getattr(trainer, "world_size", 1) > 1:
        flag = torch.tensor(float(stopping), device=trainer.strategy.root_device)
        stopping = int(trainer.strategy.reduce(flag, reduce_op="sum").item())
    if stopping:
        raise RuntimeError(mine or theirs.format(ranks=stopping, world=trainer.world_size))


def check_not_all_excluded(trainer, known: Collection[int], n: int | None) -> None:
    """Refuse an exclusion set ``known`` that holds every index of a train dataset of ``n`` samples (on any rank),
    unless no later step comes: the fit ends at ``max_steps`` (``Trainer(fast_dev_run=True)``'s single batch, or a
    ``max_steps`` run's last step), where it raised that every later step would be skipped. The same on every rank."""
    max_steps = getattr(trainer, "max_steps", -1)
    if isinstance(max_steps, int) and 0 <= max_steps <= getattr(trainer, "global_step", -1):
        return
    mine = None
    if n and len(known) >= n and all(i in known for i in range(n)):
        # without a sampler every later step would be skipped (each batch holds an excluded index), and the run
        # would end as if it had trained; a sampler with exclude() refuses this too
        mine = (f"every sample of the train DataLoader's dataset that its epochs draw ({n}, indices 0..{n - 1}) has "
                f"been excluded, so every later step would be skipped; {_WAY_OUT}")
    raise_together(trainer, mine, "every sample of the train DataLoader's dataset has been excluded on {ranks} other "
                   "rank(s) of {world} (their error names it), so every later step would be skipped; " + _WAY_OUT)


_WAY_OUT = "lower the thresholds (z_threshold, rel_threshold), or use actions without 'skip'/'rollback'"


class ExcludedOnlyRun:
    """Stops a run whose steps are all skipped for holding an excluded sample (no sampler with ``exclude()``).

    :func:`check_not_all_excluded` catches an exclusion of every index ``0..n-1`` at once, but a dataset's ``index``
    may be any integer id (a shard's global ids). Every excluded id came from a batch, so once there are as many as
    the dataset has samples, all are excluded; an epoch's worth of optimizer steps in a row then skipped confirms that
    the run trains nothing more, and it raises instead of ending as if it had trained. (Exclusions that hit many but
    not all samples only skip the steps that hold one: not an error. An unsized dataset is not checked.) Under DDP
    each rank checks its own dataset and epoch, and all ranks raise together (:func:`raise_together`)."""

    def __init__(self) -> None:
        self.steps = 0

    def update(self, trainer, pending: dict | None, num_excluded: int, num_samples: int | None) -> None:
        """After each optimizer step; ``pending``: the monitor's event of this step (None: no event)."""
        only_excluded = pending is not None and not pending["counted"]  # skipped only for an excluded sample
        self.steps = self.steps + 1 if only_excluded else 0
        if not self.steps:  # (the same on every rank: the decisions are)
            return
        batches = getattr(trainer, "num_training_batches", math.inf)
        mine = None
        if num_samples and num_excluded >= num_samples and math.isfinite(batches):
            per_epoch = math.ceil(batches / max(int(getattr(trainer, "accumulate_grad_batches", 1) or 1), 1))
            if self.steps >= per_epoch:
                mine = (f"LossSpikeMonitor: the last {counted(self.steps, 'step')} (an epoch of the train DataLoader) "
                        f"{plural(self.steps, 'was', 'were all')} skipped because each batch held an excluded sample "
                        f"index: {num_excluded} sample ids are excluded and the dataset has {num_samples}, so the "
                        f"run would train nothing more; {_WAY_OUT}")
        raise_together(trainer, mine, "LossSpikeMonitor: on {ranks} other rank(s) of {world}, an epoch of the train "
                       "DataLoader in a row was all skipped for excluded sample indices and every sample id of its "
                       "dataset is excluded (their error names them), so the run would train nothing more; "
                       + _WAY_OUT)


class _Weak:
    """A weak reference that pickles as a dead one: a monitor that served a fit is picklable (a ``weakref.ref`` is
    not: given to a ``Trainer(strategy="ddp_spawn")`` after a fit of its own, the launch failed with ``TypeError:
    cannot pickle 'weakref.ReferenceType' object``). Its copy in another process serves another Trainer."""

    def __init__(self, obj) -> None:
        self._ref = weakref.ref(obj)

    def __call__(self):
        return self._ref() if self._ref is not None else None

    def __getstate__(self) -> dict:
        return {"_ref": None}

    def __deepcopy__(self, memo: dict) -> _Weak:  # (a copy in this process compares the same objects, as before)
        return self


def _weak(obj) -> _Weak | None:
    try:
        return _Weak(obj)
    except TypeError:  # (an object without weak references: not compared)
        return None


def fit_data(trainer) -> tuple:
    """What a fit trains on, weakly held: ``(trainer, its datamodule, else its train DataLoader's dataset)``."""
    data = trainer.datamodule
    if data is None:
        data = getattr(getattr(trainer, "train_dataloader", None), "dataset", None)
    return _weak(trainer), None if data is None else _weak(data)


def note_fit_data(previous: tuple | None, trainer, excluded: Collection[int]) -> tuple:
    """This fit's :func:`fit_data`, after a warning where a later ``fit`` of the same Trainer (``previous``: the
    earlier fit's :func:`fit_data`) on another datamodule (or, without one, another train dataset) goes on with the
    earlier fit's ``excluded`` sample indices, which may name other samples there: a staged fit on a second datamodule
    skipped its steps whose batch held indices 12..15 because samples 12..15 of the first had spiked, without a word.
    (The same datamodule fitted again, or a resume in a new Trainer, is not told.)"""
    current = fit_data(trainer)
    if not previous or not excluded or previous[0] is None or previous[0]() is not trainer:
        return current
    now = current[1]
    if previous[1] is None or now is None or previous[1]() is now():
        return current
    shown = sorted(excluded)
    rank_zero_warn(
        f"LossSpikeMonitor: this fit of the same Trainer trains on another {type(now()).__name__} than the previous "
        f"fit, and goes on with its {len(shown)} excluded sample indices {shown[:8]}{' ...' if len(shown) > 8 else ''}"
        ": in this data they name other samples, which are not trained on. If this is other data, call "
        "monitor.excluded.clear() before this fit (or fit a new Trainer)"
    )
    return current
