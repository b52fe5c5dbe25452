"""scripts/bench_sampler_scaling.py: the growth figures are each variant's cost at the largest N over the smallest."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import load_script


def test_growth_is_largest_over_smallest_whatever_the_order_of_sizes(capsys):
    threads = torch.get_num_threads()
    try:  # the sizes given largest first: the growth was the first size's cost over the last's (0.83x for 1.2x)
        load_script("bench_sampler_scaling").main(["--sizes", "3000", "1000", "--steps", "2", "--warmup", "0",
                                                   "--block", "8"])
    finally:
        torch.set_num_threads(threads)
    lines = capsys.readouterr().out.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["sizes"] == [1000, 3000]
    assert [r["n"] for r in result["rows"]] == [1000] * 4 + [3000] * 4
    ms = {(r["n"], r["variant"]): r["ms_per_step"] for r in result["rows"]}
    for variant, growth in result["growth_largest_over_smallest"].items():
        assert growth == pytest.approx(ms[3000, variant] / ms[1000, variant])
    table = [line for line in lines if line.startswith("| moment_ratio |")]
    cells = table[0].strip("| ").split(" | ")
    assert [float(c) for c in cells[1:3]] == pytest.approx([ms[1000, "moment_ratio"], ms[3000, "moment_ratio"]],
                                                            abs=5e-4)
    assert float(cells[3]) == pytest.approx(result["growth_largest_over_smallest"]["moment_ratio"], abs=5e-3)
