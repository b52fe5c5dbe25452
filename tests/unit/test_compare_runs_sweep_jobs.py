"""scripts/compare_runs.py: a sweep's jobs: their order, jobs never started, failed, failed again, killed or extended,
and their errors."""

from __future__ import annotations

import json
import logging

from torch.utils.tensorboard import SummaryWriter

from tests.unit._compare_runs_helpers import compare_runs, write_run


def test_the_table_lists_a_sweeps_jobs_in_job_order(tmp_path):
    """`python train.py -m optimizer.lr=1e-3,-1,1e4,3e-3`: job 1 failed before logging, so its row came after all
    the runs that logged, below job 3 ('0.001, 10000.0, 0.003, -1'): the grid no longer read in its order. The rows
    of a sweep's jobs follow the job numbers now; runs given one by one keep the order they were given in."""
    sweep = tmp_path / "sweep"
    for job, lr in (("0", "0.001"), ("2", "10000.0"), ("3", "0.003")):
        write_run(sweep / job, {5: 3.0 - int(job) * 0.1}, overrides=[f"optimizer.lr={lr}"])
    (sweep / "1" / ".hydra").mkdir(parents=True)
    (sweep / "1" / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=-1\n")
    (sweep / "1" / "train.log").write_text("[x][lit_dtrain.train][ERROR] - job 1 failed: ConfigError: lr < 0\n")
    other = write_run(tmp_path / "runs" / "baseline", {5: 3.5}, overrides=["optimizer.lr=0.01"])
    result = compare_runs.compare([str(other), str(sweep)], ["val/loss"], out=str(tmp_path / "c.png"))
    labels = [line.split(" | ")[0][2:] for line in result["markdown"].splitlines()[2:]]
    assert labels == [f"optimizer.lr={lr}" for lr in ("0.01", "0.001", "-1", "10000.0", "0.003")]


def test_the_jobs_a_stopped_sweep_never_started_have_rows(tmp_path):
    """A 2 x 2 sweep ('-m scheduler=wsd,cosine optimizer.lr=1e-3,3e-3') stopped by SIGTERM in job 1: Hydra creates a
    job's dir when the job starts, so the table listed job 0 and job 1 (unfinished) only, and read like a complete
    comparison of the wsd runs with no cosine in it. The jobs of the sweep's multirun.yaml (Hydra's basic sweeper:
    the product of the swept values, hydra.sweeper.params first) that have no dir get a 'not started' row, labelled
    like the others, and are listed in the JSON's 'not_started', where the sweep is given whole (its dir, or the
    `<sweep>/*` glob, which matches its multirun.yaml)."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text(
        "hydra:\n  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
        "    params:\n      scheduler: wsd,cosine\n"
        "  overrides:\n    task:\n    - optimizer.lr=1e-3,3e-3\n    - trainer.max_steps=5\n"
    )
    write_run(sweep / "0", {5: 3.0}, overrides=["scheduler=wsd", "optimizer.lr=0.001", "trainer.max_steps=5"])
    (sweep / "0" / "config_resolved.yaml").write_text("trainer: {max_steps: 5}\n")
    (sweep / "0" / "summary.json").write_text(json.dumps({"steps": 5}))
    write_run(sweep / "1", {2: 3.2}, overrides=["scheduler=wsd", "optimizer.lr=0.003", "trainer.max_steps=5"])
    (sweep / "1" / "config_resolved.yaml").write_text("trainer: {max_steps: 5}\n")
    for args in ([str(sweep)], sorted(str(p) for p in sweep.glob("*"))):
        result = compare_runs.compare(args, ["val/loss"], out=str(tmp_path / "c.png"))
        assert result["markdown"].splitlines()[2:] == [
            "| scheduler=wsd optimizer.lr=0.001 | 5 | 3.0000 | 3.0000 (5) | +0.00% |",
            "| scheduler=wsd optimizer.lr=0.003 | 3 (unfinished) | 3.2000 | 3.2000 (3) | - |",
            "| scheduler=cosine optimizer.lr=0.001 | not started | - | - | - |",
            "| scheduler=cosine optimizer.lr=0.003 | not started | - | - | - |",
        ]
        assert result["not_started"] == [
            {"label": "scheduler=cosine optimizer.lr=0.001", "dir": str(sweep / "2")},
            {"label": "scheduler=cosine optimizer.lr=0.003", "dir": str(sweep / "3")},
        ]
    # one job given alone (or two of its jobs) is no comparison of the sweep: it listed jobs 2 and 3 'not started'
    for args in ([str(sweep / "0")], [str(sweep / "1"), str(sweep / "0")]):
        result = compare_runs.compare(args, ["val/loss"], out=str(tmp_path / "c.png"))
        assert result["not_started"] == [] and "not started" not in result["markdown"]
        assert len(result["markdown"].splitlines()) == 2 + len(args)
    complete = write_run(tmp_path / "other" / "0", {5: 3.1}, overrides=["optimizer.lr=0.01"])
    (complete.parent / "multirun.yaml").write_text(
        "hydra:\n  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
        "  overrides:\n    task:\n    - optimizer.lr=0.01\n"
    )
    assert compare_runs.compare([str(complete.parent)], ["val/loss"], out=str(tmp_path / "d.png"))["not_started"] == []


def test_a_failed_job_of_a_hydra_app_of_ones_own_shows_its_error(tmp_path):
    """Hydra's job logging writes to ``<job dir>/<hydra.job.name>.log``, the app's script name: train.log for the
    root train.py, my_train.log for a Hydra app of one's own calling train(cfg). compare_runs read train.log only,
    so such an app's failed job got 'no metrics logged (not started, ...)' although its log held the error. The
    log is the one .hydra/hydra.yaml names (rank 1's train_ddp_process_1.log is another job name's, not read)."""
    sweep = tmp_path / "sweep"
    write_run(sweep / "0", {5: 3.0}, overrides=["optimizer.lr=1e-3"])
    failed = sweep / "1"
    (failed / ".hydra").mkdir(parents=True)
    (failed / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=-1\n")
    (failed / ".hydra" / "hydra.yaml").write_text("hydra:\n  job:\n    name: my_train\n    num: 1\n")
    (failed / "my_train.log").write_text("[x][lit_dtrain.train][ERROR] - job 1 failed: ConfigError: lr < 0\n")
    (failed / "my_train_ddp_process_1.log").write_text("[x][lit_dtrain.train][ERROR] - job 1 failed: rank 1's\n")
    result = compare_runs.compare([str(sweep)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert result["markdown"].splitlines()[3] == "| optimizer.lr=-1 | failed: ConfigError: lr < 0 | - | - | - |"
    assert result["skipped_jobs"][0]["error"] == "ConfigError: lr < 0"


def test_a_failed_jobs_error_is_shown_in_the_first_table_only(tmp_path):
    """'--metric val/loss --metric lr-AdamW/decay' over a sweep with a failed job printed the job's error (up to
    100 characters) in every metric's table, the same text once per table. The first table shows it; the others
    say where it is. The JSON keeps it in each run and skipped job as before."""
    sweep = tmp_path / "sweep"
    write_run(sweep / "0", {5: 3.0}, overrides=["optimizer.lr=1e-3"])
    bad = sweep / "1"
    SummaryWriter(str(bad / "tb")).close()  # failed after its logger started: a run without the metrics
    (bad / ".hydra").mkdir(parents=True)
    (bad / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=1e4\n")
    (bad / "train.log").write_text("[x][lit_dtrain.train][ERROR] - job 1 failed: NonFiniteError: at step 1\n")
    (sweep / "2" / ".hydra").mkdir(parents=True)
    (sweep / "2" / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=-1\n")
    (sweep / "2" / "train.log").write_text("[x][lit_dtrain.train][ERROR] - job 2 failed: ConfigError: lr < 0\n")
    result = compare_runs.compare([str(sweep)], ["val/loss", "lr-AdamW/decay"], out=str(tmp_path / "c.png"))
    first, second = result["markdown"].split("\n\n")
    assert first.splitlines()[3:] == [
        "| optimizer.lr=1e4 | failed: NonFiniteError: at step 1 | - | - | - |",
        "| optimizer.lr=-1 | failed: ConfigError: lr < 0 | - | - | - |",
    ]
    assert second.splitlines()[3:] == [
        "| optimizer.lr=1e4 | failed (error in the val/loss table) | - | - | - |",
        "| optimizer.lr=-1 | failed (error in the val/loss table) | - | - | - |",
    ]
    assert result["runs"][1]["error"] == "NonFiniteError: at step 1"
    assert result["skipped_jobs"][0]["error"] == "ConfigError: lr < 0"


def test_a_resumed_runs_purged_points_are_dropped_without_tensorboards_warning(tmp_path, caplog):
    """A resumed run's event files: the killed run logged steps 0-5, the resume (``purge_step=3``, as train() passes
    it) logged 3-7. TensorBoard drops the killed run's 3-5 and printed 'Detected out of order event.step likely
    caused by a TensorFlow restart. Purging expired events ...' on stderr for every such run, which no user can act
    on; the values are the resumed run's and stderr is quiet."""
    from lit_dtrain.run_dirs import read_scalars

    tb = tmp_path / "run" / "tb"
    with SummaryWriter(str(tb)) as w:
        for step in range(6):
            w.add_scalar("val/loss", 10.0 + step, step)
    with SummaryWriter(str(tb), purge_step=3) as w:
        for step in range(3, 8):
            w.add_scalar("val/loss", float(step), step)
    with caplog.at_level(logging.INFO):
        values = read_scalars(tmp_path / "run")["val/loss"]
    assert values == [(0, 10.0), (1, 11.0), (2, 12.0), (3, 3.0), (4, 4.0), (5, 5.0), (6, 6.0), (7, 7.0)]
    assert not [r for r in caplog.records if "out of order" in r.getMessage()]
    assert logging.getLogger("tensorboard").level == logging.NOTSET  # put back after reading


def test_a_sweep_whose_job_dirs_are_not_numbered_has_no_not_started_rows(tmp_path):
    """'-m seed=1,2 hydra.sweep.subdir=${hydra.job.override_dirname}' names the job dirs seed=1 and seed=2, not 0 and
    1: both jobs ran, yet each got a second row, 'not started', because <sweep>/0 and <sweep>/1 do not exist. Jobs
    that never started can be named only where the job dirs are the job numbers (conf/hydra's subdir)."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()

    def multirun(subdir: str) -> None:  # as Hydra saves it: the subdir unresolved
        (sweep / "multirun.yaml").write_text(
            f"hydra:\n  sweep:\n    dir: {sweep}\n    subdir: {subdir}\n"
            "  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
            "  overrides:\n    task:\n    - seed=1,2\n"
        )

    multirun("${hydra.job.override_dirname}")
    for seed, loss in ((1, 3.0), (2, 3.2)):
        write_run(sweep / f"seed={seed}", {5: loss}, overrides=[f"seed={seed}"])
    for args in ([str(sweep)], sorted(str(p) for p in sweep.glob("seed=*"))):
        result = compare_runs.compare(args, ["val/loss"], out=str(tmp_path / "c.png"))
        assert result["not_started"] == []
        assert result["markdown"].splitlines()[2:] == [
            "| seed=1 | 6 | 3.0000 | 3.0000 (6) | +0.00% |",
            "| seed=2 | 6 | 3.2000 | 3.2000 (6) | +6.67% |",
        ]
    for subdir in ("${hydra:job.num}", "${hydra.job.num}"):  # numbered job dirs (conf/hydra's, Hydra's own default)
        multirun(subdir)
        result = compare_runs.compare([str(sweep)], ["val/loss"], out=str(tmp_path / "d.png"))
        assert [job["dir"] for job in result["not_started"]] == [str(sweep / "0"), str(sweep / "1")]


def test_a_job_that_failed_again_shows_its_latest_error(tmp_path):
    """Hydra's job log is opened for appending: a job re-run into its dir (resume=auto hydra.sweep.dir=...) adds to
    the same train.log. A job that failed at a collective, was re-run with resume=auto and failed again at a loss
    spike was reported with the first, stale error."""
    from lit_dtrain.run_dirs import job_error

    sweep = tmp_path / "sweep"
    write_run(sweep / "0", {5: 3.0}, overrides=["optimizer.lr=1e-3"])
    failed = write_run(sweep / "1", {2: 3.4}, overrides=["optimizer.lr=3e-3"])
    (failed / "train.log").write_text(
        "[x][lit_dtrain.train][ERROR] - job 1 failed: CollectiveError: rank 1: a collective failed\n"
        "Traceback (most recent call last):\n"
        "[y][lightning.pytorch.utilities.rank_zero][INFO] - Restoring states from the checkpoint path\n"
        "[z][lit_dtrain.train][ERROR] - job 1 failed: LossSpikeError: spike at 11\nTraceback (most recent call last):\n"
    )
    assert job_error(failed) == "LossSpikeError: spike at 11"
    result = compare_runs.compare([str(sweep)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert [r.get("error") for r in result["runs"]] == [None, "LossSpikeError: spike at 11"]


def test_a_failed_run_whose_later_start_was_killed_is_unfinished_not_failed(tmp_path, capsys):
    """`python train.py optimizer.lr=1e30 run_name=a` failed at step 1 (NonFiniteError); `run_name=a resume=auto` with a
    sane LR then trained to step 1235 and was killed: its row said '1235 (failed)' with the first start's error, as
    the killed start logged nothing. Every start that passes its checks now logs TRAINING_STARTS to train.log, and
    only an error logged after the latest one counts."""
    from lit_dtrain.run_dirs import TRAINING_STARTS, job_error

    run = write_run(tmp_path / "a", {1229: 1.5072, 1235: 1.5232})
    (run / "config_resolved.yaml").write_text("trainer: {max_steps: 2000}\n")
    failed = (f"[x][lit_dtrain.train][INFO] - {TRAINING_STARTS}\n"
              "[y][lit_dtrain.train][ERROR] - run failed: NonFiniteError: non-finite gradients at step 1\n")
    (run / "train.log").write_text(failed + f"[z][lit_dtrain.train][INFO] - {TRAINING_STARTS}\n")
    assert job_error(run) is None
    result = compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert result["markdown"].splitlines()[2] == "| a | 1236 (unfinished) | 1.5232 | 1.5072 (1230) | +0.00% |"
    assert "did not finish" in capsys.readouterr().err
    # that start failed too: its own error; a log of before the marker line: its last error, as before
    (run / "train.log").write_text(failed * 2)
    assert job_error(run) == "NonFiniteError: non-finite gradients at step 1"
    (run / "train.log").write_text(failed.split("\n", 1)[1])
    assert job_error(run) == "NonFiniteError: non-finite gradients at step 1"


def test_an_extension_of_a_finished_run_that_failed_before_its_first_logged_step_is_failed(tmp_path, capsys):
    """A real 2-step run extended with `resume=auto trainer.max_steps=4 data.batch_size=20000` failed at its first step
    (DefaultCPUAllocator: can't allocate memory): summary.json still said steps=2 and the extension had logged no
    step, so the run was 'finished'; and TensorBoard's purge at the extension's first step (2) dropped the run's
    final val/loss, so its row read '| ... | no sync logged | - | - | - |'. The latest start counts: failed."""
    from lit_dtrain.run_dirs import SUMMARY_LINE, TRAINING_STARTS

    run = write_run(tmp_path / "ext", {2: 4.5692})  # its final validation, at step 2 as logged
    (run / "config_resolved.yaml").write_text("trainer: {max_steps: 4}\n")
    (run / "summary.json").write_text(json.dumps({"val_loss": 4.5692, "steps": 2}))
    w = SummaryWriter(str(run / "tb"), purge_step=2, filename_suffix=".2")  # the extension's writer
    w.add_scalar("lr-AdamW/decay", 1e-3, 2)
    w.close()
    first = f"[a][lit_dtrain.train][INFO] - {TRAINING_STARTS}\n[b][lit_dtrain.train][INFO] - {SUMMARY_LINE}4.5692\n"
    failed = "[d][lit_dtrain.train][ERROR] - run failed: RuntimeError: can't allocate memory\n"
    (run / "train.log").write_text(first + f"[c][lit_dtrain.train][INFO] - {TRAINING_STARTS}\n" + failed)
    row = compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"))["runs"][0]
    assert (row["finished"], row["error"]) == (False, "RuntimeError: can't allocate memory")
    md = compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"))["markdown"]
    assert md.splitlines()[2] == "| ext | failed: RuntimeError: can't allocate memory | - | - | - |"
    (run / "train.log").write_text(first + f"[c][lit_dtrain.train][INFO] - {TRAINING_STARTS}\n")  # killed
    assert compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"))["runs"][0]["finished"] is False
    for log in (first, first + failed):  # its last start wrote the summary; a refused start never started
        (run / "train.log").write_text(log)
        assert compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"))["runs"][0]["finished"]


def test_a_start_that_trains_logs_its_marker_to_the_job_log_only(tmp_path):
    """The marker goes to the root logger's file handlers (Hydra's job log), not to the console."""
    import io

    from lit_dtrain.run_dirs import TRAINING_STARTS
    from lit_dtrain.sweeps import log_training_start

    root, console = logging.getLogger(), io.StringIO()
    handlers = [logging.FileHandler(tmp_path / "train.log"), logging.StreamHandler(console)]
    for h in handlers:
        h.setLevel(logging.INFO)
        root.addHandler(h)
    try:
        log_training_start(logging.getLogger("lit_dtrain.train"))
    finally:
        for h in handlers:
            root.removeHandler(h)
            h.close()
    assert (tmp_path / "train.log").read_text() == f"{TRAINING_STARTS}\n" and console.getvalue() == ""


def test_a_run_stopped_before_logging_the_metric_says_it_did_not_finish(tmp_path, capsys):
    """A sweep job killed at step 7 of 20 with val_check_interval=10 has train/loss but no val/loss and no
    summary.json. stderr said "its row is marked '(unfinished)'", yet its val/loss row was '| ... | - | - | - | - |',
    like a finished run that never logs that metric: the table did not say that the job stopped early."""
    done = write_run(tmp_path / "s" / "0", {9: 3.5, 19: 3.2, 20: 3.2}, overrides=["optimizer.lr=1e-3"])
    (done / "config_resolved.yaml").write_text("trainer: {max_steps: 20}\n")
    (done / "summary.json").write_text(json.dumps({"steps": 20}))
    killed = tmp_path / "s" / "1"
    with SummaryWriter(str(killed / "tb")) as w:
        w.add_scalar("train/loss", 4.0, 4)
    (killed / ".hydra").mkdir(parents=True)
    (killed / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=3e-3\n")
    (killed / "config_resolved.yaml").write_text("trainer: {max_steps: 20}\n")
    result = compare_runs.compare([str(tmp_path / "s")], ["val/loss", "train/loss"], out=str(tmp_path / "c.png"))
    first, second = result["markdown"].split("\n\n")
    assert first.splitlines()[2:] == [
        "| optimizer.lr=1e-3 | 20 | 3.2000 | 3.2000 (20) | +0.00% |",
        "| optimizer.lr=3e-3 | unfinished (no val/loss logged) | - | - | - |",
    ]
    assert second.splitlines()[3] == "| optimizer.lr=3e-3 | 5 (unfinished) | 4.0000 | 4.0000 (5) | +0.00% |"
    assert "its row is marked '(unfinished)'" in capsys.readouterr().err


def test_the_legend_of_many_long_labels_hides_no_curve_and_is_in_the_png(tmp_path, monkeypatch):
    """`compare_runs.py outputs` over a few sweeps: 20 runs labelled like 'strategy=ddp_compressed/local_sgd_adaptive
    experiment=compression_sweep max_steps=20 ...'. The legend, inside the first panel, was wider than the panel: it
    covered the curves and the y label, and its left part (the start of every label) was cut off the PNG. It is
    below the panels now, clear of every panel and its labels, and the PNG holds all of it."""
    from matplotlib.figure import Figure
    from matplotlib.image import imread

    seen = {}
    savefig = Figure.savefig

    def record(fig, *args, **kwargs):
        savefig(fig, *args, **kwargs)
        renderer = fig.canvas.get_renderer()
        legend = fig.axes[0].get_legend()
        seen["legend"] = legend.get_window_extent(renderer)
        seen["texts"] = [t.get_text() for t in legend.get_texts()]
        seen["axes"] = [(ax.get_window_extent(renderer), ax.xaxis.label.get_window_extent(renderer),
                         ax.yaxis.label.get_window_extent(renderer)) for ax in fig.axes]

    monkeypatch.setattr(Figure, "savefig", record)
    curves = {f"strategy=ddp_compressed/preset{i} experiment=compression_sweep trainer.max_steps=20 "
              f"trainer.log_every_n_steps=5 window_size=5": {"val/loss": [(9, 3.0 + i / 10), (19, 2.0 + i / 10)],
                                                               "train/loss": [(9, 3.1), (19, 2.1)]}
              for i in range(20)}
    out = tmp_path / "c.png"
    compare_runs.plot(curves, ["val/loss", "train/loss"], out)
    assert seen["texts"] == list(curves)
    legend = seen["legend"]
    for panel, xlabel, ylabel in seen["axes"]:
        assert not legend.overlaps(panel) and not legend.overlaps(xlabel) and not legend.overlaps(ylabel)
    height, width = imread(out).shape[:2]  # the PNG is at least as large as the legend and the panels above it
    panel = seen["axes"][0][0]
    assert width >= legend.width and height >= legend.height + panel.height


def test_a_sweep_with_an_interpolated_override_lists_its_jobs(tmp_path, capsys):
    """'-m optimizer.lr=1e-3,3e-3 paths.checkpoint_dir=/ck/${hydra:job.num}' (a checkpoint dir per job): reading its
    multirun.yaml resolved the override, 'cannot list the jobs ... (UnsupportedInterpolationType: Unsupported
    interpolation type hydra)', and a job that never started had no row. The overrides are read as typed."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text(
        "hydra:\n  sweeper:\n    _target_: hydra._internal.core_plugins.basic_sweeper.BasicSweeper\n"
        "  overrides:\n    task:\n    - optimizer.lr=1e-3,3e-3\n    - paths.checkpoint_dir=/ck/${hydra:job.num}\n"
    )
    job0 = ["optimizer.lr=0.001", r"paths.checkpoint_dir=/ck/$\{hydra\:job.num\}"]  # as Hydra writes a job's
    write_run(sweep / "0", {5: 3.0}, overrides=job0)
    result = compare_runs.compare([str(sweep)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert result["not_started"] == [{"label": "optimizer.lr=0.003", "dir": str(sweep / "1")}]
    assert "cannot list the jobs" not in capsys.readouterr().err
