"""ResumableCSVLogger: a resumed run keeps the CSV history up to its checkpoint and appends to it."""

import csv

import pytest

from lit_dtrain.loggers import ResumableCSVLogger, purge_csv_metrics


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
