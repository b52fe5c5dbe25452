"""Every ``python train.py ...`` command shown in README.md and docs/*.md composes as written.

Hydra's override grammar is easy to get wrong in prose (an unquoted ``~`` in a list is a lexer error); a
command that a reader copies must not fail before training starts. Sweep (``-m``) values are composed one by
one. Paths in the commands (checkpoints, corpora) are only composed, not opened.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import ROOT, compose_cfg

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def train_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after train.py) of every command line, with ``\\`` continuations joined."""
    out = []
    for doc in DOCS:
        text = doc.read_text().replace("\\\n", " ")
        for lineno, line in enumerate(text.splitlines(), 1):
            for match in re.finditer(r"(?:^|&&\s*|`)python train\.py([^`#&\n]*)", line):
                args = shlex.split(match.group(1))
                for flag in ("--help", "--cfg"):  # Hydra's flags: --cfg job prints the config of the overrides
                    if flag in args:
                        i = args.index(flag)
                        del args[i:i + (2 if flag == "--cfg" else 1)]
                if match.group(0).startswith("`") and not args:
                    continue
                out.append((f"{doc.name}:{lineno}", args))
    return out


def sweep_values(override: str) -> list[str]:
    """``key=a,b`` -> [``key=a``, ``key=b``]; ``key=[a],[a,b]`` -> [``key=[a]``, ``key=[a,b]``] (commas inside
    brackets are list syntax, not a sweep)."""
    key, sep, value = override.partition("=")
    values = re.split(r",(?![^\[]*\])", value)  # the commas outside brackets
    if not sep or len(values) == 1:
        return [override]
    return [f"{key}={v}" for v in values]


COMMANDS = train_commands()


def test_the_docs_have_commands():
    assert len(COMMANDS) > 40  # the extractor really finds them


@pytest.mark.parametrize(("where", "args"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_documented_command_composes(where, args, tmp_path):
    multirun = "-m" in args
    overrides = [a for a in args if a != "-m"]
    variants = [overrides]
    if multirun:
        variants = [[]]
        for override in overrides:
            variants = [v + [choice] for v in variants for choice in sweep_values(override)]
    for i, variant in enumerate(variants):
        cfg = compose_cfg(variant, tmp_path / str(i), None, tiny=False)
        assert cfg.trainer.max_steps > 0, (where, variant)


def test_the_readme_test_command_collects_every_test_file(monkeypatch, capsys):
    """The README's test command (``python -m pytest -q``, which CI runs) never collected tests/dist/: pytest's
    default ``norecursedirs`` holds ``dist``, so the 2-process gloo tests ran only when named on the command line,
    and docs/reliability.md's rows that name them were not run by CI. Every ``tests/**/test_*.py`` must be
    collected by a bare ``pytest``."""
    class Collected:
        nodeids: list[str] = []

        def pytest_collection_finish(self, session):
            self.nodeids = [item.nodeid for item in session.items]

    # the bare command's collection, run in this process: the test modules are imported already (a fresh Python
    # per collection cost ~10 s of imports), and pytest reads the same ini from the same directory
    monkeypatch.chdir(ROOT)
    collector = Collected()
    status = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[collector])
    out = capsys.readouterr()
    assert status == 0, out.out[-2000:] + out.err[-2000:]
    collected = {nodeid.split("::")[0] for nodeid in collector.nodeids}
    on_disk = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")}
    assert on_disk - collected == set(), out.out[-2000:] + out.err[-2000:]
    assert any(f.startswith("tests/dist/") for f in collected)


def test_the_readme_shows_how_to_shrink_every_sweep_experiment(tmp_path):
    """`python train.py -m experiment=wsd_vs_cosine` trains 6 jobs of 1000 steps, and the README said nothing of a
    smaller budget; the obvious `trainer.max_steps=20` fails every job (the experiment's 50 warmup steps do not fit).
    The README shows a shrunk command for each experiment with a sweep grid; each of its jobs passes the config check
    at fewer steps than the experiment's own."""
    from omegaconf import OmegaConf

    from lit_dtrain.config_checks import check_config
    from tests.conftest import CONF_DIR

    for conf in sorted(Path(CONF_DIR, "experiment").glob("*.yaml")):
        experiment = OmegaConf.load(conf)
        grid = OmegaConf.select(experiment, "hydra.sweeper.params")
        if not grid:
            continue
        shrunk = [(where, args) for where, args in COMMANDS if where.startswith("README") and "-m" in args
                  and f"experiment={conf.stem}" in args and any(a.startswith("trainer.max_steps=") for a in args)]
        assert shrunk, f"README.md shows no smaller run of -m experiment={conf.stem}"
        for where, args in shrunk:
            jobs = [[a for a in args if a != "-m"]]
            for key, values in grid.items():
                jobs = [job + [f"{key}={v.strip()}"] for job in jobs for v in str(values).split(",")]
            for i, job in enumerate(jobs):
                cfg = compose_cfg(job, tmp_path / conf.stem / str(i), None, tiny=False)
                check_config(cfg)
                assert cfg.trainer.max_steps < experiment.trainer.max_steps, where


def test_train_py_help_shows_commands_that_compose(tmp_path):
    """``python train.py --help`` began with Hydra's bare "train is powered by Hydra." and no word of how to run,
    sweep or resume. Its header (``hydra.help.header``) shows commands now; each composes (Hydra's own flags such
    as ``--cfg job`` left out), as the docs' commands do."""
    import yaml

    from tests.conftest import CONF_DIR

    header = yaml.safe_load(Path(CONF_DIR, "hydra", "default.yaml").read_text())["help"]["header"]
    commands = [shlex.split(line.split("#")[0])[2:] for line in header.splitlines()
                if line.strip().startswith("python train.py")]
    assert len(commands) >= 5 and ["-m", "optimizer.lr=1e-3,3e-3"] in commands
    for i, args in enumerate(commands):
        overrides = [a for a in args if not a.startswith("-") and a != "job"]
        variants = [[]]
        for override in overrides:
            variants = [v + [choice] for v in variants for choice in sweep_values(override)]
        for j, variant in enumerate(variants):
            assert compose_cfg(variant, tmp_path / f"{i}_{j}", None, tiny=False).trainer.max_steps > 0, args
