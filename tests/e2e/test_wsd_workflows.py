"""WSD's workflows through train(cfg): decay branch, extend, continual pre-training, callback mode, the errors that
name a workflow's key. (The experiment configs are in test_wsd_experiment_configs.py.)"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import lightning as L
import pytest
import torch
from omegaconf import open_dict

from lit_dtrain.schedules import wsd_lr_factor
from lit_dtrain.train import ConfigError, train
from tests.conftest import PYTHON, ROOT, TINY, compose_cfg, make_corpus, subprocess_env

PEAK = 3e-3  # conf/optimizer/adamw.yaml


class Probe(L.Callback):
    """Records the LR of every optimizer step and the weights at train start."""

    def __init__(self) -> None:
        self.lrs: dict[int, float] = {}
        self.start_weights: dict[str, torch.Tensor] = {}
        self.start_step = -1

    def on_train_start(self, trainer, pl_module):
        self.start_step = trainer.global_step
        self.start_weights = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.lrs[trainer.global_step] = optimizer.param_groups[0]["lr"]


def run(cfg):
    with open_dict(cfg):
        cfg.callbacks.probe = {"_target_": "tests.e2e.test_wsd_workflows.Probe"}
        cfg.sample.max_new_tokens = 0
    metrics, objects = train(cfg)
    probe = next(c for c in objects["trainer"].callbacks if isinstance(c, Probe))
    return metrics, objects, probe


def weights(objects) -> dict[str, torch.Tensor]:
    return objects["module"].model.state_dict()


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def cfg_keys(cfg) -> list[str]:
    return list(cfg.keys())


@pytest.fixture(scope="module")
def two_step_ckpt(tmp_path_factory) -> Path:
    """last.ckpt of a tiny 2-step run (warmup 1, horizon 2), trained once for the tests that only read or copy it:
    ``tiny_cfg("trainer.max_steps=2", "sample.max_new_tokens=0")``."""
    root = tmp_path_factory.mktemp("two_step")
    cfg = compose_cfg(["trainer.max_steps=2", "sample.max_new_tokens=0"], root / "src", make_corpus(root / "corpus"))
    train(cfg)
    return root / "src" / "checkpoints" / "last.ckpt"


def tree_digest(root: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_decay_branch_continues_step_and_lr_and_leaves_the_source_run_alone(tiny_cfg):
    # a stable run planned for 100 steps (20% decay), stopped at step 4
    _, stable, _ = run(tiny_cfg("trainer.max_steps=4", "scheduler.total_steps=100", run="stable"))
    src_dir = Path(stable["trainer"].default_root_dir)
    ckpt = src_dir / "checkpoints" / "last.ckpt"
    before = tree_digest(src_dir)
    metrics, branch, probe = run(tiny_cfg(f"decay_branch.ckpt={ckpt}", "decay_branch.steps=3", run="branch"))
    assert probe.start_step == 4 and branch["trainer"].global_step == 7 and metrics["steps"] == 7
    # steps 4, 5, 6 are the decay, p = 1/3, 2/3, 1; the first branch step is the first decay value
    assert probe.lrs[4] == pytest.approx(PEAK * (1 - (1 / 3) ** 0.5), rel=1e-12)
    assert [probe.lrs[s] for s in (4, 5, 6)] == [PEAK * wsd_lr_factor(s, total_steps=7, decay_steps=3,
                                                                      warmup_steps=1) for s in (4, 5, 6)]
    assert probe.lrs[6] == 0.0
    assert tree_digest(src_dir) == before  # not one byte (nor mtime) of the source run changed
    # the branch is exactly a WSD run planned for 7 steps with a 3-step decay
    _, straight, sprobe = run(tiny_cfg("trainer.max_steps=7", "scheduler.decay_steps=3",
                                       "scheduler.decay_fraction=null", run="straight"))
    assert sprobe.lrs[4] == probe.lrs[4]
    assert same(weights(branch), weights(straight))


def test_extend_resumes_at_the_peak_without_rewarmup(tiny_cfg):
    common = ["scheduler.warmup_steps=2"]
    _, first, fprobe = run(tiny_cfg(*common, "trainer.max_steps=4", "scheduler.total_steps=8", run="short"))
    assert [fprobe.lrs[s] for s in range(4)] == [PEAK / 2, PEAK, PEAK, PEAK]
    ckpt = Path(first["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    _, ext, probe = run(tiny_cfg(*common, f"ckpt_path={ckpt}", "trainer.max_steps=12", run="extended"))
    assert ext["trainer"].global_step == 12
    assert [probe.lrs[s] for s in range(4, 10)] == [PEAK] * 6  # no re-warmup; decay = round(0.2*12) = 2
    assert probe.lrs[10] == pytest.approx(PEAK * (1 - 0.5**0.5)) and probe.lrs[11] == 0.0
    _, straight, _ = run(tiny_cfg(*common, "trainer.max_steps=12", run="straight12"))
    assert same(weights(ext), weights(straight))


def test_continual_pretraining_from_weights_with_rewarmup_and_replay(tmp_path):
    old, new = make_corpus(tmp_path / "old", seed=1), make_corpus(tmp_path / "new", seed=2, n_files=16)
    _, base, _ = run(compose_cfg(["trainer.max_steps=4"], tmp_path / "base", old))
    ckpt = Path(base["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    base_weights = {k: v.clone() for k, v in weights(base).items()}
    cpt = [
        f"init_from={ckpt}", "data=mixture", "trainer.max_steps=5", "scheduler.warmup_steps=3",
        "data.sources.0.name=old", "data.sources.0.kind=files", f"+data.sources.0.paths=[{old}]",
        "data.sources.0.weight=20", "data.sources.1.name=new", f"data.sources.1.paths=[{new}]",
        "data.sources.1.weight=80",
    ]
    metrics, objs, probe = run(compose_cfg(cpt, tmp_path / "cpt"))
    assert probe.start_step == 0 and objs["trainer"].global_step == 5  # the step starts fresh
    assert same(probe.start_weights, base_weights)  # ... from the checkpoint's weights
    assert [probe.lrs[s] for s in range(4)] == [PEAK / 3, PEAK * 2 / 3, PEAK, PEAK]  # configurable re-warmup
    opt_state = objs["trainer"].optimizers[0].state_dict()["state"]
    assert all(int(s["step"]) == 5 for s in opt_state.values())  # fresh optimizer state: 5 steps, not 4 + 5
    assert {"val/old/loss", "val/new/loss"} <= metrics.keys()  # old and new data tracked separately
    assert metrics["val/old/loss"] != metrics["val/new/loss"]
    # the replay share of the old corpus is the mixture weight: 20% of drawn windows
    dm = objs["datamodule"]
    draws = torch.cat([dm.sampler.global_batch(s, 64) for s in range(100)]).numpy()
    share_old = float((dm.train_windows.source_of(draws) == 0).mean())
    assert share_old == pytest.approx(0.2, abs=0.02)


def test_callback_mode_matches_the_scheduler_in_litllm(tiny_cfg, tmp_path, corpus):
    _, sched, sp = run(tiny_cfg("trainer.max_steps=6", "scheduler.warmup_steps=2", run="sched"))
    tiny_no_sched = [o for o in TINY if not o.startswith("scheduler.")]
    cb_cfg = compose_cfg([*tiny_no_sched, "trainer.max_steps=6", "~scheduler", "callbacks=[default,wsd]",
                          "callbacks.progress_bar=null", "callbacks.wsd.warmup_steps=2"], tmp_path / "cb", corpus,
                         tiny=False)
    assert "scheduler" not in cfg_keys(cb_cfg)
    _, cb, cp = run(cb_cfg)
    assert not cb["trainer"].lr_scheduler_configs
    assert cp.lrs == sp.lrs and len(cp.lrs) == 6
    assert same(weights(sched), weights(cb))


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["decay_branch.steps=3"], "decay_branch needs both ckpt and steps"),
        (["decay_branch.ckpt=/nonexistent.ckpt", "decay_branch.steps=3"], "decay_branch.ckpt"),
        (["decay_branch.ckpt=CKPT", "decay_branch.steps=0"], "decay_branch.steps"),
        (["decay_branch.ckpt=CKPT", "decay_branch.steps=3", "scheduler=cosine"], "needs the WSD schedule"),
        (["decay_branch.ckpt=CKPT", "decay_branch.steps=3", "scheduler.warmup_steps=5"], "inside the warmup"),
        (["decay_branch.ckpt=CKPT", "decay_branch.steps=3", "ckpt_path=CKPT"], "not both"),
        (["decay_branch.ckpt=CKPT", "decay_branch.steps=3", "RUN=src"], "give the branch its own run_name"),
        (["init_from=/nonexistent.ckpt"], "init_from"),
        (["init_from=CKPT", "ckpt_path=CKPT"], "either init_from"),
        (["init_from=CKPT", "model.d_model=48"], "does not fit the configured model"),
        # heads regrouped: every tensor keeps its shape, so load_state_dict alone took it silently
        (["init_from=CKPT", "model.n_head=4", "model.n_kv_head=2"],
         r"init_from: checkpoint .* it holds a model with n_head=2, n_kv_head=1, this model has n_head=4, n_kv_head=2"),
    ],
)
def test_workflow_config_errors_name_the_key(tiny_cfg, tmp_path, two_step_ckpt, overrides, match):
    ckpt = tmp_path / "src" / "checkpoints" / "last.ckpt"  # in the run dir of run_name 'src' of this test
    ckpt.parent.mkdir(parents=True)
    shutil.copyfile(two_step_ckpt, ckpt)
    ckpt = str(ckpt)
    run_name = next((o.split("=")[1] for o in overrides if o.startswith("RUN=")), "bad")
    overrides = [o.replace("CKPT", ckpt) for o in overrides if not o.startswith("RUN=")]
    with pytest.raises(ConfigError, match=match):
        train(tiny_cfg(*overrides, run=run_name))


@pytest.mark.slow
def test_branch_one_command_via_train_py(tmp_path, corpus):
    """The documented CLI: a stable run keeping its checkpoints, then one command for a decay branch. A key the branch
    sets, given on the command line with another value, is refused: ``trainer.max_steps=20`` (or a decay length of
    the schedule's own) was replaced without a word, and the branch stopped at S + N."""
    common = [o for o in TINY if not o.startswith("trainer.max_steps=")]
    common += ["data=textfiles", f"data.sources.0.paths=[{corpus}]", "sample.max_new_tokens=0"]

    def cli(*args, rc=0):
        proc = subprocess.run([PYTHON, str(ROOT / "train.py"), *common, *args], cwd=tmp_path,
                              env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=300)
        assert proc.returncode == rc, proc.stdout[-2000:] + proc.stderr[-2000:]
        return proc

    cli("run_name=stable", "trainer.max_steps=6", "scheduler.total_steps=100",
        "callbacks.model_checkpoint.save_top_k=-1")  # keep every checkpoint: each is a branch point
    (at3,) = (tmp_path / "outputs" / "runs" / "stable" / "checkpoints").glob("step000003-*.ckpt")
    proc = cli("run_name=decay_at_3", f"decay_branch.ckpt={at3}", "decay_branch.steps=2")
    assert "steps=5" in proc.stdout
    out = torch.load(tmp_path / "outputs/runs/decay_at_3/checkpoints/last.ckpt", weights_only=True)
    assert out["global_step"] == 5
    assert out["optimizer_states"][0]["param_groups"][0]["lr"] == 0.0  # the decay reached min_lr_factor 0
    branch = ("run_name=other", f"decay_branch.ckpt={at3}", "decay_branch.steps=2")
    for given, sets in [("trainer.max_steps=20", "trainer.max_steps=5"),
                        ("scheduler.decay_steps=4", "scheduler.decay_steps=2"),
                        ("scheduler.decay_fraction=0.5", "scheduler.decay_fraction=null")]:
        proc = cli(*branch, given, rc=1)
        assert f"error: decay_branch sets {sets} " in proc.stderr + proc.stdout
        assert f"but {given} is given" in proc.stderr + proc.stdout
    cli(*branch, "trainer.max_steps=5", "scheduler.decay_steps=2", "scheduler.decay_fraction=null")  # the same values
    assert (tmp_path / "outputs/runs/other/checkpoints/last.ckpt").is_file()


def test_interrupted_branch_resumes_itself_with_resume_auto(tiny_cfg, tmp_path, two_step_ckpt):
    from lit_dtrain.schedules.workflows import apply_decay_branch

    ckpt = two_step_ckpt
    args = (f"decay_branch.ckpt={ckpt}", "decay_branch.steps=3", "resume=auto")
    cfg = tiny_cfg(*args, run="br")
    assert apply_decay_branch(cfg) == 2 and cfg.ckpt_path == str(ckpt) and cfg.resume is None  # first start
    own = tmp_path / "br" / "checkpoints" / "last.ckpt"
    own.parent.mkdir(parents=True)
    own.write_bytes(ckpt.read_bytes())
    cfg = tiny_cfg(*args, run="br")
    apply_decay_branch(cfg)  # restart after an interruption: resume the branch's own last.ckpt
    assert cfg.ckpt_path is None and cfg.resume == "auto"
    assert cfg.trainer.max_steps == 5 and cfg.scheduler.total_steps == 5 and cfg.scheduler.decay_steps == 3


@pytest.mark.parametrize("mode", [[], ["~scheduler", "callbacks=[default,wsd]"]], ids=["scheduler", "callback"])
def test_branch_warmup_check_uses_the_branch_horizon_not_the_default_max_steps(tmp_path, mode):
    # The default warmup is ${lit.warmup:${trainer.max_steps}}; the branch sets max_steps = S + N, so the check
    # must see min(100, (S + N) // 10) = 7 here, not min(100, 1000 // 10) = 100 from conf/trainer's default.
    from lit_dtrain.config_checks import check_config
    from lit_dtrain.schedules.workflows import apply_decay_branch
    from tests.conftest import compose_cfg

    ckpt = tmp_path / "src" / "step60.ckpt"
    ckpt.parent.mkdir()
    torch.save({"global_step": 60, "state_dict": {}}, ckpt)
    cfg = compose_cfg([*mode, f"decay_branch.ckpt={ckpt}", "decay_branch.steps=10"], tmp_path / "branch", tiny=False)
    assert apply_decay_branch(cfg) == 60
    assert cfg.trainer.max_steps == 70
    node = cfg.scheduler if not mode else cfg.callbacks.wsd
    assert (node.total_steps, node.decay_steps, node.warmup_steps) == (70, 10, 7)
    check_config(cfg)  # the schedule the branch will run is valid


def test_scheduler_resuming_a_checkpoint_without_scheduler_state_follows_the_global_step(
        tiny_cfg, tmp_path, corpus):
    # a run with the WSDScheduler callback saves no LR-scheduler state; resuming (extending) it with the default
    # LR scheduler must run the schedule at global_step, not restart it at step 0 (re-warmup, decay 4 steps late)
    tiny_no_sched = [o for o in TINY if not o.startswith("scheduler.")]
    cb_overrides = [*tiny_no_sched, "~scheduler", "callbacks=[default,wsd]", "callbacks.progress_bar=null",
                    "callbacks.wsd.warmup_steps=2", "callbacks.wsd.total_steps=100", "trainer.max_steps=4"]
    _, first, _ = run(compose_cfg(cb_overrides, tmp_path / "cb", corpus, tiny=False))
    ckpt = Path(first["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    _, ext, probe = run(tiny_cfg("scheduler.warmup_steps=2", f"ckpt_path={ckpt}", "trainer.max_steps=8", run="ext"))
    assert ext["trainer"].global_step == 8
    expected = [PEAK * wsd_lr_factor(s, total_steps=8, warmup_steps=2, decay_steps=2) for s in range(4, 8)]
    assert [probe.lrs[s] for s in range(4, 8)] == expected  # PEAK, PEAK, PEAK * (1 - sqrt(1/2)), 0


def test_extending_a_finished_run_logs_each_steps_lr_at_that_step(tiny_cfg):
    # continuing a finished run (resume=auto, larger max_steps) whose last step validated: the LearningRateMonitor
    # ran before the logging-step fix-up, so the LR used at step 6 was logged at step 7 (6 missing, 7 twice)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def logged_lrs(objects) -> list[tuple[int, float]]:
        acc = EventAccumulator(str(Path(objects["trainer"].default_root_dir) / "tb"), size_guidance={"scalars": 0})
        acc.Reload()
        return [(e.step, e.value) for e in acc.Scalars("lr-AdamW/decay")]

    common = ["trainer.log_every_n_steps=1", "scheduler.warmup_steps=2", "scheduler.total_steps=10"]
    run(tiny_cfg(*common, "trainer.max_steps=6", run="ext"))  # validates (and checkpoints) at steps 3 and 6
    _, ext, probe = run(tiny_cfg(*common, "trainer.max_steps=10", "resume=auto", run="ext"))
    assert sorted(probe.lrs) == [6, 7, 8, 9]
    lrs = logged_lrs(ext)
    assert [s for s, _ in lrs] == list(range(10))
    assert [v for s, v in lrs if s >= 6] == pytest.approx([probe.lrs[s] for s in range(6, 10)], rel=1e-6)  # fp32 log


def test_rerunning_a_branch_into_its_own_dir_without_resume_auto_is_refused(tmp_path):
    # without resume=auto a second start of the same branch re-resumed the source checkpoint into a dir that already
    # held the first start's checkpoints: Lightning wrote last-v1.ckpt and step...-v1.ckpt beside them, and a later
    # resume=auto picked the stale last.ckpt (the guard a fresh run gets in resolve_ckpt_path)
    from lit_dtrain.schedules.workflows import apply_decay_branch
    from tests.conftest import compose_cfg

    src = tmp_path / "src" / "step4.ckpt"
    src.parent.mkdir()
    torch.save({"global_step": 4, "state_dict": {}}, src)
    args = [f"decay_branch.ckpt={src}", "decay_branch.steps=3"]
    cfg = compose_cfg(args, tmp_path / "br")
    assert apply_decay_branch(cfg) == 4 and cfg.ckpt_path == str(src)  # first start: an empty dir
    own = tmp_path / "br" / "checkpoints"
    own.mkdir(parents=True)
    (own / "last.ckpt").write_bytes(src.read_bytes())
    with pytest.raises(ConfigError, match="resume=auto"):
        apply_decay_branch(compose_cfg(args, tmp_path / "br"))
    cfg = compose_cfg([*args, "resume=auto"], tmp_path / "br")
    apply_decay_branch(cfg)  # with resume=auto it continues its own last.ckpt
    assert cfg.ckpt_path is None and cfg.resume == "auto"


def run_from_a_stable_checkpoint_with_the_default_warmup(tiny_cfg, src_steps: int, *overrides: str):
    """Train a stable run (warmup 1, horizon 100) for ``src_steps``, then run ``overrides`` (CKPT: its last.ckpt) with
    conf/scheduler/wsd.yaml's default warmup ``${lit.warmup:${trainer.max_steps}}`` (TINY sets warmup 1)."""
    _, src, _ = run(tiny_cfg(f"trainer.max_steps={src_steps}", "scheduler.total_steps=100", run="src"))
    ckpt = Path(src["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    cfg = tiny_cfg(*(o.replace("CKPT", str(ckpt)) for o in overrides), run="next")
    with open_dict(cfg):
        cfg.scheduler.warmup_steps = "${lit.warmup:${trainer.max_steps}}"
    return run(cfg)


def test_branch_from_a_stable_checkpoint_is_not_refused_for_a_default_warmup_grown_by_a_long_decay(tiny_cfg):
    # The source (warmup 1) is at its peak LR at step 2. A 28-step branch gets max_steps = 30, whose *default* warmup
    # min(100, max(1, 30 // 10)) = 3 lies past step 2: the branch runs no step < 3 in warmup, so that derived number
    # must not refuse it as "inside the warmup" (the checkpoint's LR shows it is past its own warmup).
    metrics, _, probe = run_from_a_stable_checkpoint_with_the_default_warmup(
        tiny_cfg, 2, "decay_branch.ckpt=CKPT", "decay_branch.steps=28"
    )
    assert probe.start_step == 2 and metrics["steps"] == 30
    assert [probe.lrs[s] for s in range(2, 30)] == [
        PEAK * wsd_lr_factor(s, total_steps=30, decay_steps=28) for s in range(2, 30)
    ]
    assert probe.lrs[2] == pytest.approx(PEAK * (1 - (1 / 28) ** 0.5), rel=1e-12) and probe.lrs[29] == 0.0


def test_branch_inside_an_explicit_warmup_names_the_key(tiny_cfg, two_step_ckpt):
    cfg = tiny_cfg(f"decay_branch.ckpt={two_step_ckpt}", "decay_branch.steps=3", "scheduler.warmup_steps=5", run="b")
    with pytest.raises(ConfigError, match=r"inside the warmup \(scheduler\.warmup_steps=5\)"):
        train(cfg)


def test_extending_a_stable_run_past_the_default_warmup_keeps_the_peak(tiny_cfg):
    # docs/wsd.md (b): ckpt_path=... trainer.max_steps=LARGER, "the restored step skips the warmup". The source
    # (warmup 1) is at its peak LR at step 4; the extension's *default* warmup min(100, max(1, 60 // 10)) = 6 used
    # to put step 4 back into a warmup: LR 5/6 of the peak, re-warmed over steps 4 and 5.
    metrics, _, probe = run_from_a_stable_checkpoint_with_the_default_warmup(
        tiny_cfg, 4, "ckpt_path=CKPT", "trainer.max_steps=60"
    )
    assert probe.start_step == 4 and metrics["steps"] == 60
    assert [probe.lrs[s] for s in range(4, 48)] == [PEAK] * 44  # stable; decay = round(0.2 * 60) = 12 steps
    assert [probe.lrs[s] for s in range(48, 60)] == [
        PEAK * wsd_lr_factor(s, total_steps=60, decay_steps=12) for s in range(48, 60)
    ]


def test_extending_a_decayed_checkpoint_warns_that_the_lr_jumps_up(tiny_cfg, caplog):
    # A finished run's last.ckpt has decayed to LR 0; ckpt_path=... trainer.max_steps=LARGER puts step 6 back in the
    # stable phase at the peak. decay_branch warned about this jump; the extension said nothing.
    def extend(total: int) -> list[str]:
        _, src, _ = run(tiny_cfg("trainer.max_steps=6", f"scheduler.total_steps={total}", run=f"src{total}"))
        ckpt = Path(src["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
        caplog.clear()
        with caplog.at_level("WARNING", logger="lit_dtrain.schedules.workflows"):
            _, _, probe = run(tiny_cfg(f"ckpt_path={ckpt}", "trainer.max_steps=10", run=f"ext{total}"))
        assert probe.lrs[6] == PEAK
        return [r.getMessage() for r in caplog.records if r.name == "lit_dtrain.schedules.workflows"]

    assert extend(100) == []  # a stable checkpoint: its LR for step 6 is already the peak
    [message] = extend(6)  # decayed: 1-sqrt over steps 5..5 (round(0.2 * 6) = 1), LR 0 for step 6
    assert "checkpoint" in message and "its LR for step 6 is [0, 0] (peak [0.003, 0.003])" in message
    assert "this run's is [0.003, 0.003]" in message and "jumps up" in message and "init_from" in message


def test_resume_auto_of_a_cpt_run_does_not_need_the_init_from_file(tiny_cfg, tmp_path, two_step_ckpt):
    """A continual-pre-training run restarted with ``resume=auto`` continues its own checkpoints, so the
    ``init_from`` file is not read again: deleted (a scratch dir cleaned before a requeue), the restart failed with
    ``init_from=... does not exist``. A first start still needs it."""
    init = tmp_path / "init.ckpt"
    shutil.copyfile(two_step_ckpt, init)
    args = (f"init_from={init}", "resume=auto", "scheduler.total_steps=6")
    _, first, _ = run(tiny_cfg(*args, "trainer.max_steps=3", run="cpt"))
    own = Path(first["trainer"].default_root_dir) / "checkpoints" / "last.ckpt"
    saved = {k[len("model."):]: v for k, v in torch.load(own, weights_only=True)["state_dict"].items()}
    init.unlink()
    _, resumed, probe = run(tiny_cfg(*args, "trainer.max_steps=6", run="cpt"))
    assert probe.start_step == 3 and resumed["trainer"].global_step == 6
    assert same(probe.start_weights, saved)  # continued from its own checkpoint
    with pytest.raises(ConfigError, match=r"init_from='.*init.ckpt' does not exist"):
        train(tiny_cfg(*args, run="fresh"))  # nothing to resume: the file is needed




def test_a_relative_interpolation_for_a_key_the_branch_sets_is_judged(tmp_path, two_step_ckpt, monkeypatch, capfd):
    """``scheduler.decay_steps=${.warmup_steps}`` (relative to its node, which Hydra's override parser cannot resolve
    alone) was not judged: the branch replaced it with decay_branch.steps without a word. It is read in the config."""
    from tests.conftest import run_script

    monkeypatch.setenv("LIT_DTRAIN_OUTPUT", str(tmp_path / "out"))
    branch = ["run_name=b", f"decay_branch.ckpt={two_step_ckpt}", "decay_branch.steps=3", "scheduler.warmup_steps=1"]
    proc = run_script("../train.py", [*branch, "scheduler.decay_steps=${.warmup_steps}"], tmp_path, capfd)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: decay_branch sets scheduler.decay_steps=3 (decay_branch.steps), but scheduler.decay_steps=1 is given; "
        "drop scheduler.decay_steps (decay_branch.steps is the decay's length)")
    assert not (tmp_path / "out" / "runs" / "b" / "checkpoints").exists()  # refused before training
