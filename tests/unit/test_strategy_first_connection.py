"""The ranks' first connection waits ``connect_timeout_s``, at least ``collective_timeout_s``; the collectives after
it get ``collective_timeout_s`` (lit_dtrain.strategies._connect). The 2-rank runs are in tests/e2e/test_reliability.py
(a rank starting late, then hanging at step 4)."""

from __future__ import annotations

import signal
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lit_dtrain.errors import ConfigError
from lit_dtrain.strategies import CompressedDDPStrategy, make_ddp, make_fsdp
from lit_dtrain.strategies._connect import first_connection_message, torchrun_attempt_store
from lit_dtrain.strategies.by_name import build_strategy, even_epochs_by_name
from lit_dtrain.utils.distributed import FirstConnectionError, is_collective_failure, set_collective_timeout
from tests.conftest import free_port


def test_every_strategy_takes_a_connect_timeout_apart_from_its_collective_timeout():
    """strategy.collective_timeout_s=8 also bounded the ranks' first connection: a rank slow to import failed the run
    before training ('DistStoreError: Timed out after 9 seconds waiting for clients. 1/2 clients joined.')."""
    from lightning.pytorch.strategies import StrategyRegistry

    built = [make_ddp(collective_timeout_s=3), make_fsdp(collective_timeout_s=3),
             CompressedDDPStrategy(compressor="int8", collective_timeout_s=3)]
    with even_epochs_by_name(3, 600):
        entry = StrategyRegistry["ddp"]
        built.append(entry["strategy"](**entry["init_params"]))
    assert [(s._timeout.total_seconds(), s._connect_timeout.total_seconds()) for s in built] == \
        [(3, 1800)] * 3 + [(3, 600)]
    assert make_ddp(collective_timeout_s=3, connect_timeout_s=60)._connect_timeout == timedelta(seconds=60)


def test_a_connect_timeout_that_is_no_number_of_seconds_is_refused_naming_its_key():
    from omegaconf import OmegaConf

    with pytest.raises(ValueError, match=r"^make_ddp: connect_timeout_s must be a number of seconds > 0, got 0$"):
        make_ddp(connect_timeout_s=0)
    cfg = OmegaConf.create({"strategy": {"_target_": "lit_dtrain.strategies.make_ddp", "connect_timeout_s": "abc"}})
    with pytest.raises(ConfigError, match=r"^strategy.connect_timeout_s must be a number of seconds > 0, got 'abc'$"):
        build_strategy(cfg)


def test_a_first_connection_that_timed_out_says_how_many_ranks_connected_not_that_a_collective_failed():
    store_error = RuntimeError("Timed out after 4 seconds waiting for clients. 1/2 clients joined.")
    said = first_connection_message(store_error, 0, 2, 3.0)
    assert said.startswith("rank 0: only 1 of 2 ranks connected within 3 s (RuntimeError: Timed out after 4 ")
    assert said.endswith("raise strategy.connect_timeout_s if the ranks start slowly")
    torchrun_error = RuntimeError("wait timeout after 3000ms, keys: /default_pg/0//cpu//0/1")  # gloo's, under torchrun
    assert first_connection_message(torchrun_error, 0, 2, 3.0).startswith(
        "rank 0: the 2 ranks did not all connect within 3 s (RuntimeError: wait timeout after 3000ms")
    assert not is_collective_failure(FirstConnectionError(said))  # train.py's CollectiveError leaves it as it is


def test_a_refused_connection_says_it_failed_in_seconds_not_that_the_ranks_did_not_connect_in_time(monkeypatch):
    """gloo's 'timed out connecting: SO_ERROR: Connection refused' (a torchrun restart that read a dead worker's
    address) failed in 3 s: the line said 'the 2 ranks did not all connect within 1800 s' and to raise the timeout."""
    refused = RuntimeError("Gloo connectFullMesh failed with [pair.cc:152] timed out connecting: SO_ERROR: Connection "
                           "refused, remote=[127.0.0.1]:21895$1")
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    said = first_connection_message(refused, 1, 2, 1800.0, 2.6)
    assert said.startswith("rank 1: a connection to another rank was refused after 3 s, not timed out (strategy."
                           "connect_timeout_s is 1800 s) (RuntimeError: Gloo connectFullMesh failed")
    assert "within" not in said and "raise strategy.connect_timeout_s" not in said
    assert said.endswith("the rank that wrote it ended or restarted since (its own output names why)")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert first_connection_message(refused, 1, 2, 1800.0, 2.6).endswith(
        "launch with --rdzv-backend=c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment")


def test_each_torchrun_attempt_on_one_node_gets_keys_of_its_own_in_the_agents_store(monkeypatch):
    """torchrun's agent store outlives its workers (static rendezvous: one store, one key prefix per launch), so a
    restarted rank read the failed attempt's gloo address: 'Connection refused' in seconds. Each attempt's client
    writes under its own prefix; on several nodes (their own restart counts) and without restarts torch's is kept."""
    agent = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the agent's store
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "GROUP_WORLD_SIZE": "1", "TORCHELASTIC_MAX_RESTARTS": "1",
           "TORCHELASTIC_RESTART_COUNT": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(agent.port)}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    attempt, store = torchrun_attempt_store(timedelta(seconds=10))
    store.set("rank_0", "new address")
    assert attempt == "1" and agent.get("lit_dtrain/torchrun_attempt1/rank_0") == b"new address"
    for key, value in (("GROUP_WORLD_SIZE", "2"), ("TORCHELASTIC_USE_AGENT_STORE", "False"),
                       ("TORCHELASTIC_MAX_RESTARTS", "0")):
        monkeypatch.setenv(key, value)
        assert torchrun_attempt_store(timedelta(seconds=10)) is None, key
        monkeypatch.setenv(key, env[key])


def test_set_collective_timeout_bounds_the_groups_collectives_and_its_store():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=1800))
    try:
        set_collective_timeout(timedelta(seconds=3))
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert backend.options._timeout == timedelta(seconds=3)
        assert dist.distributed_c10d._get_default_store().timeout == timedelta(seconds=3)
    finally:
        dist.destroy_process_group()


def _group_timeout() -> float:
    backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds()


@pytest.mark.filterwarnings("ignore:CompressedDDPStrategy on 1 process")
def test_a_later_trainer_in_the_same_process_gets_its_own_collective_timeout(no_group_left, tmp_path):
    """The group a first fit connected outlives it (Lightning leaves it): a second Trainer's make_ddp(
    collective_timeout_s=7) kept the first one's 4 s (a hung rank then failed the run after 4 s; a 3600 s one for a
    long evaluation, after the first fit's 60). A group made outside lit_dtrain's strategies keeps its own bound."""
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(strategy) -> float:
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=1, max_steps=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=tmp_path)
        trainer.fit(Tiny(), DataLoader(TensorDataset(torch.ones(2, 2))))
        return _group_timeout()

    assert fit(make_ddp(collective_timeout_s=4)) == 4
    assert fit(make_ddp(collective_timeout_s=7)) == 7
    assert fit(CompressedDDPStrategy(compressor="int8", collective_timeout_s=5)) == 5
    assert dist.distributed_c10d._get_default_store().timeout == timedelta(seconds=5)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    assert fit(make_ddp(collective_timeout_s=7)) == 60


def test_the_killed_child_rank_is_reaped_and_off_the_list_lightnings_observer_watches():
    """Lightning's child-process observer polls its launcher's ``procs`` every 5 s and SIGKILLs this process when it
    finds a rank ended by a signal: after a first connection that timed out, whose child rank is killed, a multirun
    went on to job 1 and was killed there (exit 137, no line). The child is killed, reaped, and off that list."""
    import subprocess
    import sys

    from lit_dtrain.utils.launcher_watch import kill_launched_ranks

    class Launcher:
        def __init__(self):
            self.procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])]

        def kill(self, signum):  # Lightning's: signals each of procs, leaves them on the list
            for proc in self.procs:
                proc.send_signal(signum)

    launcher = Launcher()
    child = launcher.procs[0]
    watched = launcher.procs  # the list Lightning's launch gives its observer
    kill_launched_ranks(launcher)
    assert child.returncode == -signal.SIGKILL and watched == [] and launcher.procs is watched


def test_a_launched_rank_that_ends_within_the_grace_keeps_its_own_exit_status_and_is_off_the_list():
    """After a signal in a DDP sweep job's end-of-run sample rank 0 takes its child ranks off the observer's list and
    gives them ``grace_s`` to exit with 143 themselves (their last line written); one still alive then is killed."""
    import subprocess
    import sys

    from lit_dtrain.utils.launcher_watch import kill_launched_ranks

    class Launcher:
        def __init__(self, code):
            self.procs = [subprocess.Popen([sys.executable, "-c", code])]

        def kill(self, signum):
            raise AssertionError("a launcher with a procs list is not killed through kill()")

    ending = Launcher("import time; time.sleep(0.5); raise SystemExit(143)")
    hung = Launcher("import time; time.sleep(60)")
    (rank_ending,), (rank_hung,) = ending.procs, hung.procs
    kill_launched_ranks(ending, grace_s=20.0)
    kill_launched_ranks(hung, grace_s=0.5)
    assert (rank_ending.returncode, rank_hung.returncode) == (143, -signal.SIGKILL)
    assert ending.procs == [] and hung.procs == []


def test_a_stop_signal_to_rank_0_in_the_grace_still_kills_a_hung_launched_rank():
    """A peer stopped before training gives rank 0 a 5 s grace for its child ranks (collectives_named); a second
    signal to rank 0 in it (a Ctrl-C again, a scheduler's SIGTERM) raised out of the wait and skipped the SIGKILL: in a
    real 2-rank run a rank 1 hung at exit was left alive, its parent init, after rank 0 exited with 143."""
    import subprocess
    import sys

    from lit_dtrain.stops_before_training import StoppedBeforeTraining
    from lit_dtrain.utils.launcher_watch import kill_launched_ranks

    class Launcher:
        def __init__(self):
            self.procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])]

    def stop(signum, frame):  # StopsBeforeTraining's handler, as rank 0's own SIGTERM comes in the grace
        raise StoppedBeforeTraining(signal.SIGTERM)

    launcher = Launcher()
    (hung,) = launcher.procs
    previous = signal.signal(signal.SIGALRM, stop)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(StoppedBeforeTraining):
            kill_launched_ranks(launcher, grace_s=30.0)
        left = hung.poll()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if hung.poll() is None:  # (left running before: not to outlive the test)
            hung.kill()
            hung.wait()
    assert left == -signal.SIGKILL and launcher.procs == []


def test_a_failed_collective_ends_a_sweep_and_its_resume_names_the_sweep_not_a_bare_resume_auto():
    """Under -m a CollectiveError ends the sweep as a first connection that timed out does (the jobs share one group,
    which it broke); its single run's 'Resume with resume=auto.' (refused under -m) makes way for the sweep's resume."""
    from lit_dtrain.sigterm_exit import TRAIN_RESUME_HINT
    from lit_dtrain.strategies._connect import ends_the_sweep
    from lit_dtrain.train import CollectiveError

    ended = ends_the_sweep(CollectiveError("rank 0: a collective failed at step 2 (RuntimeError: x). Another rank "
                                           "probably died or hung; the collective timeout is strategy.collective_"
                                           "timeout_s. Resume with resume=auto."))
    assert isinstance(ended, CollectiveError)
    assert str(ended) == ("rank 0: a collective failed at step 2 (RuntimeError: x). Another rank probably died or "
                          "hung; the collective timeout is strategy.collective_timeout_s; the sweep stops at this job "
                          "(its later jobs would fail in their first collective: the ranks' connections are gone): "
                          f"resume with {TRAIN_RESUME_HINT}")
    assert ends_the_sweep(RuntimeError("a bug")) is None


def test_a_failed_collective_in_a_single_run_is_one_line_naming_resume_auto(capsys):
    """A rank killed mid-training: the survivor's CollectiveError (which names the step, the timeout key and
    resume=auto) was the last line of Hydra's traceback of train()'s frames, which hold no cause (the dead rank's
    output does); it is one 'error:' line now, as a first connection that timed out is. A bug keeps its traceback."""
    from lit_dtrain.sweeps import reports_user_errors
    from lit_dtrain.train import CollectiveError

    said = ("rank 0: a collective failed at step 5 (RuntimeError: Connection closed by peer). Another rank probably "
            "died or hung; the collective timeout is strategy.collective_timeout_s. Resume with resume=auto.")

    def job(error):
        raise error

    with pytest.raises(SystemExit) as stop:
        reports_user_errors(job)(CollectiveError(said))
    assert stop.value.code == 1
    assert capsys.readouterr().err.splitlines() == [f"error: {said}"]
    with pytest.raises(RuntimeError, match="a bug"):
        reports_user_errors(job)(RuntimeError("a bug"))
