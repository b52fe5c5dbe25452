"""Every load of a checkpoint checks the CRC-32 torch.save records for each zip member (reliability row 4c). torch
checks none, so a changed byte in a tensor's storage, or in an integer of data.pkl, loaded without a word: a resume,
an init_from, generate.py and spectrum.py went on with a changed weight or step."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lit_dtrain.checkpoint import AtomicCheckpointIO, CheckpointError, checkpoint_global_step, safe_torch_load
from lit_dtrain.errors import ConfigError
from lit_dtrain.models import build_llama
from lit_dtrain.schedules.workflows import apply_decay_branch, load_model_weights, model_from_checkpoint
from lit_dtrain.train import resolve_ckpt_path, train


def _flipped(data: bytes, offset: int, path: Path) -> Path:
    path.write_bytes(data[:offset] + bytes([data[offset] ^ 0x10]) + data[offset + 1 :])
    return path


def _data_offset(data: bytes, info: zipfile.ZipInfo) -> int:
    header = data[info.header_offset : info.header_offset + 30]
    return info.header_offset + 30 + int.from_bytes(header[26:28], "little") + int.from_bytes(header[28:30], "little")


def test_a_changed_byte_in_a_tensor_or_in_the_step_is_refused_at_every_load(tiny_cfg, tmp_path, caplog):
    _, objs = train(tiny_cfg("sample.max_new_tokens=0", "trainer.max_steps=2", "trainer.val_check_interval=2"))
    ckpt_dir = Path(objs["trainer"].default_root_dir) / "checkpoints"
    data = (ckpt_dir / "last.ckpt").read_bytes()
    whole = safe_torch_load(ckpt_dir / "last.ckpt")
    with zipfile.ZipFile(ckpt_dir / "last.ckpt") as archive:
        members = {info.filename: info for info in archive.infolist()}
    weight = whole["state_dict"]["model.blocks.0.attn.wq.weight"]
    member = next(name for name, info in members.items() if info.file_size == weight.numel() * 4 and
                  torch.equal(torch.frombuffer(bytearray(data[_data_offset(data, info):][:info.file_size]),
                                               dtype=torch.float32).view_as(weight), weight))
    tensor = _flipped(data, _data_offset(data, members[member]) + 2, tmp_path / "tensor.ckpt")
    damaged = rf"^checkpoint '{tensor}' is damaged: member '{member}' fails its CRC-32 check"
    # torch.load itself: one weight 2^-? off, without a word
    assert not torch.equal(torch.load(tensor, weights_only=True)["state_dict"]["model.blocks.0.attn.wq.weight"], weight)
    for load in (lambda: safe_torch_load(tensor), lambda: safe_torch_load(tensor, mmap=True),
                 lambda: AtomicCheckpointIO().load_checkpoint(tensor),  # resume, ckpt_path, decay_branch.ckpt
                 lambda: model_from_checkpoint(tensor)):  # generate.py, spectrum.py
        with pytest.raises(CheckpointError, match=damaged):
            load()
    model = build_llama(**whole["model_config"])
    with pytest.raises(ConfigError, match="^init_from: " + damaged[1:]):
        load_model_weights(model, tensor)
    # named by the key typed, as init_from: it was the path alone
    with pytest.raises(ConfigError, match="^decay_branch.ckpt: " + damaged[1:]):
        apply_decay_branch(tiny_cfg(f"decay_branch.ckpt={tensor}", "decay_branch.steps=2", run="branch"))
    # global_step, an integer of data.pkl (BININT1 2): it unpickled as 3
    pkl = data.index(b"global_step", _data_offset(data, members["archive/data.pkl"]))
    step = data.index(b"K\x02", pkl)
    stepped = tmp_path / "step.ckpt"
    stepped.write_bytes(data[: step + 1] + b"\x03" + data[step + 2 :])
    assert torch.load(stepped, weights_only=True)["global_step"] == 3
    with pytest.raises(CheckpointError, match=rf"'{stepped}' is damaged: member 'archive/data.pkl' fails its CRC"):
        checkpoint_global_step(stepped)
    # resume=auto passes a damaged last.ckpt over for the newest intact checkpoint, saying why
    _flipped(data, _data_offset(data, members[member]) + 2, ckpt_dir / "last.ckpt")
    cfg = OmegaConf.create({"ckpt_path": None, "resume": "auto", "run_name": "r",
                            "paths": {"checkpoint_dir": str(ckpt_dir), "output_dir": str(ckpt_dir.parent)}})
    with caplog.at_level("WARNING", logger="lit_dtrain.train"):
        chosen = resolve_ckpt_path(cfg)
    assert Path(chosen).name.startswith("step000002"), chosen
    assert any(f"last.ckpt is unreadable, skipped: checkpoint '{ckpt_dir / 'last.ckpt'}' is damaged: member "
               f"'{member}' fails its CRC-32 check" in r.getMessage() for r in caplog.records), caplog.text


def test_bench_checkpoint_crc_times_the_check_and_refuses_a_damaged_file(tmp_path, capsys):
    from tests.conftest import load_script

    path = tmp_path / "a.ckpt"
    torch.save({"global_step": 3, "w": torch.ones(1000), "v": torch.zeros(10)}, path)
    bench = load_script("bench_checkpoint_crc")
    bench.main([str(path), "--rounds", "1"])
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])["rows"]
    with zipfile.ZipFile(path) as archive:
        members = {info.filename: info for info in archive.infolist()}
    assert [(r["cache"], r["members"]) for r in rows] == [("cold", len(members)), ("warm", len(members))]
    assert all(r["verify_per_load"] == round(r["verify_s"] / r["load_s"], 2) for r in rows)
    data = path.read_bytes()
    _flipped(data, _data_offset(data, members["a/data/1"]) + 9, path)  # in v's zeros
    with pytest.raises(SystemExit):
        bench.main([str(path), "--rounds", "1"])
    assert "a.ckpt' is damaged: member 'a/data/1' fails its CRC-32 check" in capsys.readouterr().out


def _refused_naming_the_bytes_after(path: Path, whole: bytes, n: int) -> None:
    path.write_bytes(whole + bytes(n))
    with pytest.raises(CheckpointError, match=rf"'{path}' has {n} bytes after the zip end record .* intact\. "
                                              rf"Remove them \(truncate -s {len(whole)} <file>\)"):
        safe_torch_load(path)


def test_bytes_after_a_whole_archive_are_not_taken_for_a_cut(tmp_path):
    """A checkpoint with zeros after its zip end record (a copy that padded it) is whole: torch loads it with 16 such
    bytes, and the CRC check passes, but the check's first step called it 'truncated' and refused it (a real
    resume=auto of a run whose two checkpoints had 16 bytes appended: 'no checkpoint ... can be resumed (... is
    truncated ...)'; it had resumed before the check). With 4096 torch fails ('Invalid argument'): named as such."""
    path = tmp_path / "a.ckpt"
    torch.save({"global_step": 3, "w": torch.arange(10.0)}, path)
    whole = path.read_bytes()
    padded = tmp_path / "padded.ckpt"
    padded.write_bytes(whole + bytes(16))
    assert safe_torch_load(padded)["global_step"] == 3 and torch.equal(safe_torch_load(padded)["w"], torch.arange(10.0))
    _refused_naming_the_bytes_after(padded, whole, 4096)
    (tmp_path / "cut.ckpt").write_bytes(whole[:-30])
    with pytest.raises(CheckpointError, match="is truncated"):
        safe_torch_load(tmp_path / "cut.ckpt")


def test_bytes_after_a_whole_archive_are_found_past_64_kib(tmp_path):
    """The end record was looked for in the last 64 KiB only: a nano last.ckpt with 65536 zeros appended, which torch
    loads, was refused as 'is truncated', and one with 70000, which torch cannot load, was called 'truncated' too
    instead of naming the bytes and the truncate -s that removes them."""
    path = tmp_path / "a.ckpt"
    torch.save({"global_step": 3, "w": torch.arange(30000.0)}, path)  # 120 kB: torch reads past 65536 zeros
    whole = path.read_bytes()
    path.write_bytes(whole + bytes(65537))
    assert safe_torch_load(path)["global_step"] == 3 and torch.equal(safe_torch_load(path)["w"], torch.arange(30000.0))
    _refused_naming_the_bytes_after(path, whole, 200_000)
    data = bytearray(whole)
    data[-5000] ^= 0x10  # in w's bytes, with the zeros after the archive: its CRC-32 is still checked
    path.write_bytes(bytes(data) + bytes(200_000))
    with pytest.raises(CheckpointError, match="is damaged: member 'a/data/0' fails its CRC-32 check"):
        safe_torch_load(path)
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointError, match="is truncated"):
        safe_torch_load(path)


def test_a_changed_byte_past_the_first_mebibyte_of_a_tensor_is_refused(tmp_path):
    """The check reads each member to its end (zipfile compares the CRC-32 only there): a check that read one 1 MiB
    chunk passed a file whose 2 MiB tensor had a byte changed near its end, and the weight loaded changed."""
    path = tmp_path / "big.ckpt"
    torch.save({"w": torch.zeros(2**19)}, path)  # one member of 2 MiB
    data = path.read_bytes()
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.file_size == 2**21)
    damaged = _flipped(data, _data_offset(data, info) + info.file_size - 3, tmp_path / "damaged.ckpt")
    assert torch.load(damaged, weights_only=True)["w"].count_nonzero() == 1  # torch: loaded, one weight changed
    with pytest.raises(CheckpointError, match=rf"member '{info.filename}' fails its CRC-32 check"):
        safe_torch_load(damaged)


def test_an_empty_archive_appended_to_a_checkpoint_is_named_and_its_crc_checked(tmp_path):
    """An empty zip's end record (22 bytes) appended to a checkpoint ends the file like the checkpoint's own: taken
    for it, a real last.ckpt passed the check, torch failed on it ('archive does not contain any files'), and
    resume=auto skipped it as 'a zip archive without the data.pkl torch.save writes (it holds [])'; the CRC-32 of
    the archive before it was never checked. Now the record is bytes after the archive, named with the truncate -s
    that removes them, and a changed byte before it is named as damage."""
    path = tmp_path / "a.ckpt"
    torch.save({"global_step": 3, "w": torch.arange(1000.0)}, path)
    whole, empty = path.read_bytes(), b"PK\x05\x06" + bytes(18)
    path.write_bytes(whole + empty)
    with pytest.raises(CheckpointError, match=rf"has 22 bytes after the zip end record .* \(truncate -s {len(whole)} "):
        safe_torch_load(path)
    data = bytearray(whole)
    data[-2000] ^= 0x10  # in w's bytes
    path.write_bytes(bytes(data) + empty)
    with pytest.raises(CheckpointError, match="is damaged: member 'a/data/0' fails its CRC-32 check"):
        safe_torch_load(path)


def test_bench_checkpoint_crc_names_why_a_file_is_not_timed(tmp_path, capsys):
    """A missing file was 'not a torch checkpoint (a zip archive) or cannot be read', as a text file was."""
    from tests.conftest import load_script

    bench = load_script("bench_checkpoint_crc")
    (tmp_path / "notes.ckpt").write_text("hello\n")
    (tmp_path / "run").mkdir()
    (tmp_path / "empty.ckpt").touch()
    for name, reason in (("missing.ckpt", "does not exist"), ("run", "is a directory, not a checkpoint file"),
                         ("empty.ckpt", "is empty (0 bytes)"),
                         ("notes.ckpt", "is not a torch checkpoint: it is text starting 'hello\\n'")):
        with pytest.raises(SystemExit):
            bench.main([str(tmp_path / name), "--rounds", "1"])
        error = json.loads(capsys.readouterr().out.splitlines()[-1])["error"]
        assert error.startswith(f"checkpoint '{tmp_path / name}' {reason}"), error
