"""scripts/bench_activation_ckpt.py: ``--device cpu`` (the default) keeps its keys and figures; the CUDA reporting
path (wall clock, CUDA peak instead of RSS) runs on CPU with the CUDA figures stubbed in.

The figures a CPU run prints for a tiny model are reproduced here independently with the same library calls on
the same seeded model and batch: activation bytes, backward FLOPs and a zero gradient difference against
``none`` (the budget plan depends on timings, so only its keys are checked). The CUDA measurements themselves
(``torch.cuda.max_memory_allocated``, synchronized wall time) need a GPU; this checks the reporting around them.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re

import pytest
import torch

from lit_dtrain.callbacks._checkpoint_policies import apply_checkpointing, every_k_plan, set_plan, uniform_plan
from lit_dtrain.models import Llama, LlamaConfig
from lit_dtrain.utils.memory import POINTWISE_OPS, backward_flops_by_op, measure_activation_memory
from tests.conftest import load_script

TINY_SHAPE = dict(d_model=64, n_layer=4, n_head=4, n_kv_head=2)
ARGV = ["--shapes", "tiny", "--seqs", "16", "--tokens", "64", "--repeats", "1", "--plot", ""]
POLICIES = ["none", "full", "every_k", "selective", "budget"]
# by_config keys of a CPU run before --device existed (commit 69ae026), in order, with saved_bytes_from
CPU_KEYS = ["saved_bytes_ratio", "saved_bytes_from", "max_act_ratio", "time_ratio", "max_abs_grad_diff", "peak_act_mib",
            "step_s", "wall_s", "peak_rss_mib", "step_rss_mib", "bwd_gflops_mm", "bwd_gflops_all"]
MiB = 2**20


@pytest.fixture
def bench(monkeypatch):
    mod = load_script("bench_activation_ckpt")
    monkeypatch.setitem(mod.SHAPES, "tiny", TINY_SHAPE)
    threads = torch.get_num_threads()
    yield mod
    torch.set_num_threads(threads)  # main() sets --threads for the whole process


@pytest.fixture(scope="module")
def cpu_run():
    """``(summary, stdout, configs)`` of one ``--device cpu`` run of ARGV: main()'s summary and output, and each of
    its ``run_config`` calls as ``((shape, seq, vars(args)), returned)``. Both the CPU test and the CUDA-reporting
    test read it: the run (every policy's memory, FLOPs and timings, through MemTracker) costs far more than either
    test's checks."""
    mod = load_script("bench_activation_ckpt", "_bench_actckpt_cpu_run")
    mod.SHAPES["tiny"] = TINY_SHAPE
    real_run_config, configs = mod.run_config, []

    def recorded(shape, seq, args):
        configs.append(((shape, seq, copy.deepcopy(vars(args))), real_run_config(shape, seq, args)))
        return copy.deepcopy(configs[-1][1])

    mod.run_config = recorded
    threads, out = torch.get_num_threads(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            summary = mod.main([*ARGV, "--device", "cpu"])
    finally:
        torch.set_num_threads(threads)  # main() sets --threads for the whole process
    return summary, out.getvalue(), configs


def test_defaults_are_the_cpu_benchmark_and_cuda_times_wall_clock(bench, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the default --plot was outputs/bench_actckpt/..., its dir made when checked
    args = bench.parse_args([])
    assert args.plot == "" and list(tmp_path.iterdir()) == []  # no plot unless --plot asks for one
    assert (args.device, args.dtype, args.clock, args.tokens, args.shapes, args.seqs, args.repeats) == (
        "cpu", "fp32", "cpu", 1024, "small,deep", "256,1024", 5)
    assert bench.step_clock(args) == "cpu"
    assert bench.step_clock(bench.parse_args(["--clock", "wall"])) == "wall"
    assert bench.step_clock(bench.parse_args(["--device", "cuda"])) == "wall"  # CPU time means nothing there


def test_cpu_run_keeps_its_keys_and_reproduces_its_figures(cpu_run):
    summary, out, _ = cpu_run
    assert json.loads(out.strip().splitlines()[-1]) == summary
    header = next(line for line in out.splitlines() if line.startswith("policy"))
    assert header.split()[:13] == ["policy", "peakACT", "MiB", "ratio", "maxACT", "cpu", "s", "ratio", "wall", "s",
                                   "RSS", "MiB", "+step"]
    assert "CUDA" not in out
    assert list(summary) == [*POLICIES, "targets", "settings"]
    assert summary["settings"] == {"clock": "cpu", "threads": 1, "tokens": 64, "repeats": 1, "every_k": 2,
                                   "memory_budget": 0.5}
    for p in POLICIES:
        assert list(summary[p]) == ["saved_bytes_ratio", "time_ratio", "max_abs_grad_diff", "by_config"]
        assert list(summary[p]["by_config"]) == ["tiny/T16"]
        assert list(summary[p]["by_config"]["tiny/T16"]) == CPU_KEYS

    # the same seeded model and batch (B = 64 // 16), measured directly
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=257, block_size=256, **TINY_SHAPE))
    ids = torch.randint(0, 257, (4, 17), generator=torch.Generator().manual_seed(0))
    blocks = list(model.blocks)
    wrappers = apply_checkpointing(blocks, uniform_plan(len(blocks), "none"))

    def loss():
        return torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1).float(), ids[:, 1:].flatten())

    def step():
        loss().backward()
        model.zero_grad(set_to_none=True)

    n = len(blocks)
    plans = {"none": uniform_plan(n, "none"), "full": uniform_plan(n, "full"), "every_k": every_k_plan(n, 2),
             "selective": uniform_plan(n, "selective")}  # the script's order
    peak = {}
    for p, plan in plans.items():
        set_plan(wrappers, plan)
        peak[p] = measure_activation_memory(step, model).peak_act / MiB
        flops = backward_flops_by_op(loss)
        model.zero_grad(set_to_none=True)
        row = summary[p]["by_config"]["tiny/T16"]
        assert row["peak_act_mib"] == peak[p]
        assert row["bwd_gflops_all"] == sum(flops.values()) / 1e9
        assert row["bwd_gflops_mm"] == sum(v for op, v in flops.items() if op not in set(POINTWISE_OPS)) / 1e9
        assert row["saved_bytes_ratio"] == peak[p] / peak["none"] and row["saved_bytes_from"] == "peak_act"
        assert row["max_abs_grad_diff"] == 0.0
        assert row["peak_rss_mib"] > 0 and row["step_s"] > 0
    assert peak["full"] < peak["selective"] < peak["none"]  # the policies differ, so the comparison means something
    assert summary["budget"]["max_abs_grad_diff"] == 0.0
    # the mm-only FLOPs check asked for none < selective, which selective's saved matmuls never give: MISS every run
    assert summary["targets"]["flops_none_eq_sel_lt_full_mm_only"] is True


def test_cuda_without_a_gpu_stops_with_a_message(bench, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        bench.main([*ARGV, "--device", "cuda"])
    assert e.value.code == 2  # and the last stdout line is the JSON error, as every script's bad input
    error = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert re.match(r"--device cuda, but torch .* sees no CUDA device", error)


def test_cuda_report_has_wall_clock_and_cuda_peak_instead_of_rss(bench, monkeypatch, capsys, tmp_path, cpu_run):
    """main()'s CUDA branch (table, JSON, plot), fed by a CPU run_config (``cpu_run``'s, of the same shape, seq and
    flags but --device) with made-up CUDA peaks."""
    ((cpu_shape, cpu_seq, cpu_args), cpu_config), = cpu_run[2]

    def run_config_with_cuda_peaks(shape, seq, args):
        assert (shape, seq, {**vars(args), "device": "cpu", "plot": ""}) == (cpu_shape, cpu_seq, cpu_args)
        cfg = copy.deepcopy(cpu_config)
        for i, r in enumerate(cfg["policies"].values()):
            del r["peak_rss_mib"], r["step_rss_mib"]
            r["cuda_peak_step_mib"] = 100.0 - 10 * i
            r["cuda_peak_ratio"] = r["cuda_peak_step_mib"] / 100.0
        return cfg

    monkeypatch.setattr(bench, "run_config", run_config_with_cuda_peaks)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    plot = tmp_path / "cuda.png"
    summary = bench.main([*ARGV[:-2], "--plot", str(plot), "--device", "cuda"])
    out = capsys.readouterr().out
    assert "(--clock cpu does not apply on CUDA)" in out and "RSS n/a" in out
    header = next(line for line in out.splitlines() if line.startswith("policy"))
    assert header.split()[5:13] == ["wall", "s", "ratio", "wall", "s", "CUDA", "MiB", "ratio"]
    assert json.loads(out.strip().splitlines()[-1]) == summary
    assert summary["settings"]["clock"] == "wall"
    assert (summary["settings"]["device"], summary["settings"]["gpu"], summary["settings"]["dtype"]) == (
        "cuda", "Fake GPU", "fp32")
    for i, p in enumerate(POLICIES):
        row = summary[p]["by_config"]["tiny/T16"]
        assert list(row) == [*CPU_KEYS[:8], "cuda_peak_step_mib", "cuda_peak_ratio", *CPU_KEYS[10:]]
        assert row["cuda_peak_step_mib"] == 100.0 - 10 * i
        assert summary[p]["cuda_peak_ratio"] == row["cuda_peak_ratio"] == (100.0 - 10 * i) / 100.0
    assert plot.stat().st_size > 0


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--repeats", "0"], "--repeats must be a positive integer, got 0"),
        (["--every-k", "0"], "--every-k must be a positive integer, got 0"),
        (["--threads", "0"], "--threads must be a positive integer, got 0"),
        (["--tokens", "-5"], "--tokens must be a positive integer, got -5"),
        (["--memory-budget", "-1"], "--memory-budget must be in (0, 1] (a fraction of none's peak ACT), got -1.0"),
        (["--seqs", "0"], "--seqs must be a comma list of positive integers, got '0'"),
        (["--seqs", "abc"], "--seqs must be a comma list of positive integers, got 'abc'"),
        (["--policies", "none,foo"], "--policies: unknown ['foo']; choose from"),
        (["--shapes", "huge"], "--shapes: unknown ['huge']; choose from"),
        (["--shapes", ""], "--shapes must name at least one of ['small', 'deep'"),
        (["--policies", ","], "--policies must name at least one of ['none', 'full', 'every_k'"),
        # every ratio was nan, the JSON line held no policy and the targets were {}: ratios are against none's
        (["--policies", "full,selective"], "--policies must include none (every ratio and grad diff is against"),
        # a KeyError traceback after the runs; --seqs 64,64 ran twice, by_config kept one table, the ratios both
        (["--policies", "none,full,none"], "--policies: ['none'] listed twice in 'none,full,none'"),
        (["--shapes", "small,small"], "--shapes: ['small'] listed twice in 'small,small'"),
        (["--seqs", "64,064"], "--seqs: ['64'] listed twice in '64,64'"),
    ],
)
def test_bad_flags_are_named_before_any_model_is_built(bench, capsys, flags, message):
    """--repeats 0 was a StatisticsError, --seqs 0 a ZeroDivisionError, --seqs abc, --every-k 0, --policies foo and
    a bad --memory-budget ValueErrors, --threads 0 a RuntimeError: tracebacks after the first model was built;
    --tokens -5 ran with batch 1 and reported tokens -5."""
    with pytest.raises(SystemExit) as e:
        bench.parse_args(flags)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_where_weights_set_the_memory_peak_the_ratio_is_of_the_largest_act_and_says_so(bench, capsys, monkeypatch,
                                                                                        tmp_path):
    """A wide model on a few tokens: the memory peaks with every gradient allocated, where no activation is left, so
    peak ACT gave every policy 1.0 (the small shape at T=16, B=2: 1.000 for full, whose largest ACT gave 0.159).
    Without --plot nothing is written (outputs/bench_actckpt/actckpt_memory_vs_time.png was, under the cwd)."""
    monkeypatch.chdir(tmp_path)
    bench.SHAPES["wide"] = dict(d_model=256, n_layer=2, n_head=4, n_kv_head=2)
    summary = bench.main(["--shapes", "wide", "--seqs", "8", "--tokens", "8", "--repeats", "1",
                          "--policies", "none,full"])
    out = capsys.readouterr().out
    assert list(tmp_path.iterdir()) == [] and "plot:" not in out
    full = summary["full"]["by_config"]["wide/T8"]
    assert full["saved_bytes_from"] == "max_act" and full["saved_bytes_ratio"] == full["max_act_ratio"] < 0.5
    assert "note: ratio = largest ACT over none's (as maxACT), not peak ACT" in out


def test_the_plot_path_is_checked_before_the_runs(tmp_path, capsys):
    """``--plot /tmp`` trained every policy, then wrote ``/tmp.png`` (matplotlib adds the suffix) and printed
    'plot: /tmp', exit 0; a ``.txt`` path failed in savefig after all the runs. Both are refused first now, and a
    path without a suffix is the ``.png`` it becomes."""
    bench = load_script("bench_activation_ckpt", "_bench_actckpt_plot")
    for plot, message in ((str(tmp_path), "is a directory; give a file path"),
                          (str(tmp_path / "fig.txt"), "matplotlib cannot write '.txt' files")):
        with pytest.raises(SystemExit) as exit_info:
            bench.parse_args(["--plot", plot])
        assert exit_info.value.code == 2
        assert message in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]
    assert bench.parse_args(["--plot", str(tmp_path / "fig")]).plot == str(tmp_path / "fig.png")
    assert bench.parse_args(["--plot", ""]).plot == ""
    assert list(tmp_path.iterdir()) == []
