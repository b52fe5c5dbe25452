"""Exact results of the sweep's read-once jobs (``basic_sweep_jobs``, keyed by ``multirun.yaml``'s text and the grid)
where single-point mutants passed test_sweep_grid_checks.py (tenth hand mutation audit): a ``multirun.yaml`` that
cannot be read leaves the count unknown (as before the cache, where its load's error was taken for that), never an
``OSError`` at a job's end; and its count read anew once it can be read."""

from __future__ import annotations

from pathlib import Path

from hydra.core.hydra_config import HydraConfig

from lit_dtrain.sigterm_exit import _the_sweeps_last_job
from lit_dtrain.sweep_grid import sweep_job_count
from tests.unit._sweep_helpers import multirun_job


def test_a_multirun_file_that_cannot_be_read_leaves_the_count_unknown(tmp_path, corpus, monkeypatch):
    multirun = tmp_path / "sweep" / "multirun.yaml"
    with multirun_job(tmp_path / "sweep" / "1", ["optimizer.lr=1e-3,2e-3"], ["optimizer.lr=2e-3"], corpus):
        hydra = HydraConfig.get()
        real = Path.read_bytes

        def unreadable(path):
            if path == multirun:
                raise PermissionError(13, "Permission denied", str(path))
            return real(path)

        with monkeypatch.context() as patched:
            patched.setattr(Path, "read_bytes", unreadable)
            assert sweep_job_count(hydra) is None and not _the_sweeps_last_job()
        assert sweep_job_count(hydra) == 2 and _the_sweeps_last_job()  # job 1 of 2, once the file is read


def test_the_count_is_of_the_multirun_text_it_is_kept_under(tmp_path, corpus, monkeypatch):
    """The cache's key is ``multirun.yaml``'s bytes read once; the jobs were parsed from the file loaded twice more,
    so another start's sweep written between the reads (a continued sweep's new ``-m`` list) was counted and kept
    under the first text: with that text back in the file, 3 jobs were counted where it lists 2."""
    multirun = tmp_path / "sweep" / "multirun.yaml"
    with multirun_job(tmp_path / "sweep" / "1", ["optimizer.lr=1e-3,2e-3"], ["optimizer.lr=2e-3"], corpus):
        hydra = HydraConfig.get()
        two_jobs = multirun.read_bytes()
        three_jobs = two_jobs.replace(b"1e-3,2e-3", b"1e-3,2e-3,3e-3")
        real = Path.read_bytes

        def written_after_the_read(path):
            text = real(path)
            if path == multirun:  # another start writes its sweep right after this read
                multirun.write_bytes(three_jobs)
            return text

        with monkeypatch.context() as patched:
            patched.setattr(Path, "read_bytes", written_after_the_read)
            assert sweep_job_count(hydra) == 2  # the count of the text read
        assert sweep_job_count(hydra) == 3  # the file's text now
        multirun.write_bytes(two_jobs)
        assert sweep_job_count(hydra) == 2
