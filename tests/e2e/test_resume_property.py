"""Property (hypothesis): any sequence of stop/resume points reproduces the uninterrupted run bitwise."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lit_dtrain.train import train
from tests.conftest import compose_cfg, make_corpus

TOTAL = 8
COMMON = [f"scheduler.total_steps={TOTAL}", "trainer.val_check_interval=3", "sample.max_new_tokens=0"]
_counter = itertools.count()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume_property")
    corpus = make_corpus(root / "corpus")
    _, objs = train(compose_cfg([*COMMON, f"trainer.max_steps={TOTAL}"], root / "straight", corpus))
    return root, corpus, {k: v.clone() for k, v in objs["module"].model.state_dict().items()}


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stops=st.lists(st.integers(min_value=1, max_value=TOTAL - 1), min_size=1, max_size=3, unique=True))
def test_any_sequence_of_resumes_matches_straight_run(workdir, stops):
    root, corpus, reference = workdir
    run = root / f"split_{next(_counter)}"
    ckpt = None
    for end in [*sorted(stops), TOTAL]:
        extra = [f"ckpt_path={ckpt}"] if ckpt else []
        _, objs = train(compose_cfg([*COMMON, f"trainer.max_steps={end}", *extra], run, corpus))
        assert objs["trainer"].global_step == end
        ckpt = Path(run) / "checkpoints" / "last.ckpt"
    final = objs["module"].model.state_dict()
    for k, v in reference.items():
        assert torch.equal(final[k], v), (stops, k)
