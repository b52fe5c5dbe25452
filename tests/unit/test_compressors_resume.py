"""Compressed-DDP state across a resume: under another preset, strategy or number of ranks, and a rollback."""

from __future__ import annotations

import re

import pytest
import torch

from lit_dtrain.strategies import (
    COMPRESSORS,
    LOCAL_UPDATES,
    CommSession,
    DiLoCo,
    LocalSGD,
    LoopbackCommunicator,
    build_compressor,
)
from tests.unit._compressor_helpers import make_params


def test_compression_ratio_is_absent_until_something_was_sent():
    """Before a local-update run's first sync nothing is sent; the ratio was logged as inf, which flattened
    TensorBoard's axis for the whole run."""

    session = CommSession(None, LocalSGD(sync_period=3))
    session.comm = LoopbackCommunicator()
    params = [("w", torch.nn.Parameter(torch.randn(4, 4)))]
    seen = []
    for _ in range(3):
        session.before_optimizer_step(params)
        session._dense_this_step = 64  # what the comm hook counts for a 4x4 fp32 gradient under DDP
        metrics = session.after_optimizer_step(params)
        seen.append(metrics.get("comm/compression_ratio"))
    assert seen[:2] == [None, None]
    assert seen[2] == pytest.approx(3 * 64 / 64)  # the sync at step 3 sent the 64 parameter bytes once


def test_another_strategy_resuming_compressed_state_is_told_what_it_drops():
    """The message a plain-DDP (or single-device) resume of a ``ddp_compressed`` checkpoint warns with, from the
    strategy's own ``comm_state_dict``; the 2-rank run through Lightning is in
    tests/dist/test_compressed_ddp_resume.py."""
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from lit_dtrain.strategies import CHECKPOINT_KEY, CompressedDDPStrategy, dropped_comm_state_message

    plain = SingleDeviceStrategy(device="cpu")
    diloco = CompressedDDPStrategy(local_update=DiLoCo(sync_period=2, compressor="int4"))
    params = make_params()
    diloco.local_update.maybe_initialize(params)
    for _ in range(2):  # one outer step: outer parameters, momentum and the int4 pseudo-gradient residual
        for _, p in params:
            p.data.add_(0.01)
        diloco.local_update.after_optimizer_step(params, LoopbackCommunicator())
    checkpoint = {CHECKPOINT_KEY: diloco.comm_state_dict()}
    message = dropped_comm_state_message(checkpoint, plain, "x.ckpt")
    assert message.startswith(f"{CHECKPOINT_KEY}: x.ckpt was written under CompressedDDPStrategy "
                              "(strategy=ddp_compressed/diloco strategy.local_update.compressor=int4, 1 rank)"), message
    for part in ("DiLoCo's outer parameters and momentum", "pseudo-gradient compressor's error-feedback residuals",
                 "SingleDeviceStrategy does not read", "written right after a sync"):
        assert part in message, (part, message)
    assert dropped_comm_state_message(checkpoint, diloco) is None  # it restores the state itself
    assert dropped_comm_state_message({}, plain) is None  # a plain checkpoint: nothing to drop
    fp16 = {CHECKPOINT_KEY: CompressedDDPStrategy(compressor="fp16").comm_state_dict()}
    assert "ddp_compressed/fp16" in dropped_comm_state_message(fp16, plain)  # no error feedback: only counters
    assert "only the comm/* counters restart" in dropped_comm_state_message(fp16, plain)


@pytest.mark.parametrize("written, resumed", [("powersgd", "int8"), (None, "int8"), ("int8", None)])
def test_a_resume_under_another_preset_names_the_file_and_the_ways_out(tmp_path, written, resumed):
    """``ddp_compressed/int8`` resuming a PowerSGD checkpoint is refused (its state cannot be applied); the error
    named neither the file nor the preset that wrote it nor ``strategy=ddp``, which resumes without that state. A
    ConfigError: train.py prints it as one line (a ValueError came with a traceback)."""
    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import CHECKPOINT_KEY, CompressedDDPStrategy

    path = tmp_path / "last.ckpt"
    torch.save({CHECKPOINT_KEY: CompressedDDPStrategy(compressor=written).comm_state_dict()}, path)
    with pytest.raises(ConfigError) as err:
        CompressedDDPStrategy(compressor=resumed).load_checkpoint(path)
    message = str(err.value)
    for part in (str(path), f"strategy=ddp_compressed/{written or 'none'})", "or with strategy=ddp,"):
        assert part in message, (part, message)


def test_the_preset_a_refused_resume_names_exists_for_every_codec_and_rule(tmp_path):
    """An int4_rs checkpoint resumed under ddp_compressed/int8 said 'Resume it with the preset that wrote it
    (strategy=ddp_compressed/int4_rs)', a preset that does not exist (Hydra: 'Could not find'): every codec and
    local-update name is named by overrides that compose and build it."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lit_dtrain.strategies import CHECKPOINT_KEY, CompressedDDPStrategy
    from tests.conftest import CONF_DIR

    path = tmp_path / "last.ckpt"
    torch.save({CHECKPOINT_KEY: CompressedDDPStrategy(compressor="int4_rs").comm_state_dict()}, path)
    with pytest.raises(ValueError, match=r"\(strategy=ddp_compressed/int8_rs strategy.compressor.bits=4\)"):
        CompressedDDPStrategy(compressor="int8").load_checkpoint(path)
    from lit_dtrain.strategies.comm_checkpoint import preset_overrides

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        for name in sorted(COMPRESSORS) + sorted(LOCAL_UPDATES):
            kwargs = {"local_update": name} if name in LOCAL_UPDATES else {"compressor": name}
            overrides = preset_overrides(CompressedDDPStrategy(**kwargs).comm_state_dict()).split()
            node = compose(config_name="train", overrides=overrides).strategy
            part = node.local_update if name in LOCAL_UPDATES else node.compressor
            assert instantiate(part).name == name, (name, overrides)


def test_a_refused_diloco_resume_names_the_pseudo_gradient_compressor_that_wrote_it(tmp_path):
    """DiLoCo with an int4 pseudo-gradient compressor resumed with int8 was told 'Resume it with the preset that wrote
    it (strategy=ddp_compressed/diloco)': the preset in use, which has no compressor and drops the int4 residuals."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lit_dtrain.strategies import CHECKPOINT_KEY, CompressedDDPStrategy, dropped_comm_state_message
    from tests.conftest import CONF_DIR

    path, want = tmp_path / "last.ckpt", "strategy=ddp_compressed/diloco strategy.local_update.compressor=int4"
    state = CompressedDDPStrategy(local_update=DiLoCo(sync_period=2, compressor="int4")).comm_state_dict()
    torch.save({CHECKPOINT_KEY: state}, path)
    with pytest.raises(ValueError, match=rf"preset that wrote it \({want}\), or with strategy=ddp"):
        CompressedDDPStrategy(local_update=DiLoCo(sync_period=2, compressor="int8")).load_checkpoint(path)
    assert f"resume with {want} on the same 1 rank" in dropped_comm_state_message({CHECKPOINT_KEY: state}, None)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        node = compose(config_name="train", overrides=want.split()).strategy
    assert instantiate(node.local_update).compressor.name == "int4"


def test_litllm_warns_about_dropped_comm_state_without_importing_strategies_up_front(tmp_path):
    """``LitLLM.on_load_checkpoint`` warns through ``lit_dtrain.strategies``, but importing ``lit_dtrain.module``
    (as ``LossSpikeMonitor`` does, for ``NonFiniteError``) must not import the compressed-DDP package, which
    registers ``ddp_compressed`` in Lightning's strategy registry: the callbacks are imported one by one."""
    import subprocess
    import sys
    import types
    import warnings

    from lightning.pytorch.plugins import Precision
    from lightning.pytorch.strategies import SingleDeviceStrategy

    from tests.conftest import subprocess_env

    code = ("import sys; from lit_dtrain.callbacks import LossSpikeMonitor; import lit_dtrain.module; "
            "print(sorted(m for m in sys.modules if m.startswith('lit_dtrain.strategies')))")
    out = subprocess.run([sys.executable, "-c", code], env=subprocess_env(tmp_path), capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", out

    from lit_dtrain.models import Llama, LlamaConfig
    from lit_dtrain.module import LitLLM
    from lit_dtrain.strategies import CHECKPOINT_KEY, CompressedDDPStrategy

    lit = LitLLM(Llama(LlamaConfig(block_size=8, n_layer=1, n_head=2, n_kv_head=1, d_model=8)))
    checkpoint = {CHECKPOINT_KEY: CompressedDDPStrategy(compressor="int8").comm_state_dict()}
    lit.on_load_checkpoint(checkpoint)  # no trainer: only the weights are read, nothing to say
    lit._trainer = types.SimpleNamespace(strategy=SingleDeviceStrategy(device="cpu"), ckpt_path="x.ckpt",
                                         precision_plugin=Precision())  # 32-true: converts nothing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lit.on_load_checkpoint(checkpoint)
    (message,) = [str(w.message) for w in caught if CHECKPOINT_KEY in str(w.message)]
    assert "x.ckpt was written under CompressedDDPStrategy (strategy=ddp_compressed/int8" in message


def test_local_update_checkpoint_holds_cpu_copies_of_each_ranks_optimizer_state():
    """Under local updates every rank's optimizer state is all-gathered into the checkpoint. It was gathered as
    ``opt.state_dict()``: the live tensors, on the rank's device (on GPUs, rank r's would be unpickled on rank 0
    as ``cuda:r``, which a one-GPU-per-task job cannot see); the parameters next to it were already CPU copies."""
    from lit_dtrain.strategies import CompressedDDPStrategy

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).square().sum().backward()
    opt.step()
    strategy = CompressedDDPStrategy(local_update=LocalSGD(sync_period=2))
    strategy._lightning_module, strategy.optimizers = model, [opt]
    saved = strategy.comm_state_dict()["per_rank"][0]["optimizer_states"][0]["state"]
    live = opt.state_dict()["state"]
    assert saved.keys() == live.keys() and saved
    for i, entry in saved.items():
        for key, value in entry.items():
            assert value.device.type == "cpu"
            assert value.untyped_storage().data_ptr() != live[i][key].untyped_storage().data_ptr(), (i, key)
    before = {i: {k: v.clone() for k, v in e.items()} for i, e in saved.items()}
    opt.step()  # the live state moves on; what was saved does not
    assert all(torch.equal(saved[i][k], before[i][k]) for i in saved for k in saved[i])


def test_all_gather_uses_all_gather_into_tensor_where_torch_has_no_all_gather_single(monkeypatch):
    """torch 2.11 (seen on a GPU machine) has no ``dist.all_gather_single``, added in 2.13: every gathering codec
    failed in its first backward with AttributeError. The communicator falls back to ``all_gather_into_tensor``."""
    import torch.distributed as dist

    from lit_dtrain.strategies import comm

    calls = []
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda out, t, group=None, async_op=False:
                        calls.append((out, t, group, async_op)) or "work")
    out, t = torch.empty(4), torch.ones(2)
    assert comm._all_gather_single(out, t, group="g", async_op=True) == "work"
    assert len(calls) == 1 and calls[0][0] is out and calls[0][1] is t and calls[0][2:] == ("g", True)


@pytest.mark.usefixtures("no_group_left")
@pytest.mark.parametrize("codec", ["topk", "powersgd", "int8_rs"])
def test_a_resume_into_a_model_without_the_states_parameters_is_an_error_naming_the_file(tmp_path, codec):
    """A model that loads a checkpoint with ``strict_loading=False`` and another layout (a renamed layer) got the
    codec state of parameters it does not have: it was kept, never applied, and saved again in every checkpoint
    (residual keys 'lin.weight', 'lin.bias' next to the new model's own). A residual of another size (a direct
    ``load_state_dict``) failed at the first step as torch's bare 'expanded size ... must match'."""
    import lightning as L

    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import CompressedDDPStrategy

    class Net(L.LightningModule):
        def __init__(self, layer: str) -> None:
            super().__init__()
            self.layer, self.strict_loading = layer, False
            torch.manual_seed(0)
            setattr(self, layer, torch.nn.Linear(8, 8))

        def training_step(self, batch, _):
            return getattr(self, self.layer)(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8)), batch_size=4)

    def trainer(steps: int) -> L.Trainer:
        spec = {"name": codec, "error_feedback": True} if codec != "powersgd" else {"name": codec, "start_step": 0}
        return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         strategy=CompressedDDPStrategy(compressor=spec))

    path = str(tmp_path / "lin.ckpt")
    first = trainer(2)
    # one process: nothing is sent, yet the codec rounds every step's gradient (before: without a word)
    with pytest.warns(UserWarning, match=rf"^CompressedDDPStrategy on 1 process: the '{codec}' codec sends nothing, "
                                         r"yet training uses its decoded \(lossy\) gradient; .* strategy=auto"):
        first.fit(Net("lin"))
    first.save_checkpoint(path)
    assert {"lin.weight", "lin.bias"} <= set(first.strategy.compressor.residuals)
    with pytest.raises(ConfigError, match=rf"^{re.escape(path)}: {codec} compressor state holds the .* of 'lin\."):
        trainer(4).fit(Net("other"), ckpt_path=path)
    trainer(4).fit(Net("lin"), ckpt_path=path)  # the model that wrote it resumes

    c = build_compressor({"name": codec, "error_feedback": True})
    c.load_state_dict(first.strategy.compressor.state_dict())
    with pytest.raises(ValueError, match=r"'lin.weight' with 64 values; this model's has 32"):
        c.check_fits({"lin.weight": 32, "lin.bias": 8})


def test_a_rollback_keeps_the_sync_counts_that_a_checkpoint_restores():
    """comm/syncs and comm/early_syncs count the syncs made, as comm/bytes_per_step's totals count their bytes: a
    loss-spike rollback to an older snapshot put them back (2 -> 1 in a 2-rank local SGD run) while the bytes stayed.
    The schedule (steps, steps since the sync) is the snapshot's; a checkpoint's load restores the counts too."""
    from lit_dtrain.strategies import CompressedDDPStrategy

    strategy = CompressedDDPStrategy(local_update=LocalSGD(sync_period=2))
    rule, params, comm = strategy.local_update, make_params(), LoopbackCommunicator()
    rule.after_optimizer_step(params, comm)
    snapshot = strategy.comm_local_state_dict()  # after 1 step, no sync yet
    for _ in range(4):
        rule.after_optimizer_step(params, comm)
    rule.sync_now(params, comm)  # an early sync (a validation)
    assert (rule.num_syncs, rule.num_early_syncs, rule.step, rule.steps_since_sync) == (3, 1, 5, 0)
    strategy.load_comm_local_state_dict(snapshot)
    assert (rule.num_syncs, rule.num_early_syncs) == (3, 1)
    assert (rule.step, rule.steps_since_sync) == (1, 1)
    assert rule.after_optimizer_step(params, comm) and rule.num_syncs == 4  # the snapshot's schedule: sync at 2
    strategy.load_comm_local_state_dict(snapshot, counts=True)
    assert (rule.num_syncs, rule.num_early_syncs, rule.step) == (0, 0, 1)


def test_a_resume_on_another_number_of_ranks_keeps_the_shared_state_and_the_mean_residual(tmp_path):
    """A 2-rank checkpoint resumed on 1 process was refused ('holds compressor state of 2 ranks but this run has
    1'), even for state that is not per rank. Now the replicated state (PowerSGD's Qs, counters) is kept, every rank
    takes the mean of the saved residuals (the gradient still owed), and rank 0 warns what changed; a state other
    than residuals that differs between the ranks (one nothing can split) and another preset are still refused."""
    import copy
    import warnings

    from lit_dtrain.errors import ConfigError
    from lit_dtrain.strategies import CHECKPOINT_KEY, CompressedDDPStrategy

    spec = {"name": "powersgd", "matrix_approximation_rank": 2}
    one = CompressedDDPStrategy(compressor=spec).comm_state_dict()
    ranks = [copy.deepcopy(one["per_rank"][0]) for _ in range(2)]
    for r, entry in enumerate(ranks):
        entry["compressor"]["residuals"] = {"w": torch.tensor([1.0, -2.0, 3.0]) * (r + 1), "b": torch.ones(2) * r}
        entry["compressor"]["q_memory"] = {"w": torch.arange(4.0).view(2, 2)}
        entry["counters"]["step"] = 4
    entry["counters"]["total_time_ms"] = 9.0  # rank 1's own comm time
    path = tmp_path / "step=4.ckpt"
    torch.save({CHECKPOINT_KEY: {**one, "world_size": 2, "per_rank": ranks}}, path)
    strategy = CompressedDDPStrategy(compressor=spec)
    with pytest.warns(UserWarning, match=r"^lit_dtrain_comm: the checkpoint was written on 2 ranks and this run has "
                                         r"1: .*residuals of 2 ranks are replaced on every rank by their mean \(norm "
                                         r"5.66: .* \(norm 2.83, zero in sum\)\. A resume on the same number"):
        strategy.load_checkpoint(path)
    c = strategy.compressor
    assert torch.equal(c.residuals["w"], torch.tensor([1.5, -3.0, 4.5])) and torch.equal(c.residuals["b"],
                                                                                       torch.full((2,), 0.5))
    assert torch.equal(c.q_memory["w"], torch.arange(4.0).view(2, 2))
    assert strategy.session.counters_state_dict()["total_time_ms"] == ranks[0]["counters"]["total_time_ms"]
    assert strategy.session.step == 4

    ranks[1]["compressor"]["q_memory"]["w"] += 1  # not replicated: nothing can split it over another world size
    torch.save({CHECKPOINT_KEY: {**one, "world_size": 2, "per_rank": ranks}}, path)
    with pytest.raises(ConfigError, match=r"the compressor state \['q_memory'\] differs between rank 0 and rank 1: .*"
                                          r"resume on the 2 ranks that wrote it, or with strategy=ddp, which") as e:
        CompressedDDPStrategy(compressor=spec).load_checkpoint(path)
    assert "preset that wrote it" not in str(e.value)  # the preset in use: it was 'Resume it with the preset ...'
    ranks[1]["compressor"]["q_memory"]["w"] -= 1
    torch.save({CHECKPOINT_KEY: {**one, "world_size": 2, "per_rank": ranks}}, path)
    with warnings.catch_warnings(), pytest.raises(ConfigError, match=r"compressor state is for 'powersgd', this "
                                                                     r"compressor is 'int8'"):
        warnings.simplefilter("error")  # another preset: refused on any world size, with no elastic warning first
        CompressedDDPStrategy(compressor="int8").load_checkpoint(path)


def test_a_resume_on_another_number_of_ranks_drops_server_residuals_and_averages_local_parameters():
    """``int8_rs``'s server residuals are shares laid out for the saved world size: dropped, and said. Under local
    updates every rank starts from the mean of the saved ranks' parameters (said only when they differ, mid-period)
    with rank 0's optimizer state."""
    from lit_dtrain.strategies import comm_checkpoint

    def entry(r: int, server: bool) -> dict:
        compressor = {"name": "int8_rs", "num_calls": 4, "residuals": {"w": torch.full((2,), float(r))},
                      "server_layout": {"world_size": 2, "block_size": 64}}
        if server:
            compressor["server_residuals"] = {"w": torch.full((1,), 1.0 + r)}
        return {"counters": {"step": 4}, "compressor": compressor, "local_update": None}

    state = {"world_size": 2, "local_update": None, "per_rank": [entry(0, True), entry(1, True)]}
    kept, notes = comm_checkpoint.elastic_rank_entry(state, 1)
    assert kept["compressor"]["server_residuals"] == {} and torch.equal(kept["compressor"]["residuals"]["w"],
                                                                        torch.full((2,), 0.5))
    assert kept["compressor"]["server_layout"] == {"world_size": 2, "block_size": 64}
    assert notes[-1] == "the compressor server residuals (shares laid out for 2 ranks, norm 2.24) are dropped"

    ranks = [{"counters": {"step": 5}, "compressor": None, "local_update": None,
              "params": {"w": torch.tensor([1.0, 2.0 + r])}, "optimizer_states": [{"rank": r}]} for r in range(2)]
    local = {"world_size": 2, "local_update": {"name": "local_sgd", "steps_since_sync": 2}, "per_rank": ranks}
    kept, notes = comm_checkpoint.elastic_rank_entry(local, 3)
    assert torch.equal(kept["params"]["w"], torch.tensor([1.0, 2.5])) and kept["optimizer_states"] == [{"rank": 0}]
    assert notes == ["every rank starts from the mean of the 2 ranks' parameters, which differ 2 steps after the last "
                     "sync (the point a sync now would move them to)",
                     "every rank takes rank 0's optimizer state (rank 1's is dropped)"]
    diloco = {**local, "local_update": {"name": "diloco", "steps_since_sync": 2}}  # a sync there is an outer step
    assert comm_checkpoint.elastic_rank_entry(diloco, 3)[1][0] == (
        "every rank starts from the mean of the 2 ranks' parameters, which differ 2 steps after the last sync (their "
        "average, not where an outer step now would move them; the outer parameters and momentum are kept)")
    ranks[1]["params"]["w"] = ranks[0]["params"]["w"].clone()  # right after a sync: kept exactly, nothing to say
    kept, notes = comm_checkpoint.elastic_rank_entry(local, 3)
    assert torch.equal(kept["params"]["w"], ranks[0]["params"]["w"]) and len(notes) == 1


@pytest.mark.filterwarnings("ignore:.*predates per-rank parameters")  # a state written without a module
@pytest.mark.parametrize("rule", [None, "diloco"])
def test_residuals_a_resumed_codec_does_not_apply_are_dropped_and_said_so(tmp_path, rule):
    """int4 (error feedback on) resumed with ``error_feedback=False`` kept the checkpoint's residuals, never applied
    them and saved them again unchanged (2 gloo ranks: norm 0.0524 at step 4 and at step 8, no warning), so a later
    resume with error feedback back on added them, stale, to its first step; DiLoCo resumed without its int4
    pseudo-gradient compressor dropped them without a word. Both are dropped now, with a warning naming the key."""
    from lit_dtrain.strategies import CHECKPOINT_KEY, CompressedDDPStrategy

    def strategy(codec) -> CompressedDDPStrategy:
        if rule is None:
            return CompressedDDPStrategy(compressor=codec)
        return CompressedDDPStrategy(local_update=DiLoCo(sync_period=2, compressor=codec))

    def codec_of(s: CompressedDDPStrategy):
        return s.compressor if rule is None else s.local_update.compressor

    written, path = strategy("int4"), tmp_path / "last.ckpt"
    codec_of(written).residuals = {"w": torch.full((4,), 0.5)}
    torch.save({CHECKPOINT_KEY: written.comm_state_dict()}, path)
    off = {"name": "int4", "error_feedback": False}
    key = "compressor" if rule is None else "local_update.compressor"
    cases = [(off, f"strategy.{key}.error_feedback=true")] + ([(None, f"strategy.{key}=int4")] if rule else [])
    for codec, fix in cases:
        resumed = strategy(codec)
        with pytest.warns(UserWarning, match=rf"^{CHECKPOINT_KEY}: the checkpoint's .*int4.* error-feedback residuals "
                                             rf"\(rank 0's norm 1: .* resume with {re.escape(fix)}"):
            resumed.load_checkpoint(path)
        if codec is not None:
            assert codec_of(resumed).residuals == {}
            saved = resumed.comm_state_dict()["per_rank"][0]
            assert saved["compressor" if rule is None else "local_update"]["residuals"] == {}  # not saved again
    kept = strategy("int4")  # the codec that wrote them applies them
    kept.load_checkpoint(path)
    assert torch.equal(codec_of(kept).residuals["w"], torch.full((4,), 0.5))
