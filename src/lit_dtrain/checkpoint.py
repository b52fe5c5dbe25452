"""Atomic, safely loaded checkpoints.

Lightning's ``TorchCheckpointIO`` writes through fsspec without an fsync and loads with whatever
``weights_only`` default torch has. Ours writes ``.<file>.tmp-<pid>`` in the same directory, fsyncs it,
``os.replace``-s it over the target and fsyncs the directory (:mod:`lit_dtrain.utils.atomic`), so a crash
or a full disk never leaves a corrupt ``last.ckpt``; and it loads with ``torch.load(weights_only=True)``, so a
checkpoint cannot execute code. Errors name the file.
"""

from __future__ import annotations

import contextlib
import logging
import operator
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from lit_dtrain._checkpoint_files import (  # the reasons a load failed; damage_reason is public here too
    _starts_like_zip,
    damage_reason,
    foreign_reason,
    trailing_bytes_reason,
    truncation_reason,
)
from lit_dtrain.utils.atomic import os_error as _os_error  # sweeps.user_error imports it from here
from lit_dtrain.utils.atomic import what_is_left, write_atomically

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message names the file."""


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` atomically (:func:`lit_dtrain.utils.atomic.write_atomically`: temp file + fsync +
    rename + directory fsync); :class:`CheckpointError` naming the file when it fails."""
    path = Path(path)

    def write(tmp: Path) -> None:
        # streamed into the temp file: serializing into memory first would hold a second copy of every tensor.
        # Through a Python file, not torch.save(obj, tmp): torch's C++ writer reports a full disk as a bare
        # 'file write failed', where Python's write raises the OSError that says ENOSPC
        with open(tmp, "wb") as f:
            torch.save(obj, f)

    try:
        write_atomically(path, write)
    except Exception as e:  # disk full, I/O error, an object torch cannot pickle ...
        reason = _os_error(e)
        what = (reason.strerror or str(reason)) if reason is not None else f"{type(e).__name__}: {e}"
        raise CheckpointError(f"could not write checkpoint {str(path)!r}: {what}; {what_is_left(path)}") from e


def not_a_file_reason(path: Path) -> str:
    """Why ``path``, which is not a file, cannot be a checkpoint: for messages ``f"{key}={path!r} {reason}"``. A
    directory (a run dir or its checkpoints/, given for its last checkpoint) gets the file in it to give: ``ckpt_path``
    and ``init_from`` said only "give a checkpoint file in it", the scripts' load named the file."""
    if path.is_dir():
        inside = _checkpoint_in(path)
        return "is a directory, not a checkpoint file; " + (
            f"give a file in it, e.g. {str(inside)!r}" if inside else "it holds none (no *.ckpt in it or in its "
            "checkpoints/): give a checkpoint file")
    if path.is_symlink() and not path.exists():
        return f"is a broken symbolic link (to {str(os.readlink(path))!r})"
    if path.exists():  # a device (/dev/null), a FIFO, a socket
        return "is not a regular file (a device, FIFO or socket); give a checkpoint file"
    return "does not exist"


def _checkpoint_in(directory: Path) -> Path | None:
    """The ``last.ckpt`` of ``directory`` or of its ``checkpoints/``, else the newest ``*.ckpt`` there (by time)."""
    dirs = (directory, directory / "checkpoints")
    last = [d / "last.ckpt" for d in dirs if (d / "last.ckpt").is_file()]
    files = [p for d in dirs for p in d.glob("*.ckpt") if p.is_file()]
    return last[0] if last else max(files, key=lambda p: p.stat().st_mtime, default=None)


def checkpoint_files(directory: str | os.PathLike) -> list[str]:
    """The names of the ``*.ckpt`` files in ``directory`` (sorted; empty when it does not exist)."""
    directory = Path(directory)
    return sorted(p.name for p in directory.glob("*.ckpt")) if directory.is_dir() else []


def safe_torch_load(
    path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False, verify: bool = True
) -> Any:
    """``torch.load(weights_only=True)`` with errors that name the file; with ``verify`` (the default) after
    :func:`verify_checkpoint`, so a changed byte is refused naming its member instead of loading as a changed weight.
    ``verify=False`` is for reads of a few keys (``global_step``) of files that may never be loaded: a scan of a
    checkpoint dir, the messages at a run's end."""
    path = Path(path)
    if not path.is_file():  # a run dir or its checkpoints/ given for its last.ckpt: the reason names that file
        raise CheckpointError(f"checkpoint {str(path)!r} {not_a_file_reason(path)}")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {str(path)!r} is empty (0 bytes)")
    if verify:
        verify_checkpoint(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # truncated zip, bad pickle, unsupported global ...
        if mmap and not _starts_like_zip(path):  # torch maps only zip files ("please torch.save ... with
            # _use_new_zipfile_serialization=True"); read it plainly: the same reasons as without mmap
            return safe_torch_load(path, map_location=map_location, mmap=False, verify=False)
        try:  # before the weights-only branch: a file cut to a byte or two, or a changed byte in data.pkl, reads
            # as a foreign pickle ('Unsupported operand'); then a file that is no torch file at all, which failed as
            # whatever its bytes meant to the unpickler ('KeyError: 101' for text starting 'he')
            broken = (truncation_reason(path) or damage_reason(path) or trailing_bytes_reason(path)
                      or foreign_reason(path))
        except OSError:  # it cannot be opened (permissions, removed meanwhile): torch's own error says so, below
            broken = None
        if broken:
            raise CheckpointError(f"checkpoint {str(path)!r} {broken}") from e
        if "Weights only load failed" in str(e):
            raise CheckpointError(
                f"checkpoint {str(path)!r} is refused: {_weights_only_reason(str(e))}. It is not a checkpoint "
                "written by lit_dtrain, or it holds objects other than tensors and plain containers, and loading "
                "those (weights_only=False) could run code inside the file; a checkpoint train.py wrote never needs it"
            ) from e
        raise CheckpointError(f"checkpoint {str(path)!r} is corrupt or unreadable: {type(e).__name__}: {e}") from e


_intact: set[tuple[int, ...]] = set()  # identities of the files verify_checkpoint read whole, in this process


def verify_checkpoint(path: str | os.PathLike) -> None:
    """:class:`CheckpointError` naming ``path`` and the member (``is damaged: member 'archive/data/3' fails its
    CRC-32 check ...``, :func:`damage_reason`; ``is truncated`` for a zip cut short, :func:`truncation_reason`) when
    a member's bytes differ from the CRC-32 torch.save recorded. torch checks none on load, so a changed byte in a
    tensor, or in an integer of ``data.pkl`` (a ``global_step``, a storage's size), loaded without a word.

    Reads the file whole with ``zipfile``: about half a full ``torch.load`` (0.4-0.6x, model=nano and model=small
    checkpoints, docs/reliability.md row 4c). Once per file per process: a file read whole, intact, is remembered by
    its device, inode, size and modification time, so the ``mmap`` reads of a few keys before a resume and the
    resume's own load read it once. A file that is no zip archive has no CRC to check (torch.load names it)."""
    try:
        st = os.stat(path)
        identity = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if identity in _intact:
            return
        reason = truncation_reason(path) or damage_reason(path)
    except OSError:  # it cannot be opened (permissions, removed meanwhile): torch's own error says so
        return
    if reason:
        raise CheckpointError(f"checkpoint {str(path)!r} {reason}")
    _intact.add(identity)


def _weights_only_reason(message: str) -> str:
    """The specific reason in torch's weights_only error (its other lines advise weights_only=False, which we do
    not pass on): e.g. 'Trying to load unsupported GLOBAL posix.system ...' or 'Unsupported operand 123'."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    marker = "WeightsUnpickler error:"
    if any(line.startswith(marker) for line in lines):  # a global not allowed lists options (1) and (2) first
        lines = [line for line in lines if line.startswith(marker)]
    skip = ("Weights only load failed", "Please file an issue", "Check the documentation")
    reasons = [
        line.removeprefix(marker).strip().split(". Please use ")[0] for line in lines if not line.startswith(skip)
    ]
    reasons = [r for r in reasons if r]
    return "; ".join(r.rstrip(".") for r in reasons)[:300] or "torch.load(weights_only=True) failed"


def checkpoint_global_step(path: str | os.PathLike, verify: bool = True) -> int:
    """``global_step`` of a Lightning training checkpoint; :class:`CheckpointError` naming the file if it is
    readable but not one (a plain model state dict, a tensor, a list ...), or damaged (``verify``:
    :func:`verify_checkpoint`; a changed byte in ``data.pkl`` can change the step)."""
    ckpt = safe_torch_load(path, mmap=True, verify=verify)
    lacks = [k for k in ("global_step", "state_dict") if not isinstance(ckpt, dict) or k not in ckpt]
    if not lacks and not isinstance(ckpt["state_dict"], dict):
        lacks = ["a dict at 'state_dict'"]
    if lacks:  # a dict holding a 'state_dict' alone was said to be 'without 'global_step' and 'state_dict''
        what = f"a dict with keys {sorted(map(str, ckpt))[:5]}" if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(
            f"checkpoint {str(path)!r} is not a Lightning training checkpoint: it holds {what}, without "
            f"{' and '.join(k if k.startswith('a ') else repr(k) for k in lacks)}; resume from a .ckpt written by "
            "train.py"
        )
    step = ckpt["global_step"]
    try:  # an int, or an integer tensor or numpy scalar of another tool's
        count = None if isinstance(step, bool) else operator.index(step)
    except TypeError:
        count = None
    if count is None or count < 0:  # int('abc') was a ValueError traceback; int(2.5) resumed at step 2
        raise CheckpointError(f"checkpoint {str(path)!r} has global_step={step!r} ({type(step).__name__}), not a "
                              "step count (an integer >= 0): the file was edited or written by other code")
    return count


def state_dict_mismatch(weights: dict, expected: dict) -> str | None:
    """Why ``weights`` (a checkpoint's) cannot load strictly into a module whose ``state_dict()`` is ``expected``, in
    one line naming the first mismatched key in the module's order and both shapes, e.g. ``'tok_embeddings.weight'
    is [257, 128] in the checkpoint, [257, 64] in the model (41 of 42 tensors differ in shape)``; None when every
    key is in both with the same shape. ``nn.Module.load_state_dict`` lists every tensor over as many lines (40 for
    a 5-block model of another width), which a message cut to its first few hundred characters left mid-line."""

    def shape(tensor) -> list[int]:
        return list(getattr(tensor, "shape", ()))

    differ = [k for k in expected if k in weights and shape(weights[k]) != shape(expected[k])]
    missing = [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected]
    problems = []
    if differ:
        k = differ[0]
        problems.append(f"{k!r} is {shape(weights[k])} in the checkpoint, {shape(expected[k])} in the model "
                        f"({len(differ)} of {len(expected)} tensors differ in shape)")
    if missing:
        problems.append(f"{len(missing)} of the model's tensors are not in the checkpoint, the first {missing[0]!r}")
    if unexpected:
        problems.append(f"{len(unexpected)} of the checkpoint's tensors are not in the model, the first "
                        f"{unexpected[0]!r}")
    return "; ".join(problems) or None


def weights_loaded_otherwise(weights: dict, module: torch.nn.Module) -> str | None:
    """Why ``weights`` (a checkpoint's, keyed as ``module.state_dict()``) would load into ``module`` as other numbers
    than the file holds, where every shape fits (:func:`state_dict_mismatch`), in one line naming the key: an integer
    or bool entry for a floating-point weight (``load_state_dict`` casts it: a hand-edited int64 ``wq.weight`` loaded
    truncated, silently), or the entries of one tied tensor (``tie_embeddings``: ``tok_embeddings.weight`` and
    ``lm_head.weight``) that differ (both are copied into it and the last wins: a checkpoint of an untied model
    whose ``model_config`` was edited to tie loaded its LM head as the embedding). None when they load as saved."""
    tied: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
        saved = weights.get(name)
        if torch.is_tensor(saved) and param.is_floating_point() and not saved.is_floating_point():
            return (f"{name!r} is {str(saved.dtype).removeprefix('torch.')} in the checkpoint, a floating-point weight "
                    "in the model (loading would cast it): the file was edited or written by other code")
    for names in tied.values():
        saved = [(n, weights[n]) for n in names if torch.is_tensor(weights.get(n))]
        for (first, a), (other, b) in zip(saved, saved[1:]):
            if a.shape == b.shape and not torch.equal(a, b):
                return (f"{first!r} and {other!r} are one tied tensor in the model (tie_embeddings) but differ in the "
                        "checkpoint (loading would keep the last): the file was edited, or an untied model wrote it "
                        "(then its model_config was edited to tie_embeddings: true)")
    return None


def misfit_advice(ckpt: Any, model: Any) -> str:
    """What to change where a checkpoint's weights do not fit ``model`` (:func:`state_dict_mismatch`): the ``model.*``
    shape of the run that wrote it, or, where its ``model_config`` already equals ``model.config`` in every key that
    shapes the weights, the code: then another version of the model code (or another model class) wrote it, and no
    ``model.*`` override can make it fit."""
    from lit_dtrain.module import WEIGHT_CONFIG_KEYS  # (lit_dtrain.module imports this module)

    saved = ckpt.get("model_config") if isinstance(ckpt, dict) else None
    config = getattr(getattr(model, "_orig_mod", model), "config", None)
    if isinstance(saved, dict) and config is not None and all(
        k in saved and saved[k] == getattr(config, k, None) for k in WEIGHT_CONFIG_KEYS
    ):
        return "its model_config is this shape, so another version of the model code wrote it: load it with that code"
    return "set model.* to the shape of the run that wrote it"


def misfit_message(path: str | os.PathLike, module: Any, error: Exception) -> str:
    """The one-line message for Lightning's ``Error(s) in loading state_dict`` (``error``: torch's list of every tensor,
    a line each) on resuming checkpoint ``path`` into ``module`` (a ``LitLLM``): :func:`misfit_advice` and
    :func:`state_dict_mismatch`, or torch's last line where the file cannot be read again."""
    try:
        ckpt = safe_torch_load(path, mmap=True)
        advice = misfit_advice(ckpt, module.model)
        mismatch = state_dict_mismatch(ckpt["state_dict"], module.state_dict())
    except Exception:  # only a better message for an error being raised already
        advice, mismatch = misfit_advice(None, module.model), None
    return (f"checkpoint {str(path)!r} does not fit the configured model ({advice}): "
            f"{mismatch or str(error).splitlines()[-1].strip()}")


def nonfinite_tensors(state_dict: dict, keys) -> list[str]:
    """The keys among ``keys`` whose tensor in ``state_dict`` holds a NaN or inf (one host sync per device)."""
    tensors = {k: t for k in keys if torch.is_tensor(t := state_dict.get(k)) and t.is_floating_point()}
    by_device: dict = {}
    for k, t in tensors.items():
        by_device.setdefault(t.device, []).append(k)
    bad = set()
    for names in by_device.values():
        finite = torch.stack([tensors[k].isfinite().all() for k in names]).tolist()
        bad.update(k for k, ok in zip(names, finite) if not ok)
    return [k for k in tensors if k in bad]


def first_nonfinite_weight(path: str | os.PathLike, verify: bool = True) -> str | None:
    """The first tensor of checkpoint ``path``'s ``state_dict`` that holds a NaN or inf, or None. train()'s models
    keep no buffer in it (the rope tables are not persistent), so it holds the parameters only. Memory-mapped, read
    tensor by tensor up to the first bad one: the weights once, never the optimizer state (model=nano: ~60 ms more
    than reading global_step alone, on 2 busy CPU cores); with ``verify``, after :func:`verify_checkpoint`."""
    ckpt = safe_torch_load(path, mmap=True, verify=verify)
    state = ckpt.get("state_dict") if isinstance(ckpt, dict) else None  # not a checkpoint: the load names it
    for key, t in state.items() if isinstance(state, dict) else ():
        if torch.is_tensor(t) and t.is_floating_point() and not bool(t.isfinite().all()):
            return str(key)
    return None


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning ``CheckpointIO`` plugin using :func:`atomic_torch_save` and :func:`safe_torch_load`.

    ``parameter_names``: the module's parameters (its ``named_parameters()``, the keys of its ``state_dict``). A
    checkpoint in which one of them is not finite (NaN/inf: a non-finite update was applied, with
    ``module.check_finite=false``) is not written, with a warning: written, it replaced the last finite
    ``last.ckpt`` (ModelCheckpoint writes it at every validation), and ``resume=auto`` continued the NaN weights.
    Buffers are not checked (a mask may hold -inf). A skip is warned once per file and step: ``train()``'s final save
    of ``last.ckpt`` follows the last validation's at the same step, and said the same line twice."""

    def __init__(self, parameter_names=()) -> None:
        super().__init__()
        self.parameter_names = list(parameter_names)
        self._skips_warned: set[tuple[str, object]] = set()

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None:
            raise TypeError(f"AtomicCheckpointIO does not take storage_options, got {storage_options}")
        state = checkpoint.get("state_dict")
        bad = nonfinite_tensors(state, self.parameter_names) if isinstance(state, dict) else []
        if bad:
            if (str(path), checkpoint.get("global_step")) in self._skips_warned:
                return
            self._skips_warned.add((str(path), checkpoint.get("global_step")))
            kept = what_is_left(path)
            if os.path.lexists(path):
                with contextlib.suppress(CheckpointError):
                    kept += f" (step {checkpoint_global_step(path, verify=False)})"
            log.warning(
                "checkpoint %r not written: the weights at step %s are not finite (NaN/inf in %d parameter(s), the "
                "first %r), a resume would continue NaN weights; %s", str(path), checkpoint.get("global_step"),
                len(bad), bad[0], kept)
            return
        atomic_torch_save(checkpoint, path)

    def load_checkpoint(self, path, map_location=None, weights_only=None) -> dict:
        return safe_torch_load(path, map_location=map_location or "cpu")
