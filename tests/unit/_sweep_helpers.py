"""Helpers shared by the tests of the sweep checks (test_sweep_*.py and others): one job of a multirun, composed and
set up in-process the way Hydra sets it up."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.types import RunMode
from omegaconf import OmegaConf, open_dict

from tests.conftest import CONF_DIR, TINY, in_hydra_job


@contextlib.contextmanager
def multirun_job(job_dir: Path, sweep: list[str], job: list[str], corpus: Path, mode: RunMode = RunMode.MULTIRUN):
    """The config of one job of ``python <entry> -m *sweep``, which Hydra expanded to ``job``, with Hydra's runtime
    config set as in that job (``multirun.yaml`` of this start beside the job dir); ``mode=RunMode.RUN``: the one
    run of ``python <entry> *job``."""
    tiny = [o for o in TINY if not (o.startswith("scheduler.") and "~scheduler" in job)]
    base = [*tiny, "sample.max_new_tokens=0", "data=textfiles", f"data.sources.0.paths=[{corpus}]"]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        full = compose(config_name="train", overrides=base + job, return_hydra_config=True)
    with open_dict(full):
        full.hydra.mode = mode
        if mode == RunMode.MULTIRUN:
            full.hydra.job.num = int(job_dir.name)
        full.hydra.runtime.output_dir = str(job_dir)
        full.hydra.overrides.task = base + job
        full.paths.output_dir = str(job_dir)
        full.paths.cache_dir = str(job_dir.parent.parent / "token_cache")
    job_dir.parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save({"hydra": {"overrides": {"task": base + sweep}}}, job_dir.parent / "multirun.yaml")
    pinned = os.environ.get("LIT_DTRAIN_SWEEP_DIR")  # train(cfg) exports the sweep dir: not for later tests
    try:
        with in_hydra_job(full) as cfg:
            yield cfg
    finally:
        if pinned is None:
            os.environ.pop("LIT_DTRAIN_SWEEP_DIR", None)
        else:
            os.environ["LIT_DTRAIN_SWEEP_DIR"] = pinned
