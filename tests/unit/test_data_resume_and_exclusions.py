"""LMDataModule across a resume (position, seed, global batch, edited corpus) and its excluded samples, also per
mixture source."""

import logging
import re

import numpy as np
import pytest
import torch

from lit_dtrain.data import CorpusSource
from tests.conftest import make_corpus
from tests.unit._data_helpers import dm_for, drew_a_batch


def test_data_position_advances_and_restores(corpus, tmp_path):
    dm = dm_for(corpus, tmp_path)
    first = [dm.on_before_batch_transfer(0, 0)["index"] for _ in range(3)]
    state = dm.state_dict()
    nxt = dm.on_before_batch_transfer(0, 0)["index"]
    fresh = dm_for(corpus, tmp_path)
    fresh.load_state_dict(state)
    assert state["micro_step"] == 3
    assert torch.equal(fresh.on_before_batch_transfer(0, 0)["index"], nxt)
    assert not torch.equal(first[0], first[1])


def test_resuming_with_another_data_seed_warns(corpus, tmp_path, caplog, monkeypatch):
    """The checkpoint records the data seed, and a resume with another ``data.seed`` switched the data stream
    silently (the resumed run is no longer the interrupted one's continuation). Rank 0 alone says it, in train.log (a
    warnings.warn was printed by each rank of a 2-rank run, and not in train.log); every rank restores the state."""
    from lightning.pytorch.utilities import rank_zero_only

    dm = dm_for(corpus, tmp_path, seed=1)
    dm.on_before_batch_transfer(0, 0)
    for rank, count in ((1, 0), (0, 1)):
        monkeypatch.setattr(rank_zero_only, "rank", rank)
        other = dm_for(corpus, tmp_path, seed=2)
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
            other.load_state_dict(dm.state_dict())
        said = [r.getMessage() for r in caplog.records if "data seed" in r.getMessage()]
        assert len(said) == count and other.micro_step == 1  # the position is restored all the same
    assert "data seed 1, and this run's data.seed is 2" in said[0] and "set data.seed=1, or seed=1" in said[0]


def test_resuming_on_another_global_batch_warns(corpus, tmp_path, caplog, monkeypatch):
    """A resume on another number of ranks (compressed DDP resumes on any since 3d529cb; plain DDP always did) or with
    another data.batch_size trained on other global batches at the same LR without a word: the checkpoint records its
    global batch, and a resume whose batch differs says so and which data.batch_size keeps it."""
    def said(dm, state) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
            dm.load_state_dict(state)
        return [r.getMessage() for r in caplog.records if "global batches" in r.getMessage()]

    state = drew_a_batch(dm_for(corpus, tmp_path, batch_size=8)).state_dict()
    assert state["global_batch"] == 8 and state["accumulate_grad_batches"] == 1
    assert said(dm_for(corpus, tmp_path, batch_size=8), state) == []
    [message] = said(dm_for(corpus, tmp_path, batch_size=4), state)
    assert "global batches of 8 windows" in message
    assert "are 4 (data.batch_size=4 on 1 rank(s), accumulate_grad_batches=1)" in message
    assert "(data.batch_size=8 keeps its batch)" in message
    two_ranks = dm_for(corpus, tmp_path, batch_size=4)
    monkeypatch.setattr(two_ranks, "_world", lambda: (0, 2))
    assert said(two_ranks, state) == []  # 4 on each of 2 ranks: the same global batch of 8
    three_ranks = dm_for(corpus, tmp_path, batch_size=4)
    monkeypatch.setattr(three_ranks, "_world", lambda: (0, 3))
    [message] = said(three_ranks, state)
    assert "are 12 (data.batch_size=4 on 3 rank(s)" in message and "keeps" not in message  # 8 / 3: no whole size


def test_a_resume_that_keeps_its_global_batch_by_accumulation_stays_quiet(corpus, tmp_path, caplog, monkeypatch):
    """The step's batch is data.batch_size x ranks x trainer.accumulate_grad_batches: a checkpoint of batches of 8
    resumed with data.batch_size=4 trainer.accumulate_grad_batches=2 (the usual answer to an OOM) trains on the same 8
    windows a step, yet was told 'this run's are 4 ... data.batch_size=8 keeps its batch'; and batches of 8 resumed
    with accumulate_grad_batches=2 train on 16 a step without a word."""
    def said(dm, state, accumulation) -> list[str]:
        monkeypatch.setattr(dm, "_accumulation", lambda: accumulation, raising=False)
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
            dm.load_state_dict(state)
        return [r.getMessage() for r in caplog.records if "global batches" in r.getMessage()]

    state = drew_a_batch(dm_for(corpus, tmp_path, batch_size=8)).state_dict()
    assert said(dm_for(corpus, tmp_path, batch_size=4), state, 2) == []
    [message] = said(dm_for(corpus, tmp_path, batch_size=8), state, 2)
    assert "global batches of 8 windows" in message and "this run's are 16" in message
    assert "accumulate_grad_batches=2" in message and "(data.batch_size=4 keeps its batch)" in message
    accumulated = dm_for(corpus, tmp_path, batch_size=4)
    monkeypatch.setattr(accumulated, "_accumulation", lambda: 2, raising=False)
    state = drew_a_batch(accumulated).state_dict()  # 4 x 2 = 8 a step
    assert said(dm_for(corpus, tmp_path, batch_size=8), state, 1) == []
    [message] = said(dm_for(corpus, tmp_path, batch_size=4), state, 1)
    assert "global batches of 8 windows" in message and "this run's are 4" in message
    old = {k: v for k, v in state.items() if k != "accumulate_grad_batches"}  # a checkpoint from before: this run's
    assert said(dm_for(corpus, tmp_path, batch_size=4), old, 2) == []


def test_resuming_on_an_edited_corpus_warns(corpus, tmp_path, caplog):
    """A resume after a corpus file was edited (or block_size, val_fraction or max_val_windows changed) continued on
    other windows without a word, unlike one with another data seed; a resume on the same data stays silent."""
    def warned(dm, state) -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.data.corpus"):
            dm.load_state_dict(state)
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("the checkpoint")]

    dm = dm_for(corpus, tmp_path)
    dm.on_before_batch_transfer(0, 0)
    assert warned(dm_for(corpus, tmp_path), dm.state_dict()) == []
    with open(corpus / "doc_003.txt", "a") as f:
        f.write("one more line\n")
    edited = dm_for(corpus, tmp_path)
    [message] = warned(edited, dm.state_dict())
    assert re.search(r"trained on dataset \w+, and this run's is \w+: the corpus .*changed since", message), message
    assert edited.micro_step == 1  # the position is restored all the same
    [message] = warned(dm_for(corpus, tmp_path, val_fraction=0.3), dm.state_dict())
    assert "data.block_size or data.val_fraction changed" in message
    # another data.max_val_windows: the same data, other validation windows (the best checkpoint's score is not
    # comparable); it resumed without a word
    state = edited.state_dict()
    [message] = warned(dm_for(corpus, tmp_path, max_val_windows=8), state)
    assert message.startswith("the checkpoint validated on up to 256 windows per source, and this run's "
                              "data.max_val_windows is 8: from here on val/loss is measured on other windows")
    # two caps above a source's val windows validate on all of them, the same windows: no warning (a corpus whose val
    # held 18 windows resumed with 128 after 64 was told that val/loss is measured on other windows)
    few = dm_for(corpus, tmp_path, max_val_windows=10_000)
    n = len(few.val_dataloader()[0].dataset)
    assert 8 < n < 10_000
    assert warned(dm_for(corpus, tmp_path, max_val_windows=n), few.state_dict()) == []
    [message] = warned(dm_for(corpus, tmp_path, max_val_windows=n - 1), few.state_dict())
    assert message.startswith(f"the checkpoint validated on up to 10000 windows per source, and this run's "
                              f"data.max_val_windows is {n - 1}: ")
    state.pop("max_val_windows")  # a checkpoint from before it was recorded
    assert warned(dm_for(corpus, tmp_path, max_val_windows=8), state) == []


def test_exclusions_are_never_drawn_and_persist(corpus, tmp_path):
    dm = dm_for(corpus, tmp_path)
    n = dm.num_train_samples
    dm.sampler.exclude(torch.arange(0, n - 2))
    drawn = torch.cat([dm.batch_for_step(s)["index"] for s in range(10)])
    assert set(drawn.tolist()) <= {n - 2, n - 1}
    again = dm_for(corpus, tmp_path)
    again.load_state_dict(dm.state_dict())
    assert set(again.batch_for_step(0)["index"].tolist()) <= {n - 2, n - 1}


def test_exclusions_of_a_checkpoint_from_another_dataset_are_refused_not_misapplied():
    """Exclusions are window indices: restored into a dataset of another size (another corpus or block_size)
    they name unrelated windows. That used to exclude those silently (or fail with a bare IndexError when an
    index was past the end); the FourierSampler already refused such a state."""
    from lit_dtrain.data.samplers import RandomSampler

    a = RandomSampler()
    a.setup(1000)
    a.exclude([5, 900])
    state = a.state_dict()
    for n in (500, 950):
        b = RandomSampler()
        b.setup(n)
        with pytest.raises(ValueError, match=rf"covers 1000 samples but the dataset has {n}"):
            b.load_state_dict(state)
    legacy = {"excluded": state["excluded"]}  # a checkpoint from before num_samples was recorded
    b = RandomSampler()
    b.setup(500)
    with pytest.raises(ValueError, match="excluded sample index 900 is out of range for 500 samples"):
        b.load_state_dict(legacy)
    same = RandomSampler()
    same.setup(1000)
    same.load_state_dict(state)
    assert same.excluded.nonzero().flatten().tolist() == [5, 900]
    clean = RandomSampler()
    clean.setup(1000)
    other = RandomSampler()
    other.setup(700)
    other.load_state_dict(clean.state_dict())  # no exclusions: nothing to misapply, a resume may change the data
    assert other.num_excluded == 0


def test_train_batches_carry_the_samplers_importance_weights_for_their_own_shard(corpus, tmp_path):
    """A sampler with ``loss_weights`` (FourierSampler, importance_weights=True) puts each rank's weights, for
    that rank's indices, in the batch as ``loss_weight``; without weights the key is absent."""
    from lit_dtrain.data.samplers import FourierSampler

    s = FourierSampler(importance_weights=True, require_updates=False, stages=False, step_unit=1)
    dm = dm_for(corpus, tmp_path, sampler=s)
    n = len(dm.train_windows)
    idx = torch.arange(min(n, 64))
    s.observe(torch.rand(len(idx), 32, generator=torch.Generator().manual_seed(0)) + (idx % 5)[:, None], idx, 1)
    for rank in (0, 1):
        batch = dm.batch_for_step(3, rank=rank, world_size=2)
        want = s.loss_weights(batch["index"])
        assert batch["loss_weight"].shape == (4,) and torch.equal(batch["loss_weight"], want)
    assert len(set(s.loss_weights(torch.arange(n)).tolist())) > 1  # the weights differ across samples
    assert "loss_weight" not in dm_for(corpus, tmp_path).batch_for_step(3)


def three_source_mixture(tmp_path, **kw):
    """Sources a, b, c weighted 0.5/0.3/0.2 (a has the most windows: its windows weigh the least each)."""
    sources = [
        CorpusSource(
            name=name,
            kind="files",
            paths=[str(make_corpus(tmp_path / name, n_files=6, size=size, seed=i))],
            weight=weight,
        )
        for i, (name, size, weight) in enumerate((("a", 6000, 0.5), ("b", 3000, 0.3), ("c", 2000, 0.2)))
    ]
    return dm_for(None, tmp_path, sources=sources, val_fraction=0.2, **kw)


def source_shares(dm, steps: int) -> list[float]:
    idx = torch.cat([dm.batch_for_step(s)["index"] for s in range(steps)]).numpy()
    return np.bincount(dm.train_windows.source_of(idx), minlength=len(dm.sources)) / len(idx)


@pytest.mark.parametrize("kind", ["random", "fourier"])
def test_exclusions_keep_every_sources_share_of_a_mixture(tmp_path, kind):
    """Excluding windows (the loss-spike monitor's skip) renormalizes within their source: the mixture keeps
    its configured shares. The target was renormalized over all remaining windows, so excluding half of
    source a (weights 0.5/0.3/0.2) drew 0.336/0.399/0.266. A FourierSampler that has not learned anything
    draws its target; its importance part reweights samples (and sources) on purpose, as without exclusions."""
    from lit_dtrain.data.samplers import FourierSampler

    sampler = FourierSampler(require_updates=False) if kind == "fourier" else None
    dm = three_source_mixture(tmp_path, batch_size=256, sampler=sampler)
    offsets = dm.train_windows.offsets
    dm.sampler.exclude(torch.arange(offsets[0], offsets[0] + dm.train_windows.counts[0] // 2))
    target = dm.sampler.target_distribution()
    per_source = [float(target[a:b].sum()) for a, b in zip(offsets[:-1], offsets[1:])]
    assert per_source == pytest.approx([0.5, 0.3, 0.2], abs=1e-12)
    assert float(target[offsets[0] : offsets[0] + dm.train_windows.counts[0] // 2].sum()) == 0
    assert source_shares(dm, 40) == pytest.approx([0.5, 0.3, 0.2], abs=0.015)  # 10240 draws: noise ~0.005


def test_a_mixture_source_with_every_window_excluded_hands_its_share_to_the_others_and_warns(tmp_path, caplog):
    """Logged (in train.log: a warnings.warn under Lightning reached the console only), by rank 0 alone (every
    rank excluded the same windows, and a 2-rank run said it twice)."""
    dm = three_source_mixture(tmp_path, batch_size=256)
    offsets = dm.train_windows.offsets
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.data.samplers"):
        dm.sampler.exclude(torch.arange(offsets[0], offsets[1]))
    (line,) = [r.getMessage() for r in caplog.records if r.name == "lit_dtrain.data.samplers"]
    assert re.search(r"data source 'a': every training window .* excluded.*0\.5", line), line
    target = dm.sampler.target_distribution()
    assert [float(target[a:b].sum()) for a, b in zip(offsets[:-1], offsets[1:])] == pytest.approx([0, 0.6, 0.4])
    assert source_shares(dm, 20) == pytest.approx([0, 0.6, 0.4], abs=0.02)


def test_exclusions_of_a_checkpoint_written_before_per_source_shares_load_and_keep_the_shares(tmp_path):
    """The sampler state is unchanged ({"excluded": indices, "num_samples": N}, as the earlier code wrote it):
    such a checkpoint resumes with the same excluded windows, now drawn with every source's share kept."""
    dm = three_source_mixture(tmp_path, batch_size=256)
    n, first_half = dm.num_train_samples, torch.arange(dm.train_windows.counts[0] // 2)
    old_state = {"micro_step": 5, "seed": 0, "sampler": {"excluded": first_half.clone(), "num_samples": n}}
    resumed = three_source_mixture(tmp_path, batch_size=256)
    resumed.load_state_dict(old_state)
    assert resumed.micro_step == 5 and resumed.sampler.num_excluded == len(first_half)
    assert torch.equal(resumed.sampler.state_dict()["excluded"], first_half)
    assert source_shares(resumed, 40) == pytest.approx([0.5, 0.3, 0.2], abs=0.015)


def test_without_exclusions_a_mixture_draws_the_batches_of_before():
    """Per-source renormalization only acts on exclusions: the default draws are those of the earlier code
    (indices recorded from it, seed 7, windows 60/30/10 at weights 0.5/0.3/0.2)."""
    from lit_dtrain.data.samplers import FourierSampler, RandomSampler

    counts = torch.tensor([60, 30, 10])
    base = torch.repeat_interleave(torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64) / counts, counts)
    s = RandomSampler()
    s.setup(100, base, seed=7, source_offsets=[0, 60, 90, 100], source_names=["a", "b", "c"])
    assert s.global_batch(3, 16).tolist() == [3, 98, 66, 31, 74, 91, 19, 35, 74, 62, 0, 91, 58, 5, 18, 65]
    f = FourierSampler(require_updates=False)
    f.setup(100, base, seed=7, source_offsets=[0, 60, 90, 100], source_names=["a", "b", "c"])
    assert f.global_batch(3, 16).tolist() == [31, 97, 61, 21, 70, 90, 8, 26, 70, 56, 5, 90, 52, 55, 7, 60]
    # a sampler that is not told the sources renormalizes over every window left, as before
    s = RandomSampler()
    s.setup(100, base, seed=7)
    s.exclude(torch.arange(0, 30))
    assert s.global_batch(3, 16).tolist() == [32, 98, 77, 53, 83, 93, 44, 56, 83, 74, 30, 93, 71, 34, 44, 76]
