"""``LMDataModule``: token cache -> fixed windows -> deterministic, rank-sharded batches.

Training samples are non-overlapping windows of ``block_size + 1`` tokens; window ``i`` of a source is
``tokens[i*block_size : i*block_size + block_size + 1]`` and has the stable global ``index``
``offset(source) + i``. The train DataLoader yields *step tickets*; the batch itself is materialized in
:meth:`LMDataModule.on_before_batch_transfer`, which Lightning calls at step time, after the previous
step's ``on_train_batch_end``. So the batch of micro-step ``s`` is a pure function of
(seed, s, sampler state) even though Lightning prefetches one item ahead, and resume and DDP are exact.

Validation under data parallelism is exact too: every rank gets its own share of the validation windows and
runs the same number of them; the few padding windows that even out the shares carry ``loss_weight`` 0
(see :meth:`LMDataModule.val_dataloader`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset

from lit_dtrain.data._datamodule_checks import check_every_rank_read_the_same_data, source_from_config
from lit_dtrain.data._datamodule_state import (
    restore_scheduled_accumulation,
    warn_if_the_data_changed,
    warn_if_the_dataset_changed,
)
from lit_dtrain.data._drawn_shares import STATE_KEY as DRAWN_KEY
from lit_dtrain.data._drawn_shares import count_drawn, drawn_state, restore_drawn
from lit_dtrain.data._fit_end import check_the_fit_ends
from lit_dtrain.data._mixture_resume import mixture_shares
from lit_dtrain.data.corpus import CorpusError, CorpusSource, resolve_files
from lit_dtrain.data.samplers.base import IndexSampler, RandomSampler
from lit_dtrain.data.token_cache import TokenSplits, build_token_cache
from lit_dtrain.data.tokenizer import ByteTokenizer
from lit_dtrain.data.windows import (
    WindowSet,
    _ValWindows,
    dataset_key,
    token_counts,
    window_batch,
)
from lit_dtrain.utils.args import check_int, is_number
from lit_dtrain.utils.rank_zero import log_once

log = logging.getLogger("lit_dtrain.data.corpus")  # the data's logger (token caches, splits, a resume's data)


class _StepTickets(IterableDataset):
    """An endless stream of placeholder items; training length is set by ``max_steps``."""

    def __iter__(self):
        while True:
            yield 0


class LMDataModule(L.LightningDataModule):
    """Language-model data from the stdlib corpus, text files, or a weighted mixture of corpora.

    Args:
        sources: list of :class:`CorpusSource` (or dicts of its fields); weights set the mixture.
        block_size: tokens per training sample (the window holds ``block_size + 1``).
        batch_size: per-rank micro-batch size; global batch ``batch_size * world_size * accumulate_grad_batches``.
        seed: sampling seed (batches are a pure function of seed, step and sampler state).
        val_fraction: share of documents held out for validation (deterministic, by content hash).
        max_val_windows: cap on validation windows per source (evenly spaced over the val stream).
        cache_dir: where token caches live.
        cache_keep: token caches kept per source name and corpus in ``cache_dir``, the most recently used (one in use
            by a live process is never removed); None keeps every one.
        exclude_dirs: directories whose files are never corpus text (the configs give the run outputs' root); the
            files under ``cache_dir`` never are either.
        sampler: an :class:`IndexSampler`; defaults to :class:`RandomSampler`.
        tokenizer: :class:`ByteTokenizer` by default; one of one's own has ``name`` (in the cache key), ``vocab_size``,
            ``eos_id`` and ``encode(data: bytes, add_eos: bool)`` returning integer ids below ``vocab_size`` and 65536
            (``eos_id`` too).
    """

    def __init__(
        self,
        sources: list | None = None,
        block_size: int = 256,
        batch_size: int = 16,
        seed: int = 0,
        val_fraction: float = 0.02,
        max_val_windows: int = 256,
        val_batch_size: int | None = None,
        cache_dir: str = "~/.cache/lit_dtrain",
        sampler: IndexSampler | None = None,
        tokenizer: ByteTokenizer | None = None,
        progress: bool = True,
        cache_keep: int | None = 4,
        exclude_dirs: Iterable[str] | None = None,
    ) -> None:
        super().__init__()
        if sources is None:
            sources = [CorpusSource()]
        elif not isinstance(sources, (str, bytes, Mapping)) and isinstance(sources, Iterable):
            sources = list(sources)
        if isinstance(sources, (str, bytes, Mapping)) or not isinstance(sources, list) or not sources:
            # an empty list trained on the stdlib corpus without a word
            raise CorpusError(
                f"data.sources must be a non-empty list of sources, got {sources!r}; e.g. data=textfiles "
                "'data.sources.0.paths=[\"~/corpus\"]' (data=stdlib, or sources=None, for the stdlib corpus)"
            )
        self.sources = [s if isinstance(s, CorpusSource) else source_from_config(i, s) for i, s in enumerate(sources)]
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            # an unnamed files source is named by its first path (a478013): two of them under dirs of one name
            # ('/a/corpus', '/b/corpus') were refused without the fix, with names the user never gave
            raise CorpusError(f"data.sources names must be unique, got {names} (a source given no name is named by "
                              "the last part of its first path): give each its own name, "
                              "data.sources.<i>.name=<name> (CorpusSource(name=...))")
        total = sum(s.weight for s in self.sources)
        if not total > 0:  # here, not in setup(): before any source is tokenized
            raise CorpusError(f"data.sources: every weight is 0 ({names}); nothing to train on")
        if total == float("inf"):  # each finite, their sum not: every share became 0, a draw an IndexError
            raise CorpusError(f"data.sources: the weights {[s.weight for s in self.sources]} sum past the largest "
                              "float; only their ratios count, so scale them down (e.g. to shares that sum to 1)")
        # whole numbers, named: int() took block_size=64.5 as 64 and a string failed with int()'s own message
        self.block_size = check_int("data.block_size", block_size, minimum=1)
        self.batch_size = check_int("data.batch_size", batch_size, minimum=1)
        self.max_val_windows = check_int("data.max_val_windows", max_val_windows, minimum=1)
        self.seed = check_int("data.seed", seed, minimum=None)
        # None means batch_size; 0 used to mean it silently, -1 failed inside torch's DataLoader
        self.val_batch_size = self.batch_size if val_batch_size is None else check_int(
            "data.val_batch_size", val_batch_size, minimum=1)
        if not is_number(val_fraction) or not 0 < val_fraction < 1:
            raise ValueError(f"data.val_fraction must be a number in (0, 1) (the share of documents held out), got "
                             f"{val_fraction!r}")
        self.val_fraction = float(val_fraction)
        if not str(cache_dir).strip():  # '' put the token caches in the working dir
            raise CorpusError(
                f"data.cache_dir is empty ({cache_dir!r}): give the token caches' directory (the configs' default is "
                "paths.cache_dir: LIT_DTRAIN_CACHE, or ~/.cache/lit_dtrain)"
            )
        self.cache_dir, self.progress = cache_dir, progress
        self.cache_keep = None if cache_keep is None else check_int("data.cache_keep", cache_keep, minimum=1)
        if isinstance(exclude_dirs, (str, os.PathLike)):  # one dir, not its characters
            exclude_dirs = [exclude_dirs]
        self.exclude_dirs = [os.fspath(d) for d in exclude_dirs or ()]
        self.tokenizer = tokenizer or ByteTokenizer()
        self.sampler = sampler if sampler is not None else RandomSampler()
        minimum = self.sampler.min_block_size  # here, before any corpus is read: not at the first sampler update
        if self.block_size < minimum:
            raise ValueError(
                f"data.block_size={self.block_size} is below {type(self.sampler).__name__}'s minimum of "
                f"{minimum}: {self.sampler.min_block_size_reason}"
            )
        self.micro_step = 0  # train batches materialized so far (the data position)
        self.splits: list[TokenSplits] = []
        self.train_windows: WindowSet | None = None
        self.drawn_windows: np.ndarray | None = None  # windows drawn from each source, all ranks' (data/share/<name>)
        self._pending_state: dict | None = None
        self.overfit_indices: dict[int, torch.Tensor] = {}  # under Trainer(overfit_batches=k)

    # ---- building -----------------------------------------------------------------------------------
    def prepare_data(self) -> None:
        """Build the token caches once (rank 0 / local rank 0). Lightning calls it again at every entry point
        (``fit``, then ``validate``): the corpus is hashed once per process."""
        if not self.splits:
            self.splits = self._build_token_caches(self.progress, self.cache_keep)

    def _build_token_caches(self, progress: bool, keep: int | None) -> list[TokenSplits]:
        """Every source's token cache, once every source's paths are found: a missing path of a mixture's second
        source was named only after the first was hashed (the stdlib's 1790 files, seconds)."""
        files = [resolve_files(s) for s in self.sources]
        return [
            build_token_cache(s, self.cache_dir, self.block_size + 1, self.val_fraction, self.tokenizer, progress,
                              keep=keep, exclude_dirs=self.exclude_dirs, files=f)
            for s, f in zip(self.sources, files)
        ]

    def setup(self, stage: str | None = None) -> None:
        self._state_for_fit = stage in (None, "fit")  # see load_state_dict
        if self.train_windows is not None:
            return
        if not self.splits:  # prepare_data ran in another process (DDP rank > 0) or not at all
            self.splits = self._build_token_caches(False, None)
        check_every_rank_read_the_same_data(self)
        self.train_windows = WindowSet([s.train for s in self.splits], self.block_size)
        self.drawn_windows = np.zeros(len(self.sources), dtype=np.int64)
        global_batch = self.batch_size * self._world()[1]
        # the windows drawn: a weight-0 source's are never (validation only), so a tiny trained source beside a large
        # validation-only one (2 windows drawn of 613) was not warned about
        drawn = sum(int(n) for n, s in zip(self.train_windows.counts, self.sources) if s.weight > 0)
        if drawn < global_batch:  # a tiny corpus: the loss falls to 0 by memorizing it
            log_once(  # in train.log, once (a warnings.warn was printed by each rank, and named Lightning's call.py)
                log, logging.WARNING,
                "the training data holds %d window(s) of block_size+1 = %d tokens%s, fewer than one global batch of "
                "%d: every batch repeats windows (the model can only memorize them); use more text or a smaller "
                "data.block_size / data.batch_size", drawn, self.block_size + 1,
                " in its sources of weight > 0" if drawn < len(self.train_windows) else "", global_batch)
        weights = torch.tensor([s.weight for s in self.sources], dtype=torch.float64)
        if not weights.sum() > 0:
            names = [s.name for s in self.sources]
            raise CorpusError(f"data.sources: every weight is 0 ({names}); nothing to train on")
        weights = weights / weights.sum()
        base = None
        if len(self.sources) > 1:
            counts = torch.as_tensor(self.train_windows.counts, dtype=torch.float64)
            base = torch.repeat_interleave(weights / counts, torch.as_tensor(self.train_windows.counts))
        offsets = [int(o) for o in self.train_windows.offsets] if len(self.sources) > 1 else None
        self.sampler.setup(
            len(self.train_windows),
            base,
            self.seed,
            source_offsets=offsets,
            source_names=[s.name for s in self.sources] if offsets else None,
            dataset_key=dataset_key(self.splits),
        )
        if self._pending_state is not None:
            self._apply_state(self._pending_state)
            self._pending_state = None

    @property
    def num_train_samples(self) -> int:
        return len(self.train_windows) if self.train_windows is not None else 0

    def _world(self) -> tuple[int, int]:
        trainer = self.trainer
        if trainer is None:
            return 0, 1
        return trainer.global_rank, trainer.world_size

    def _accumulation(self) -> int:
        """The trainer's micro-batches per optimizer step (1 without a trainer)."""
        return int(getattr(self.trainer, "accumulate_grad_batches", 1) or 1) if self.trainer is not None else 1

    # ---- training batches -----------------------------------------------------------------------------
    def train_dataloader(self) -> DataLoader:
        return DataLoader(_StepTickets(), batch_size=None)

    def batch_for_step(self, step: int, rank: int = 0, world_size: int = 1) -> dict:
        """The rank's shard of the global batch of micro-step ``step`` (pure: does not advance state)."""
        return self._shard_batch(self.sampler.global_batch(step, self.batch_size * world_size), rank)

    def _overfit_batches(self) -> int:
        """``Trainer(overfit_batches=k)``: the micro-batches to cycle through (0: off). Lightning's own rule limits a
        DataLoader to its first k batches, which for this step-drawn stream trained on new batches every step."""
        k = getattr(self.trainer, "overfit_batches", 0) if self.trainer is not None else 0
        if isinstance(k, float) and k == 1.0:  # another fraction: Lightning refuses it for an IterableDataset
            # Lightning's "100% of the batches", which int() made one batch, cycled (train.py's check refuses it too)
            raise ValueError("LMDataModule: Trainer(overfit_batches=1.0) means all batches (Lightning's float), and "
                             "this stream, drawn by step, has no end: give the number of micro-batches to train on "
                             "again and again as an int (overfit_batches=1), or leave it out")
        return int(k)

    def _shard_batch(self, indices: torch.Tensor, rank: int) -> dict:
        shard = indices[rank * self.batch_size : (rank + 1) * self.batch_size]
        batch = window_batch(self.train_windows.gather(shard.numpy()), shard.clone())
        weight_fn = getattr(self.sampler, "loss_weights", None)
        if weight_fn is not None:
            weights = weight_fn(shard)
            if weights is not None:
                batch["loss_weight"] = weights
        return batch

    def next_train_batch(self) -> dict:
        """Materialize the next training batch for this rank and advance the data position."""
        rank, world = self._world()
        overfit = self._overfit_batches()
        if overfit:  # the first k micro-batches' windows again and again (kept: a sampler's draws move with its state)
            slot, size = self.micro_step % overfit, self.batch_size * world
            kept = self.overfit_indices.get(slot)
            excluded = getattr(self.sampler, "excluded", None)
            if kept is not None and excluded is not None and len(excluded) and bool(excluded[kept].any()):
                # LossSpikeMonitor's exclusions go to the sampler, whose draws kept windows bypass (they trained again
                # every k steps): the rest, topped up from the slot's draw, which leaves them out
                kept, drawn = kept[~excluded[kept]], self.sampler.global_batch(slot, size)
                kept = self.overfit_indices[slot] = torch.cat([kept, drawn[~torch.isin(drawn, kept)]])[:size]
            if kept is None or len(kept) != size:  # a resume on another global batch: the kept windows cut or topped up
                drawn = self.sampler.global_batch(slot, size)
                self.overfit_indices[slot] = drawn if kept is None else torch.cat([kept, drawn[len(kept):]])[:size]
            indices = self.overfit_indices[slot]
        else:
            indices = self.sampler.global_batch(self.micro_step, self.batch_size * world)
        batch = self._shard_batch(indices, rank)
        count_drawn(self, indices)
        self.micro_step += 1
        return batch

    def on_before_batch_transfer(self, batch, dataloader_idx: int):
        if isinstance(batch, int) and not isinstance(batch, bool):  # a train step ticket
            # checked at the batch, not as the DataLoader is made (and its first ticket fetched): Tuner.lr_find and
            # scale_batch_size remake it after their search, with the Trainer's own max_steps (-1) back
            check_the_fit_ends(self.trainer)
            if getattr(self, "_resumed", False):
                restore_scheduled_accumulation(self)
            return self.next_train_batch()
        return batch

    # ---- validation ------------------------------------------------------------------------------------
    def val_dataloader(self) -> list[DataLoader]:
        """One loader per source, over up to ``max_val_windows`` windows evenly spaced over its val stream.

        Under data parallelism each rank validates its own share, and the shares hold every window exactly
        once. Lightning would instead wrap each loader in torch's ``DistributedSampler``, which evens the
        shares out by repeating windows: those count twice unless the world size divides the window count
        (and it warns so during ``trainer.validate()``). Ranks must still run the same number of batches:
        under FSDP every forward is a collective, and Lightning stops a rank whose loader is empty ("within
        local rank has zero length"), or, with ``allow_zero_length_dataloader_with_multiple_devices``, lets it
        skip the evaluation loop and with it the epoch-end metric reduction, which the other ranks then wait
        for (Lightning's ``UnrepeatedDistributedSampler``, which does not pad, asserts that no rank is empty).
        So the set is padded to a multiple of the world size with fillers whose ``loss_weight`` is 0, and
        split by torch's ``DistributedSampler`` (rank ``r`` takes items ``r, r + world, ...``), which needs
        no padding of its own then; Lightning keeps a ``DistributedSampler`` it is given, and does not warn.
        ``LitLLM`` weighs each window's tokens by its ``loss_weight``, so its val loss is the single-process
        one. Also under ``trainer.limit_val_batches`` given as a number of batches ``k``: Lightning caps each
        rank's loader, so 2 ranks validated the first ``2k`` batches' windows and 1 process the first ``k`` (the same
        weights: val loss 3.1999 on 2 ranks, 3.3406 on 1, with ``k=1``); the set is cut to the first ``k`` batches'
        windows here, and the ranks share those (each rank runs ``k`` or fewer batches, so Lightning's cap cuts
        nothing more). A fraction is still Lightning's, of each rank's loader.
        """
        return self._window_loaders("limit_val_batches")

    def predict_dataloader(self) -> list[DataLoader]:
        """The validation windows again, one loader per source, shared by the ranks as in :meth:`val_dataloader`
        (``trainer.limit_predict_batches`` in place of ``limit_val_batches``): ``trainer.predict(LitLLM(...),
        datamodule=dm)`` gives each held-out window's loss (``LitLLM.predict_step``, which drops the fillers)."""
        return self._window_loaders("limit_predict_batches")

    def _window_loaders(self, limit_name: str) -> list[DataLoader]:
        rank, world = self._world()
        limit = getattr(self.trainer, limit_name, None) if self.trainer is not None else None
        loaders = []
        for split in self.splits:
            windows = WindowSet([split.val], self.block_size)
            n = len(windows)
            if n == 0:
                raise CorpusError(f"data source {split.name!r}: validation split has no full window")
            idx = np.unique(np.linspace(0, n - 1, min(n, self.max_val_windows)).round().astype(np.int64))
            if world > 1 and is_number(limit, integer=True) and limit > 0:
                idx = idx[: limit * self.val_batch_size]  # the windows one process validates (see above)
            dataset = _ValWindows(windows, idx, padding=-len(idx) % world)
            sampler = None
            if world > 1:
                sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
            loaders.append(DataLoader(dataset, batch_size=self.val_batch_size, shuffle=False, sampler=sampler))
        return loaders

    @property
    def val_names(self) -> list[str]:
        return [s.name for s in self.sources]

    def unigram_entropy(self) -> float:
        """Entropy (nats) of the token unigram distribution that training draws from: the loss of a
        model that ignores context, a baseline that any trained model should beat clearly. Under a mixture,
        each source's unigram distribution counts in proportion to its weight (weight 0: not at all)."""
        total = sum(s.weight for s in self.sources)
        probs = np.zeros(self.tokenizer.vocab_size, dtype=np.float64)
        for source, split in zip(self.sources, self.splits):
            if source.weight > 0:
                counts = token_counts(split.train, self.tokenizer.vocab_size).astype(np.float64)
                probs += (source.weight / total) * (counts / counts.sum())
        p = probs[probs > 0] / probs.sum()
        return float(-(p * np.log(p)).sum())

    # ---- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        # val_fraction: not restored (the config decides), recorded so that tools (scripts/spectrum.py) can hold out
        # the documents this run held out; max_val_windows: to warn when a resume validates on other windows
        return {
            "micro_step": self.micro_step,
            "seed": self.seed,
            "sampler": self.sampler.state_dict(),
            "val_fraction": self.val_fraction,
            "max_val_windows": self.max_val_windows,
            "global_batch": self.batch_size * self._world()[1],  # windows per micro-step; with the accumulation:
            "accumulate_grad_batches": self._accumulation(),  # to warn when a resume trains on other batches
            "epoch": self.trainer.current_epoch if self.trainer is not None else 0,  # (for an accumulation schedule)
            "overfit_indices": {slot: indices.tolist() for slot, indices in self.overfit_indices.items()},
            "mixture_shares": mixture_shares(self.sources),  # to warn when a resume draws another share of each source
            DRAWN_KEY: drawn_state(self),  # the shares drawn so far (data/share/<name>) go on across a resume
        }

    def load_state_dict(self, state: dict) -> None:
        if not getattr(self, "_state_for_fit", True):
            # trainer.validate()/test()/predict() with ckpt_path= (Lightning restores a datamodule's state there too):
            # an evaluation needs the weights only, and the state would rewind the fit this datamodule serves (its step
            # 8 -> 2 and its FourierSampler table after validate(ckpt_path=<step 2>), which a later fit went on from)
            return
        if self.train_windows is None:  # setup() has not run yet: apply once the sampler is bound
            self._pending_state = state
        else:
            self._apply_state(state)

    def _apply_state(self, state: dict) -> None:
        warn_if_the_data_changed(self, state)  # seed, validation windows, global batch, mixture
        self._resumed = True  # (restore_scheduled_accumulation at the first batch)
        self.micro_step = int(state["micro_step"])
        restore_drawn(self, state)
        self.overfit_indices = {int(k): torch.tensor(v) for k, v in state.get("overfit_indices", {}).items()}
        self.sampler.load_state_dict(state["sampler"])  # refuses per-window state (exclusions, a table) of other data
        warn_if_the_dataset_changed(state["sampler"].get("dataset_key"), self.sampler.dataset_key)
        self.restored_data = (state["sampler"].get("dataset_key"), state.get("mixture_shares"))  # (same_data)
