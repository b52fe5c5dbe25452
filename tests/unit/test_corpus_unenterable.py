"""A corpus directory that can be listed but not entered (read but no search permission, as ``chmod -R 644 corpus``
leaves its dirs): its names were listed and the first stat of one was a ``PermissionError`` traceback (train.py over
such a subdir: 19 frames, exit 1). Modes are real here: as root the check runs without ``CAP_DAC_OVERRIDE``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

RESOLVE = """
import json, logging, sys
from lit_dtrain.data.corpus import CorpusError, CorpusSource, resolve_files
said = []
class Said(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
logging.getLogger("lit_dtrain.data.corpus").addHandler(Said())
out = []
for path in sys.argv[1:]:
    try:
        out.append([p.name for p in resolve_files(CorpusSource(name="t", kind="files", paths=[path]))])
    except CorpusError as e:
        out.append(str(e))
print(json.dumps({"results": out, "said": said}))
"""


def _resolve_without_privilege(tmp_path: Path, paths: list[str]) -> dict:
    command = [sys.executable, "-c", RESOLVE, *paths]
    if os.geteuid() == 0:  # root ignores modes: drop the capabilities that let it, and own nothing of the corpus
        drop = ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search", "--"]
        if shutil.which("setpriv") is None or subprocess.run([*drop, "true"], capture_output=True).returncode:
            pytest.skip("needs setpriv, allowed to drop capabilities, to check file modes as root")
        subprocess.run(["chown", "-R", "65534:65534", str(tmp_path / "corpus")], check=True)
        command = [*drop, *command]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_directory_that_can_be_listed_but_not_entered_is_named_not_a_traceback(tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "top").mkdir()
    (corpus / "a.txt").write_text("kept text\n" * 20)
    (corpus / "sub" / "b.txt").write_text("left out\n" * 20)
    (corpus / "top" / "c.txt").write_text("left out\n" * 20)
    for d in (corpus / "sub", corpus / "top"):
        d.chmod(0o744)  # read, no search (x) for anyone but the owner
    got = _resolve_without_privilege(tmp_path, [str(corpus), f"{corpus}/**/*.txt", f"{corpus}/*/*.txt",
                                                str(corpus / "top"), f"{corpus}/top/**/*"])
    why = "Permission denied (it has read but no search (x) permission: chmod +x it)"
    glob = got["results"].pop(2)  # the first of sub/b.txt and top/c.txt that glob listed
    assert glob in [f"data source 't': glob '{corpus}/*/*.txt' matched '{corpus}/{d}/{f}', which cannot be reached: "
                    f"'{corpus}/{d}' cannot be entered: {why}" for d, f in (("sub", "b.txt"), ("top", "c.txt"))]
    assert got["results"] == [
        ["a.txt"],  # the directory source: its subdirs left out, with a warning
        ["a.txt"],
        f"data source 't': directory '{corpus}/top' cannot be listed: {why}",
        f"data source 't': glob '{corpus}/top/**/*' matched no files ('{corpus}/top' cannot be listed: {why})",
    ]
    assert f"cannot enter {corpus}/sub ({why}): its files are left out" in got["said"]
    assert f"cannot enter {corpus}/top ({why}): its files are left out" in got["said"]


def test_a_link_it_cannot_follow_is_left_out_with_one_warning_by_a_directory_source_and_a_glob_alike(tmp_path):
    """corpus/open/link.txt -> a file in a dir it may not enter, corpus/open/ext -> a dir there: a link whose target
    cannot be stat'ed may be a file or a directory. A ``**`` glob warned 'cannot reach <link> ...: it is left out',
    then refused the run naming it as a file it matched; a directory source refused the link to the directory, which
    a ``**`` glob left out. Each is left out now, named once, as a link whose target is missing is (a path given in
    ``paths`` that cannot be reached is still an error)."""
    corpus = tmp_path / "corpus"
    (corpus / "closed" / "inner").mkdir(parents=True)
    (corpus / "closed" / "b.txt").write_text("out of reach\n" * 20)
    (corpus / "closed" / "inner" / "c.txt").write_text("out of reach\n" * 20)
    (corpus / "closed").chmod(0o700)
    (corpus / "open").mkdir()
    (corpus / "open" / "a.txt").write_text("kept text\n" * 20)
    (corpus / "open" / "link.txt").symlink_to(corpus / "closed" / "b.txt")
    (corpus / "open" / "ext").symlink_to(corpus / "closed" / "inner")
    paths = [str(corpus / "open"), f"{corpus}/open/*", f"{corpus}/open/**/*.txt", f"{corpus}/open/**/*",
             f"{corpus}/open/link.txt"]
    got = _resolve_without_privilege(tmp_path, paths)
    assert got["results"] == [["a.txt"]] * 4 + [
        f"data source 't': path '{corpus}/open/link.txt' cannot be reached: Permission denied"]
    for link in ("link.txt", "ext"):
        said = [line for line in got["said"] if f"{corpus}/open/{link}" in line]
        assert said == [f"cannot reach {corpus}/open/{link} (Permission denied): it is left out"] * 4, got["said"]


def test_a_link_to_a_place_it_cannot_reach_leaves_out_that_link_not_its_sibling_dirs(tmp_path):
    """corpus/ext -> a dir inside a 0700 dir: the first stat of it ended the listing of corpus's subdirs, so a glob
    over corpus/**/*.txt kept top.txt and left out a/ and b/ (2 of its 3 files), warning 'cannot list corpus ...: its
    files are left out' of a dir whose files were kept. Only the link is left out now, named."""
    corpus = tmp_path / "corpus"
    for d, name in (("a", "x.txt"), ("b", "y.txt"), (".closed/inner", "s.txt")):
        (corpus / d).mkdir(parents=True)
        (corpus / d / name).write_text("text\n" * 20)
    (corpus / "top.txt").write_text("text\n" * 20)
    (corpus / "ext").symlink_to(corpus / ".closed" / "inner")
    (corpus / ".closed").chmod(0o700)
    got = _resolve_without_privilege(tmp_path, [f"{corpus}/**/*.txt"])
    assert got["results"] == [["x.txt", "y.txt", "top.txt"]]
    assert f"cannot reach {corpus}/ext (Permission denied): it is left out" in got["said"]
