"""Lightning's lines and Python warnings reach the run's log file (Hydra's train.log) as well as the console."""

from __future__ import annotations

import logging
import warnings

from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lit_dtrain.utils.job_log import console_lines_to_job_log, log_to_handlers


def test_lightning_lines_and_warnings_reach_the_file_handler_and_are_put_back(tmp_path, capsys, monkeypatch):
    log_file = tmp_path / "train.log"
    handler = logging.FileHandler(log_file)
    root = logging.getLogger()
    root.addHandler(handler)
    lightning = logging.getLogger("lightning.pytorch")
    monkeypatch.setattr(lightning, "propagate", False)  # as in train.py, which imports Lightning before Hydra logs
    console = []  # stands for the console: what warnings.showwarning printed before the block
    monkeypatch.setattr(warnings, "showwarning", lambda message, *args, **kwargs: console.append(str(message)))
    handlers_before, shown_before = list(lightning.handlers), warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            shown_in = None
            with console_lines_to_job_log():
                shown_in = warnings.showwarning
                rank_zero_warn("AdaptiveGradClip runs before Lightning's gradient_clip_val=1.0")
                rank_zero_info("`Trainer.fit` stopped: `max_steps=4` reached.")
                log_to_handlers(logging.getLogger("lit_dtrain.train"), "summary: val_loss=4.2036")
            warnings.warn("after the run", UserWarning, stacklevel=1)  # not copied once the block is left
            logging.getLogger("lightning.pytorch").info("after the run, Lightning")
    finally:
        root.removeHandler(handler)
        handler.close()
    text = log_file.read_text()
    assert "[py.warnings][WARNING]" not in text  # Hydra's format is not set here: the plain message
    assert text.count("AdaptiveGradClip runs before Lightning's gradient_clip_val=1.0") == 1
    assert "UserWarning" in text
    assert text.count("`Trainer.fit` stopped: `max_steps=4` reached.") == 1
    assert text.count("summary: val_loss=4.2036") == 1
    assert "after the run" not in text
    assert shown_in is not shown_before
    assert warnings.showwarning is shown_before and lightning.handlers == handlers_before
    # the console still shows each warning once, as before (and log_to_handlers writes to the files only)
    assert console == ["AdaptiveGradClip runs before Lightning's gradient_clip_val=1.0", "after the run"]
    assert "summary: val_loss" not in capsys.readouterr().err


def test_without_a_file_handler_nothing_changes(monkeypatch):
    root = logging.getLogger()  # (pytest's logging plugin keeps a FileHandler of its own on the root logger)
    monkeypatch.setattr(root, "handlers", [h for h in root.handlers if not isinstance(h, logging.FileHandler)])
    lightning = logging.getLogger("lightning.pytorch")
    monkeypatch.setattr(lightning, "propagate", False)
    shown, handlers = warnings.showwarning, list(lightning.handlers)
    with console_lines_to_job_log():
        assert warnings.showwarning is shown and lightning.handlers == handlers
