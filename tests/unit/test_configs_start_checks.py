"""Checks at the start of a run: a val fraction without a batch, a schedule horizon below max_steps, torchrun
restarts and launches that do not match the trainer, several nodes without a launcher."""

import logging
import math
import re
from pathlib import Path

import pytest

from lit_dtrain.train import ConfigError


def test_a_val_fraction_that_rounds_to_no_batch_is_refused_before_the_first_step(tiny_cfg, monkeypatch):
    """trainer.limit_val_batches=0.1 of a 1-batch val loader: Lightning raised at the first validation,
    val_check_interval steps in and before any checkpoint (a run trained 15 steps and saved nothing). The loaders'
    sizes are known at fit start: the run now stops there, naming the key, the sizes and the smallest fraction that
    works; a fraction that leaves a batch trains."""
    from lit_dtrain.module import LitLLM
    from lit_dtrain.train import train

    steps = []
    original = LitLLM.training_step
    monkeypatch.setattr(LitLLM, "training_step", lambda self, *a, **k: steps.append(1) or original(self, *a, **k))
    cfg = tiny_cfg("trainer.limit_val_batches=0.1", "data.max_val_windows=16", "data.val_batch_size=8")
    with pytest.raises(ConfigError, match=r"limit_val_batches=0\.1 leaves no validation batch.*'text': 2.*>= 0\.5"):
        train(cfg)
    assert steps == []
    assert not (Path(cfg.paths.output_dir) / "checkpoints" / "last.ckpt").exists()
    metrics, _ = train(tiny_cfg("trainer.limit_val_batches=0.5", "data.max_val_windows=16", "data.val_batch_size=8",
                                "sample.max_new_tokens=0", run="ok"))
    assert metrics["steps"] == 6 and math.isfinite(metrics["val_loss"])


@pytest.mark.parametrize("batches", [3, 9, 49, 1000])
def test_the_smallest_val_fraction_a_refusal_suggests_keeps_a_batch(batches):
    """The refusal of a val fraction that leaves no batch suggests the smallest fraction that works. It printed
    1 / batches to 3 significant digits, rounded to nearest: 0.333 for a 3-batch loader, which leaves int(3 x 0.333) = 0
    batches (Lightning's count) and is refused again; 1 / 49 fails even unrounded (49 x (1/49) < 1 in floats)."""
    from types import SimpleNamespace

    from lit_dtrain.train_callbacks import ValLimitCheck

    loaders = [range(batches), range(3 * batches)]  # 0.5 / batches leaves the large one a batch
    trainer = SimpleNamespace(datamodule=SimpleNamespace(val_dataloader=lambda: loaders))
    module = SimpleNamespace(val_names=["small", "large"])
    with pytest.raises(ConfigError, match=rf"is 0 for {{'small': {batches}}}.*fraction >= ([0-9.]+),") as e:
        ValLimitCheck(0.5 / batches).on_fit_start(trainer, module)
    suggested = float(re.search(r"fraction >= ([0-9.]+),", str(e.value)).group(1))
    assert all(int(len(loader) * suggested) >= 1 for loader in loaders), suggested
    assert suggested <= 1.01 / batches  # and it is still the smallest, to 3 significant digits
    ValLimitCheck(suggested).on_fit_start(trainer, module)  # the suggestion is accepted


def test_a_schedule_horizon_below_max_steps_is_warned_about(tiny_cfg, caplog):
    """scheduler=cosine scheduler.total_steps=3 trainer.max_steps=6 trained steps 3..5 at the floor
    (min_lr_factor of the peak; 0 for WSD) without a word; the WSD callback warns for the same case. A warning, not
    an error: a horizon above max_steps plans a stable run to branch from (docs/wsd.md)."""

    from lit_dtrain.config_checks import warn_if_the_schedule_ends_early
    from lit_dtrain.train import train

    caplog.set_level(logging.WARNING, logger="lit_dtrain.config_checks")
    _, objs = train(tiny_cfg("scheduler=cosine", "scheduler.total_steps=3", "sample.max_new_tokens=0"))
    warned = [r.getMessage() for r in caplog.records if "scheduler.total_steps" in r.getMessage()]
    assert warned == [
        "scheduler.total_steps=3 is below trainer.max_steps=6: the cosine_scheduler ends at step 2 and the last 3 "
        "steps run at min_lr_factor=0.1 of the peak LR. Set scheduler.total_steps=6 (or leave it at its default, "
        "${trainer.max_steps}), or trainer.max_steps=3"
    ]
    lr = objs["trainer"].optimizers[0].param_groups[0]["lr"]
    assert lr == pytest.approx(0.1 * objs["module"].trainer.lr_scheduler_configs[0].scheduler.base_lrs[0])

    def warnings_for(*overrides, start_step=0):
        caplog.clear()
        warn_if_the_schedule_ends_early(tiny_cfg(*overrides), start_step)
        return [r.getMessage() for r in caplog.records]

    (wsd,) = warnings_for("scheduler.total_steps=4")  # the default wsd: its floor is 0
    assert wsd.startswith("scheduler.total_steps=4 is below trainer.max_steps=6: the wsd_scheduler ends at step 3 "
                          "and the last 2 steps run at min_lr_factor=0.0 of the peak LR")
    (resumed,) = warnings_for("scheduler=cosine", "scheduler.total_steps=3", start_step=4)  # this run's steps only
    assert "and the last 2 steps run at" in resumed
    (one,) = warnings_for("scheduler.total_steps=5")  # it said "the last 1 steps run at"
    assert "ends at step 4 and the last 1 step runs at min_lr_factor=0.0 of the peak LR" in one
    assert warnings_for("scheduler=cosine", "scheduler.total_steps=3", start_step=6) == []
    assert warnings_for("scheduler=cosine") == []  # total_steps: ${trainer.max_steps}
    assert warnings_for("scheduler=cosine", "scheduler.total_steps=100") == []  # a longer horizon, on purpose
    assert warnings_for("scheduler=constant") == []
    (rounded,) = warnings_for("trainer.max_steps=4", "scheduler.total_steps=2")  # 0.2 of 2 rounds to no decay
    assert rounded == (
        "scheduler.total_steps=2 is below trainer.max_steps=4: the wsd_scheduler ends at step 1 with no decay "
        "(decay_fraction=0.2 of 2 steps rounds to 0 decay steps), so its LR falls from the peak straight to "
        "min_lr_factor=0.0 of the peak and the last 2 steps run at it. Set scheduler.total_steps=4 (or leave it at its "
        "default, ${trainer.max_steps}), or trainer.max_steps=2 with scheduler.decay_steps=1 or more for a decay")
    caplog.set_level(logging.INFO, logger="lit_dtrain.config_checks")  # a longer horizon says where the run stops
    assert warnings_for("scheduler=cosine", "scheduler.total_steps=100") == [
        "scheduler.total_steps=100 is above trainer.max_steps=6: this run stops at step 5 with the LR at 0.9943 of "
        "the peak, before its schedule ends (at step 99)"
    ]


def test_torchrun_restarts_that_cannot_continue_the_run_are_warned_about(tiny_cfg, caplog):
    """Under torchrun --max-restarts, a restarted worker runs the same command: without resume=auto it was a fresh
    start refused in the run dir (using up the restarts). On several nodes with the agent's shared store a restart
    can read the failed attempt's addresses (pytorch#135712): the warning names c10d and the variable, which static
    rendezvous ignores. On one node each attempt has keys of its own, and the warning that advised the variable for
    every gloo launch, where under --master-port every restart failed in seconds with it, is gone."""

    from lit_dtrain._launch_checks import warn_about_torchrun_restarts

    caplog.set_level(logging.WARNING, logger="lit_dtrain.config_checks")
    torchrun = {"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "1"}

    def warnings_for(env, *overrides):
        caplog.clear()
        warn_about_torchrun_restarts(tiny_cfg(*overrides), env)
        return [r.getMessage() for r in caplog.records]

    (fresh,) = warnings_for(torchrun)  # one node: only the missing resume=auto
    assert fresh.startswith("torchrun --max-restarts=2: a restarted worker continues this run only with resume=auto")
    assert warnings_for(torchrun, "resume=auto") == []
    (store,) = warnings_for({**torchrun, "GROUP_WORLD_SIZE": "2"}, "resume=auto")
    assert store.startswith("torchrun --max-restarts=2 on 2 nodes with torchrun's shared store") and \
        "launch with --rdzv-backend=c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in store
    assert warnings_for({**torchrun, "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "False"},
                        "resume=auto") == []  # the setting
    assert warnings_for({**torchrun, "TORCHELASTIC_RESTART_COUNT": "1"}) == []  # said at the first start only
    assert warnings_for({**torchrun, "TORCHELASTIC_MAX_RESTARTS": "0"}) == []  # no restarts
    assert warnings_for({}) == []  # not under torchrun


@pytest.mark.parametrize(
    "overrides, env, message",
    [
        ((), {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"},  # tiny_cfg: trainer.devices=1
         "trainer.devices=1 starts 1 process(es) per node, but torchrun started LOCAL_WORLD_SIZE=2 workers per node: "
         "set trainer.devices=2 trainer.num_nodes=1"),
        (("trainer.devices=auto",), {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"},  # the default: 1 process on a CPU
         "trainer.devices=auto starts 1 process(es) per node, but torchrun started LOCAL_WORLD_SIZE=2 workers per "
         "node: set trainer.devices=2 trainer.num_nodes=1 (on a CPU: trainer=ddp_cpu trainer.devices=2), or torchrun "
         "--nproc_per_node=1 (each worker would train a run of its own, all in one run dir)"),
        (("trainer=ddp_cpu", "trainer.devices=4"), {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"},
         "trainer.devices=4 starts 4 process(es) per node, but torchrun started LOCAL_WORLD_SIZE=2"),
        (("trainer=ddp_cpu",), {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"},
         "trainer.num_nodes=1 x 2 workers per node = 2 processes, but torchrun's WORLD_SIZE=4: set trainer.devices=2 "
         "trainer.num_nodes=2"),
        (("trainer=ddp_cpu",), {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"}, None),  # what torchrun started
        (("trainer=ddp_cpu", "trainer.num_nodes=2"), {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "4"}, None),
        ((), {"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1"}, None),  # torchrun --nproc_per_node=1: one process
    ],
)
def test_a_torchrun_launch_that_does_not_match_the_trainer_is_refused_before_any_compute(tiny_cfg, overrides, env,
                                                                                          message):
    """`torchrun --nproc_per_node=2 train.py` with the default trainer.devices (auto: one process on a CPU) trained
    2 single-process runs into one run dir, both exiting 0 (last.ckpt and last-v1.ckpt); Lightning checks the world
    size only for a strategy of several processes."""
    from lit_dtrain._launch_checks import check_torchrun_launch

    env = {"TORCHELASTIC_RUN_ID": "abc", **env}
    if message is None:
        check_torchrun_launch(tiny_cfg(*overrides), env)
        check_torchrun_launch(tiny_cfg(*overrides), {})  # not under torchrun: nothing to check
        return
    with pytest.raises(ConfigError) as e:
        check_torchrun_launch(tiny_cfg(*overrides), env)
    assert str(e.value).startswith(message)
    check_torchrun_launch(tiny_cfg(*overrides), {k: v for k, v in env.items() if k != "TORCHELASTIC_RUN_ID"})


@pytest.mark.parametrize(
    "env, message",
    [
        ({}, "trainer.num_nodes=2 without torchrun or srun: Lightning's own launch on each node reads the first "
             "node's address and this node's rank from MASTER_ADDR and NODE_RANK, and MASTER_ADDR and NODE_RANK are "
             "not set"),
        ({"MASTER_ADDR": "10.0.0.1"}, "and NODE_RANK is not set"),
        ({"MASTER_ADDR": "10.0.0.1", "NODE_RANK": "1"}, None),  # Lightning's own multi-node launch
        ({"TORCHELASTIC_RUN_ID": "x"}, None),  # torchrun gives the ranks (its own check is check_torchrun_launch)
        ({"SLURM_NTASKS": "4"}, None),  # srun: lit_dtrain.slurm checks it
    ],
)
def test_several_nodes_without_a_launcher_or_their_addresses_are_refused(tiny_cfg, env, message):
    """`python train.py trainer=ddp_cpu trainer.num_nodes=2` on one machine, with no launcher and no MASTER_ADDR /
    NODE_RANK: Lightning's launch waited for the other node's 2 ranks on 127.0.0.1 until the collective timeout."""
    from lit_dtrain._launch_checks import check_multinode_launch

    cfg = tiny_cfg("trainer=ddp_cpu", "trainer.num_nodes=2")
    if message is None:
        check_multinode_launch(cfg, env)
    else:
        with pytest.raises(ConfigError, match=re.escape(message)):
            check_multinode_launch(cfg, env)
    check_multinode_launch(tiny_cfg("trainer=ddp_cpu"), {})  # one node: nothing to check


def test_a_horizon_below_max_steps_that_rounds_to_no_decay_is_one_warning(tiny_cfg, caplog):
    """scheduler.total_steps=2 trainer.max_steps=4: 'the last 2 steps run at min_lr_factor=0.0' from the start check,
    then 'no decay, the LR stays at its peak to the last step and never reaches min_lr_factor' from the schedule's
    build: both true, read as a contradiction. The start check's warning says both; the build says nothing more,
    while a schedule built without that check (a project of one's own) still warns."""
    import torch
    from hydra.utils import instantiate

    from lit_dtrain.config_checks import warn_if_the_schedule_ends_early

    caplog.set_level(logging.WARNING)
    cfg = tiny_cfg("trainer.max_steps=4", "scheduler.total_steps=2")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    warn_if_the_schedule_ends_early(cfg)
    instantiate(cfg.scheduler)(optimizer)
    rounded = [r.getMessage() for r in caplog.records if "rounds to 0" in r.getMessage()]
    assert len(rounded) == 1 and rounded[0].startswith("scheduler.total_steps=2 is below trainer.max_steps=4")
    caplog.clear()
    warn_if_the_schedule_ends_early(tiny_cfg("trainer.max_steps=2"))  # no horizon warning: the build's own
    instantiate(cfg.scheduler)(optimizer)
    assert [r.getMessage()[:41] for r in caplog.records] == ["WSD: decay_fraction=0.2 of total_steps=2 "]


@pytest.mark.parametrize(("overrides", "continues"), [((), False), (("resume=auto",), True)])
def test_train_tells_slurm_whether_a_requeue_continues_the_run(tiny_cfg, monkeypatch, overrides, continues):
    """train() arms the requeue signal with resume=auto's answer and checks a requeued fresh start (lit_dtrain.slurm's
    own tests give these functions their arguments; a train() that passed continues=True always requeued a job
    that would start over)."""
    import lit_dtrain.train as train_module

    calls = []

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(train_module, "catch_requeue_signal", lambda continues: calls.append(("signal", continues)))
    monkeypatch.setattr(train_module, "warn_about_a_requeued_fresh_start",
                        lambda cfg, ckpt_path: calls.append(("warn", ckpt_path)))
    monkeypatch.setattr(train_module, "check_torchrun_launch", stop)  # the check after them: nothing trains
    with pytest.raises(Stop):
        train_module.train(tiny_cfg(*overrides))
    assert calls == [("signal", continues), ("warn", None)]


@pytest.mark.parametrize(("override", "line"), [
    # a node '+' added without choosing the callback: refused as the callbacks were built, after the model
    ("+callbacks.loss_spike.z=3", "callbacks.loss_spike has no _target_ (it holds only z); a conf/callbacks option "
                                  "is chosen first ('callbacks=[default,<option>]'), or callbacks.loss_spike given a "
                                  "_target_"),
    # the model's shape: refused as the model was built, after the seed and the datamodule
    ("model.n_layer=0", "model: LlamaConfig.n_layer must be positive, got 0"),
    ("model.n_head=3", "model: LlamaConfig.d_model=32 is not divisible by n_head=3"),
    ("model.dropout=1.5", "model: LlamaConfig.dropout must be in [0, 1), got 1.5"),
])
def test_a_callback_without_target_or_a_bad_model_shape_is_refused_before_the_seed(tiny_cfg, monkeypatch, override,
                                                                                  line):
    """'Seed set to 1337' was printed before these refusals: the run had seeded (and built the datamodule, and for
    the callback the model) first. They are config checks now, before any of it."""
    import lightning as L

    from lit_dtrain.train import train

    def seeded(*args, **kwargs):
        raise AssertionError("seeded before the config was refused")

    monkeypatch.setattr(L, "seed_everything", seeded)
    with pytest.raises(ConfigError) as refused:
        train(tiny_cfg(override))
    assert str(refused.value) == line


@pytest.mark.parametrize(("override", "words"), [
    ("data.batch_size=0", "data.batch_size must be >= 1, got 0"),
    ("data.sources.0.weight=inf", "weight must be finite and >= 0, got inf"),
    ("data.cache_dir=''", "data.cache_dir is empty ('')"),
    ("data/sampler=fourier data.sampler.min_prob=2", "FourierSampler needs 0 < min_prob <= max_prob, got 2, 1.0"),
])
def test_the_datamodules_own_argument_checks_come_before_the_seed(tiny_cfg, monkeypatch, override, words):
    """LMDataModule's checks ran as the run built it, after 'Seed set to 1337': the config checks build it once."""
    import lightning as L

    from lit_dtrain.train import train

    monkeypatch.setattr(L, "seed_everything", lambda *a, **k: pytest.fail("seeded before the config was refused"))
    with pytest.raises(Exception) as refused:
        train(tiny_cfg(*override.split(" ")))
    assert words in f"{refused.value} {refused.value.__cause__}"


def test_a_missing_corpus_path_or_a_cache_dir_below_a_file_is_refused_before_the_seed(tiny_cfg, tmp_path,
                                                                                         monkeypatch):
    """Both were refused in prepare_data, after 'Seed set to 1337' and with config_resolved.yaml written (the cache
    dir after the whole corpus was read): one line before the seed now, naming the key. A cache dir that cannot be
    written to is not refused here: another user's read-only cache dir serves its caches."""
    import lightning as L

    from lit_dtrain.data.corpus import CorpusError
    from lit_dtrain.train import train

    monkeypatch.setattr(L, "seed_everything", lambda *a, **k: pytest.fail("seeded before the config was refused"))
    (tmp_path / "a_file").write_text("x")
    for overrides, line in [
        ([f"data.sources.0.paths=[{tmp_path / 'nope'}]"],
         f"data.sources.0 (data source 'text'): path '{tmp_path / 'nope'}' does not exist"),
        ([f"data.cache_dir={tmp_path / 'a_file' / 'cache'}"],
         f"data.cache_dir='{tmp_path / 'a_file' / 'cache'}' cannot hold token caches: '{tmp_path / 'a_file'}' is a "
         "file, not a directory; move it away or point LIT_DTRAIN_CACHE (paths.cache_dir) elsewhere"),
        ([f"data.sources.0.paths=[{tmp_path / 'nothing' / '*.txt'}]"],
         f"data.sources.0 (data source 'text'): glob '{tmp_path / 'nothing' / '*.txt'}' matched no files"),
    ]:
        with pytest.raises(CorpusError) as refused:
            train(tiny_cfg(*overrides))
        assert str(refused.value) == line
    assert not (tmp_path / "run" / "config_resolved.yaml").exists()


def test_a_cache_dir_that_cannot_be_written_to_is_refused_before_the_seed_unless_it_holds_caches(
        tiny_cfg, tmp_path, monkeypatch):
    """A read-only cache dir (a tmpfs mounted ro: root too is refused there, as chmod 0555 refuses another user) was
    refused after the seed, once the whole corpus was hashed: one line before the seed now, naming the key, where it
    holds no cache of the source (none could be read or written). One that holds the source's caches is left to the
    corpus read: another user's read-only cache dir serves its caches."""
    import os

    import lightning as L

    from lit_dtrain.data.corpus import CorpusError
    from lit_dtrain.train import train

    read_only = tmp_path / "read_only"
    (read_only / "other-0123").mkdir(parents=True)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **k: Path(path) != read_only and real_access(path, mode, **k))
    monkeypatch.setattr(L, "seed_everything", lambda *a, **k: pytest.fail("seeded before the config was refused"))
    for cache_dir, why in [(read_only, "Permission denied"),
                           (read_only / "sub", f"'{read_only}' cannot be written to: Permission denied")]:
        with pytest.raises(CorpusError) as refused:
            train(tiny_cfg(f"data.cache_dir={cache_dir}"))
        assert str(refused.value) == (
            f"data.cache_dir='{cache_dir}' holds no token cache of data source 'text' and cannot be written to "
            f"({why}); make it writable or point LIT_DTRAIN_CACHE (paths.cache_dir) elsewhere")
    key = "0123456789abcdef01234567"  # a cache's key: 24 hex digits
    for other in (f"text-2-{key}", "text-old", f"text2-{key}"):  # source 'text-2''s cache passed as 'text''s
        (read_only / other).mkdir()
        with pytest.raises(CorpusError, match=r"^data.cache_dir=.* holds no token cache of data source 'text' and "):
            train(tiny_cfg(f"data.cache_dir={read_only}"))
    (read_only / f"text-{key}").mkdir()  # a cache of the source: which key the run needs is known once it is read
    monkeypatch.setattr(L, "seed_everything", lambda *a, **k: pytest.fail("passed the checks"))
    with pytest.raises(pytest.fail.Exception, match="passed the checks"):
        train(tiny_cfg(f"data.cache_dir={read_only}"))
