"""``scripts/generate.py --prompt-file PATH`` (``-``: stdin): the prompt's bytes from a file, as ``--prompt`` gives
them from the command line. (test_script_checkpoint_errors.py holds the other generate.py tests; it is past 400
lines.)"""

import io
import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT, load_script
from tests.unit.test_script_checkpoint_errors import _tiny_checkpoint, script_error

GREEDY = ["--max-new-tokens", "4", "--temperature", "0", "--device", "cpu"]


def _last_json(text: str) -> dict:
    return json.loads(text.strip().splitlines()[-1])


def test_a_prompt_file_is_the_prompt_of_its_bytes(tmp_path, capsys):
    """The file's bytes as they are (a final newline, bytes that are not UTF-8, as --prompt takes them from argv)."""
    ckpt = str(_tiny_checkpoint(tmp_path / "tiny.ckpt"))
    mod = load_script("generate")
    for data in (b"def f(x):\n", b"\xff\xfe\xc3\xa9"):
        (tmp_path / "p.txt").write_bytes(data)
        mod.main([ckpt, "--prompt-file", str(tmp_path / "p.txt"), *GREEDY])
        from_file = _last_json(capsys.readouterr().out)
        assert from_file["text"].startswith(data.decode(errors="replace")) and from_file["new_tokens"] == 4
    mod.main([ckpt, "--prompt", data.decode(errors="surrogateescape"), *GREEDY])  # how argv bytes arrive
    assert _last_json(capsys.readouterr().out) == from_file


@pytest.mark.parametrize("make, message", [
    (lambda p: p, r"--prompt-file '.*missing.txt': cannot read it: No such file or directory"),
    (lambda p: p.write_bytes(b"") or p, r"--prompt-file '.*missing.txt' is empty; to start a new document use "
                                        r"--prompt ''"),
    (lambda p: p.mkdir() or p, r"--prompt-file '.*missing.txt': cannot read it: Is a directory"),
])
def test_a_prompt_file_that_cannot_be_read_or_is_empty_is_named_before_loading(tmp_path, capsys, make, message):
    path = make(tmp_path / "missing.txt")
    with script_error(capsys, message):
        load_script("generate").main([str(tmp_path / "never_read.ckpt"), "--prompt-file", str(path)])


def test_prompt_and_prompt_file_exclude_each_other(tmp_path, capsys):
    with script_error(capsys, r"argument --prompt-file: not allowed with argument --prompt"):
        load_script("generate").main([str(tmp_path / "x.ckpt"), "--prompt", "a", "--prompt-file", "p.txt"])


def test_prompt_file_dash_reads_stdin(tmp_path, capsys, monkeypatch):
    """`cat prompt.py | generate.py CKPT --prompt-file -`, as its own Python (never a fork of pytest); empty stdin is
    refused as an empty file is."""
    ckpt = str(_tiny_checkpoint(tmp_path / "tiny.ckpt"))
    script = [sys.executable, str(ROOT / "scripts" / "generate.py"), ckpt, "--prompt-file", "-", *GREEDY]
    done = subprocess.run(script, input=b"import os\n\xff", capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    out = _last_json(done.stdout.decode())
    assert out["text"].startswith("import os\n\ufffd") and out["new_tokens"] == 4
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    with script_error(capsys, r"^--prompt-file stdin is empty; to start a new document use --prompt ''$"):
        load_script("generate").main([ckpt, "--prompt-file", "-"])
