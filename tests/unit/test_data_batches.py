"""LMDataModule's batches: the tokenizer, the stdlib corpus, seeds, rank shards, validation shards, mixtures and
their weights."""

import os
import types

import numpy as np
import pytest
import torch
from torch.utils.data import DistributedSampler

from lit_dtrain.data import ByteTokenizer, CorpusError, CorpusSource, LMDataModule, build_token_cache, stdlib_files
from tests.conftest import make_corpus
from tests.unit._data_helpers import dm_for


def test_tokenizer_roundtrip_any_bytes():
    tok = ByteTokenizer()
    ids = tok.encode("héllo\x00", add_eos=True)
    assert ids.dtype == np.uint16 and ids[-1] == tok.eos_id and ids.max() == 256
    assert tok.decode(ids[:-1]) == "héllo\x00"
    junk = bytes(range(256))
    assert tok.encode(junk).tolist() == list(range(256))
    assert isinstance(tok.decode(tok.encode(b"\xff\xfe")), str)  # invalid UTF-8 never raises


def test_stdlib_corpus_found_without_site_packages():
    files = stdlib_files()
    assert len(files) > 500
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in files)


def test_the_stdlib_corpus_does_not_list_site_packages(tmp_path, monkeypatch):
    """Every start listed all of site-packages (43k files below a stdlib with torch installed in it, 0.7-1.1 s per
    rank) only to leave its files out. Left-out dirs are no longer entered; the files are the same."""
    import sysconfig

    for rel in ("a.py", "notes.txt", "pkg/b.py", "pkg/deep/c.py", "site-packages/x/d.py", "pkg/dist-packages/e.py",
                "__pycache__/f.py", ".hidden/g.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": str(tmp_path)})
    listed, scandir = [], os.scandir
    monkeypatch.setattr(os, "scandir", lambda path=".": listed.append(os.fspath(path)) or scandir(path))
    files = stdlib_files()
    assert [str(f.relative_to(tmp_path)) for f in files] == [".hidden/g.py", "a.py", "pkg/b.py", "pkg/deep/c.py"]
    entered = {os.path.relpath(p, tmp_path) for p in listed}
    assert "pkg/deep" in entered and not [p for p in entered if "packages" in p or "__pycache__" in p]


def test_same_seed_same_batches_and_windows(corpus, tmp_path):
    a = dm_for(corpus, tmp_path, seed=3)
    b = dm_for(corpus, tmp_path, seed=3)
    c = dm_for(corpus, tmp_path, seed=4)
    for step in range(5):
        ba, bb = a.batch_for_step(step), b.batch_for_step(step)
        assert all(torch.equal(ba[k], bb[k]) for k in ba)
    assert not torch.equal(a.batch_for_step(0)["index"], c.batch_for_step(0)["index"])
    batch = a.batch_for_step(0)
    assert torch.equal(batch["input_ids"][:, 1:], batch["labels"][:, :-1])  # labels are inputs shifted by one
    i = int(batch["index"][0])
    stream = np.asarray(a.splits[0].train)
    assert batch["input_ids"][0].tolist() == stream[i * 32 : i * 32 + 32].tolist()  # stable window index


def test_rank_shards_are_disjoint_pieces_of_the_global_batch(corpus, tmp_path):
    dm = dm_for(corpus, tmp_path, seed=1)
    for step in range(4):
        r0 = dm.batch_for_step(step, rank=0, world_size=2)["index"]
        r1 = dm.batch_for_step(step, rank=1, world_size=2)["index"]
        glob = dm.sampler.global_batch(step, 8)
        assert torch.equal(torch.cat([r0, r1]), glob)
        # positions in the global batch are disjoint; with replacement an index may repeat, so compare slots
        assert r0.numel() == r1.numel() == 4


def test_the_training_stream_is_the_batches_of_micro_steps_0_1_2(corpus, tmp_path):
    """Micro-step s trains batch_for_step(s), from 0 on, as a resume, the spike records and the sampler's per-step
    draws assume; a stream shifted by one (step s drew batch s + 1) was still consistent across resumes, so no other
    test saw that batch 0 was never trained."""
    dm = dm_for(corpus, tmp_path, seed=1)
    drawn = [dm.next_train_batch()["index"] for _ in range(3)]
    assert dm.micro_step == 3
    for step, index in enumerate(drawn):
        assert torch.equal(index, dm.batch_for_step(step)["index"]), step


def test_a_limit_in_batches_validates_the_same_windows_on_any_number_of_ranks(corpus, tmp_path):
    """trainer.limit_val_batches=k: Lightning caps each rank's loader at k batches, so 2 ranks validated the first 2k
    batches' windows and 1 process the first k (the same weights: val loss 3.1999 on 2 ranks, 3.3406 on 1). Now the
    ranks share the windows of one process's first k batches, each running k batches or fewer."""
    dm = dm_for(corpus, tmp_path, max_val_windows=13, val_batch_size=3)
    for limit in (1, 2, 4, 10):
        dm.trainer = types.SimpleNamespace(global_rank=0, world_size=1, limit_val_batches=limit)
        (single,) = dm.val_dataloader()
        first = [int(i) for b in list(single)[:limit] for i in b["index"]]  # what Lightning's cap leaves one process
        for world in (2, 3):
            real, batches = [], []
            for rank in range(world):
                dm.trainer = types.SimpleNamespace(global_rank=rank, world_size=world, limit_val_batches=limit)
                (loader,) = dm.val_dataloader()
                shard = list(loader)
                batches.append(len(shard))
                real += [int(i) for b in shard for i, w in zip(b["index"], b["loss_weight"]) if float(w) == 1]
            assert sorted(real) == sorted(first), (limit, world)
            assert max(batches) <= limit, (limit, world)
    dm.trainer = types.SimpleNamespace(global_rank=0, world_size=2, limit_val_batches=1.0)  # Lightning's "all"
    (loader,) = dm.val_dataloader()
    assert len(loader.dataset) == 14  # 13 windows and one filler


def test_val_shards_hold_every_window_once_and_even_out_the_ranks(corpus, tmp_path):
    """Under data parallelism each rank validates its own windows: together every window exactly once, with
    weight 1; the ranks run equally many items (and batches), the padding that evens them out weighs 0."""
    for n in (1, 2, 5, 7, 8):
        dm = dm_for(corpus, tmp_path, max_val_windows=n, val_batch_size=3)
        (single,) = dm.val_dataloader()
        everything = [int(i) for b in single for i in b["index"]]
        assert len(everything) == n and all(float(w) == 1 for b in single for w in b["loss_weight"])
        for world in (2, 3, 4, 8):
            real, padding, items, batches = [], [], set(), set()
            for rank in range(world):
                dm.trainer = types.SimpleNamespace(global_rank=rank, world_size=world)
                (loader,) = dm.val_dataloader()
                # Lightning replaces any sampler of a distributed run that is not a DistributedSampler
                assert isinstance(loader.sampler, DistributedSampler)
                shard = list(loader)
                index = [int(i) for b in shard for i in b["index"]]
                weight = [float(w) for b in shard for w in b["loss_weight"]]
                assert set(weight) <= {0.0, 1.0}
                real += [i for i, w in zip(index, weight) if w == 1]
                padding += [i for i, w in zip(index, weight) if w == 0]
                items.add(len(index))
                batches.add(len(shard))
            assert sorted(real) == sorted(everything), (n, world)  # disjoint and complete
            assert items == {-(-n // world)} and len(batches) == 1, (n, world)  # same count on every rank
            assert len(padding) == world * -(-n // world) - n < world, (n, world)


def test_split_is_by_document_and_deterministic(tmp_path):
    corpus = make_corpus(tmp_path / "big", n_files=60, size=2000)
    src = CorpusSource(name="t", kind="files", paths=[str(corpus)])
    a = build_token_cache(src, tmp_path / "c1", 33, val_fraction=0.1, progress=False)
    b = build_token_cache(src, tmp_path / "c2", 33, val_fraction=0.1, progress=False)
    assert a.meta["split"] == "by_document"
    assert np.array_equal(np.asarray(a.val), np.asarray(b.val))
    eos = ByteTokenizer.eos_id
    assert np.asarray(a.val)[-1] == eos and np.asarray(a.train)[-1] == eos  # whole documents


def _two_sources(tmp_path, weights: dict[str, float], sizes: tuple[int, int], batch_size: int, steps: int):
    """A datamodule over two corpora of 6 files (seeds 1 and 2, ``sizes`` bytes a file) named and weighted by
    ``weights``, and the source (0 or 1) of each window of its first ``steps`` training batches."""
    sources = [CorpusSource(name=name, kind="files", weight=weight,
                            paths=[str(make_corpus(tmp_path / name, n_files=6, size=size, seed=seed))])
               for seed, ((name, weight), size) in enumerate(zip(weights.items(), sizes), start=1)]
    dm = dm_for(None, tmp_path, sources=sources, batch_size=batch_size)
    idx = torch.cat([dm.batch_for_step(s)["index"] for s in range(steps)]).numpy()
    return dm, dm.train_windows.source_of(idx)


def test_mixture_weights_shape_the_draws(tmp_path):
    dm, drawn = _two_sources(tmp_path, {"a": 0.8, "b": 0.2}, (4000, 12000), batch_size=64, steps=40)
    share_a = float((drawn == 0).mean())
    assert 0.75 < share_a < 0.85, share_a
    assert len(dm.val_dataloader()) == 2 and dm.val_names == ["a", "b"]


def test_zero_weight_source_is_validation_only(tmp_path):
    dm, drawn = _two_sources(tmp_path, {"new": 1.0, "old": 0.0}, (4000, 4000), batch_size=32, steps=10)
    assert (drawn == 0).all()  # never trained on
    assert len(dm.val_dataloader()) == 2  # but validated on
    with pytest.raises(CorpusError, match="every weight is 0"):
        dm_for(None, tmp_path, sources=[CorpusSource(name="x", kind="files", paths=[str(tmp_path / "new")],
                                                     weight=0.0)])


def test_all_zero_weights_fail_when_the_datamodule_is_built_before_tokenizing(tmp_path):
    """Every weight 0 (data=mixture data.sources.0.weight=0 data.sources.1.weight=0) used to be found in setup(),
    inside trainer.fit, after every source had been hashed and tokenized into the cache."""
    a = make_corpus(tmp_path / "a", n_files=2, size=500)
    sources = [CorpusSource(name="x", kind="files", paths=[str(a)], weight=0.0),
               CorpusSource(name="y", kind="stdlib", weight=0)]
    with pytest.raises(CorpusError, match=r"data.sources: every weight is 0 \(\['x', 'y'\]\); nothing to train on"):
        LMDataModule(sources=sources, block_size=16, batch_size=2, cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()


def test_paths_given_as_one_string_is_one_path_not_its_characters(tmp_path):
    """data.sources.0.paths=/my/corpus (no brackets) arrives as a str; iterating it made '/', 'm', 'y', ... paths:
    '/' is a directory, so the whole filesystem was walked (PermissionError at /proc/1/cwd as root)."""
    from lit_dtrain.data.corpus import resolve_files

    corpus = make_corpus(tmp_path / "c", n_files=3, size=200)
    source = CorpusSource(name="t", kind="files", paths=str(corpus))
    assert source.paths == [str(corpus)]
    assert [p.name for p in resolve_files(source)] == ["doc_000.txt", "doc_001.txt", "doc_002.txt"]
    with pytest.raises(CorpusError, match=r"data source 't': paths must be a list of files, directories or globs"):
        CorpusSource(name="t", kind="files", paths=3)


def test_mixture_prior_and_exclusions_are_drawn_from_a_cached_cdf():
    """Under a mixture prior (or exclusions) the sampler draws by inverse CDF from a cached table: the
    frequencies follow the prior, excluded samples are never drawn (not even at ``u = 1`` when the last
    sample is excluded), and the cache follows new exclusions and a restored state."""
    from lit_dtrain.data.samplers import RandomSampler
    from lit_dtrain.data.samplers.base import draw_from_cdf

    n = 600
    base = torch.where(torch.arange(n) < 200, 4.0, 1.0)  # the first third carries 2/3 of the mass
    s = RandomSampler()
    s.setup(n, base, seed=0)
    s.exclude([7, n - 1])
    draws = torch.cat([s.global_batch(step, 2048) for step in range(100)])
    freq = torch.bincount(draws, minlength=n).double() / draws.numel()
    assert freq[[7, n - 1]].sum() == 0
    target = base.double().masked_fill(s.excluded, 0.0)
    target /= target.sum()
    assert 0.5 * (freq - target).abs().sum().item() < 0.03  # total variation; sampling noise is ~0.01
    assert freq[:200].sum().item() == pytest.approx(target[:200].sum().item(), abs=0.01)
    # u = 1 happens when a draw rescales u (u / floor can round up to 1)
    top = torch.tensor([1.0 - 2.0**-53, 1.0], dtype=torch.float64)
    assert draw_from_cdf(s.target_cdf(), top).tolist() == [n - 2, n - 2]  # not the excluded last sample
    s.exclude([0])
    assert 0 not in torch.cat([s.global_batch(step, 4096) for step in range(20)]).tolist()
    other = RandomSampler()
    other.setup(n, base, seed=0)
    assert 0 in torch.cat([other.global_batch(step, 4096) for step in range(20)]).tolist()
    other.load_state_dict(s.state_dict())
    assert other.num_excluded == 3 and torch.equal(other.global_batch(5, 64), s.global_batch(5, 64))


def test_empty_files_warn_for_user_files_but_not_for_the_stdlib(tmp_path, monkeypatch, caplog):
    """The default corpus (the stdlib) always holds empty __init__.py files: no warning on every run."""
    import lit_dtrain.data.corpus as corpus_mod

    corpus = make_corpus(tmp_path / "c", n_files=3)
    (corpus / "empty.txt").write_text("")
    files = sorted(corpus.iterdir())
    with caplog.at_level("INFO", logger="lit_dtrain.data.corpus"):
        build_token_cache(CorpusSource(name="x", kind="files", paths=[str(corpus)]), tmp_path / "a", 33, progress=False)
    warned = [r for r in caplog.records if "empty file" in r.getMessage()]
    assert [r.levelname for r in warned] == ["WARNING"]
    caplog.clear()
    monkeypatch.setattr(corpus_mod, "stdlib_files", lambda: files)
    with caplog.at_level("INFO", logger="lit_dtrain.data.corpus"):
        build_token_cache(CorpusSource(name="stdlib", kind="stdlib"), tmp_path / "b", 33, progress=False)
    noted = [r for r in caplog.records if "empty file" in r.getMessage()]
    assert [r.levelname for r in noted] == ["INFO"]


@pytest.mark.parametrize("kind", ["random", "fourier"])
def test_excluding_every_weighted_sample_fails_even_when_zero_weight_samples_remain(kind):
    """A mixture with a validation-only (weight 0) source: once every window of the weighted sources is
    excluded, nothing is left to train on. The sampler used to go on drawing from a 0/0 (NaN) target: the
    RandomSampler returned index N (past the last window), the FourierSampler a weight-0 window."""
    from lit_dtrain.data.samplers import FourierSampler, RandomSampler

    base = torch.tensor([1.0] * 4 + [0.0] * 4)  # windows 4..7: a weight-0 source
    s = RandomSampler() if kind == "random" else FourierSampler(require_updates=False)
    s.setup(8, base, seed=0)
    s.exclude([0, 1, 2])
    assert set(s.global_batch(0, 64).tolist()) == {3}
    with pytest.raises(RuntimeError, match="nothing is left to train on"):
        s.exclude([3])


@pytest.mark.parametrize("index", [-1, 8])
def test_an_out_of_range_exclusion_is_refused_not_wrapped(index):
    """exclude([-1]) excluded the last sample (Python indexing), silently; 8 of 8 samples was an IndexError."""
    from lit_dtrain.data.samplers import RandomSampler

    s = RandomSampler()
    s.setup(8, None, seed=0)
    with pytest.raises(ValueError, match=f"exclude: sample index {index} is out of range for 8 samples"):
        s.exclude([2, index])
    assert s.num_excluded == 0 and not s.excluded.any()  # nothing half-applied


def test_decode_marks_ids_that_are_no_byte():
    """A model with vocab_size above 257 can sample ids the byte tokenizer has no byte for: they were dropped from
    the text without a trace; they are U+FFFD now, as an invalid byte sequence is."""
    tok = ByteTokenizer()
    assert tok.decode([300, -1, 65, tok.eos_id, 66]) == "\ufffd\ufffdA\nB"


def test_unigram_entropy_is_that_of_the_weighted_mixture_that_is_trained_on(tmp_path):
    """The context-free baseline is the entropy of the token distribution the sampler trains on: each
    source's unigram distribution in proportion to its weight; a weight-0 (validation-only) source is not
    part of it. It was the entropy of all train streams pooled (a 1:3 size ratio overrode 1:1 weights)."""
    for name, alphabet, n in (("x", "ab", 3), ("y", "cdefgh", 9)):
        (tmp_path / name).mkdir()
        for i in range(n):
            text = "".join(alphabet[(7 * j + i) % len(alphabet)] for j in range(3000))
            (tmp_path / name / f"{i}.txt").write_text(text)

    def entropy(p):
        p = p[p > 0] / p.sum()
        return float(-(p * np.log(p)).sum())

    def source(name, weight):
        return CorpusSource(name=name, kind="files", paths=[str(tmp_path / name)], weight=weight)

    for wx, wy in ((1.0, 0.0), (0.5, 0.5), (0.2, 0.8)):
        dm = dm_for(None, tmp_path, sources=[source("x", wx), source("y", wy)])
        counts = [np.bincount(np.asarray(s.train), minlength=257).astype(np.float64) for s in dm.splits]
        expected = entropy(wx * counts[0] / counts[0].sum() + wy * counts[1] / counts[1].sum())
        assert dm.unigram_entropy() == pytest.approx(expected, rel=1e-9), (wx, wy)
    one = dm_for(None, tmp_path, sources=[source("y", 3.0)])
    assert one.unigram_entropy() == pytest.approx(entropy(np.bincount(np.asarray(one.splits[0].train))), rel=1e-12)
