"""Bad flags given to the scripts are refused, naming the flag, before any work, and the last stdout line is the
JSON ``{"error": ...}`` (a script's last line is JSON on success too). ``--steps 0``, ``--repeats 0`` and ``--rounds
0`` ended minutes later in ``statistics.StatisticsError: no median for empty data``, ``--batch 0`` in an FFT error,
``bench_step.py --warmup`` >= ``--steps`` timed nothing (0 ms/step, or the same error); an unknown
``bench_spikes.py --variants`` name was a KeyError after the earlier variants had trained, an ``--inject`` step past
``--steps`` was never injected (and counted as missed), an empty ``--lrs`` a ValueError, a ``bench_comm.py --rates``
typo a ``tc`` failure inside the network namespace, a garbage ``--replot``/``--merge`` file a traceback, a negative
``--seed`` a ``ConfigError`` traceback at ``bench_spikes.py``'s first run
(``bench_fourier.py --seeds -1`` trained on)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT, load_script, run_script

WINDOW_OF_ONE = "argument --block-size: must be >= 2 (a window of 1 token trains the model without context), got 1"


@pytest.mark.parametrize("script, args, message", [
    ("bench_sampler_scaling.py", ["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    ("bench_sampler_scaling.py", ["--batch", "0"], "argument --batch: must be >= 1, got 0"),
    # a ValueError traceback from token_loss ('needs at least 2 positions for a spectrum, got T=1')
    ("bench_sampler_scaling.py", ["--block", "1"], "--block 1: the Fourier samplers need windows of >= 2 tokens"),
    ("bench_optim_diag.py", ["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    ("bench_step.py", ["--rounds", "0"], "argument --rounds: must be >= 1, got 0"),
    ("bench_step.py", ["--steps", "abc"], "argument --steps: expected a whole number, got 'abc'"),
    ("bench_step.py", ["--steps", "5", "--warmup", "5"], "--warmup (5) must be below --steps (5)"),
    # Hydra overrides and the config they give: tracebacks (Hydra's, a RuntimeError, a ValueError) before
    ("bench_step.py", ["data.nokey=1"], "data.nokey is not a config key (data holds _target_, batch_size"),
    ("bench_step.py", ["trainer=nope"], "In 'train': Could not find 'trainer/nope' Available options in 'trainer'"),
    ("bench_step.py", ["trainer.precision=16-mixed"], "plain loop mirrors trainer.precision 32-true or bf16-mixed"),
    # several processes: Lightning's side failed inside fit on both ranks (a 2-process traceback), after a plain round
    ("bench_step.py", ["experiment=compression_sweep"], "both sides are timed in one process, and "
     "trainer.devices=2 with trainer.num_nodes=1 is not one process: add trainer.devices=1 trainer.num_nodes=1, or "
     "time DDP and its compression presets on 2 ranks with scripts/bench_comm.py"),
    ("bench_step.py", ["trainer.num_nodes=2"], "trainer.devices=1 with trainer.num_nodes=2 is not one process"),
    # an interpolation naming no key or no resolver: a traceback in instantiate, inside the first round
    ("bench_step.py", ["optimizer.lr=${nope}"], "optimizer.lr: interpolation key 'nope' not found: an interpolation"),
    ("bench_step.py", ["trainer.max_steps=${oc.evn:X}"],
     "trainer.max_steps: unsupported interpolation type oc.evn: no resolver has that name; did you mean oc.env?"),
    # an unset variable: OmegaConf's "KeyError raised while resolving interpolation: ... object_type=dict"
    ("bench_step.py", ["optimizer.lr=${oc.env:LIT_DTRAIN_H11_UNSET}"], "environment variable LIT_DTRAIN_H11_UNSET is "
     "not set (read by ${oc.env:LIT_DTRAIN_H11_UNSET}): set it, or give a default"),
    # a value train.py refuses in one line: a constructor's ValueError traceback in the first round, no JSON line
    ("bench_step.py", ["data.batch_size=${oc.env:LIT_DTRAIN_H1_UNSET,4}"], "data.batch_size must be an integer, got "
     "'4' (str): ${oc.env:...} gives text; read it as a number with ${oc.decode:"),
    ("bench_spikes.py", ["--variants", "clean,foo"], "argument --variants: unknown ['foo']; choose from"),
    ("bench_spikes.py", ["--inject", "nan_loss:2000"],
     "--inject: step(s) [2000] are not below --steps 2000: the run never reaches them"),
    # a window of 1 token: a model without context trained (bench_spikes.py refused it alone), exit 0
    ("bench_spikes.py", ["--block-size", "1"], WINDOW_OF_ONE),
    ("bench_optim_diag.py", ["--block-size", "1"], WINDOW_OF_ONE),
    ("bench_codecs.py", ["--block-size", "1"], WINDOW_OF_ONE),
    ("bench_comm.py", ["--block-size", "1"], WINDOW_OF_ONE),
    ("bench_wsd.py", ["--block-size", "1"], WINDOW_OF_ONE),
    ("bench_spikes.py", ["--warmup-steps", "1"], "--warmup-steps 1: LossSpikeMonitor needs >= 2 steps"),
    ("bench_spikes.py", ["--inject", "nan:5"], "argument --inject: 'nan:5': expected kind:step with kind in"),
    ("bench_wsd.py", ["--lrs", "1e-3,,2e-3"], "argument --lrs: expected a comma list without empty entries"),
    ("bench_wsd.py", ["--lrs", "1e-3,0"], "argument --lrs: '0': must be a finite number > 0, got 0"),
    ("bench_wsd.py", ["--fractions", "0.001"], "--fractions 0.001: a decay of round(0.001 * 80) = 0 steps"),
    ("bench_fourier.py", ["--variants", "brief_stages"], "--variants must include uniform"),
    ("bench_fourier.py", ["--eval-every", "0"], "argument --eval-every: must be >= 1, got 0"),
    ("bench_fourier.py", ["--block-sizes", "256", "1"], "--block-sizes 1: the Fourier samplers need blocks of >= 2"),
    ("bench_fourier.py", ["--merge", "missing.json"], "--merge 'missing.json': cannot read it"),
    ("bench_codecs.py", ["--codecs", "int8,int8"], "argument --codecs: ['int8'] listed twice in 'int8,int8'"),
    ("bench_comm.py", ["--rates", "1gbt"], "argument --rates: '1gbt': expected a positive tc rate"),
    ("bench_comm.py", ["--replot", "missing.json"], "--replot 'missing.json': cannot read it"),
    # trained every variant, then a ZeroDivisionError traceback from both ranks: the first two steps are not timed
    ("bench_comm.py", ["--steps", "2", "--chunk", "1"], "--steps must be >= 3 (each variant's first two steps are not"),
    # a negative seed: a ConfigError traceback at bench_spikes.py's first train.py run; bench_fourier.py trained on
    ("bench_spikes.py", ["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    ("bench_fourier.py", ["--seeds", "0", "-1"], "argument --seeds: must be >= 0, got -1"),
    ("bench_wsd.py", ["--seed", "-1"], "argument --seed: must be >= 0, got -1"),
    ("bench_comm.py", ["--seed", str(2**32)], f"argument --seed: must be <= {2**32 - 1} (the range of train.py's"),
    ("bench_activation_ckpt.py", ["--seed", "-3"], "argument --seed: must be >= 0, got -3"),
    ("generate.py", ["missing.ckpt"], "checkpoint 'missing.ckpt' does not exist"),
    ("spectrum.py", ["missing.ckpt", "--files"], "argument --files: expected at least one argument"),
    # Path('') is '.': the line said "--out '' is a directory; give a file path"
    ("spectrum.py", ["missing.ckpt", "--out", ""], "--out is empty; give a file path"),
    ("compare_runs.py", ["missing_run"], "run dir 'missing_run' does not exist"),
])
def test_bad_counts_are_refused_before_any_work(script, args, message, tmp_path, capfd):
    done = run_script(script, args, tmp_path, capfd)
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert message in json.loads(done.stdout.strip().splitlines()[-1])["error"]
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_step_on_a_gpu_config_without_cuda_is_one_line(tmp_path, capfd):
    """``bench_step.py trainer=gpu`` (scripts/gpu_checks.sh's step) on a machine without CUDA ended in a
    ``RuntimeError`` traceback, with no JSON line."""
    done = run_script("bench_step.py", ["trainer=gpu"], tmp_path, capfd)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    error = json.loads(done.stdout.strip().splitlines()[-1])["error"]
    assert error.startswith("trainer.accelerator=gpu, but torch ") and "sees no CUDA device" in error, error


def test_a_script_run_by_run_script_ends_as_in_its_own_python(tmp_path, capfd):
    """The tests above run each script in this process (``run_script``); a script run as its own Python gives the
    same status, stdout and stderr."""
    for script, args in (("compare_runs.py", ["missing_run"]), ("bench_step.py", ["--rounds", "0"])):
        own = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        here = run_script(script, args, tmp_path, capfd)
        assert (here.returncode, here.stdout, here.stderr) == (own.returncode, own.stdout, own.stderr), script


def test_bench_wsd_wipes_only_a_dir_of_its_own(tmp_path, capfd):
    """bench_wsd.py wipes --out-dir first: ``--out-dir .`` (or any dir of the user's) deleted it whole."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    done = run_script("bench_wsd.py", ["--out-dir", str(mine)], tmp_path, capfd)
    assert done.returncode == 2 and "exists and was not made by this script" in done.stderr, done.stderr[-2000:]
    assert (mine / "notes.txt").read_text() == "keep me"
    bench_wsd = load_script("bench_wsd", "_bench_wsd_wipe")
    (tmp_path / "empty").mkdir()
    assert not bench_wsd.wipeable(mine) and bench_wsd.wipeable(tmp_path / "empty")
    (mine / "notes.txt").unlink()
    (mine / "e1_wsd_lr0.001").mkdir()  # a run dir of an earlier bench_wsd.py, without the marker
    assert bench_wsd.wipeable(mine)
    bench = bench_wsd.Bench(bench_wsd.parse_args(["--out-dir", str(mine)]))
    assert sorted(p.name for p in mine.iterdir()) == [bench_wsd.MARKER] and bench.out == mine.resolve()


def test_an_error_names_the_script_also_where_a_test_loads_it(capsys):
    """A script loaded by a test (or another program) named itself after ``sys.argv[0]``, pytest's: its usage line
    and ``pytest: error: ...`` (``__main__.py: error``), both from its parser and from ``fail()``. Both name the
    script's file now, as when it runs as ``python scripts/x.py``."""
    spectrum = load_script("spectrum", "_spectrum_prog")
    with pytest.raises(SystemExit):
        spectrum.main(["missing.ckpt", "--windows", "0"])  # the parser's error
    err = capsys.readouterr().err
    assert err.startswith("usage: spectrum.py [-h]") and "\nspectrum.py: error: argument --windows:" in err, err
    with pytest.raises(SystemExit):
        spectrum.load_model("missing.ckpt")  # fail() without prog
    assert capsys.readouterr().err.startswith("spectrum.py: error: checkpoint 'missing.ckpt' does not exist")
    generate = load_script("generate", "_generate_prog")
    with pytest.raises(SystemExit):
        generate.main(["missing.ckpt"])
    assert capsys.readouterr().err.startswith("generate.py: error: checkpoint 'missing.ckpt'")
    # a --seed outside train.py's [0, 2**32 - 1]: a traceback ('Overflow when unpacking long long') past 2**64
    for seed, message in (("-1", "must be >= 0, got -1"), (str(2**70), f"must be <= {2**32 - 1}")):
        with pytest.raises(SystemExit):
            generate.main(["missing.ckpt", "--seed", seed])
        assert f"generate.py: error: argument --seed: {message}" in capsys.readouterr().err


def test_help_shows_each_options_default():
    """``--help`` printed ``--steps STEPS  steps per round`` with no number: the reader had to find each default in
    the source. An option with a default value now ends its help with it; one without a default (None, False, ''
    or []), or whose help already says its default, is left as written."""
    from lit_dtrain.utils.args import ScriptArgumentParser, comma_list

    p = ScriptArgumentParser(prog="s.py")
    p.add_argument("--steps", type=int, default=40, help="steps per round")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--prompt", default="def ", help="text to continue")
    p.add_argument("--frac", type=float, default=0.5, help="a share, in %% of the rest")
    p.add_argument("--out", default="a.png", help="PNG (default: a.png)")
    for name, default in [("--warmup", None), ("--title", ""), ("--maximize", []), ("--logy", False)]:
        p.add_argument(name, default=default, help=f"{name} help")
    text = " ".join(p.format_help().split())
    assert "steps per round (default: 40)" in text and "--seed SEED default: 1337" in text
    assert "text to continue (default: 'def ')" in text and "in % of the rest (default: 0.5)" in text
    assert text.count("default") == 5  # --out's own, none for the options without a value
    assert " ".join(p.format_help().split()) == text  # a second --help adds nothing
    # a list default as typed: bench_fourier.py's --help read 'default: ['stdlib', 'mixture']'
    p.add_argument("--corpora", nargs="+", default=["stdlib", "mixture"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds")
    p.add_argument("--variants", type=comma_list(), default=["a", "b"], help="variants")
    text = " ".join(p.format_help().split())
    assert "default: stdlib mixture" in text and "seeds (default: 0 1 2)" in text, text
    assert "variants (default: a,b)" in text and "['" not in text and "[0" not in text, text


def test_an_empty_lit_dtrain_cache_means_the_default_cache_dir_in_the_scripts(monkeypatch, tmp_path):
    """``LIT_DTRAIN_CACHE`` set but empty means ``~/.cache/lit_dtrain`` for ``train.py`` (docs/running.md), but the
    bench scripts read it with ``os.environ.get``: ``LIT_DTRAIN_CACHE= python scripts/bench_wsd.py`` took '' and
    stopped at ``data.cache_dir is empty``. They take ``paths.cache_dir``'s rule now."""
    from lit_dtrain.config_resolvers import default_cache_dir

    bench_comm = load_script("bench_comm")
    monkeypatch.chdir(tmp_path)  # parse_args makes its --out dir, outputs/bench_comm under the current directory
    for value in ("", "  "):
        monkeypatch.setenv("LIT_DTRAIN_CACHE", value)
        assert default_cache_dir() == "~/.cache/lit_dtrain"
        assert bench_comm.parse_args([]).cache_dir == "~/.cache/lit_dtrain"
    monkeypatch.setenv("LIT_DTRAIN_CACHE", "/data/tok")
    assert bench_comm.parse_args([]).cache_dir == "/data/tok"
    for script in ("bench_wsd.py", "bench_spikes.py", "bench_optim_diag.py"):  # the same call, heavier to load
        assert "default_cache_dir()" in (ROOT / "scripts" / script).read_text(), script


def test_bench_threads_ends_a_failed_run_with_one_line_and_the_json_error(tmp_path, capfd, monkeypatch):
    """A ``train.py`` run that failed ended ``bench_threads.py`` through ``sys.exit(text)``: its stderr, status 1
    and no JSON line on stdout (a caller reading the last line found nothing). It ends as every script's error does."""
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("LIT_DTRAIN_CACHE", str(tmp_path / "file" / "cache"))  # under a file: no cache is written
    done = run_script("bench_threads.py", ["--steps", "1", "--rounds", "1", "--variants", "single_omp1"], tmp_path,
                      capfd)
    assert done.returncode == 1, done.stderr[-2000:]
    error = json.loads(done.stdout.strip().splitlines()[-1])["error"]
    # train.py refuses a cache dir below a file with its config checks, before the seed
    assert error.startswith("single_omp1: train.py failed (status 1): error: data.cache_dir="), error
    assert "cannot hold token caches" in error and "is a file, not a directory" in error, error
    assert done.stderr.rstrip().endswith(f"bench_threads.py: error: {error}"), done.stderr[-2000:]


@pytest.mark.slow
def test_bench_comm_ends_a_failed_rank_with_one_line_and_the_json_error(tmp_path, capfd):
    """A rank that failed (here: a ``--cache-dir`` under a file) ended ``bench_comm.py`` in a ``CalledProcessError``
    traceback after the rank's, with no JSON line. The rank's traceback stays; then one line with its error."""
    (tmp_path / "file").write_text("")
    done = run_script("bench_comm.py", ["--no-netns", "--steps", "3", "--chunk", "1", "--variants", "ddp", "--rates",
                                        "1gbit", "--cache-dir", str(tmp_path / "file" / "cache"), "--out",
                                        str(tmp_path / "out")], tmp_path, capfd)
    assert done.returncode == 1, done.stderr[-2000:]
    error = json.loads(done.stdout.strip().splitlines()[-1])["error"]
    assert error.startswith("rank 0: lit_dtrain.data.corpus.CorpusError: cannot write the token cache"), error
    assert done.stderr.rstrip().endswith(f"bench_comm.py: error: {error}"), done.stderr[-2000:]
    assert "CalledProcessError" not in done.stderr


def test_bench_wsd_refuses_an_img_dir_that_is_a_file_before_any_run(tmp_path, capsys, monkeypatch):
    """``--img-dir`` naming a file was first used by the first plot, after experiment 1's runs had trained (a
    traceback, the runs' figures lost)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("")
    bench_wsd = load_script("bench_wsd", "_bench_wsd_img_dir")
    with pytest.raises(SystemExit) as exit_info:
        bench_wsd.parse_args(["--quick", "--img-dir", "a_file", "--out-dir", "out"])
    assert exit_info.value.code == 2
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert error.startswith("--img-dir 'a_file/wsd_vs_cosine.png': cannot create its directory"), error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # no run dir either


def test_bench_comm_main_runs_its_worker_with_the_flags_it_was_given(tmp_path, monkeypatch):
    """``bench_comm.main(argv)`` parsed ``argv`` but started the two ranks' worker with ``sys.argv[1:]``: called from
    Python (``main(["--no-netns", "--steps", "3", ...])``) the worker got its caller's command line (pytest's flags:
    the worker's argparse error, status 2) instead. The worker's command is checked here, without starting it."""
    bench_comm = load_script("bench_comm")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["caller.py", "--caller-flag"])
    commands = []

    def fake_run(cmd, *args, **kwargs):  # the worker, which writes the result file main reads next
        commands.append(cmd)
        raise SystemExit(0)

    monkeypatch.setattr(bench_comm.subprocess, "run", fake_run)
    flags = ["--steps", "3", "--chunk", "1", "--variants", "ddp", "--rates", "1gbit", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit):
        bench_comm.main(["--no-netns", *flags])
    [cmd] = commands
    worker_flags = cmd[2:cmd.index("--_worker")]
    assert worker_flags == flags, cmd
