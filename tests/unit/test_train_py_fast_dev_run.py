"""``python train.py +trainer.fast_dev_run=true``, Lightning's smoke test: it leaves a run dir as it found it (no
checkpoint for ``resume=auto`` to take, and a finished run's record unchanged)."""

from __future__ import annotations

from pathlib import Path


def test_train_py_under_fast_dev_run_leaves_no_checkpoint_for_resume_auto(tiny_cfg):
    """``python train.py +trainer.fast_dev_run=true``: Lightning suppresses checkpointing in a smoke test, but train()
    wrote its own final last.ckpt (step 1), which a real run with the same run_name and resume=auto then resumed."""
    from omegaconf import open_dict

    from lit_dtrain.train import train

    cfg = tiny_cfg("trainer.val_check_interval=2")
    with open_dict(cfg):
        cfg.trainer.fast_dev_run = True
    metrics, _ = train(cfg)
    assert metrics["steps"] == 1 and metrics["checkpoint"] is None
    assert sorted(p.name for p in Path(cfg.paths.output_dir).rglob("*.ckpt")) == []


def test_train_py_under_fast_dev_run_keeps_the_run_dirs_record(tiny_cfg):
    """A smoke test in a run dir (``resume=auto`` in a finished run's, the way its run-dir check says to go on)
    replaced that run's summary.json by its own (val_loss 4.2036 -> 4.2606, one batch's; checkpoint last.ckpt -> null)
    and its config_resolved.yaml and overrides.yaml, which compare_runs.py reads: now it writes none of them."""
    from omegaconf import open_dict

    from lit_dtrain.train import train

    cfg = tiny_cfg("trainer.val_check_interval=2")
    with open_dict(cfg):
        cfg.trainer.fast_dev_run = True
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True)
    record = {name: f"the finished run's {name}\n" for name in ("summary.json", "config_resolved.yaml",
                                                                  "overrides.yaml")}
    for name, text in record.items():
        (out / name).write_text(text)
    metrics, _ = train(cfg)
    assert metrics["steps"] == 1
    assert {name: (out / name).read_text() for name in record} == record
