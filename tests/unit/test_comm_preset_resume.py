"""A resume under another codec or local-update rule than the one that wrote the checkpoint's comm state is refused
(``CompressedDDPStrategy.load_checkpoint``), and now before the fit: the refusal came after the resume had cut the
run's logs at the checkpoint's step, so ``resume=auto strategy=ddp_compressed/topk`` on a finished 2-rank ``int8``
run (model=nano, 6 steps) dropped the 2 rows of ``metrics.csv`` at step 6, its final validation among them, and then
trained nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lit_dtrain.errors import ConfigError
from lit_dtrain.strategies import CompressedDDPStrategy, make_ddp
from lit_dtrain.strategies.comm_checkpoint import CHECKPOINT_KEY, refuse_another_preset
from lit_dtrain.train import train


def _saved(tmp_path: Path, compressor=None, local_update=None) -> Path:
    """A checkpoint holding the comm state ``CompressedDDPStrategy(compressor, local_update)`` writes on one rank."""
    state = CompressedDDPStrategy(compressor=compressor, local_update=local_update).comm_state_dict()
    path = tmp_path / "last.ckpt"
    torch.save({"global_step": 4, CHECKPOINT_KEY: state}, path)
    return path


@pytest.mark.parametrize("written, resumed, named", [
    ("int8", "topk", "compressor 'int8' (this run: 'topk')"),
    ("int8", "int4", "compressor 'int8' (this run: 'int4')"),
    (None, "powersgd", "compressor 'none' (this run: 'powersgd')"),
])
def test_a_checkpoint_of_another_codec_is_refused_naming_both_and_the_preset(tmp_path, written, resumed, named):
    path = _saved(tmp_path, compressor=written)
    with pytest.raises(ConfigError) as caught:
        refuse_another_preset(CompressedDDPStrategy(compressor=resumed), path)
    message = str(caught.value)
    assert message.startswith(f"{path}: its comm state was written by {named}")
    assert f"(strategy=ddp_compressed/{written or 'none'})" in message and "or with strategy=ddp," in message


def test_a_checkpoint_of_a_codec_resumed_under_a_local_update_rule_is_refused(tmp_path):
    path = _saved(tmp_path, compressor="int8")
    with pytest.raises(ConfigError, match="local-update rule None \\(this run: 'local_sgd'\\)"):
        refuse_another_preset(CompressedDDPStrategy(local_update={"name": "local_sgd"}), path)
    diloco = _saved(tmp_path, local_update={"name": "diloco", "compressor": "int4"})
    with pytest.raises(ConfigError, match="pseudo-gradient compressor 'int4' \\(this run: 'int8'\\)"):
        refuse_another_preset(CompressedDDPStrategy(local_update={"name": "diloco", "compressor": "int8"}), diloco)


def test_what_the_load_accepts_passes(tmp_path):
    """The same codec with other settings, DiLoCo with its pseudo-gradient codec left out (its residuals are dropped
    with a warning at the load) or added, and another strategy (which warns that it drops the state)."""
    refuse_another_preset(CompressedDDPStrategy(compressor={"name": "topk", "ratio": 0.5}),
                          _saved(tmp_path, compressor="topk"))
    diloco = _saved(tmp_path, local_update={"name": "diloco", "compressor": "int4"})
    refuse_another_preset(CompressedDDPStrategy(local_update={"name": "diloco"}), diloco)
    refuse_another_preset(make_ddp(), diloco)
    plain = _saved(tmp_path, local_update={"name": "diloco"})
    refuse_another_preset(CompressedDDPStrategy(local_update={"name": "diloco", "compressor": "int8"}), plain)


def test_a_refused_resume_leaves_the_runs_logs_as_they_were(tiny_cfg):
    cfg = tiny_cfg("trainer.max_steps=4", "sample.max_new_tokens=0", "logger=csv", "strategy=ddp_compressed/int8")
    train(cfg)
    metrics = Path(cfg.paths.output_dir) / "csv" / "metrics.csv"
    before = metrics.read_text()
    step = before.splitlines()[0].split(",").index("step")
    assert any(row.split(",")[step] == "4" for row in before.splitlines()[1:])  # the rows a resume at 4 cuts
    resumed = tiny_cfg("trainer.max_steps=6", "sample.max_new_tokens=0", "logger=csv", "resume=auto",
                       "strategy=ddp_compressed/topk")
    with pytest.raises(ConfigError, match="'int8'.*'topk'"):  # (the fit's refusal said it as well, after the cut)
        train(resumed)
    assert metrics.read_text() == before
