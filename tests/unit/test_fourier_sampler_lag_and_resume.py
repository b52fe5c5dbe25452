"""FourierSampler: the lag-one table update, the state dict and what a resume keeps or refuses."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities import rank_zero_only

from lit_dtrain.data.samplers import FourierSampler, RandomSampler
from lit_dtrain.data.samplers import spectral as S
from lit_dtrain.errors import ConfigError
from lit_dtrain.sweeps import user_error
from lit_dtrain.train import train
from tests.unit._fourier_helpers import FOURIER, _observations, feed, make


@pytest.mark.parametrize("variant", ["moment_ratio", "magnitude"])
def test_lag_one_draws_from_the_table_through_the_step_before_the_previous_one(variant):
    """lag=1: the draw of step s sees the updates of steps 1 .. s-2, exactly what lag=0 draws after s-2 updates."""
    obs = _observations(9)
    for s in range(2, 10):
        lag0 = make(step_unit=1, variant=variant, require_updates=False)
        lag1 = make(step_unit=1, variant=variant, require_updates=False, lag=1)
        for k in range(s - 2):
            lag0.observe(*obs[k], k + 1)
        for k in range(s - 1):
            lag1.observe(*obs[k], k + 1)
        assert lag1.updates == lag0.updates == s - 2 and len(lag1._pending) == min(s - 1, 1)
        assert torch.equal(lag1.global_batch(s, 64), lag0.global_batch(s, 64)), s
        assert torch.equal(lag1.probabilities(s), lag0.probabilities(s)), s
    assert not torch.equal(lag0.probabilities(9), make(step_unit=1, variant=variant).probabilities(9))  # it learned


def test_lag_one_resumes_exactly_with_its_pending_update(tmp_path):
    straight = make(seed=3, step_unit=1, lag=1)
    expected = feed(straight, 10)
    first = make(seed=3, step_unit=1, lag=1)
    drawn = feed(first, 4)
    torch.save(first.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)  # plain tensors, ints and lists
    assert state["pending_steps"] == [4] and state["updates"] == 3
    resumed = make(seed=3, step_unit=1, lag=1)
    resumed.load_state_dict(state)
    assert torch.equal(torch.cat([drawn, feed(resumed, 6, start=4)]), expected)
    for key in ("m1", "m2", "visits", "profile"):
        assert torch.equal(getattr(straight, key), getattr(resumed, key)), key
    assert straight.updates == resumed.updates == 9
    assert torch.equal(straight.state_dict()["pending_records"][0], resumed.state_dict()["pending_records"][0])


def test_a_lag_one_state_resumed_with_lag_zero_applies_its_pending_update_at_once():
    obs = _observations(5)
    lag0, lag1 = make(stages=False), make(stages=False, lag=1)
    for k, (loss, idx) in enumerate(obs):
        lag0.observe(loss, idx, k + 1)
        lag1.observe(loss, idx, k + 1)
    assert lag1.updates == 4 and lag0.updates == 5
    resumed = make(stages=False)
    resumed.load_state_dict(lag1.state_dict())
    assert resumed.updates == 5 and not resumed._pending
    for key in ("m1", "m2", "visits", "profile"):
        assert torch.equal(getattr(lag0, key), getattr(resumed, key)), key


def test_lag_one_keeps_learning_when_the_step_count_starts_over():
    """A second fit with a new Trainer on the same datamodule counts optimizer steps from 0 again. With lag=1 the
    update left pending by the first fit's last step (5) waited for a step above 5, and every later update queued
    behind it: the table stood still through the second fit's first 5 steps. Each observe() now applies the updates
    of the earlier calls, whatever their step number."""
    obs = _observations(8)
    steps = [1, 2, 3, 4, 5, 1, 2, 3]  # a first fit of 5 steps, then a second one
    lag0, lag1 = make(stages=False), make(stages=False, lag=1)
    for (loss, idx), step in zip(obs, steps):
        lag1.observe(loss, idx, step)
    for (loss, idx), step in zip(obs[:7], steps):
        lag0.observe(loss, idx, step)
    assert lag1.updates == lag0.updates == 7 and [u.step for u in lag1._pending] == [3]
    for key in ("m1", "m2", "visits", "profile"):
        assert torch.equal(getattr(lag0, key), getattr(lag1, key)), key


def test_damaged_pending_records_are_refused():
    s = make(stages=False, lag=1)
    feed(s, 3)
    state = s.state_dict()
    width = state["pending_records"][0].shape[1]
    for records, match in [(state["pending_records"][0][:, :-2], f"uint8 records \\[n, {width}\\]"),
                           (state["pending_records"][0].float(), "torch.float32")]:
        with pytest.raises(ValueError, match=f"'pending_records' of step 3: expected .*{match}"):
            make(stages=False, lag=1).load_state_dict({**state, "pending_records": [records]})
    bad = state["pending_records"][0].clone()
    bad[0, :8] = torch.tensor([200], dtype=torch.int64).view(torch.uint8)  # sample 200 of 50
    with pytest.raises(ValueError, match=r"names samples outside \[0, 50\)"):
        make(stages=False, lag=1).load_state_dict({**state, "pending_records": [bad]})
    with pytest.raises(ValueError, match="lag must be 0 or 1"):
        FourierSampler(lag=2)


@pytest.mark.parametrize("lag", [0, 1])
def test_lag_one_observe_never_reads_the_token_loss_on_the_host(lag):
    """On a GPU, any host read of the step's token loss (bool, item, .cpu) waits for the step. Meta tensors have no
    data, so such a read fails: with lag=1 observe queues all its work on the token loss's device; lag=0 reads."""
    s = make(stages=False, lag=lag)
    loss, idx = _observations(1)[0]
    meta = loss.to("meta")
    if lag == 0:
        with pytest.raises((RuntimeError, NotImplementedError)):
            s.observe(meta, idx, 1)
        return
    stats = s.observe(meta, idx, 1)
    assert stats["top_band_energy"].device.type == "meta" and stats["nonfinite"] is None
    assert s.updates == 0 and len(s._pending) == 1 and s._pending[0].parts[0].device.type == "meta"


def test_state_dict_is_plain_and_checked(tmp_path):
    s = make(step_unit=1)
    feed(s, 3)
    torch.save(s.state_dict(), tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)
    other = make(num_samples=51)
    with pytest.raises(ValueError, match="'m1'"):
        other.load_state_dict(state)
    partial = {k: v for k, v in state.items() if k != "m2"}
    with pytest.raises(KeyError, match="'m2'"):
        make().load_state_dict(partial)


def _sampler_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "lit_dtrain.data.samplers"]


def test_a_fourier_sampler_resuming_a_random_sampler_state_starts_its_table_over(tiny_cfg, caplog):
    """RandomSampler's warning on resuming a FourierSampler state says that "a later resume with
    data/sampler=fourier starts it over", but FourierSampler refused a RandomSampler's state with a KeyError ('m1'):
    a run could not switch to data/sampler=fourier on resume. It now keeps the exclusions, warns, and learns a fresh
    table from the resumed step on."""
    random = RandomSampler()
    random.setup(50, seed=0)
    random.exclude([3, 9])
    s = make(step_unit=1)
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.data.samplers"):  # in train.log, by rank 0
        s.load_state_dict(random.state_dict())
    (line,) = _sampler_lines(caplog)
    assert re.search(r"written by RandomSampler.*2 excluded samples.*table starts empty", line), line
    assert s.excluded.nonzero().flatten().tolist() == [3, 9] and s.updates == 0 and int(s.visits.sum()) == 0
    assert float(s.probabilities(0)[[3, 9]].sum()) == 0.0
    common = ["scheduler=constant", "sample.max_new_tokens=0", "trainer.val_check_interval=3"]
    _, first = train(tiny_cfg(*common, "trainer.max_steps=3", run="switch"))
    ckpt = Path(first["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.data.samplers"):
        _, resumed = train(
            tiny_cfg(*common, "data/sampler=fourier", "trainer.max_steps=6", f"ckpt_path={ckpt}", run="switch")
        )
    assert ["written by RandomSampler" in line for line in _sampler_lines(caplog)] == [True]
    assert resumed["trainer"].global_step == 6 and resumed["datamodule"].sampler.updates == 3


@pytest.mark.parametrize("rank", [0, 1])
def test_a_random_sampler_resuming_a_fourier_state_says_what_it_drops(caplog, monkeypatch, rank):
    """``data/sampler=random`` resuming a ``data/sampler=fourier`` checkpoint keeps the exclusions and dropped the
    spectral table silently (switching strategies warns in the same situation)."""
    s = make(step_unit=1)
    feed(s, 3)
    s.exclude([7])
    random = RandomSampler()
    random.setup(50, seed=0)
    seen = int((s.visits > 0).sum())
    monkeypatch.setattr(rank_zero_only, "rank", rank)  # every rank resumes it; rank 0 says so (in train.log)
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.data.samplers"):
        random.load_state_dict(s.state_dict())
    assert random.excluded.nonzero().flatten().tolist() == [7]
    lines = _sampler_lines(caplog)
    assert len(lines) == (1 if rank == 0 else 0), lines
    if rank == 0:
        assert re.search(rf"written by FourierSampler.*{seen} samples seen.*RandomSampler.*dropped", lines[0])


def test_a_table_from_another_corpus_of_the_same_size_is_refused(tiny_cfg, corpus):
    """The table is indexed by window: resuming on another corpus (here one document reversed, so the same number
    of windows) silently applied its scores to other text. The checkpoint now records which dataset the table
    indexes (the token caches' content keys, which cover the files, block_size and val_fraction) and a resume on
    another one is a ValueError naming both, before any step."""
    common = [*FOURIER, "trainer.val_check_interval=3"]
    _, first = train(tiny_cfg(*common, "trainer.max_steps=3", run="other"))
    n = first["datamodule"].num_train_samples
    ckpt = Path(first["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    doc = corpus / "doc_000.txt"
    doc.write_text(doc.read_text()[::-1])
    # the same bytes in another order: the same number of windows, so the size check cannot tell
    other = r"dataset [0-9a-f]{16}, and this run's is [0-9a-f]{16}: the checkpoint belongs to another corpus"
    with pytest.raises(ConfigError, match=other) as refused:
        train(tiny_cfg(*common, "trainer.max_steps=6", f"ckpt_path={ckpt}", run="other"))
    assert user_error(refused.value) is refused.value  # train.py prints it as one line, 'error: ...', no traceback
    doc.write_text(doc.read_text()[::-1])  # the corpus it was trained on: resumes
    _, resumed = train(tiny_cfg(*common, "trainer.max_steps=6", f"ckpt_path={ckpt}", run="other"))
    assert resumed["datamodule"].num_train_samples == n and resumed["datamodule"].sampler.updates == 6


def test_exclusions_from_another_dataset_are_refused_and_an_exclusion_free_state_is_not():
    a, b = RandomSampler(), RandomSampler()
    a.setup(50, seed=0, dataset_key="aaaa")
    b.setup(50, seed=0, dataset_key="bbbb")
    b.load_state_dict(a.state_dict())  # nothing per-window: any dataset may take it
    a.exclude([4])
    with pytest.raises(ConfigError, match="'excluded' indexes the windows of dataset aaaa, and this run's is bbbb"):
        b.load_state_dict(a.state_dict())
    c = RandomSampler()
    c.setup(50, seed=0)  # no key (a sampler outside LMDataModule), or a checkpoint from before keys: not checked
    c.load_state_dict(a.state_dict())
    assert c.excluded.nonzero().flatten().tolist() == [4]


@pytest.mark.parametrize("changed", [{"max_freq": 512}, {"num_bands": 6}])
def test_a_band_config_changed_on_resume_is_refused_not_silently_replaced(changed):
    """The table's band profile was computed with the checkpoint's band edges, and load_state_dict took them over
    silently: resuming with data.sampler.max_freq=512 (or num_bands=6, stages on: the same 8-band profile shape)
    kept scoring with 256/4 while the config said otherwise. A configured value that differs is now an error naming
    both; null (auto) takes the checkpoint's."""
    s = make(max_freq=256, num_bands=4, step_unit=1)
    feed(s, 3)
    state = s.state_dict()
    key, value = next(iter(changed.items()))
    with pytest.raises(ValueError, match=rf"{key}={value}.*checkpoint.*{key}={state[key]}"):
        make(step_unit=1, **{"max_freq": 256, "num_bands": 4, **changed}).load_state_dict(state)
    auto = make(step_unit=1)  # null: the checkpoint's
    auto.load_state_dict(state)
    assert (auto.max_freq, auto.num_bands) == (256, 4)


def test_stages_turned_off_on_resume_keep_the_finer_profile_and_score_with_its_merged_bands():
    """A table saved with stages on holds an 8-band profile; resuming it with data.sampler.stages=false (4 bands) was
    refused ("'profile' has 8 bands, this configuration uses 4"), and no setting let it through (num_bands=8 differs
    from the saved num_bands=4). The finer profile merges exactly into 4 bands: the resumed table is kept, draws as
    before, and scores new batches as a sampler whose table was built with stages off from the same profiles."""
    s = make(max_freq=256, num_bands=4, step_unit=1000, variant="magnitude")  # stages on: warmup, 4 of 8 bands
    feed(s, 3)
    state = s.state_dict()
    assert state["profile"].shape[1] == 8
    off = make(stages=False, variant="magnitude")
    off.load_state_dict(state)
    assert torch.equal(off.probabilities(3), s.probabilities(3))
    assert off.fine_bands == 8 and off.bands_at(3) == 4
    loss, idx = torch.rand(8, 64, generator=torch.Generator().manual_seed(9)), torch.arange(8)
    merged = S.merge_bands(S.band_energies(loss, 256, 8), 4)
    assert torch.allclose(merged, S.band_energies(loss, 256, 4), rtol=1e-5, atol=1e-7)  # why keeping it is exact
    stats = off.observe(loss, idx, 4)
    assert stats["bands"] == 4 and off.profile.shape[1] == 8 and bool(off.visits[idx].gt(0).all())
    with pytest.raises(ValueError, match="'profile' has 8 bands, this configuration needs 10"):
        make(step_unit=1000, stage_table=[["a", 0, 4, 0.3, 1.0], ["b", 5, 10, 0.5, 1.0]]).load_state_dict(state)
