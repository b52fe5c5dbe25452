"""``FourierSampler``: importance sampling of training windows from the spectrum of their token loss.

Each observed sample gets a score ``(1 - mix) * time_score + mix * freq_score`` (mean token loss, and the
band-weighted energy of the rfft of its token loss, see :mod:`.spectral`). A per-sample table keeps EMAs
``m1``/``m2`` of the score; they become sampling probabilities with a uniform floor. All ranks hold the same
table: each rank all-gathers its ``(index, score, band profile)`` updates (profiles in fp16, optionally with
``async_op=True``, waited on before the next draw), and every rank draws the same global batch from the step's
seeded generator, so the draw stays a pure function of (seed, step, sampler state) as :class:`IndexSampler`
requires, and resume is exact. With ``lag=1`` the draw of optimizer step ``s`` uses the table through step
``s - 2`` instead of ``s - 1``: ``observe`` then never waits for the device (the scores are copied to the host while
the next step runs, and applied at the next step's ``observe``), so a GPU is not left idle while the host updates
the table and draws the next batch.

The table lives on CPU and is updated under ``no_grad``. Memory is O(N): see :meth:`bytes_per_sample`.
This module scores a batch (:meth:`FourierSampler.observe`) and holds the table; the update travels
to every rank's table through :mod:`.fourier_sync` (whose ``UpdateQueue`` applies it when ``lag`` says), and the
table becomes draws through :mod:`.fourier_cdf` (the two-level CDF); the table's memory and checkpointed state are in
:mod:`.fourier_state`, and its argument checks in :mod:`._fourier_args`. :mod:`.spectral` is the pure core: bands,
scores, the stage schedule and the importance transforms.
``lit_dtrain.callbacks.FourierSamplerCallback`` feeds it (without the callback the sampler never learns
anything, so it refuses to draw past step 1 without updates unless ``require_updates=False``).

Not to be confused with the published "FourierSampler" that orders token unmasking when a diffusion LM decodes.
"""

from __future__ import annotations

import torch

from lit_dtrain.data.samplers import spectral
from lit_dtrain.data.samplers._fourier_args import check_args
from lit_dtrain.data.samplers.base import IndexSampler, step_generator
from lit_dtrain.data.samplers.fourier_cdf import TwoLevelCDF
from lit_dtrain.data.samplers.fourier_state import TableState
from lit_dtrain.data.samplers.fourier_sync import (
    UpdateQueue,
    _pack,
    _Update,
    all_reduce_sum,
    gather_update,
    world_and_rank,
)


class FourierSampler(TableState, UpdateQueue, TwoLevelCDF, IndexSampler):
    """Spectral importance sampler (defaults are the research brief's).

    Args:
        max_freq, num_bands: band edges ``compute_bands(max_freq, num_bands)``; None picks the brief's
            defaults from the sequence length at the first update (256/4 up to 512 tokens, 1024/6 from 2048).
        score: ``mixed`` (time and frequency by ``mix``), ``time`` (mix=0) or ``frequency`` (mix=1).
        mix_initial, mix_final, decay_steps: the cosine mixing schedule (used when the stage mix is off).
        momentum, beta: EMA rates of the score's first and second moments.
        variant: ``moment_ratio`` (the brief's ``|m1|/sqrt(m2)``) or ``magnitude`` (see :func:`.spectral.importance`).
        min_prob, max_prob, magnitude_cap, eps: clamps of the importance transform.
        prior: importance of samples not seen yet (1.0 = a steady sample / an average one).
        uniform_floor: share of uniform (mixture-prior) sampling mixed in; every sample keeps
            ``p >= uniform_floor / N``.
        importance_weights: return ``1/(N p)`` loss weights for the drawn samples (an unbiased loss).
        stages, step_unit, stage_bands, stage_mix, stage_lr, stage_table: the staged schedule, its step unit and
            which of its parts apply (bands, mix, LR multiplier); ``stage_table`` rows are
            ``[name, start_in_units, bands, mix, lr_mult]`` (None: warmup 0/4/0.3/0.1, ramp 5/6/0.5/0.5,
            stable 20/8/0.7/1.0).
        async_op: gather updates with ``async_op=True`` and wait for them at the next draw.
        lag: 0 (the brief): a step's batch is drawn from the table through the previous step, so ``observe`` waits
            for the step's token losses. 1: through the step before that; ``observe`` queues its work on the
            token loss's device and copies the result to the host without waiting, and the update is applied at
            the next step's ``observe`` (pending updates are saved in ``state_dict``: resume stays exact).
        require_updates: raise if batches are drawn past step 1 while no update ever arrived.
    """

    min_block_size = 2
    min_block_size_reason = (
        "it scores a window by the rfft of its T token losses, whose T // 2 frequency bins besides the mean (bin 0) "
        "are the spectrum: T = 1 has none"
    )

    def __init__(
        self,
        max_freq: int | None = None,
        num_bands: int | None = None,
        score: str = "mixed",
        mix_initial: float = 0.3,
        mix_final: float = 0.7,
        decay_steps: int = 10000,
        momentum: float = 0.9,
        beta: float = 0.99,
        variant: str = "moment_ratio",
        min_prob: float = 1e-4,
        max_prob: float = 1.0,
        magnitude_cap: float = 10.0,
        eps: float = 1e-8,
        prior: float = 1.0,
        uniform_floor: float = 0.1,
        importance_weights: bool = False,
        stages: bool = True,
        step_unit: float = 1000,
        stage_bands: bool = True,
        stage_mix: bool = True,
        stage_lr: bool = True,
        stage_table: list | None = None,
        async_op: bool = True,
        require_updates: bool = True,
        lag: int = 0,
    ) -> None:
        super().__init__()
        max_freq, num_bands = check_args(
            max_freq=max_freq, num_bands=num_bands, score=score, mix_initial=mix_initial, mix_final=mix_final,
            decay_steps=decay_steps, momentum=momentum, beta=beta, variant=variant, min_prob=min_prob,
            max_prob=max_prob, magnitude_cap=magnitude_cap, eps=eps, prior=prior, uniform_floor=uniform_floor,
            importance_weights=importance_weights, stages=stages, step_unit=step_unit, stage_bands=stage_bands,
            stage_mix=stage_mix, stage_lr=stage_lr, async_op=async_op, require_updates=require_updates, lag=lag,
        )
        self.max_freq, self.num_bands = max_freq, num_bands
        self._configured_bands = {"max_freq": max_freq, "num_bands": num_bands}  # None: auto (a resume takes its)
        self.score, self.variant = score, variant
        # decay_steps as given: int() made 0.5 a 0, which failed at the first update, after a training step
        self.mix_initial, self.mix_final, self.decay_steps = float(mix_initial), float(mix_final), float(decay_steps)
        self.momentum, self.beta = float(momentum), float(beta)
        self.min_prob, self.max_prob, self.magnitude_cap, self.eps = min_prob, max_prob, magnitude_cap, eps
        self.prior, self.uniform_floor, self.importance_weights = float(prior), float(uniform_floor), importance_weights
        self.stages, self.step_unit = bool(stages), float(step_unit)
        self.stage_bands, self.stage_mix, self.stage_lr = bool(stage_bands), bool(stage_mix), bool(stage_lr)
        self.stage_table = spectral.parse_stages(stage_table)
        self.async_op, self.require_updates, self.lag = bool(async_op), bool(require_updates), int(lag)
        self.group = None  # process group of the collectives (None: the default group)
        self.feeder_attached = False  # set by expect_updates(): the require_updates check is then off
        # the table (allocated by setup / at the first update)
        self.m1 = self.m2 = torch.zeros(0)
        self.visits = torch.zeros(0, dtype=torch.int32)
        self.profile = torch.zeros(0, 0, dtype=torch.float16)
        self.seq_len, self.fine_bands = 0, 0
        self.updates, self.last_step = 0, 0
        self.nonfinite_skipped = 0  # samples whose token loss was NaN/inf, left out of the table

    # ---- binding -----------------------------------------------------------------------------------------
    def setup(self, num_samples: int, base_weights: torch.Tensor | None = None, seed: int = 0, **sources) -> None:
        super().setup(num_samples, base_weights, seed, **sources)
        if self.m1.numel() != num_samples:
            self._empty_table()
        self._touch(target=True, raw=True)

    def _empty_table(self) -> None:
        """A table of ``num_samples`` unseen samples; the band layout is bound at the first update."""
        self.m1 = torch.zeros(self.num_samples, dtype=torch.float32)
        self.m2 = torch.zeros(self.num_samples, dtype=torch.float32)
        self.visits = torch.zeros(self.num_samples, dtype=torch.int32)
        self.profile = torch.zeros(self.num_samples, 0, dtype=torch.float16)
        self.seq_len = self.fine_bands = 0

    def _bind_length(self, seq_len: int) -> None:
        """Fix the band layout for sequences of ``seq_len`` tokens and allocate the profile table."""
        if self.seq_len == seq_len and self.profile.shape[1] == self.fine_bands > 0:
            return
        if self.seq_len and self.seq_len != seq_len:
            raise ValueError(
                f"FourierSampler was bound to T={self.seq_len} but got token_loss with T={seq_len}: its band table "
                "is of one window length; pad every batch to the same length (collate to a fixed maximum, not the "
                "batch's longest) and return 'token_mask' [B, T] (true: a real token) so that the padding is left out"
            )
        auto_freq, auto_bands = spectral.default_band_config(seq_len)
        self.max_freq = int(auto_freq if self.max_freq is None else self.max_freq)
        self.num_bands = int(auto_bands if self.num_bands is None else self.num_bands)
        fine = self.num_bands
        if self.stages and self.stage_bands:
            fine = max(fine, *(s.bands for s in self.stage_table))
        self.seq_len, self.fine_bands = int(seq_len), int(fine)
        self.profile = torch.zeros(self.num_samples, fine, dtype=torch.float16)

    def expect_updates(self) -> None:
        """A feeder (``FourierSamplerCallback``, at train start) declares that it hands over every trained step.

        ``require_updates`` catches a missing feeder by the lack of an update at micro-step 2; a feeder observes at
        the end of each optimizer step, so under ``accumulate_grad_batches >= 3`` micro-step 2 is drawn before its
        first update. Once a feeder is attached that check is off."""
        self.feeder_attached = True

    def required_callbacks(self) -> list:
        """The callback that feeds this sampler (for trainers that add a sampler's callbacks automatically)."""
        from lit_dtrain.callbacks.fourier_sampler import FourierSamplerCallback

        return [FourierSamplerCallback()]

    # ---- schedules ---------------------------------------------------------------------------------------
    def stage(self, step: int) -> spectral.Stage | None:
        """The active stage, or None when the staged schedule is off."""
        return spectral.stage_at(step, self.step_unit, self.stage_table) if self.stages else None

    def mix_at(self, step: int) -> float:
        """Weight of the frequency score at ``step``."""
        if self.score != "mixed":
            return 1.0 if self.score == "frequency" else 0.0
        stage = self.stage(step)
        if stage is not None and self.stage_mix:
            return stage.mix
        return spectral.mix_schedule(step, self.mix_initial, self.mix_final, self.decay_steps)

    def bands_at(self, step: int) -> int:
        """Number of bands scoring the spectrum at ``step``."""
        stage = self.stage(step)
        if stage is not None and self.stage_bands:
            return stage.bands
        return int(self.num_bands or spectral.default_band_config(self.seq_len or 256)[1])

    def lr_multiplier(self, step: int) -> float:
        """The stage's LR multiplier (1.0 when stages or their LR part are off)."""
        stage = self.stage(step)
        return stage.lr_mult if stage is not None and self.stage_lr else 1.0

    # ---- updates -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def observe(self, token_loss: torch.Tensor, index: torch.Tensor, step: int,
                token_mask: torch.Tensor | None = None) -> dict:
        """Score this rank's samples of one micro-step and share the update with every rank.

        Collective when ``torch.distributed`` is initialized: every rank must call it once per micro-step.
        Returns local statistics for logging (``mix``, ``bands``, ``top_band_energy``, ``comm_bytes``,
        ``nonfinite``). With ``lag=1`` nothing here waits for the token loss's device: ``top_band_energy`` is then a
        0-d tensor on that device (its value is copied to the host with the update's records: :meth:`landed_stats`
        reads it once they have landed) and ``nonfinite`` is None (the count reaches ``nonfinite_skipped`` when the
        update is applied, at the next step's ``observe``).

        ``token_mask`` ``[B, T]`` (true: a real token) leaves padding out of the scores: each padded position takes
        its row's mean over the real tokens, so the time score is that mean and the band energies, scaled by ``T``
        over the real tokens' count, sum to their variance. Without it, padding's zero loss counted as tokens (a
        sample padded to 3x its length scored a third of its loss). A row with no real token is left out, as a
        non-finite one.
        """
        if self.num_samples == 0:
            raise RuntimeError("FourierSampler.setup() was not called")
        if token_loss.dim() != 2 or index.shape != token_loss.shape[:1]:
            raise ValueError(f"need token_loss [B, T] and index [B], got {tuple(token_loss.shape)} and "
                             f"{tuple(index.shape)}")
        if token_mask is not None and tuple(token_mask.shape) != tuple(token_loss.shape):
            raise ValueError(f"need token_mask of token_loss's shape {tuple(token_loss.shape)}, got "
                             f"{tuple(token_mask.shape)}")
        if self.lag:
            self._apply_pending(keep=step)  # the earlier calls' updates: the draws after this call see them
        else:
            self.flush()
        self._bind_length(int(token_loss.shape[1]))
        world, _ = world_and_rank(self.group)
        # A row with a NaN/inf token loss (an fp16 overflow that the GradScaler skips, a loss spike) must not
        # poison its sample's moments or, through the band weights, every other sample's score: it is scored
        # as zero loss here and marked NaN in the record, and every rank drops it in _apply.
        token_loss = token_loss.detach()
        real = None
        if token_mask is not None:  # padding takes its row's real mean: no effect on the mean or the deviations
            mask = token_mask.detach().to(token_loss.device, torch.bool)
            real = mask.sum(1)
            kept = torch.where(mask, token_loss.float(), 0.0)
            mean = torch.where(real > 0, kept.sum(1) / real.clamp_min(1), float("nan"))  # no real token: left out
            token_loss = torch.where(mask, token_loss.float(), mean[:, None])
        finite = torch.isfinite(token_loss).all(dim=1)
        all_finite = None if self.lag else bool(finite.all())  # lag: no host sync, the same values either way
        if not all_finite:
            token_loss = torch.where(finite[:, None], token_loss, 0.0)
        fine = spectral.band_energies(token_loss, self.max_freq, self.fine_bands)  # (B, F) on token_loss.device
        if real is not None:  # the real tokens' variance, not its dilution by the padding
            fine = fine * (token_loss.shape[1] / real.clamp_min(1).float())[:, None]
        bands = self.bands_at(step)
        profile = spectral.merge_bands(fine, bands)
        local = profile.sum(0)
        global_energy = local.square().sum().reshape(1)
        comm_bytes = 0
        if world > 1:
            global_energy, comm_bytes = all_reduce_sum(global_energy, self.group)  # needed now: synchronous
        weights = spectral.adaptive_band_weights(local, global_energy.to(local.device).squeeze(0))
        mix = self.mix_at(step)
        score = (1.0 - mix) * spectral.time_score(token_loss) + mix * spectral.frequency_score(profile, weights, world)
        if not all_finite:
            score = torch.where(finite, score, float("nan"))
        if self.lag:  # packed where the losses are (no wait); the host copy is made below
            # non-blocking only towards a GPU: a GPU-to-host copy would land in pinned memory read at once below
            index = index.detach().to(score.device, torch.long, non_blocking=score.is_cuda)
            record = _pack(index, score, fine.half())
        else:
            record = _pack(index.detach().to(device="cpu", dtype=torch.long), score.cpu(), fine.cpu().half())
        top_band_energy = profile[:, -1].mean()
        stats = top_band_energy.reshape(1) if self.lag else None  # copied to the host with the records
        if world > 1:
            overlap = self.async_op or bool(self.lag)
            update, sent = gather_update(int(step), record, stats, world, self.group, overlap=overlap)
            comm_bytes += sent
        else:
            update = _Update(int(step), parts=[record], stats=stats)
        if self.lag:
            update.to_host_async()  # (nothing to do where nothing is on a GPU)
        self._pending.append(update)
        if not self.lag and (world == 1 or not self.async_op):  # nothing to overlap with on one process
            self.flush()
        return {"mix": mix, "bands": bands, "comm_bytes": comm_bytes,
                "top_band_energy": top_band_energy if self.lag else float(top_band_energy),
                "nonfinite": None if self.lag else int((~finite).sum())}

    def _apply(self, index: torch.Tensor, score: torch.Tensor, profile: torch.Tensor, step: int) -> None:
        keep = torch.isfinite(score)  # rows whose token loss was not finite (see observe) are not learned from
        if not bool(keep.all()):
            self.nonfinite_skipped += int((~keep).sum())
            index, score, profile = index[keep], score[keep], profile[keep]
        self.updates += 1
        self.last_step = step
        if index.numel() == 0:
            return
        # A sample drawn twice in one global batch gets one update with its mean score and profile.
        uniq, inverse = torch.unique(index, sorted=True, return_inverse=True)
        count = torch.zeros(len(uniq)).index_add_(0, inverse, torch.ones(len(index)))
        mean_score = torch.zeros(len(uniq)).index_add_(0, inverse, score.float()) / count
        mean_prof = torch.zeros(len(uniq), profile.shape[1]).index_add_(0, inverse, profile.float()) / count[:, None]
        self.m1[uniq], self.m2[uniq] = spectral.update_moments(
            self.m1[uniq], self.m2[uniq], mean_score, self.momentum, self.beta
        )
        self.visits[uniq] += 1
        self.profile[uniq] = mean_prof.half()
        self._refresh(uniq)

    # ---- drawing (the two-level CDF is in fourier_cdf.py) ------------------------------------------------
    def probabilities(self, step: int) -> torch.Tensor:
        """The current sampling distribution (float64, sums to 1; excluded samples 0)."""
        self.flush()
        return self._probs_at(torch.arange(self.num_samples))

    def entropy(self) -> float:
        """Entropy (nats) of the distribution of the table as it is (no flush); ``log(N)`` is uniform. O(N).

        Called between a draw and the :meth:`observe` of its batch, it is the distribution the batch was drawn
        from (on one process, or with ``async_op=False``, ``observe`` applies its update at once; with ``lag=1``,
        ``observe`` applies the previous step's)."""
        return spectral.entropy(self._probs_at(torch.arange(self.num_samples)))

    def global_batch(self, step: int, size: int) -> torch.Tensor:
        """The ``size`` indices of step ``step`` (with replacement): inverse-CDF draws from the step's generator."""
        if self.num_samples == 0:
            raise RuntimeError("FourierSampler.setup() was not called")
        self.flush()
        fed = self.updates or self._pending  # lag=1: the first update is applied after step 2 is drawn
        if self.require_updates and not self.feeder_attached and not fed and step >= 2:
            raise RuntimeError(
                f"FourierSampler is drawing step {step} but never received a training update: add the callback "
                "(`'callbacks=[default,fourier_sampler]'`, or lit_dtrain.callbacks.FourierSamplerCallback), "
                "or set require_updates=False to sample from the prior (Lightning's Tuner.lr_find and "
                "scale_batch_size, and its LearningRateFinder and BatchSizeFinder callbacks, whose search runs at fit "
                "start, train without the Trainer's callbacks: tune with require_updates=False, which the fit after "
                "the search keeps fed by the callback, or on the default RandomSampler, then fit with the callback)"
            )
        u = torch.rand(size, generator=step_generator(self.seed, step), dtype=torch.float64)
        return self._draw(u)

    def loss_weights(self, shard_indices: torch.Tensor) -> torch.Tensor | None:
        """``1/(N p_i)`` (``target_i / p_i`` under a mixture prior) for the drawn samples, or None when off."""
        if not self.importance_weights:
            return None
        idx = torch.as_tensor(shard_indices, dtype=torch.long)
        return (self._target_at(idx) / self._probs_at(idx)).float()

    def exclude(self, indices) -> None:
        super().exclude(indices)
        self._touch(target=True)
