import contextlib
import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def script_error(capsys, pattern: str):
    """The block ends the script on bad input: exit status 2 and, as the last stdout line, ``{"error": ...}`` matching
    ``pattern`` (the plain SystemExit message generate.py and spectrum.py ended with was no JSON)."""
    with pytest.raises(SystemExit) as e:
        yield
    assert e.value.code == 2
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert re.search(pattern, error), error


@pytest.mark.parametrize("script", ["generate", "spectrum"])
def test_scripts_name_a_missing_or_unreadable_checkpoint_without_a_traceback(tmp_path, capsys, script):
    spec = importlib.util.spec_from_file_location(f"_{script}_ckpt_err", ROOT / "scripts" / f"{script}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with script_error(capsys, "nope.ckpt.*does not exist"):
        mod.load_model(str(tmp_path / "nope.ckpt"))
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    with script_error(capsys, "garbage.ckpt"):
        mod.load_model(str(garbage))


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_{name}_args", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _tiny_checkpoint(path: Path, block_size: int = 32) -> Path:
    import dataclasses

    import torch

    from lit_dtrain.models import build_llama

    model = build_llama(vocab_size=257, block_size=block_size, n_layer=1, n_head=2, n_kv_head=1, d_model=16)
    state = {f"model.{k}": v for k, v in model.state_dict().items()}
    torch.save({"model_config": dataclasses.asdict(model.config), "state_dict": state, "global_step": 3}, path)
    return path


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0: greedy), got -1.0"),
        (["--top-k", "-2"], "--top-k must be an integer >= 0 (0: all tokens), got -2"),
        (["--max-new-tokens", "-3"], "--max-new-tokens must be an integer >= 0, got -3"),
        (["--temperature", "inf"], "--temperature must be a finite number >= 0 (0: greedy), got inf"),
    ],
)
def test_generate_rejects_bad_sampling_flags_before_loading(tmp_path, capsys, flags, message):
    """A negative --temperature used to mean greedy silently, a negative --max-new-tokens printed the prompt
    alone, and a negative --top-k was a RuntimeError from torch.topk."""
    with script_error(capsys, re.escape(message)):
        _script("generate").main([str(tmp_path / "never_read.ckpt"), *flags])


def test_generate_top_k_zero_samples_from_all_tokens(tmp_path, capsys):
    import json

    ckpt = _tiny_checkpoint(tmp_path / "tiny.ckpt")
    _script("generate").main([str(ckpt), "--top-k", "0", "--max-new-tokens", "4", "--prompt", "ab"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["new_tokens"] == 4 and out["global_step"] == 3


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--windows", "0"], "argument --windows: must be >= 1, got 0"),
        (["--batch-size", "0"], "argument --batch-size: must be >= 1, got 0"),
        (["--block-size", "-2"], "argument --block-size: must be >= 1, got -2"),
        (["--max-freq", "0"], "argument --max-freq: must be >= 1, got 0"),
        (["--num-bands", "0"], "argument --num-bands: must be >= 1, got 0"),
        (["--windows", "1.5"], "argument --windows: expected a whole number, got '1.5'"),
        (["--bandwidth-fraction", "2"], "--bandwidth-fraction must be in (0, 1], got 2.0"),
        (["--bandwidth-fraction", "0"], "--bandwidth-fraction must be in (0, 1], got 0.0"),
        (["--files"], "argument --files: expected at least one argument"),
        (["--labels"], "argument --labels: expected at least one argument"),
    ],
)
def test_spectrum_rejects_bad_flags_before_loading(tmp_path, capsys, flags, message):
    """--windows 0 was 'stack expects a non-empty TensorList', --batch-size 0 'range() arg 3 must not be zero',
    both after tokenizing the corpus; --bandwidth-fraction 2 reported a bandwidth bin past the spectrum. --files
    without a value fell back silently to the run's corpus (or the stdlib one)."""
    with script_error(capsys, re.escape(message)):
        _script("spectrum").main([str(tmp_path / "never_read.ckpt"), *flags])


def test_spectrum_names_the_runs_window_length_above_another_models_block_size(tmp_path, capsys):
    """Two checkpoints of different block sizes, no --block-size: the window length is the first run's
    data.block_size, and the error named a flag that was never given ('--block-size 64 exceeds the block_size 32 of
    b.ckpt'). It names where the length came from and the --block-size that fits both."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config_resolved.yaml").write_text("data:\n  block_size: 64\n")
    first = _tiny_checkpoint(run / "checkpoints" / "a.ckpt", block_size=64)
    second = _tiny_checkpoint(tmp_path / "b.ckpt", block_size=32)
    with script_error(capsys, re.escape(f"the window length (data.block_size of the run of {first}) 64 exceeds the "
                                        f"block_size 32 of {second}; compare them at a length that fits every model, "
                                        "e.g. --block-size 32")):
        _script("spectrum").main([str(first), str(second), "--files", str(tmp_path / "nowhere")])


def test_spectrum_names_a_block_size_above_the_models_and_a_bad_corpus(tmp_path, capsys):
    """--block-size above the checkpoint's block_size was a ValueError from the model's forward, after the corpus
    was tokenized; a missing --files path was a CorpusError traceback."""
    ckpt = _tiny_checkpoint(tmp_path / "tiny.ckpt", block_size=32)
    with pytest.raises(SystemExit) as e:
        _script("spectrum").main([str(ckpt), "--block-size", "64", "--files", str(tmp_path / "nowhere")])
    assert e.value.code == 2
    assert "--block-size 64 exceeds the block_size 32 of" in capsys.readouterr().err
    # one position has no spectrum: a ValueError traceback from power_spectrum after the corpus was tokenized
    with script_error(capsys, r"the window length \(--block-size\) is 1; a token-loss spectrum needs at least 2"):
        _script("spectrum").main([str(ckpt), "--block-size", "1", "--files", str(tmp_path / "nowhere")])
    with script_error(capsys, "nowhere.*does not exist"):
        _script("spectrum").main([str(ckpt), "--files", str(tmp_path / "nowhere"), "--out", str(tmp_path / "s.png")])


def test_spectrum_labels_must_match_the_checkpoints(tmp_path, capsys):
    """Two checkpoints with one --labels entry: zip() dropped the second checkpoint from the plot and the JSON."""
    with pytest.raises(SystemExit) as e:
        _script("spectrum").main([str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt"), "--labels", "only_one"])
    assert e.value.code == 2 and "--labels has 1 entries but there are 2 checkpoints" in capsys.readouterr().err


@pytest.mark.parametrize("script", ["generate", "spectrum"])
def test_scripts_say_a_directory_is_not_a_checkpoint(tmp_path, capsys, script):
    """generate.py outputs/runs/x/checkpoints (the dir) said 'checkpoint ... does not exist'."""
    (tmp_path / "checkpoints").mkdir()
    with script_error(capsys, r"checkpoint '.*checkpoints' is a directory, not a checkpoint file"):
        _script(script).load_model(str(tmp_path / "checkpoints"))


def _spectrum_json(capsys) -> dict:
    import json

    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _held_out_windows(corpus: Path, cache: Path, block_size: int, val_fraction: float):
    from lit_dtrain.data import CorpusSource, LMDataModule, WindowSet

    dm = LMDataModule(
        sources=[CorpusSource(name="files", kind="files", paths=[str(corpus)])],
        block_size=block_size,
        batch_size=1,
        val_fraction=val_fraction,
        cache_dir=str(cache),
        progress=False,
    )
    dm.prepare_data()
    return WindowSet([dm.splits[0].val], block_size)


def test_spectrum_holds_out_the_documents_the_checkpoint_held_out(tmp_path, capsys):
    """spectrum.py built its "held-out" split with val_fraction 0.02 whatever the run used: a run with
    data.val_fraction=0.3 has 30 % of the documents held out, and the 0.02 split's windows were mostly documents
    that run trained on. The checkpoint records the value (LMDataModule state); --val-fraction overrides it."""
    import torch

    from tests.conftest import make_corpus

    corpus = make_corpus(tmp_path / "corpus", n_files=40, size=800)
    ckpt = _tiny_checkpoint(tmp_path / "tiny.ckpt", block_size=32)
    state = torch.load(ckpt, weights_only=False)
    state["LMDataModule"] = {"micro_step": 3, "seed": 0, "sampler": {}, "val_fraction": 0.3}
    torch.save(state, ckpt)
    flags = ["--files", str(corpus), "--cache-dir", str(tmp_path / "cache"), "--windows", "1000"]
    _script("spectrum").main([str(ckpt), *flags, "--out", str(tmp_path / "a.png")])
    out = _spectrum_json(capsys)
    held_out = _held_out_windows(corpus, tmp_path / "cache", 32, 0.3)
    assert out["val_fraction"] == 0.3 and out["windows"] == len(held_out) != len(
        _held_out_windows(corpus, tmp_path / "cache", 32, 0.02)
    )
    _script("spectrum").main([str(ckpt), *flags, "--val-fraction", "0.1", "--out", str(tmp_path / "b.png")])
    out = _spectrum_json(capsys)
    assert out["val_fraction"] == 0.1 and out["windows"] == len(_held_out_windows(corpus, tmp_path / "cache", 32, 0.1))


def test_spectrum_reads_val_fraction_from_the_runs_hydra_config_or_says_it_assumes_the_default(tmp_path, capsys):
    """A checkpoint written before LMDataModule recorded val_fraction: the run dir's .hydra/config.yaml (the
    checkpoint is <run>/checkpoints/*.ckpt) has it; without that, a printed note says 0.02 is assumed."""
    from tests.conftest import make_corpus

    corpus = make_corpus(tmp_path / "corpus", n_files=40, size=800)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / ".hydra").mkdir()
    (tmp_path / "run" / ".hydra" / "config.yaml").write_text("seed: 0\ndata:\n  val_fraction: 0.25\n  batch_size: 8\n")
    ckpt = _tiny_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt", block_size=32)
    flags = ["--files", str(corpus), "--cache-dir", str(tmp_path / "cache"), "--out", str(tmp_path / "a.png")]
    _script("spectrum").main([str(ckpt), *flags])
    assert _spectrum_json(capsys)["val_fraction"] == 0.25
    bare = _tiny_checkpoint(tmp_path / "bare.ckpt", block_size=32)
    _script("spectrum").main([str(bare), *flags])
    text = capsys.readouterr().out
    assert "records no data.val_fraction" in text and "assuming 0.02" in text and "--val-fraction" in text
    assert '"val_fraction": 0.02' in text.splitlines()[-1]


def test_spectrum_refuses_checkpoints_that_held_out_different_documents(tmp_path, capsys):
    import torch

    paths = []
    for name, fraction in (("a", 0.3), ("b", 0.02)):
        ckpt = _tiny_checkpoint(tmp_path / f"{name}.ckpt", block_size=32)
        state = torch.load(ckpt, weights_only=False)
        state["LMDataModule"] = {"micro_step": 3, "seed": 0, "sampler": {}, "val_fraction": fraction}
        torch.save(state, ckpt)
        paths.append(str(ckpt))
    with pytest.raises(SystemExit) as e:
        _script("spectrum").main([*paths, "--files", str(tmp_path / "never_read")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "data.val_fraction" in err and "0.3" in err and "0.02" in err and "--val-fraction" in err


def test_the_datamodule_state_records_val_fraction(tmp_path):
    from lit_dtrain.data import LMDataModule

    assert LMDataModule(val_fraction=0.07, cache_dir=str(tmp_path)).state_dict()["val_fraction"] == 0.07


@pytest.mark.parametrize("temperature", ["0.8", "0"])
def test_generate_names_a_checkpoint_with_non_finite_weights(tmp_path, capsys, temperature):
    """The last.ckpt of a sweep job that diverged (module.check_finite=false, optimizer.lr=1e4): generate.py died in
    torch.multinomial with 'RuntimeError: probability tensor contains either inf, nan or element < 0', and with
    --temperature 0 printed 'def ' and five NUL bytes (argmax of NaN logits) as if it were text."""
    import torch

    ckpt = _tiny_checkpoint(tmp_path / "last.ckpt")
    data = torch.load(ckpt, weights_only=True)
    key = next(k for k in data["state_dict"] if k.endswith("attn.wq.weight"))
    data["state_dict"][key] = torch.full_like(data["state_dict"][key], float("nan"))
    torch.save(data, ckpt)
    with script_error(capsys, rf"checkpoint '{ckpt}' \(step 3\) has non-finite weights \({key[6:]}"):
        _script("generate").main([str(ckpt), "--temperature", temperature, "--max-new-tokens", "5"])


def test_spectrum_names_a_checkpoint_with_non_finite_weights(tmp_path, capsys):
    """spectrum.py measured a diverged checkpoint: 'mean loss nan, ... band shares [nan, nan, nan, nan], 90% of the
    energy below bin 1', a plot of nothing and a JSON line with NaN, exit 0. It is refused as generate.py refuses it
    (the check is in model_from_checkpoint, which both load through)."""
    import torch

    ckpt = _tiny_checkpoint(tmp_path / "last.ckpt")
    data = torch.load(ckpt, weights_only=True)
    data["state_dict"]["model.norm.weight"][3] = float("inf")
    torch.save(data, ckpt)
    with script_error(capsys, rf"checkpoint '{ckpt}' \(step 3\) has non-finite weights \(norm.weight\): the run "
                              "diverged; use an earlier checkpoint of it"):
        _script("spectrum").load_model(str(ckpt))


def test_generate_takes_a_prompt_of_bytes_that_are_not_utf8(tmp_path, capsys):
    """`generate.py CKPT --prompt $'\\xff\\xfeab'`: Python hands such argv bytes over as surrogates, and the prompt
    died in str.encode with 'UnicodeEncodeError: ... surrogates not allowed'. The model reads bytes; the prompt is
    now the bytes given on the command line (os.fsencode), here ff fe 61 62."""
    import json

    ckpt = _tiny_checkpoint(tmp_path / "last.ckpt")
    _script("generate").main([str(ckpt), "--prompt", "\udcff\udcfeab", "--max-new-tokens", "3", "--temperature", "0"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["text"].startswith("\ufffd\ufffdab") and result["new_tokens"] == 3
    _script("generate").main([str(ckpt), "--prompt", "héllo ☃", "--max-new-tokens", "2", "--temperature", "0"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["text"].startswith("héllo ☃")


@pytest.mark.parametrize("script", ["generate", "spectrum"])
def test_scripts_name_a_checkpoint_whose_model_config_does_not_build(tmp_path, capsys, script):
    """A model_config with a key this version lacks (a checkpoint of another lit_dtrain version) or a damaged value
    was a ValueError or TypeError traceback from build_llama."""
    import torch

    ckpt = _tiny_checkpoint(tmp_path / "tiny.ckpt")
    state = torch.load(ckpt, weights_only=False)
    for name, change in (("newer", {"sliding_window": 64}), ("damaged", {"d_model": "sixteen"})):
        torch.save({**state, "model_config": {**state["model_config"], **change}}, tmp_path / f"{name}.ckpt")
        with script_error(capsys, rf"'.*{name}.ckpt': its model_config does not build a model"):
            _script(script).load_model(str(tmp_path / f"{name}.ckpt"))



@pytest.mark.parametrize(
    "out, message",
    [
        ("plot.foo", "--out '{tmp}/plot.foo': matplotlib cannot write '.foo' files"),
        ("file/plot.png", "--out '{tmp}/file/plot.png': cannot create its directory"),
        ("adir.png", "--out '{tmp}/adir.png' is a directory; give a file path"),
    ],
)
def test_spectrum_refuses_an_unwritable_out_before_loading(tmp_path, capsys, out, message):
    """--out with a suffix matplotlib does not write, or below a file, was a traceback from savefig after the
    whole spectrum was computed."""
    (tmp_path / "file").write_text("a file, not a dir")
    (tmp_path / "adir.png").mkdir()
    with pytest.raises(SystemExit) as e:
        _script("spectrum").main([str(tmp_path / "never_read.ckpt"), "--out", str(tmp_path / out)])
    assert e.value.code == 2 and message.format(tmp=tmp_path) in capsys.readouterr().err


def test_spectrum_reports_the_png_it_wrote_for_an_out_without_suffix(tmp_path, capsys):
    """--out spec (no suffix): matplotlib wrote spec.png, but the JSON and 'wrote' line named 'spec', no file."""
    from tests.conftest import make_corpus

    corpus = make_corpus(tmp_path / "corpus", n_files=10, size=400)
    ckpt = _tiny_checkpoint(tmp_path / "tiny.ckpt", block_size=32)
    flags = ["--files", str(corpus), "--cache-dir", str(tmp_path / "cache"), "--windows", "4", "--val-fraction", "0.5"]
    _script("spectrum").main([str(ckpt), *flags, "--out", str(tmp_path / "spec")])
    out = _spectrum_json(capsys)
    assert out["out"] == str(tmp_path / "spec.png") and (tmp_path / "spec.png").read_bytes()[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("spec", ".spec"))) == ["spec.png"]


def test_generate_device_defaults_to_cuda_where_available_and_cpu_samples(tmp_path, capsys, monkeypatch):
    """generate.py sampled on the CPU only; --device picks the device, by default CUDA where torch finds it."""
    import torch

    mod = _script("generate")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mod.sampling_device(None) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert mod.sampling_device(None) == torch.device("cuda", 1)  # the generator goes where the model goes
    assert mod.sampling_device("cuda:0") == torch.device("cuda", 0)
    with script_error(capsys, r"--device cuda:2: this machine has 2 CUDA device\(s\), cuda:0..cuda:1"):
        mod.sampling_device("cuda:2")
    ckpt = _tiny_checkpoint(tmp_path / "tiny.ckpt")
    args = [str(ckpt), "--device", "cpu", "--max-new-tokens", "5", "--prompt", "ab", "--seed", "4"]
    mod.main(args)
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    mod.main(args)
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == first and first["new_tokens"] == 5


@pytest.mark.parametrize(
    "device, message",
    [
        ("cuda", r"--device cuda: CUDA is not available here .*use --device cpu"),
        ("cuda:1", r"--device cuda:1: CUDA is not available here"),
        ("gpu", r"--device 'gpu' is not a device name \(cpu, cuda, cuda:1, ...\)"),
        ("meta", r"--device meta: only cpu and cuda are supported"),
    ],
)
def test_generate_names_a_device_it_cannot_sample_on(tmp_path, capsys, monkeypatch, device, message):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with script_error(capsys, message):
        _script("generate").main([str(tmp_path / "never_read.ckpt"), "--device", device])


def test_generate_num_samples_draws_that_many_continuations(tmp_path, capsys):
    """--num-samples did not exist: several continuations of one prompt took one run (and one model load) each."""
    ckpt = _tiny_checkpoint(tmp_path / "tiny.ckpt")
    mod = _script("generate")

    def run(*flags):
        mod.main([str(ckpt), "--prompt", "ab", "--max-new-tokens", "6", "--device", "cpu", *flags])
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    greedy = run("--temperature", "0")
    many = run("--temperature", "0", "--num-samples", "3")
    assert many["texts"] == [greedy["text"]] * 3 and many["text"] == greedy["text"] and many["new_tokens"] == 6
    drawn = run("--temperature", "1", "--top-k", "0", "--num-samples", "4", "--seed", "7")
    assert len(drawn["texts"]) == 4 and len(set(drawn["texts"])) > 1 and all(t[:2] == "ab" for t in drawn["texts"])
    assert run("--temperature", "1", "--top-k", "0", "--num-samples", "4", "--seed", "7") == drawn
    with script_error(capsys, r"argument --num-samples: must be >= 1, got 0"):
        run("--num-samples", "0")
