"""ResumableCSVLogger: a resumed run keeps the CSV history up to its checkpoint and appends to it."""

import csv
import logging
from pathlib import Path

import pytest

from lit_dtrain.loggers import ResumableCSVLogger, flat_hparams, purge_csv_metrics


def rows(path):
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def log_steps(logger, steps, key="train/loss"):
    for s in steps:
        logger.log_metrics({key: float(s)}, step=s)
    logger.save()


def test_resume_keeps_history_before_purge_step_and_drops_the_rest(tmp_path):
    first = ResumableCSVLogger(tmp_path, name="csv", version="")
    log_steps(first, range(10))
    path = tmp_path / "csv" / "metrics.csv"
    assert [int(r["step"]) for r in rows(path)] == list(range(10))

    resumed = ResumableCSVLogger(tmp_path, name="csv", version="", purge_step=6)
    log_steps(resumed, range(6, 12))
    log_steps(resumed, [12], key="val/loss")  # a new column: the file is rewritten with the wider header
    got = rows(path)
    assert [int(r["step"]) for r in got] == list(range(13))  # steps 6-9 once, from the resumed run
    assert [float(r["train/loss"]) for r in got[:12]] == [float(s) for s in range(12)]
    assert got[12]["val/loss"] == "12.0" and got[0]["val/loss"] == ""

    fresh = ResumableCSVLogger(tmp_path, name="csv", version="")  # not a resume: Lightning's behaviour
    with pytest.warns(UserWarning, match="exists and is not empty"):
        log_steps(fresh, [0])
    assert [int(r["step"]) for r in rows(path)] == [0]


def test_a_resume_drops_a_last_row_cut_by_a_kill(tmp_path, caplog):
    """A kill while Lightning appended its rows (flushed in batches, so the cut row's step can lie below the resumed
    checkpoint's) left a last line without its line end. The resume kept it: with no row to drop it appended its
    first row to it (`model=nano`, `logger=csv`, the row of step 3 cut to '0,,,3,,,,4.2', resumed at step 6: line 17
    read '0,,,3,,,,4.2,0.003,0.003,6,...' and compare_runs.py stopped there), and where rows were dropped it rewrote
    it as a whole row (',0.003,0.003,1' cut from step 13's row: step 13's LR read at step 1). It is dropped now."""
    from lit_dtrain.run_dirs import read_csv_metrics

    path = tmp_path / "csv" / "metrics.csv"
    path.parent.mkdir()
    header = "lr,step,train/loss\n"
    path.write_text(header + "0.1,0,5.0\n0.1,1,4.0\n0.1,2,3.9713\n0.2,3,3.")  # cut in step 3's loss
    resumed = ResumableCSVLogger(tmp_path, name="csv", version="", purge_step=6)
    log_steps(resumed, [6])
    assert [(t, s, v) for t, s, v in read_csv_metrics(path) if t == "train/loss"] == [
        ("train/loss", 0, 5.0), ("train/loss", 1, 4.0), ("train/loss", 2, 3.9713), ("train/loss", 6, 6.0)]
    assert "no line end" in caplog.text

    path.write_text(header + "0.1,0,5.0\n0.1,8,4.0\n0.3,1")  # step 13's row cut in its step; step 8 dropped
    assert purge_csv_metrics(path, 6) == ["lr", "step", "train/loss"]
    assert path.read_text().splitlines() == ["lr,step,train/loss", "0.1,0,5.0"]
    path.write_text("lr,st")  # cut in its header: no row to keep, Lightning writes the file afresh
    assert purge_csv_metrics(path, 6) == [] and not path.exists()


def test_a_last_row_whose_line_end_was_cut_between_cr_and_lf_is_kept(tmp_path):
    """Lightning's rows end in '\r\n' (the csv module's), written after the last cell: a kill between the two bytes
    left a whole row, which the resume dropped as cut with its metrics (a real run's metrics.csv, its step-3 row
    ending in '\r': 16 rows before the purge at step 4, 15 after). It is kept, and the file ends whole."""
    from lit_dtrain.run_dirs import read_csv_metrics

    path = tmp_path / "csv" / "metrics.csv"
    path.parent.mkdir()
    path.write_bytes(b"lr,step,train/loss\r\n0.1,0,5.0\r\n0.1,3,3.9713\r")
    assert [s for t, s, _ in read_csv_metrics(path) if t == "train/loss"] == [0, 3]
    resumed = ResumableCSVLogger(tmp_path, name="csv", version="", purge_step=4)
    log_steps(resumed, [4])
    assert [(t, s, v) for t, s, v in read_csv_metrics(path) if t == "train/loss"] == [
        ("train/loss", 0, 5.0), ("train/loss", 3, 3.9713), ("train/loss", 4, 4.0)]
    assert path.read_bytes().count(b"\r\n") == 4


def test_purge_names_a_file_that_is_not_a_metrics_file(tmp_path):
    bad = tmp_path / "metrics.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="no 'step' column"):
        purge_csv_metrics(bad, 3)
    assert purge_csv_metrics(tmp_path / "missing.csv", 3) == []


def test_a_write_that_fails_while_a_new_column_widens_the_file_keeps_the_history(tmp_path, monkeypatch):
    """A new metric (the first val/loss, a callback added on resume) makes the writer rewrite the whole file under a
    wider header. Lightning truncated metrics.csv and wrote it again, so a full disk or a kill in between left only
    the header: the run's whole history was gone. The rewrite goes to a temp file renamed over the old one."""
    import errno

    logger = ResumableCSVLogger(tmp_path, name="csv", version="")
    log_steps(logger, range(5))
    path = tmp_path / "csv" / "metrics.csv"
    before = path.read_text()

    def disk_full(self, rows):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(csv.DictWriter, "writerows", disk_full)
    with pytest.raises(OSError, match="No space left"):
        log_steps(logger, [5], key="val/loss")
    assert path.read_text() == before
    assert not [p.name for p in path.parent.iterdir() if p.name != "metrics.csv"]  # no temp file left behind
    monkeypatch.undo()
    log_steps(logger, [6], key="val/loss")  # the next save writes the new column, and the row that failed
    got = rows(path)
    assert [int(r["step"]) for r in got] == [0, 1, 2, 3, 4, 5, 6]
    assert got[-1]["val/loss"] == "6.0" and got[0]["val/loss"] == ""


def hparams_table(logdir):
    """TensorBoard's HParams table for ``logdir``, computed by its own plugin: {session run: (hparams, metrics)}."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, get_experiment, list_session_groups

    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, str(logdir))
    tb_context = base_plugin.TBContext(logdir=str(logdir), multiplexer=mux, data_provider=provider)
    backend = backend_context.Context(tb_context)
    ctx = context.RequestContext()
    experiment = get_experiment.Handler(ctx, backend, "", api_pb2.GetExperimentRequest()).run()
    request = api_pb2.ListSessionGroupsRequest(start_index=0, slice_size=100, allowed_statuses=[api_pb2.STATUS_UNKNOWN])
    for info in experiment.hparam_infos:
        request.col_params.add(hparam=info.name)
    for info in experiment.metric_infos:
        request.col_params.add(metric=info.name)
    table = {}
    for group in list_session_groups.Handler(ctx, backend, "", request).run().session_groups:
        values = {k: getattr(v, v.WhichOneof("kind")) for k, v in group.hparams.items()}
        metrics = {m.name.tag: m.value for m in group.metric_values}
        for session in group.sessions:
            table[session.name] = (values, metrics)
    return table


def test_flat_hparams_keys_the_scalar_leaves_by_their_path():
    config = {
        "optimizer": {"lr": 1e-3, "betas": [0.9, 0.95], "_target_": "x.adamw"},
        "ckpt_path": None,
        "module": {"compile": False},
        "data": {"sources": [{"name": "a", "weight": 1}]},
        "empty": {},
    }
    assert flat_hparams(config) == {
        "optimizer.lr": 1e-3,
        "optimizer.betas.0": 0.9,
        "optimizer.betas.1": 0.95,
        "optimizer._target_": "x.adamw",
        "module.compile": False,
        "data.sources.0.name": "a",
        "data.sources.0.weight": 1,
    }


def test_the_config_is_in_tensorboards_hparams_table_once_per_run_with_the_final_val_loss(tiny_cfg, tmp_path):
    """The config was only in config_resolved.yaml: TensorBoard's HParams view showed nothing to compare runs by."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lit_dtrain.train import train

    common = ("sample.max_new_tokens=0", "trainer.max_steps=4")
    train(tiny_cfg(*common, "optimizer.lr=1e-3", run="runs/a"))
    train(tiny_cfg(*common, "optimizer.lr=3e-3", run="runs/b"))
    # b resumed to 6 steps: its TensorBoard dir gets a second event file, and no second session
    train(tiny_cfg("sample.max_new_tokens=0", "trainer.max_steps=6", "optimizer.lr=3e-3", "resume=auto", run="runs/b"))
    table = hparams_table(tmp_path / "runs")
    assert sorted(table) == ["a/tb", "b/tb"]
    for run, lr, steps in (("a", 1e-3, 4), ("b", 3e-3, 4)):
        hparams, metrics = table[f"{run}/tb"]
        assert hparams["optimizer.lr"] == lr and hparams["model.n_layer"] == 2 and hparams["module.compile"] is False
        assert hparams["optimizer._target_"] == "lit_dtrain.optim.adamw" and hparams["data.sources.0.name"] == "text"
        assert hparams["trainer.max_steps"] == steps  # b: the config it was started with
        assert "ckpt_path" not in hparams  # null
        summary = json.loads((tmp_path / "runs" / run / "summary.json").read_text())
        assert metrics["val/loss"] == pytest.approx(summary["val_loss"], rel=1e-6)  # the final validation's
    assert len(list((tmp_path / "runs" / "b" / "tb").glob("events.out.tfevents.*"))) > 1
    event_files = (tmp_path / "runs" / "b" / "tb").glob("events.out.tfevents.*")
    assert sum(p.read_bytes().count(b"_hparams_/session_start_info") for p in event_files) == 1
    accumulator = EventAccumulator(str(tmp_path / "runs" / "b" / "tb"))
    accumulator.Reload()
    assert [e.step for e in accumulator.Scalars("val/loss")] == [2, 5, 6]  # none added at step 0 (4: purged)


@pytest.mark.parametrize("logger", ["csv", "none"])
def test_runs_without_tensorboard_train_and_write_no_hparams(logger, tiny_cfg, tmp_path):
    from lit_dtrain.train import train

    metrics, _ = train(tiny_cfg("sample.max_new_tokens=0", "trainer.max_steps=3", f"logger={logger}"))
    assert metrics["steps"] == 3
    assert not (tmp_path / "run" / "tb").exists()
    if logger == "csv":
        assert "val/loss" in (tmp_path / "run" / "csv" / "metrics.csv").read_text().splitlines()[0]


def test_a_start_that_failed_before_its_first_checkpoint_is_not_drawn_twice(tiny_cfg, tmp_path):
    """A start killed or failed before its first checkpoint (SIGKILL at step 0, 19 s into a `model=nano` run here)
    left its points in `tb/`, and the next start, from step 0 again (`resume=auto` finds nothing to resume), logged
    them anew: TensorBoard showed `train/loss` at 0, 1, 0, 1, 2, 3, the curve doubling back. Every TensorBoard start
    now marks where its points begin (`purge_step`, 0 here), and writes its config's HParams session again."""
    from tensorboard.backend.event_processing import plugin_event_multiplexer
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from lit_dtrain.train import train

    common = ("sample.max_new_tokens=0", "trainer.max_steps=4", "trainer.log_every_n_steps=1")
    crash = ("+callbacks.fault._target_=tests.faults.RaiseOnceAt", "+callbacks.fault.hook=on_after_backward",
             "+callbacks.fault.step=2")
    with pytest.raises(RuntimeError, match="interrupted at step 2"):
        train(tiny_cfg(*common, *crash))
    assert not list((tmp_path / "run" / "checkpoints").glob("*.ckpt"))  # the next start is from step 0
    train(tiny_cfg(*common, "resume=auto"))
    legacy = EventAccumulator(str(tmp_path / "run" / "tb"))  # scripts' and tests' reader
    legacy.Reload()
    assert [e.step for e in legacy.Scalars("train/loss")] == [0, 1, 2, 3]
    mux = plugin_event_multiplexer.EventMultiplexer()  # TensorBoard's own (Python) reader, which ignores a run's
    mux.AddRunsFromDirectory(str(tmp_path / "run"))  # first SessionLog.START: the crashed start wrote one too
    mux.Reload()
    assert [e.step for e in mux.Tensors("tb", "train/loss")] == [0, 1, 2, 3]
    assert hparams_table(tmp_path / "run")["tb"][0]["trainer.max_steps"] == 4  # its session purged, a new one


@pytest.mark.parametrize("logger", ["tensorboard", "csv"])
def test_a_fresh_start_into_another_runs_save_dir_is_warned_about(logger, tiny_cfg, tmp_path, caplog):
    """Two runs given one ``logger.save_dir`` (r1, then r2: 4 steps each) wrote into one ``tb/`` without a word:
    TensorBoard showed one run, r2's purge_step=0 hiding r1's 59 points (and ``metrics.csv`` was replaced)."""
    from lit_dtrain.loggers import build_logger

    shared = tmp_path / "shared"
    first = build_logger(tiny_cfg(f"logger={logger}", f"logger.save_dir={shared}", run="r1"), 0)
    first.log_metrics({"train/loss": 1.0}, step=0)
    first.finalize("success")
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.loggers"):
        build_logger(tiny_cfg(f"logger={logger}", f"logger.save_dir={shared}", run="r1"), 4)  # r1's resume
        build_logger(tiny_cfg(f"logger={logger}", run="r3"), 0)  # its own run dir
        assert caplog.records == []
        build_logger(tiny_cfg(f"logger={logger}", f"logger.save_dir={shared}", run="r2"), 0)
    assert [r.getMessage().split(" already")[0] for r in caplog.records] == [str(Path(first.log_dir).resolve())]
