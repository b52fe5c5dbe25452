"""Safe checkpoint loads (reliability row 4): a file that is no checkpoint, no regular file, a pickle that would run
code, a checkpoint holding a class, a truncated, damaged or unreadable one: each refused, naming what it is, never
run and never advising ``weights_only=False``. (The atomic writes are in test_checkpoint_io.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lit_dtrain.checkpoint import CheckpointError, safe_torch_load


def test_a_file_that_is_no_checkpoint_says_what_it_is(tmp_path):
    """A text file given as a checkpoint was 'corrupt or unreadable: KeyError: 101' (torch read it as its legacy
    pickle format, and 'e' is opcode 101), a CSV 'IndexError: pop from empty list', a JSON file or random bytes
    'is refused: Unsupported operand ...', the message for a file holding code: the file was named, not the cause."""
    import pickle
    import zipfile

    files = {
        "notes.ckpt": (b"hello world\n", r"is not a torch checkpoint: it is text starting 'hello world\\n'"),
        "metrics.ckpt": (b"epoch,step\n1,2\n", "is not a torch checkpoint: it is text starting 'epoch,step"),
        "summary.ckpt": (b'{"val_loss": 1.0}', "is not a torch checkpoint: it is text starting '{\"val_loss"),
        "noise.ckpt": (bytes(range(200, 256)) * 3, "is not a torch checkpoint: it is binary data starting c8 c9 ca"),
        "state.pkl": (pickle.dumps({"w": [1.0]}), r"is not a torch checkpoint: it is a Python pickle \(protocol"),
    }
    plain_zip = tmp_path / "plain.zip"
    with zipfile.ZipFile(plain_zip, "w") as archive:
        archive.writestr("a.txt", "hello")
    for name, (data, _) in files.items():
        (tmp_path / name).write_bytes(data)
    files["plain.zip"] = (None, r"is not a torch checkpoint: it is a zip archive without the '<name>/data.pkl'")
    for name, (_, match) in files.items():
        for mmap in (False, True):
            with pytest.raises(CheckpointError, match=rf"^checkpoint '{tmp_path / name}' {match}") as info:
                safe_torch_load(tmp_path / name, mmap=mmap)
            message = str(info.value)
            assert "KeyError" not in message and "Unsupported operand" not in message and "refused" not in message
    # torch's formats still load: its legacy (pre-1.6) pickle, and a zip written by torch.save
    torch.save({"w": torch.arange(3)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    torch.save({"w": torch.arange(3)}, tmp_path / "zip.pt")
    for name in ("legacy.pt", "zip.pt"):
        assert torch.equal(safe_torch_load(tmp_path / name)["w"], torch.arange(3))


class WritesMarker:
    """Unpickling this would call ``pathlib.Path.touch`` on the marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_pickle_that_would_run_code_is_refused_not_run_in_any_format(tmp_path):
    """The object is never built, whatever the format: a torch zip, torch's legacy format, a bare pickle."""
    import pickle

    marker = tmp_path / "marker"
    payload = {"state_dict": {"w": torch.zeros(2)}, "global_step": 1, "x": WritesMarker(marker)}
    pickle.loads(pickle.dumps(WritesMarker(marker)))  # the payload works when it is unpickled ...
    assert marker.exists()
    marker.unlink()
    torch.save(payload, tmp_path / "zip.ckpt")
    torch.save(payload, tmp_path / "legacy.ckpt", _use_new_zipfile_serialization=False)
    (tmp_path / "bare.ckpt").write_bytes(pickle.dumps(payload))
    for name, match in {"zip": "is refused: .*could run code", "legacy": "is refused: .*could run code",
                        "bare": "is not a torch checkpoint: it is a Python pickle"}.items():
        for mmap in (False, True):
            with pytest.raises(CheckpointError, match=rf"{name}\.ckpt' {match}"):
                safe_torch_load(tmp_path / f"{name}.ckpt", mmap=mmap)
    assert not marker.exists()  # ... and was never unpickled here


def test_a_path_that_is_no_regular_file_says_what_it_is(tmp_path, tiny_cfg):
    """/dev/null (or a FIFO) given as a checkpoint was reported as 'does not exist', and so was a broken symlink."""
    from lit_dtrain.errors import ConfigError
    from lit_dtrain.train import resolve_ckpt_path

    fifo = tmp_path / "pipe.ckpt"
    os.mkfifo(fifo)
    dangling = tmp_path / "link.ckpt"
    dangling.symlink_to(tmp_path / "gone.ckpt")
    expected = {
        "/dev/null": r"is not a regular file \(a device, FIFO or socket\)",
        str(fifo): r"is not a regular file \(a device, FIFO or socket\)",
        str(dangling): rf"is a broken symbolic link \(to '{tmp_path}/gone.ckpt'\)",
        str(tmp_path / "missing.ckpt"): "does not exist",
    }
    for path, reason in expected.items():
        with pytest.raises(CheckpointError, match=rf"^checkpoint '{path}' {reason}"):
            safe_torch_load(path)
        with pytest.raises(ConfigError, match=rf"^ckpt_path='{path}' {reason}"):
            resolve_ckpt_path(tiny_cfg(f"ckpt_path={path}"))


class NotAllowed:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_load_refuses_code_and_names_bad_files(tmp_path):
    evil = tmp_path / "evil.ckpt"
    torch.save({"x": NotAllowed()}, evil)
    with pytest.raises(CheckpointError, match="evil.ckpt"):
        safe_torch_load(evil)
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty.ckpt.*empty"):
        safe_torch_load(empty)
    with pytest.raises(CheckpointError, match="missing.ckpt.*does not exist"):
        safe_torch_load(tmp_path / "missing.ckpt")


def test_a_refused_load_does_not_advise_weights_only_false(tmp_path):
    """torch's weights_only error advises re-running with weights_only=False ("will likely succeed"), which runs
    the file's code; our message passed that advice on for pickled code and for files that are no checkpoint at all
    (a summary.json). It now gives torch's reason and says why the file is refused."""
    evil = tmp_path / "evil.ckpt"
    torch.save({"x": NotAllowed()}, evil)
    with pytest.raises(CheckpointError) as info:
        safe_torch_load(evil)
    message = str(info.value)
    assert "evil.ckpt" in message and "posix.system" in message and "could run code" in message
    assert "weights_only` set to `False` will likely succeed" not in message
    text = tmp_path / "summary.json"
    text.write_text('{"val_loss": 1.0}')
    for mmap in (False, True):  # with mmap (ckpt_path's load), torch asked to re-save it in zip format instead
        with pytest.raises(CheckpointError, match=r"summary\.json' is not a torch checkpoint: it is text") as info:
            safe_torch_load(text, mmap=mmap)
        assert "will likely succeed" not in str(info.value) and "zipfile" not in str(info.value)
    old = tmp_path / "legacy.ckpt"  # torch's pre-1.6 format: only mmap refused it
    torch.save({"w": torch.arange(3)}, old, _use_new_zipfile_serialization=False)
    assert torch.equal(safe_torch_load(old, mmap=True)["w"], torch.arange(3))


def test_a_checkpoint_holding_a_class_names_the_class_and_does_not_advise_weights_only_false(tmp_path):
    """A plain Lightning checkpoint whose module saved hyperparameters holds their classes (a ``pathlib.Path`` here).
    torch's error for such a global lists two options, and the message passed on option (1), "Re-running torch.load
    with weights_only set to False will likely succeed", cut at 300 characters before the class was named."""
    from pathlib import Path

    ckpt = tmp_path / "plain_lightning.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "global_step": 3, "hyper_parameters": {"root": Path("/x")}}, ckpt)
    with pytest.raises(CheckpointError) as info:
        safe_torch_load(ckpt)
    message = str(info.value)
    assert "plain_lightning.ckpt" in message and "pathlib.PosixPath" in message and "could run code" in message
    assert "will likely succeed" not in message and "(1)" not in message


def test_a_truncated_checkpoint_is_called_truncated_and_left_untouched(tiny_cfg, tmp_path):
    """A checkpoint cut short (an interrupted copy or download) was 'corrupt or unreadable: OSError: [Errno 22]
    Invalid argument' (torch seeking before the start of the file to find the zip end record), and cut to one byte
    'refused: Unsupported operand 80', as if it held code: the file was named, the cause was not."""
    from lit_dtrain.train import train

    _, objs = train(tiny_cfg("sample.max_new_tokens=0", "trainer.max_steps=2", "trainer.val_check_interval=2"))
    data = (Path(objs["trainer"].default_root_dir) / "checkpoints" / "last.ckpt").read_bytes()
    n = len(data)
    for cut in (1, 3, 100, n // 2, n - 98, n - 22, n - 5, n - 1):
        path = tmp_path / f"cut_{cut}.ckpt"
        path.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=rf"cut_{cut}.ckpt' is truncated: its {cut} bytes .*zip end record"):
            safe_torch_load(path, mmap=cut % 2 == 0)
        assert path.read_bytes() == data[:cut]  # left as it is
    empty = tmp_path / "cut_0.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"cut_0.ckpt' is empty \(0 bytes\)"):
        safe_torch_load(empty)
    whole = tmp_path / "whole.ckpt"
    whole.write_bytes(data)
    assert safe_torch_load(whole)["global_step"] == 2
    # damage that is not a truncation is not called one: the end record is there
    flipped = tmp_path / "flipped.ckpt"
    flipped.write_bytes(data[:40] + bytes(64) + data[104:])
    with pytest.raises(CheckpointError, match="flipped.ckpt") as info:
        safe_torch_load(flipped)
    assert "is truncated" not in str(info.value)


def _member_data_offset(data: bytes, info) -> int:
    """Where a zip member's bytes start: after its 30-byte local header, its name and its extra field."""
    header = data[info.header_offset : info.header_offset + 30]
    return info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")


def _tensors(obj, prefix: str = "") -> dict:
    """Every tensor in a nest of dicts and lists, by its path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return {path: t for key, value in items for path, t in _tensors(value, f"{prefix}/{key}").items()}


def test_a_checkpoint_damaged_inside_is_called_damaged_naming_the_member(tiny_cfg, tmp_path):
    """A changed byte inside a whole checkpoint (its zip end record intact: bit rot, a bad disk or copy) failed as
    whatever the bytes now meant: in data.pkl mostly 'is refused: Unsupported operand 105 ... could run code' (the
    message for a file holding code), else 'corrupt or unreadable: UnicodeDecodeError' or a miniz error. The zip
    members' CRC-32s now tell damage from a foreign pickle, and name the member."""
    import zipfile

    from lit_dtrain.checkpoint import damage_reason
    from lit_dtrain.train import train

    _, objs = train(tiny_cfg("sample.max_new_tokens=0", "trainer.max_steps=2", "trainer.val_check_interval=2"))
    data = (Path(objs["trainer"].default_root_dir) / "checkpoints" / "last.ckpt").read_bytes()
    whole = tmp_path / "whole.ckpt"
    whole.write_bytes(data)
    with zipfile.ZipFile(whole) as archive:
        members = {info.filename: info for info in archive.infolist()}
    pkl = members["archive/data.pkl"]
    start = _member_data_offset(data, pkl)
    central = data.find(b"PK\x01\x02")  # the zip directory's first entry

    def damaged(name: str, offset: int) -> Path:
        path = tmp_path / f"{name}.ckpt"
        path.write_bytes(data[:offset] + bytes([data[offset] ^ 0xFF]) + data[offset + 1 :])
        return path

    # ~120 bytes across the pickle: each fails, the CRC-32 checked before the load (a flip in an integer, a storage's
    # size or a memo index, still unpickled: 22 % loaded without a word before that)
    positions = range(0, pkl.file_size, max(1, pkl.file_size // 120))
    for i in positions:
        path = damaged(f"pkl_{i}", start + i)
        with pytest.raises(CheckpointError) as info:
            safe_torch_load(path, mmap=i % 2 == 0)
        assert str(info.value).startswith(
            f"checkpoint {str(path)!r} is damaged: member 'archive/data.pkl' fails its CRC-32 check"
        ), str(info.value)
        assert "refused" not in str(info.value) and "could run code" not in str(info.value)
        assert path.read_bytes() != data and len(path.read_bytes()) == len(data)  # left as it is
    local_header = members["archive/data/3"].header_offset
    for where, offset in {"directory": central + 1, "local_header": local_header + 1}.items():
        with pytest.raises(CheckpointError, match=rf"{where}.ckpt' is damaged: .*(zip directory|'archive/data/3')"):
            safe_torch_load(damaged(where, offset))
    # torch never checks a CRC: a changed byte in a tensor loads without a word, unless checked before
    tensor = damaged("tensor", _member_data_offset(data, members["archive/data/3"]) + 5)
    loaded, original = _tensors(safe_torch_load(tensor, verify=False)), _tensors(safe_torch_load(whole))
    assert loaded.keys() == original.keys()
    assert [k for k in original if not torch.equal(original[k], loaded[k])] != []  # one tensor changed, silently
    assert damage_reason(tensor).startswith("is damaged: member 'archive/data/3' fails its CRC-32 check")
    assert damage_reason(whole) is None
    with pytest.raises(CheckpointError, match=r"tensor.ckpt' is damaged: member 'archive/data/3' fails its CRC-32"):
        safe_torch_load(tensor)
    # a whole file that pickles code is still refused, not called damaged
    evil = tmp_path / "evil.ckpt"
    torch.save({"x": NotAllowed()}, evil)
    assert damage_reason(evil) is None
    with pytest.raises(CheckpointError, match=r"evil\.ckpt' is refused: .*posix\.system.*could run code"):
        safe_torch_load(evil)


def test_a_checkpoint_that_cannot_be_opened_is_reported_as_unreadable_naming_the_file(tmp_path, monkeypatch):
    """A load that fails because the file cannot be opened (no read permission as a non-root user, a file removed
    meanwhile) must stay a CheckpointError naming it: the truncation/damage diagnosis opens the file again, and
    its own OSError used to escape as a bare 'PermissionError: [Errno 13]' (resume=auto's scan of a checkpoint dir,
    which skips unreadable files by their CheckpointError, then crashed)."""
    import lit_dtrain.checkpoint as checkpoint

    path = tmp_path / "locked.ckpt"
    torch.save({"x": torch.zeros(2)}, path)

    def denied(file, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(file))

    monkeypatch.setattr(checkpoint.torch, "load", denied)
    monkeypatch.setattr(checkpoint, "open", denied, raising=False)  # the diagnosis's own open() of the file
    with pytest.raises(CheckpointError, match=r"locked.ckpt' is corrupt or unreadable: PermissionError"):
        safe_torch_load(path)
