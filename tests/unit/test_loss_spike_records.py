"""LossSpikeMonitor's records across resumes: skipped indices, replayed spikes, spikes.jsonl, exclusions of every
sample, its state dict."""

from __future__ import annotations

import json
import math
from pathlib import Path

import lightning as L
import pytest
import torch

from lit_dtrain.callbacks import LossSpikeMonitor
from tests.unit._loss_spike_helpers import (
    Inject,
    Probe,
    assert_identical,
    make_data,
    make_module,
    make_trainer,
    one_thread,  # noqa: F401 - its autouse fixture, as before the split
)


def test_resume_honours_skipped_indices_and_state_survives_checkpoint(tmp_path: Path) -> None:
    # a small corpus and a wide batch so that, without exclusion, the resumed steps would redraw the samples
    data_kwargs = dict(batch_size=16, n_files=3, size=1200)
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    probe = Probe(full=False)
    trainer = make_trainer(tmp_path, [Inject({5: "finite"}), monitor, probe], max_steps=8)
    dm = make_data(tmp_path, **data_kwargs)
    trainer.fit(make_module(), datamodule=dm)
    skipped = sorted(set(probe.indices[5]))
    assert sorted(monitor.excluded) == skipped
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)

    raw = torch.load(ckpt, map_location="cpu", weights_only=True)  # plain state only
    (key,) = [k for k in raw["callbacks"] if k.startswith("LossSpikeMonitor")]
    saved = raw["callbacks"][key]
    assert saved["excluded"].tolist() == monitor.excluded and saved["num_spikes"] == 1

    class StateAtStart(L.Callback):
        def on_train_start(self, trainer, pl_module):
            self.state = monitor2.state_dict()

    monitor2 = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    probe2, at_start = Probe(full=False), StateAtStart()
    dm2 = make_data(tmp_path, **data_kwargs)
    trainer2 = make_trainer(tmp_path, [monitor2, probe2, at_start], max_steps=24)
    trainer2.fit(make_module(seed=1), datamodule=dm2, ckpt_path=str(ckpt))
    assert at_start.state["detector"] == monitor.state_dict()["detector"]  # statistics continue, not restart
    assert monitor2.excluded == monitor.excluded and monitor2.num_spikes == 1
    drawn = {i for step, idx in probe2.indices.items() for i in idx}
    assert min(probe2.indices) == 8 and not drawn & set(skipped)
    # without the exclusion the same steps would have drawn some of them (so this test can fail)
    from lit_dtrain.data.samplers import RandomSampler

    plain = RandomSampler()
    plain.setup(dm2.num_train_samples, None, dm2.seed)
    would = {i for s in probe2.indices for i in plain.global_batch(s, 16).tolist()}
    assert would & set(skipped)


def test_a_resume_that_replays_a_spike_keeps_one_record_of_it(tmp_path: Path) -> None:
    """A run killed after a spike but before its next checkpoint replays the spike's step on resume: spikes.jsonl
    had the event twice (and spike/count said 1). The resumed run now moves the records of the steps it replays
    out of spikes.jsonl (into spikes.superseded.jsonl), so the file holds each event of the run's history once."""
    def run(max_steps, ckpt_path=None):
        monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
        trainer = make_trainer(tmp_path, [Inject({5: "finite"}), monitor], max_steps=max_steps)
        trainer.fit(make_module(), datamodule=make_data(tmp_path), ckpt_path=ckpt_path)
        return trainer, monitor

    trainer, _ = run(4)
    trainer.save_checkpoint(tmp_path / "step4.ckpt")  # the last checkpoint before the spike at step 5
    run(7, tmp_path / "step4.ckpt")  # ... the spike, then the process dies before it checkpoints again
    events = tmp_path / "spikes.jsonl"
    assert [json.loads(line)["step"] for line in events.read_text().splitlines()] == [5]
    _, monitor = run(8, tmp_path / "step4.ckpt")  # resume=auto from the same checkpoint replays step 5
    assert [e["step"] for e in monitor.events] == [5] and monitor.num_spikes == 1
    assert [json.loads(line)["step"] for line in events.read_text().splitlines()] == [5]
    superseded = tmp_path / "spikes.superseded.jsonl"
    assert [json.loads(line)["step"] for line in superseded.read_text().splitlines()] == [5]


def test_a_fresh_start_in_the_run_dir_of_a_run_killed_before_its_first_checkpoint_keeps_one_record(
    tmp_path: Path,
) -> None:
    """``resume=auto`` of a run killed before its first checkpoint starts afresh at step 0 in the same run dir and
    replays every step: the killed attempt's records move to spikes.superseded.jsonl (spikes.jsonl had step 5 twice)."""
    def run(max_steps):
        monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
        trainer = make_trainer(tmp_path, [Inject({5: "finite"}), monitor], max_steps=max_steps)
        trainer.fit(make_module(), datamodule=make_data(tmp_path))
        return monitor

    run(7)  # the spike, then the process dies before any checkpoint
    monitor = run(8)  # the same run dir, from step 0
    assert [e["step"] for e in monitor.events] == [5]
    events = [json.loads(line) for line in (tmp_path / "spikes.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events] == [5] and events[0]["index"] == monitor.events[0]["index"]
    superseded = tmp_path / "spikes.superseded.jsonl"
    assert [json.loads(line)["step"] for line in superseded.read_text().splitlines()] == [5]


@pytest.mark.parametrize(("kept", "expected"), [(2, [7, 8]), (0, [])])
def test_events_in_memory_stay_bounded_while_spikes_jsonl_has_every_one(tmp_path: Path, monkeypatch, kept,
                                                                         expected) -> None:
    """``events`` kept every event of the fit, one more per spike for as long as the run lasted (196 events after 200
    steps of NaN losses); it keeps the latest ``events_kept``, and spikes.jsonl still has every one. ``events_kept =
    0`` keeps none (``del events[:-0]`` deleted nothing: it kept all 5)."""
    monkeypatch.setattr(LossSpikeMonitor, "events_kept", kept, raising=False)
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, max_nonfinite=None)
    trainer = make_trainer(tmp_path, [Inject({s: "nan" for s in range(4, 9)}), monitor], max_steps=10)
    trainer.fit(make_module(), datamodule=make_data(tmp_path, n_files=1, size=4000))
    lines = [json.loads(x) for x in (tmp_path / "spikes.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines] == [4, 5, 6, 7, 8] and [e["step"] for e in monitor.events] == expected
    assert monitor.num_spikes == 5


def test_spikes_that_exclude_every_sample_stop_with_the_last_one_recorded(tmp_path: Path) -> None:
    """Once the spikes' samples are all of the data the sampler raises; the error says the monitor's exclusions did it,
    and the spike that excluded the last samples is in spikes.jsonl (its record was written after the exclusion)."""
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3, max_nonfinite=None)
    trainer = make_trainer(tmp_path, [Inject({s: "nan" for s in range(2, 40)}), monitor], max_steps=40)
    dm = make_data(tmp_path, n_files=1, size=400)  # 11 windows
    with pytest.raises(RuntimeError, match=r"LossSpikeMonitor: excluding the samples of the spike at step \d+ failed"
                                           r".*nothing is left to train on"):
        trainer.fit(make_module(), datamodule=dm)
    last = trainer.global_step - 1  # the step that raised
    lines = [json.loads(x) for x in (tmp_path / "spikes.jsonl").read_text().splitlines()]
    assert [e["step"] for e in lines] == list(range(2, last + 1)) == [e["step"] for e in monitor.events]
    assert monitor.num_spikes == len(lines)
    assert sorted({i for e in lines for i in e["index"]}) == list(range(dm.num_train_samples))


def test_a_lasting_grad_norm_rise_does_not_drop_every_later_step(tmp_path: Path) -> None:
    """grad_z_threshold and a grad norm that is 20x from step 10 on, with a normal loss: every later step was skipped
    (the weights after step 60 were those after step 10, and the run ended with exit 0). Now 9 are, then the new
    level is accepted and recorded."""
    class GradTimes20(L.Callback):
        def __init__(self):
            self.handle = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if trainer.global_step >= 10:
                hook = lambda m, i, out: (out.register_hook(lambda g: g * 20.0), out)[1]  # noqa: E731
                self.handle = pl_module.model.register_forward_hook(hook)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if self.handle is not None:
                self.handle.remove()
                self.handle = None

    monitor, probe = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=5, grad_z_threshold=4.0), Probe()
    trainer = make_trainer(tmp_path, [GradTimes20(), monitor, probe], max_steps=30)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    assert [e["step"] for e in monitor.events if e["actions"]] == list(range(10, 19))
    lines = [json.loads(x) for x in (tmp_path / "spikes.jsonl").read_text().splitlines()]
    assert [(e["step"], e["reasons"]) for e in lines][-1] == (19, ["grad_level_shift"])
    with pytest.raises(AssertionError):  # the steps after the shift train
        assert_identical(probe.after[19], probe.after[30], schedule=False)


def test_state_dict_roundtrip_restores_statistics_exactly(tmp_path: Path) -> None:
    monitor = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    trainer = make_trainer(tmp_path, [Inject({4: "nan"}), monitor], max_steps=7)
    trainer.fit(make_module(), datamodule=make_data(tmp_path))
    path = tmp_path / "state.pt"
    torch.save(monitor.state_dict(), path)
    other = LossSpikeMonitor(actions=["log", "skip"], warmup_steps=3)
    other.load_state_dict(torch.load(path, weights_only=True))
    assert other.detector.state_dict() == monitor.detector.state_dict()
    assert other.excluded == monitor.excluded and other.num_spikes == monitor.num_spikes == 1
    for x in (3.0, 9.0, math.nan):
        assert other.detector.decide(x).reasons == monitor.detector.decide(x).reasons
