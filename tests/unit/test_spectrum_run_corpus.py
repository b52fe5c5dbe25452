"""scripts/spectrum.py reads the run's corpus as the run read it: without the run's ``data.exclude_dirs``; and its
effective bandwidth."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from lit_dtrain.data import CorpusSource, LMDataModule, WindowSet
from lit_dtrain.models import build_llama

CONFIG = {"vocab_size": 257, "block_size": 16, "n_layer": 1, "n_head": 2, "n_kv_head": 1, "d_model": 16,
          "mlp_hidden": 32}


def spectrum_module():
    script = Path(__file__).parents[2] / "scripts" / "spectrum.py"
    spec = importlib.util.spec_from_file_location("_spectrum_exclude", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("one_dir", [False, True], ids=["list", "one_dir"])
def test_the_runs_outputs_inside_its_corpus_dir_are_not_read_as_corpus(tmp_path, capsys, one_dir):
    """A run of data=textfiles over a dir that holds its own outputs (LIT_DTRAIN_OUTPUT inside the corpus) trained
    without them (data.exclude_dirs); spectrum.py read them too, its checkpoint and config files among the documents
    ('4 file(s) look binary (NUL bytes), e.g. .../last.ckpt'): another document set, split and token cache than the
    run's, so its "held-out" windows were not the run's. ``data.exclude_dirs`` given as one dir (a string, which the
    config takes) was read as no exclusion: 8 binary files, the run's last.ckpt among them, in a real run's corpus."""
    corpus, outputs = tmp_path / "corpus", tmp_path / "corpus" / "outputs"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "some words of text here. " * (20 + i))
    run = outputs / "runs" / "r"
    (run / "checkpoints").mkdir(parents=True)
    model = build_llama(**CONFIG)
    ckpt = run / "checkpoints" / "last.ckpt"
    torch.save({"model_config": CONFIG, "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "LMDataModule": {"val_fraction": 0.3}, "global_step": 1}, ckpt)
    data = {"sources": [{"name": "text", "kind": "files", "paths": [str(corpus)]}], "block_size": 8,
            "val_fraction": 0.3, "cache_dir": str(tmp_path / "cache"),
            "exclude_dirs": str(outputs) if one_dir else [str(outputs)]}
    (run / "config_resolved.yaml").write_text(yaml.safe_dump({"data": data}))
    for i in range(6):  # the run's logs and files, text beside the checkpoint
        (run / f"log{i}.txt").write_text(f"step {i} loss 3.0\n" * 40)
    spectrum_module().main([str(ckpt), "--out", str(tmp_path / "s.png"), "--windows", "100000", "--split", "train"])
    printed = capsys.readouterr().out.strip().splitlines()
    out = json.loads(printed[-1])
    # the corpus named in words (it printed the dataclass, "corpus: CorpusSource(name='text', kind='files', ...)")
    assert f"corpus: source 'text': files {corpus} (the run's, from its config_resolved.yaml)" in printed
    dm = LMDataModule(sources=[CorpusSource(name="text", kind="files", paths=[str(corpus)])], block_size=8,
                      batch_size=1, val_fraction=0.3, cache_dir=str(tmp_path / "cache"), progress=False,
                      exclude_dirs=[str(outputs)])
    dm.prepare_data()
    assert out["windows"] == len(WindowSet([dm.splits[0].train], 8))  # the windows the run trained on
    assert len(list((tmp_path / "cache").iterdir())) == 1  # the run's token cache, not a second one


@pytest.mark.parametrize("config, message", [
    ("data: [1, 2\n", "is not valid YAML at line 2"),  # cut short
    (b"data:\n  block_size: 8\n  name: caf\xe9\n", "is not UTF-8 text (byte 33)"),  # latin-1: a traceback
    ("", "is empty"),  # cut to nothing: taken for no run config, and measured at another window length
    ("# comments only\n- a\n", "is a YAML list, not a mapping of config keys"),
    (b"\x7fELF\x02\x01\x01\x00\xf0\x9f", "is not UTF-8 text (byte 8)"),  # a binary file copied over it
    ("data:\n  sources:\n  - {name: t, kind: weird, paths: [x]}\n", "is not a corpus source"),  # edited
    ("data:\n  sources: 5\n", "has data.sources=5, not a list of sources"),  # was: 'no run config beside ...'
    ("data:\n  sources: [stdlib]\n", "has data.sources.0='stdlib', not a list of sources"),
    ("data: 5\n", "has data=5, not a mapping of data keys"),  # was: 'no run config beside ...', the stdlib measured
    ("data:\n  sources: 0\n", "has data.sources=0, not a list of sources"),  # likewise
    ("data:\n  sources: {}\n", "has data.sources={}, not a list of sources"),  # likewise
    ("data:\n  sources: []\n", "has data.sources=[], not a list of sources"),  # likewise: every run lists one
    ("data: {}\n", "has no data.sources, not a list of sources"),  # likewise
])
def test_a_run_config_that_cannot_be_read_is_one_line_naming_it(tmp_path, capsys, config, message):
    """A run config cut short (not YAML) was a YAMLError traceback from the PyYAML parser, one not UTF-8 a
    UnicodeDecodeError traceback, and a source of an unknown kind a CorpusError traceback; each is one error line
    naming it, before any corpus is read."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    model = build_llama(**CONFIG)
    ckpt = run / "checkpoints" / "last.ckpt"
    torch.save({"model_config": CONFIG, "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "LMDataModule": {"val_fraction": 0.3}, "global_step": 1}, ckpt)
    write = (run / "config_resolved.yaml").write_bytes if isinstance(config, bytes) else \
        (run / "config_resolved.yaml").write_text
    write(config)
    with pytest.raises(SystemExit) as exit_info:
        spectrum_module().main([str(ckpt), "--out", str(tmp_path / "s.png"), "--cache-dir", str(tmp_path / "c")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    raw = config if isinstance(config, bytes) else config.encode()
    assert not (tmp_path / "c").exists() and (run / "config_resolved.yaml").read_bytes() == raw  # nothing read


@pytest.mark.parametrize("fraction, power, expected", [
    (1.0, [0.637, 0.26978672, 0.04097353, 0.01652764, 0.8132702, 0.91275555, 0.6066357, 0.7294965, 0.543625], 8),
    (0.9, [0.0, 9.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0], 1),
    (0.95, [0.0, 9.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0], 2),
], ids=["all_the_energy", "one_bin", "two_bins"])
def test_the_effective_bandwidth_is_the_lowest_bin_holding_the_share(tmp_path, capsys, monkeypatch, fraction, power,
                                                                     expected):
    """The bins 1..b hold ``fraction`` of the energy. With ``--bandwidth-fraction 1`` the float32 cumulative share
    of this spectrum (T=16, Nyquist bin 8) ends at 0.99999994: it said bin 9, past the Nyquist bin (period 1.8
    tokens); in real runs at T=64, bin 33 for 6 spectra of 12."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(12):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "some words of text here. " * (20 + i))
    model = build_llama(**CONFIG)
    ckpt = tmp_path / "last.ckpt"
    torch.save({"model_config": CONFIG, "state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                "LMDataModule": {"val_fraction": 0.3}, "global_step": 1}, ckpt)
    mod = spectrum_module()
    monkeypatch.setattr(mod, "mean_spectrum", lambda *a: (np.array(power, dtype=np.float32), 3.0))
    mod.main([str(ckpt), "--files", str(corpus), "--block-size", "16", "--windows", "4", "--out",
              str(tmp_path / "s.png"), "--bandwidth-fraction", str(fraction), "--cache-dir", str(tmp_path / "c")])
    printed = capsys.readouterr().out.strip().splitlines()
    assert json.loads(printed[-1])["checkpoints"][0]["effective_bandwidth_bin"] == expected
    assert f"of the energy at or below bin {expected} (period {16 / expected:.1f} tokens)" in printed[-3]
