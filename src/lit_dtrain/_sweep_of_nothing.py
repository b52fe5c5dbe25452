"""A multirun whose first job Hydra cannot compose (``-m scheduler=cosine scheduler.decay_fraction=0.1,0.2``, a key
the config lacks) fails after Hydra's sweeper has made the sweep dir and written its ``multirun.yaml``, before any
job ran: the dir, holding that file alone, was left in ``outputs/multiruns``, a sweep of nothing that
``scripts/compare_runs.py`` then listed. (A swept option that does not exist, ``resume=auto`` without
``hydra.sweep.dir`` and the other refusals of ``lit_dtrain.sweeps``' Hydra callbacks come before the dir is made.)

:func:`note_sweep_dir` (``sweeps.OutputDirCheck``, before the sweeper makes the dir) notes a sweep dir that does not
exist yet; :func:`remove_a_sweep_of_nothing` (``train.py``'s report of an error raised before the task function ran)
removes it where it holds its ``multirun.yaml`` alone (and the dirs Hydra's ``mkdir`` made on the way to a
name with ``..``). A dir that existed before this start is never touched."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

# this start's new sweep dir, the first of its dirs made with it, and the dirs a '..' in its name made on the way
_new_sweep_dir: tuple[Path, Path, list[Path]] | None = None


def note_sweep_dir(directory) -> None:
    """Note ``directory`` (``hydra.sweep.dir``, resolved) as this start's new sweep dir, unless it exists already,
    with the outermost of its parents that do not exist either (``outputs/multiruns`` of a first sweep)."""
    global _new_sweep_dir
    # realpath, not absolute(): 'new/../kept/sweep' would take kept (which exists) for a dir made with it, as
    # 'new' does not exist yet, and remove it where empty; symlinks and '..' resolved, the missing dirs are plain names
    path = Path(os.path.realpath(str(directory)))
    missing = [p for p in (path, *path.parents) if not p.exists()]
    # Hydra's mkdir(parents=True) of 'a/nope/../x' makes a/nope on the way to a/x: it was left after the failure
    # (each by its real path, whose existence is what counts: 'nope/../kept' does not exist for the OS while nope does
    # not, and kept, empty, existing before the start, was removed after 'nope/../kept/../x' failed)
    parts = Path(os.path.join(os.getcwd(), str(directory))).parts
    made = [os.path.realpath(os.path.join(*parts[:i])) for i in range(2, len(parts))
            if ".." in parts[i:] and parts[i - 1] not in ("..", ".")]
    on_the_way = {Path(p) for p in made if not os.path.exists(p)}
    on_the_way -= {path, *path.parents}
    _new_sweep_dir = (path, missing[-1], sorted(on_the_way, key=lambda p: -len(p.parts))) if missing else None


def remove_a_sweep_of_nothing() -> Path | None:
    """Remove this start's new sweep dir where it holds only ``multirun.yaml`` (no job started), and the parents made
    with it that are left empty; the sweep dir removed, or None. Called once the multirun has failed."""
    global _new_sweep_dir
    noted, _new_sweep_dir = _new_sweep_dir, None
    if noted is None:
        return None
    path, outermost, on_the_way = noted
    try:
        if [p.name for p in path.iterdir()] != ["multirun.yaml"]:
            return None
        (path / "multirun.yaml").unlink()
        for made in (path, *path.parents):  # rmdir refuses a dir that is not empty: one made for another start
            made.rmdir()
            if made == outermost:
                break
    except OSError:  # gone, or not empty after all: left as it is
        pass
    for made in on_the_way:  # deepest first; none existed when noted, and rmdir leaves one that is not empty
        with contextlib.suppress(OSError):
            made.rmdir()
    return path
