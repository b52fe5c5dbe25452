"""A finished run started again with ``resume=auto`` (a continued sweep's finished job) only validates: it drew the
end-of-run sample and counted the train split's unigram entropy again, 16.5 s of its 33.6 s (model=nano, 2 busy CPU
cores; a pass over the whole corpus for a large one), for the same text and the same ``summary.json``. It keeps the
summary's entropy and draws no sample now, where that ``summary.json`` is of this end."""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path
from types import SimpleNamespace

import pytest

from lit_dtrain.data.datamodule import LMDataModule
from lit_dtrain.models.llama import Llama
from lit_dtrain.train import train
from lit_dtrain.train_callbacks import TrainClock, figures_of_the_fit_that_trained


@pytest.fixture
def counted(monkeypatch):
    """The entropy counts and the samples drawn, by name, as train() runs."""
    calls = {"entropy": 0, "sample": 0}
    entropy, generate = LMDataModule.unigram_entropy, Llama.generate

    def count_entropy(self):
        calls["entropy"] += 1
        return entropy(self)

    def count_sample(self, *args, **kwargs):
        calls["sample"] += 1
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(LMDataModule, "unigram_entropy", count_entropy)
    monkeypatch.setattr(Llama, "generate", count_sample)
    return calls


def test_a_finished_runs_restart_keeps_its_summary_and_draws_no_sample(tiny_cfg, counted, caplog, capsys):
    cfg = tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8")
    train(cfg)
    summary = Path(cfg.paths.output_dir) / "summary.json"
    first = json.loads(summary.read_text())
    assert counted == {"entropy": 1, "sample": 1} and "--- sample ---" in capsys.readouterr().out
    with caplog.at_level(logging.INFO, logger="lit_dtrain.train"):
        metrics, _ = train(tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8", "resume=auto"))
    assert counted == {"entropy": 1, "sample": 1}, "the restart counted or sampled again"
    again = json.loads(summary.read_text())
    # the process's peak RSS only grows in one process (a restart keeps the higher)
    assert again.pop("peak_rss_mib") >= first.pop("peak_rss_mib") > 0
    assert again == first  # every other value, the entropy and the validation's included
    assert metrics["unigram_entropy"] == first["unigram_entropy"] > 0
    assert "--- sample ---" not in capsys.readouterr().out
    line = "no text sample: the start that trained these weights drew it (this one only validated); sample them with: "
    assert f"{line}python scripts/generate.py {cfg.paths.checkpoint_dir}/last.ckpt" in caplog.text


def test_a_restart_after_a_stop_that_wrote_no_summary_samples_and_counts(tiny_cfg, counted):
    """A stop after the last step (a signal) writes no summary.json, and no sample was drawn: the restart does both."""
    cfg = tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8")
    train(cfg)
    summary = Path(cfg.paths.output_dir) / "summary.json"
    first = json.loads(summary.read_text())
    summary.unlink()
    train(tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8", "resume=auto"))
    assert counted == {"entropy": 2, "sample": 2}
    assert json.loads(summary.read_text())["unigram_entropy"] == first["unigram_entropy"]


def test_a_restart_with_the_sample_off_says_nothing_of_it(tiny_cfg, counted, caplog):
    cfg = tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=0")
    train(cfg)
    with caplog.at_level(logging.INFO, logger="lit_dtrain.train"):
        train(tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=0", "resume=auto"))
    assert counted == {"entropy": 1, "sample": 0} and "no text sample" not in caplog.text


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_keeps_the_summarys_entropy(rank, tmp_path):
    """The metrics train() returns hold the entropy on rank 0 alone (None elsewhere), as when it is counted."""
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 4, "train_loss": 2.0, "unigram_entropy": 3.5}))
    trainer = SimpleNamespace(global_step=4, is_global_zero=rank == 0)
    figures = figures_of_the_fit_that_trained(trainer, tmp_path, TrainClock(), 128)
    assert figures == ({"train_loss": 2.0, "unigram_entropy": 3.5} if rank == 0 else {"train_loss": 2.0})


def test_a_restart_on_other_data_counts_its_entropy(tiny_cfg, counted):
    """The resume accepts another train split (it warns, and validates on it): the first split's entropy stood beside
    the new split's val_loss (a finished run restarted on another corpus kept 3.23 nats where the new one has 0.51)."""
    first, _ = train(tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=0"))
    metrics, _ = train(tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=0", "resume=auto",
                                "data.val_fraction=0.3"))
    fresh, _ = train(tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=0", "data.val_fraction=0.3", run="fresh"))
    assert counted["entropy"] == 3
    assert metrics["unigram_entropy"] == fresh["unigram_entropy"] != first["unigram_entropy"]


@pytest.mark.parametrize("first", ["sample.max_new_tokens=0", "cut"])
def test_a_restart_samples_where_the_first_start_drew_none(first, tiny_cfg, counted, monkeypatch, caplog):
    """A first start that drew no sample (sample.max_new_tokens=0, or a SIGTERM that cut it, after which summary.json
    is still written): its restart with a sample said 'the start that trained these weights drew it' and drew none."""
    import lit_dtrain._run_report as run_report
    from lit_dtrain.sigterm_exit import SampleCut

    def cut(*args, **kwargs):
        raise SampleCut(15, "in the sample")

    drawing = run_report.generate_sample
    monkeypatch.setattr(run_report, "generate_sample", cut if first == "cut" else drawing)
    cfg = tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8", *[first] * (first != "cut"))
    train(cfg)
    assert json.loads((Path(cfg.paths.output_dir) / "summary.json").read_text()).get("sample_drawn") is not True
    assert counted["sample"] == 0
    monkeypatch.setattr(run_report, "generate_sample", drawing)
    with caplog.at_level(logging.INFO, logger="lit_dtrain.train"):
        train(tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8", "resume=auto"))
    assert counted["sample"] == 1 and "drew it" not in caplog.text


def test_another_runs_checkpoint_in_a_reused_run_dir_is_sampled(tiny_cfg, counted):
    """A run dir reused after `rm -r checkpoints`, with ckpt_path=<another run's checkpoint at the same step>: the old
    summary.json was taken for these weights (its tokens/s and entropy, and no sample: 'the start ... drew it')."""
    import shutil

    cfg = tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8")
    old, _ = train(cfg)
    other = tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8", "seed=5", run="other")
    train(other)
    shutil.rmtree(cfg.paths.checkpoint_dir)
    metrics, _ = train(tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8",
                                f"ckpt_path={other.paths.checkpoint_dir}/last.ckpt"))
    assert counted == {"entropy": 3, "sample": 3}
    assert metrics["tokens_per_sec"] != old["tokens_per_sec"] and metrics["val_loss"] != old["val_loss"]


def test_a_restart_with_other_sample_settings_draws_their_sample(tiny_cfg, counted, caplog):
    """A finished run restarted with another ``sample.prompt`` or ``seed`` drew no sample ('the start that trained
    these weights drew it', of the old prompt); and the line's ``generate.py`` command split a run dir with a space."""
    cfg = tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8", run="my run")
    train(cfg)
    summary = Path(cfg.paths.output_dir) / "summary.json"
    assert json.loads(summary.read_text())["sample_settings"]["prompt"] == "def "
    with caplog.at_level(logging.INFO, logger="lit_dtrain.train"):
        train(tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8", "resume=auto", run="my run"))
    assert counted["sample"] == 1
    command = caplog.text.split("sample them with: ")[1].splitlines()[0]
    assert shlex.split(command) == ["python", "scripts/generate.py", f"{cfg.paths.checkpoint_dir}/last.ckpt"]
    train(tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8", "sample.prompt=class", "resume=auto",
                   run="my run"))
    assert counted["sample"] == 2
    assert json.loads(summary.read_text())["sample_settings"]["prompt"] == "class"
    train(tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8", "sample.prompt=class", "seed=7", "resume=auto",
                   run="my run"))
    assert counted["sample"] == 3 and json.loads(summary.read_text())["sample_settings"]["seed"] == 7
    train(tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8", "sample.prompt=class", "seed=7", "resume=auto",
                   run="my run"))
    assert counted["sample"] == 3  # the same settings again: that start's sample stands


@pytest.mark.parametrize("restart", ["cut", "sample.max_new_tokens=0"])
def test_a_restart_that_drew_no_sample_of_its_settings_records_none(restart, tiny_cfg, counted, monkeypatch, caplog):
    """A finished run's restart with another prompt whose sample a SIGTERM cut (or that had the sample off) drew none,
    yet its summary.json kept the first start's sample_drawn under the restart's settings: the next restart with that
    prompt said 'the start that trained these weights drew it' and drew none."""
    import lit_dtrain._run_report as run_report
    from lit_dtrain.sigterm_exit import SampleCut

    def cut(*args, **kwargs):
        raise SampleCut(15, "in the sample")

    cfg = tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8")
    train(cfg)
    summary = Path(cfg.paths.output_dir) / "summary.json"
    drawing = run_report.generate_sample
    monkeypatch.setattr(run_report, "generate_sample", cut if restart == "cut" else drawing)
    other = ("sample.prompt=class", "resume=auto", *[restart] * (restart != "cut"))
    train(tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8", *other))
    again = json.loads(summary.read_text())
    assert (again["sample_drawn"], again["sample_settings"]) == (False, None)
    monkeypatch.setattr(run_report, "generate_sample", drawing)
    with caplog.at_level(logging.INFO, logger="lit_dtrain.train"):
        train(tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=8", "sample.prompt=class", "resume=auto"))
    assert counted["sample"] == 2 and "drew it" not in caplog.text
    assert json.loads(summary.read_text())["sample_settings"]["prompt"] == "class"
