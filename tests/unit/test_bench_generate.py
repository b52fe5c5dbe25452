"""scripts/bench_generate.py times the cached and uncached generation of one model and checks they agree."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import load_script


def test_bench_generate_reports_both_paths_and_their_agreement(capsys):
    threads = torch.get_num_threads()
    try:  # 20 tokens in a block of 16: the cached steps and the sliding window both run
        load_script("bench_generate").main(["--shapes", "nano", "--new-tokens", "3", "20", "--rounds", "1",
                                            "--block-size", "16", "--prompt-len", "4", "--batch", "2"])
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = [(r["shape"], r["block_size"], r["new_tokens"]) for r in result["rows"]]
    assert rows == [("nano", 16, 3), ("nano", 16, 20)]
    for row in result["rows"]:
        assert row["same_tokens"] is True and row["cached_tokens_per_s"] > 0 and row["uncached_tokens_per_s"] > 0
        ratio = row["cached_tokens_per_s"] / row["uncached_tokens_per_s"]  # of the rounded tokens/s
        assert row["speedup"] == pytest.approx(ratio, rel=0.02, abs=0.01)
    assert result["batch"] == 2 and result["prompt_len"] == 4 and result["device"] == "cpu"


def test_bench_generate_compares_every_rounds_pair_not_the_last_alone():
    """The docstring says every pair is checked to draw the same tokens, but only the last round's outputs were
    compared: a cached path that disagreed in an earlier round reported ``same_tokens: true``."""
    bench_generate = load_script("bench_generate")
    calls = []

    class Model:
        def generate(self, prompt, new_tokens, temperature, use_cache):
            calls.append(use_cache)
            wrong = use_cache and len(calls) == 3  # the first timed round's cached call (after 2 warm-up calls)
            return torch.full((1, new_tokens), 1 if wrong else 0)

    assert bench_generate.bench(Model(), torch.zeros(1, 4, dtype=torch.long), 3, rounds=2)["same_tokens"] is False
    assert calls == [True, False, True, False, True, False]
