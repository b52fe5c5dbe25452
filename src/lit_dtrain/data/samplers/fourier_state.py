"""The table of :class:`~lit_dtrain.data.samplers.fourier.FourierSampler` as memory and as checkpointed state: its
bytes per sample, ``state_dict`` (the table, its band layout and, with ``lag=1``, the updates not applied yet) and
``load_state_dict`` (which checks that the saved table fits this dataset and band configuration).

:class:`TableState` holds these methods of the sampler; the sampler's ``__init__`` and ``setup`` make the table.
"""

from __future__ import annotations

import logging

import torch

from lit_dtrain.errors import ConfigError
from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger("lit_dtrain.data.samplers")  # a sampler's lines: facts of the run, rank 0's, in train.log


class TableState:
    """The memory and checkpointed state of the ``FourierSampler`` table (see the module docstring)."""

    def bytes_per_sample(self) -> dict:
        """Bytes of CPU memory per training sample: the checkpointed table (m1, m2 fp32, visits int32, band
        profile fp16 x bands, excluded bool) and the derived caches (the float64 importance, which is also the
        sampling weight with one source; the mixture prior itself, and the weights, target and target CDF under a
        mixture prior or exclusions;
        the unseen mask for ``magnitude``; a few float64 values per block of ``BLOCK``), from the tensors
        actually held (after setup and the first update)."""
        n = max(self.num_samples, 1)
        table = [self.m1, self.m2, self.visits, self.profile, self.excluded]
        cache = [self._elem, self._unseen, self.base_weights]  # base_weights: the mixture prior (None: uniform)
        cache += [v for v in self._cache.values() if isinstance(v, torch.Tensor) and v.numel() > 1]

        def size(ts) -> float:  # each storage once (the weights may be the importance itself)
            storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in ts if t is not None}
            return sum(storages.values()) / n

        return {"table": size(table), "cache": size(cache), "total": size(table) + size(cache)}

    def state_dict(self) -> dict:
        self.flush()
        state = super().state_dict()
        state.update(
            m1=self.m1.clone(), m2=self.m2.clone(), visits=self.visits.clone(), profile=self.profile.clone(),
            updates=int(self.updates), last_step=int(self.last_step), seq_len=int(self.seq_len),
            nonfinite_skipped=int(self.nonfinite_skipped),
            max_freq=int(self.max_freq or 0), num_bands=int(self.num_bands or 0), fine_bands=int(self.fine_bands),
            # lag=1: the updates not applied yet (gathered, so the same on every rank), applied after the resume
            pending_steps=[u.step for u in self._pending],
            pending_records=[u.records().clone() for u in self._pending],
        )
        return state

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        table_keys = ("m1", "m2", "visits", "profile")
        if not any(key in state for key in table_keys):  # a RandomSampler's state: only the exclusions
            log_once(
                log, logging.WARNING,
                "the checkpoint's sampler state was written by RandomSampler (no table; %d excluded samples, kept): "
                "this FourierSampler's table starts empty and learns from the resumed step on", self.num_excluded,
            )
            self._pending, self._landed = [], None
            self._empty_table()
            self.updates = self.last_step = self.nonfinite_skipped = 0
            self._touch(target=True, raw=True)
            return
        pending = list(zip(state.get("pending_steps", []), state.get("pending_records", [])))
        if pending or bool(torch.as_tensor(state.get("visits", [])).any()):
            self.check_dataset(state, "table")
        for key in table_keys:
            if key not in state:
                raise KeyError(f"FourierSampler state lacks {key!r} (was it saved by another sampler?)")
            if state[key].shape[0] != self.num_samples:
                raise ConfigError(
                    f"FourierSampler state {key!r} covers {state[key].shape[0]} samples but the dataset has "
                    f"{self.num_samples}: the checkpoint belongs to another corpus or block_size"
                )
        self._pending, self._landed = [], None
        self.m1 = state["m1"].float().clone()
        self.m2 = state["m2"].float().clone()
        self.visits = state["visits"].int().clone()
        self.updates, self.last_step = int(state["updates"]), int(state["last_step"])
        self.nonfinite_skipped = int(state.get("nonfinite_skipped", 0))  # absent in checkpoints before it existed
        self.seq_len, self.fine_bands = 0, 0
        if int(state["seq_len"]):
            for name, configured in self._configured_bands.items():  # the profile was computed with the saved edges
                if configured is not None and int(configured) != int(state[name]):
                    raise ConfigError(
                        f"FourierSampler {name}={configured} is configured, but the checkpoint's table was built with "
                        f"{name}={int(state[name])} (its band profile is of those edges): resume with "
                        f"data.sampler.{name}={int(state[name])} (or null), or start the table over in a new run"
                    )
            self.max_freq, self.num_bands = int(state["max_freq"]), int(state["num_bands"])
            self._bind_length(int(state["seq_len"]))
            saved_fine = int(state["profile"].shape[1])
            if saved_fine < self.fine_bands:  # a coarser profile cannot be split into the finer bands needed
                raise ConfigError(
                    f"FourierSampler state 'profile' has {saved_fine} bands, this configuration needs "
                    f"{self.fine_bands} (stages/stage_table/num_bands changed since the checkpoint): resume with the "
                    "checkpoint's stage settings, or start the table over in a new run"
                )
            # a finer profile (stages turned off, a stage table with fewer bands) merges exactly into the bands used
            # now (merge_bands, same max_freq): it is kept, and new updates fill it at its resolution (it was refused)
            self.fine_bands = saved_fine
            self.profile = state["profile"].half().clone()
        self._touch(target=True, raw=True)
        for step, records in pending:
            self._restore_pending(int(step), torch.as_tensor(records))
