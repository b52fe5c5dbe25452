"""scripts/compare_runs.py: outputs that cannot be written, event files that cannot be read, runs given twice."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from tests.unit._compare_runs_helpers import compare_runs, write_run


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--out", "{tmp}/plot.foo"], "--out '{tmp}/plot.foo': matplotlib cannot write '.foo' files"),
        (["--out", "{tmp}/file/plot.png"], "--out '{tmp}/file/plot.png': cannot create its directory"),
        (["--table", "{tmp}/file/t.md"], "--table '{tmp}/file/t.md': cannot create its directory"),
        (["--table", "{tmp}"], "--table '{tmp}' is a directory; give a file path"),
        # a dir without a suffix: plots/ was written as plots.png beside it (exit 0)
        (["--out", "{tmp}/"], "--out '{tmp}/' is a directory; give a file path"),
        # a dir not made yet: Path drops the '/', so plots.png was written beside it, and --table a file 'tables'
        (["--out", "{tmp}/plots/"], "--out '{tmp}/plots/' ends with a path separator, so it names a directory"),
        (["--table", "{tmp}/tables/"], "--table '{tmp}/tables/' ends with a path separator, so it names a directory"),
        # and '/.': plots.png beside the missing dir; '/..': a file '...png' in it
        (["--out", "{tmp}/plots/."], "--out '{tmp}/plots/.' ends with '.', so it names a directory"),
        (["--out", "{tmp}/plots/.."], "--out '{tmp}/plots/..' ends with '..', so it names a directory"),
        (["--table", "{tmp}/tables/."], "--table '{tmp}/tables/.' ends with '.', so it names a directory"),
    ],
)
def test_an_unwritable_out_or_table_is_named_before_the_runs_are_read(tmp_path, capsys, flags, message):
    """An --out suffix matplotlib does not write, an output below a file or a --table that is a dir was a
    traceback (ValueError, FileExistsError, IsADirectoryError) after every run was read."""
    run = write_run(tmp_path / "a", {10: 3.0})
    (tmp_path / "file").write_text("a file, not a dir")
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert compare_runs.main([str(run), *flags]) == 2
    captured = capsys.readouterr()
    assert message.format(tmp=tmp_path) in captured.err
    assert "error" in json.loads(captured.out.strip().splitlines()[-1])


def test_outputs_replace_an_existing_file_whole(tmp_path, capsys, monkeypatch):
    """The PNG and table are written beside the target and renamed over it: a failure while writing leaves the
    earlier file as it was, and no temporary file."""
    from matplotlib.figure import Figure

    run = write_run(tmp_path / "a", {10: 3.0})
    out, table = tmp_path / "c.png", tmp_path / "c.md"
    out.write_bytes(b"earlier plot")

    def fail(self, path, **kwargs):
        Path(path).write_bytes(b"half a PNG")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", fail)
    assert compare_runs.main([str(run), "--out", str(out), "--table", str(table)]) == 2
    assert "disk full; the previous file at that path is intact" in capsys.readouterr().out
    assert out.read_bytes() == b"earlier plot" and sorted(p.name for p in tmp_path.iterdir()) == ["a", "c.md", "c.png"]
    monkeypatch.undo()
    assert compare_runs.main([str(run), "--out", str(out), "--table", str(table)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG" and "| a | 11 | 3.0000 |" in table.read_text()


@pytest.mark.parametrize("content", [b"garbage, not a TensorBoard event file\n", b""])
def test_an_unreadable_event_file_is_named(tmp_path, capsys, content):
    """A garbage or empty event file read as a run without scalars: "no scalar 'val/loss' in any of the 1 runs;
    they have []". The file is named now: an error when it is all the run has, a warning beside readable ones."""
    bad = tmp_path / "bad" / "tb" / "events.out.tfevents.123.host"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(content)
    assert compare_runs.main([str(tmp_path / "bad"), "--out", str(tmp_path / "x.png")]) == 2
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert error == (f"run {str(tmp_path / 'bad')!r}: its event file(s) {str(bad)!r} hold no TensorBoard events "
                     "(unreadable, not an event file, or empty)")
    assert not (tmp_path / "x.png").exists()
    good = write_run(tmp_path / "good", {10: 3.0})
    extra = good / "tb" / "events.out.tfevents.999.host"
    extra.write_bytes(content)
    result = compare_runs.compare([str(good)], ["val/loss"], out=str(tmp_path / "y.png"))
    assert result["runs"][0]["final"] == pytest.approx(3.0)
    assert f"skipping event file(s) {str(extra)!r}" in capsys.readouterr().err


def test_runs_without_any_scalar_say_so(tmp_path):
    SummaryWriter(str(tmp_path / "r" / "tb")).close()  # a run that stopped before logging: file_version only
    with pytest.raises(compare_runs.CompareError, match=r"in any of the 1 runs; they have no scalars at all"):
        compare_runs.compare([str(tmp_path / "r")], ["val/loss"], out=str(tmp_path / "z.png"))


@pytest.mark.parametrize("damage", ["cut", "crc"])
def test_an_event_file_that_cannot_be_read_to_its_end_is_named_with_what_was_read(tmp_path, capsys, damage):
    """TensorBoard's reader stops silently at a record cut off (a killed writer, a full disk) or failing its crc
    check: the run read as one that had logged less, with no word of it. The file is named now, with the events
    and bytes read from it and the last step among them; what could be read is still compared."""
    run = write_run(tmp_path / "run", {10: 3.0, 20: 2.5, 30: 2.6})
    (event_file,) = (run / "tb").iterdir()
    data = event_file.read_bytes()
    last_record_at = 0  # TFRecord framing: an 8-byte length, its crc, the event, the event's crc
    while last_record_at + 16 + int.from_bytes(data[last_record_at : last_record_at + 8], "little") < len(data):
        last_record_at += 16 + int.from_bytes(data[last_record_at : last_record_at + 8], "little")
    if damage == "cut":  # the last record (lr-AdamW/decay at step 30) loses its last 5 bytes
        event_file.write_bytes(data[:-5])
        reason = "it ends in a partial record: its writer was killed mid-record, or the disk was full"
    else:  # a byte of the last record's event flipped
        event_file.write_bytes(data[:-8] + bytes([data[-8] ^ 0xFF]) + data[-7:])
        reason = "a record fails its crc check: the file is damaged there"
    result = compare_runs.compare([str(run)], ["val/loss", "lr-AdamW/decay"], out=str(tmp_path / "x.png"))
    err = capsys.readouterr().err
    size = event_file.stat().st_size
    assert (f"compare_runs: run {str(run)!r}: event file {str(event_file)!r} cannot be read to its end ({reason}); "
            f"using its first 6 events, up to step 30 ({last_record_at} of its {size} bytes)\n") in err
    assert result["runs"][0]["by_metric"]["val/loss"]["final_step"] == 31  # read before the damaged record
    assert result["runs"][0]["by_metric"]["lr-AdamW/decay"]["final_step"] == 21  # its step-30 point is lost


def test_a_failed_write_of_the_table_is_one_error_line(tmp_path, capsys, monkeypatch):
    """``--table /proc/t.md`` as root (the directory passes the writable check), or a full disk: the write's
    AtomicWriteError was a traceback with exit status 1. It is one JSON error line naming the file now, status 2."""
    from lit_dtrain.utils.atomic import AtomicWriteError

    a = write_run(tmp_path / "a", {5: 3.0})

    def full_disk(path, write):
        raise AtomicWriteError(Path(path), OSError(28, "No space left on device"))

    monkeypatch.setattr(compare_runs, "write_atomically", full_disk)
    assert compare_runs.main([str(a), "--out", str(tmp_path / "c.png"), "--table", str(tmp_path / "t.md")]) == 2
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert "t.md" in error and "No space left on device" in error


def test_a_run_given_twice_is_compared_once(tmp_path, capsys):
    """``compare_runs.py SWEEP SWEEP/1`` (or a run dir twice) compared job 1 with itself: two rows and two curves of
    the same values, labelled '//tmp/.../1' and '//tmp/.../1 (2)', as if a rerun had reproduced it."""
    sweep = tmp_path / "sweep"
    for i, lr in enumerate(["1e-3", "3e-3"]):
        write_run(sweep / str(i), {5: 3.0 - i * 0.1}, overrides=[f"optimizer.lr={lr}"])
    (sweep / "2" / ".hydra").mkdir(parents=True)  # a job that logged nothing, reached twice too
    (sweep / "2" / ".hydra" / "overrides.yaml").write_text("- optimizer.lr=1e-2\n")
    result = compare_runs.compare([str(sweep), str(sweep / "1"), str(sweep / "0" / "."), str(sweep / "2")],
                                  ["val/loss"], out=str(tmp_path / "c.png"))
    assert [r["dir"] for r in result["runs"]] == [str(sweep / "0"), str(sweep / "1")]
    assert [r["label"] for r in result["runs"]] == ["optimizer.lr=1e-3", "optimizer.lr=3e-3"]
    assert result["skipped"] == [str(sweep / "2")] and len(result["markdown"].splitlines()) == 5
    assert "given more than once" in capsys.readouterr().err


def test_a_metrics_csv_cut_mid_row_leaves_that_row_out(tmp_path, caplog):
    """A run killed while Lightning's CSVLogger wrote its metrics.csv ends in a row without its line end: '0,19,3.'
    cut from '0,19,3.4014' was read as val/loss 3.0, the run's final value, without a word. The cut row is left
    out with a warning naming the file."""
    from tests.unit.test_compare_runs_failed_runs import write_csv_run

    run = write_csv_run(tmp_path / "a", {9: 3.9099, 19: 3.4014})
    csv_file = run / "csv" / "metrics.csv"
    text = csv_file.read_bytes()
    assert text.endswith(b"3.4014\r\n")
    csv_file.write_bytes(text[: -len(b"4014\r\n")])  # ends in '3.'
    result = compare_runs.compare([str(run)], ["val/loss"], out=str(tmp_path / "c.png"))
    assert result["runs"][0]["final"] == pytest.approx(3.9099)
    assert any("metrics.csv: its last line" in r.getMessage() and "left out" in r.getMessage()
               for r in caplog.records)


def test_a_metrics_csv_cell_that_is_no_number_is_one_line_naming_it(tmp_path, capsys):
    """A damaged cell ('3.9x') in metrics.csv was a ValueError traceback; it is one error line naming the file and
    the line."""
    from tests.unit.test_compare_runs_failed_runs import write_csv_run

    run = write_csv_run(tmp_path / "a", {9: 3.9099, 19: 3.4014})
    csv_file = run / "csv" / "metrics.csv"
    csv_file.write_bytes(csv_file.read_bytes().replace(b"3.9099", b"3.9x"))
    assert compare_runs.main([str(run), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert f"{csv_file}, line " in err and "'3.9x'" in err and "Traceback" not in err


@pytest.mark.parametrize("kept", [b"", b"epoch,step,val/l"])
def test_a_metrics_csv_cut_before_its_first_row_holds_no_metrics(tmp_path, capsys, kept):
    """A metrics.csv empty or cut in its header (a run killed as its first rows were written) was 'has no 'step'
    column, so it is not a Lightning CSVLogger metrics file; its columns are None', an error that stopped the
    comparison of every run; that run now has no values (its row says so) and the other runs are compared."""
    from tests.unit.test_compare_runs_failed_runs import write_csv_run

    good = write_csv_run(tmp_path / "a", {9: 3.9099, 19: 3.4014})
    cut = write_csv_run(tmp_path / "b", {9: 3.5})
    (cut / "csv" / "metrics.csv").write_bytes(kept)
    assert compare_runs.main([str(good), str(cut), "--out", str(tmp_path / "c.png")]) == 0
    captured = capsys.readouterr()
    runs = json.loads(captured.out.strip().splitlines()[-1])["runs"]
    assert [(r["dir"], r["final"]) for r in runs] == [(str(good), pytest.approx(3.4014)), (str(cut), None)]
    assert "not a Lightning CSVLogger metrics file" not in captured.err
