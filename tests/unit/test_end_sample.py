"""The end-of-run sample: drawn by rank 0 alone, not at all where the weights are sharded (FSDP on several ranks),
in fp32 like ``scripts/generate.py`` (so ``generate.py --seed <seed>`` on ``last.ckpt`` prints the same text), and
without the EOS that stands in for an empty prompt."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy
from omegaconf import OmegaConf

import lit_dtrain.train as train_module
from lit_dtrain.data import ByteTokenizer
from lit_dtrain.end_sample import generate_sample, generated_text, in_fp32
from lit_dtrain.models import build_llama
from lit_dtrain.train import train
from tests.conftest import load_script


def tiny_llama(dtype=torch.float32):
    torch.manual_seed(0)
    return build_llama(vocab_size=257, block_size=32, n_layer=2, n_head=2, n_kv_head=1, d_model=32).to(dtype)


class Module(SimpleNamespace):
    pass


def call_sample(strategy, world_size: int, rank: int, monkeypatch):
    """``train._generate_sample`` with a stand-in trainer; the number of ``generate`` calls it made."""
    model = tiny_llama()
    calls = []
    monkeypatch.setattr(type(model), "generate", lambda self, ids, n, **kw: calls.append(n) or ids)
    trainer = SimpleNamespace(strategy=strategy, world_size=world_size, is_global_zero=rank == 0)
    module = Module(model=model, device=torch.device("cpu"))
    cfg = OmegaConf.create({"seed": 1, "sample": {"prompt": "a", "max_new_tokens": 3}})
    text = train_module._generate_sample(module, SimpleNamespace(tokenizer=ByteTokenizer()), cfg, trainer,
                                         "/runs/x/checkpoints/last.ckpt")
    return text, calls


@pytest.mark.parametrize("strategy", [DDPStrategy(), SingleDeviceStrategy(device="cpu")])
def test_only_rank_0_draws_the_sample(strategy, monkeypatch):
    """Every DDP rank drew the sample (rank 1 only to throw it away, and the run ended when the slowest had)."""
    assert call_sample(strategy, 2, 1, monkeypatch) == ("", [])
    text, calls = call_sample(strategy, 2, 0, monkeypatch)
    assert calls == [3] and text == "a"


@pytest.mark.parametrize("rank", [0, 1])
def test_no_sample_where_the_weights_are_sharded_and_one_line_says_how_to_sample(rank, monkeypatch, caplog):
    """Under FSDP with several ranks the sample read sharded root weights outside FSDP's forward (and a block's
    forward all-gathers: a collective the other ranks do not join). No rank draws it; rank 0 names generate.py."""
    with caplog.at_level(logging.INFO):
        assert call_sample(FSDPStrategy(), 2, rank, monkeypatch) == ("", [])
    lines = [r.getMessage() for r in caplog.records if "end-of-run sample" in r.getMessage()]
    if rank == 0:
        assert lines == ["no end-of-run sample under FSDPStrategy with 2 ranks (the model's weights are sharded "
                         "across them); sample the saved weights with: python scripts/generate.py "
                         "/runs/x/checkpoints/last.ckpt"]
    else:
        assert lines == []
    # one rank holds all the weights: drawn as before
    assert call_sample(FSDPStrategy(), 1, 0, monkeypatch)[1] == [3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_a_half_or_double_model_is_sampled_in_fp32_and_left_as_it_was(dtype, monkeypatch):
    """bf16-true/16-true/64-true runs sampled in their dtype, generate.py in fp32: the same seed could draw other
    text."""
    model = tiny_llama(dtype)
    seen = []
    real = type(model).generate

    def spy(self, *args, **kwargs):
        seen.append({p.dtype for p in self.parameters()} | {self.rope_cos.dtype})
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(model), "generate", spy)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rope = model.rope_cos.clone()
    ref = tiny_llama(dtype).float()  # what generate.py loads from the checkpoint
    cfg = {"prompt": "def ", "max_new_tokens": 40, "temperature": 1.0, "top_k": None}
    text = generate_sample(model, ByteTokenizer(), cfg, 7, torch.device("cpu"))
    g = torch.Generator().manual_seed(7)
    out = ref.generate(torch.tensor([list(b"def ")]), 40, temperature=1.0, generator=g)
    assert seen[0] == {torch.float32} and text == ByteTokenizer().decode(out[0])
    assert all(v.dtype == dtype and torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.rope_cos.dtype == rope.dtype and torch.equal(model.rope_cos, rope)
    with in_fp32(model) as m:
        assert {p.dtype for p in m.parameters()} == {torch.float32}


def test_the_eos_that_stands_for_an_empty_prompt_is_not_printed():
    tok = ByteTokenizer()
    assert generated_text(tok, torch.tensor([tok.eos_id, 65, tok.eos_id, 66]), "") == "A\nB"
    assert generated_text(tok, torch.tensor([tok.eos_id, 65]), b"") == "A"
    assert generated_text(tok, torch.tensor([120, 65]), "x") == "xA"
    assert np.array_equal(tok.prompt_ids(""), [tok.eos_id])  # the stand-in this drops


def test_the_end_of_run_sample_is_what_generate_py_prints_for_the_checkpoint(tiny_cfg, capsys):
    """A bf16-true run's sample with an empty prompt: generate.py --seed <seed> on last.ckpt prints the same text
    (both began with the newline of the start EOS; in bf16 the run's sample could differ from generate.py's)."""
    cfg = tiny_cfg("trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.precision=bf16-true",
                   "sample.prompt=''", "sample.max_new_tokens=60", "seed=3")
    train(cfg)
    out = capsys.readouterr().out
    sample = out.split("--- sample ---\n", 1)[1].split("\n--------------", 1)[0]
    ckpt = f"{cfg.paths.checkpoint_dir}/last.ckpt"
    load_script("generate").main([ckpt, "--prompt", "", "--max-new-tokens", "60", "--seed", "3", "--device", "cpu"])
    printed = json.loads(capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[1])["text"]
    assert sample == printed
    assert not sample.startswith("\n")


def test_fsdp_units_are_not_cast(monkeypatch):
    """A cast of an FSDP unit's parameters (views of its flat parameter) would cut them off from it: under FSDP on
    one rank the sample is drawn in the run's dtype."""
    import lit_dtrain.end_sample as end_sample
    from lit_dtrain.models.llama import Block

    model = tiny_llama(torch.bfloat16)
    seen = []
    real = type(model).generate
    monkeypatch.setattr(type(model), "generate", lambda self, *a, **k: seen.append(self.lm_head.weight.dtype)
                        or real(self, *a, **k))
    monkeypatch.setattr(end_sample, "FullyShardedDataParallel", Block)  # the blocks stand in for FSDP units
    generate_sample(model, ByteTokenizer(), {"max_new_tokens": 2}, 0, torch.device("cpu"))
    assert seen == [torch.bfloat16]


def test_a_model_of_mixed_dtypes_is_sampled_from_an_fp32_copy_and_non_finite_weights_draw_nothing(caplog):
    """A model with bf16 blocks beside fp32 norms is copied to fp32 (one dtype to cast back to there is not); a
    diverged model (NaN weights, which torch.multinomial refuses) draws no sample and says why."""
    model = tiny_llama()
    model.blocks.to(torch.bfloat16)
    with in_fp32(model) as m:
        assert m is not model and {p.dtype for p in m.parameters()} == {torch.float32}
    assert {p.dtype for p in model.blocks.parameters()} == {torch.bfloat16}
    cfg = {"prompt": "def ", "max_new_tokens": 4, "temperature": 1.0, "top_k": None}
    assert generate_sample(model, ByteTokenizer(), cfg, 7, torch.device("cpu"))  # drawn (in fp32)
    with torch.no_grad():
        model.norm.weight[0] = float("nan")
    with caplog.at_level(logging.WARNING, logger="lit_dtrain.end_sample"):
        assert generate_sample(model, ByteTokenizer(), cfg, 7, torch.device("cpu")) == ""
    assert "weights are not finite" in caplog.text


def test_sample_top_p_draws_what_generate_top_p_draws():
    """``sample.top_p`` is the sample's nucleus, ``generate.py --top-p``'s (it had no such key: the sample always drew
    as ``--top-p 1``); ``1.0``, the default, draws what no top-p draws."""
    model, tok = tiny_llama(), ByteTokenizer()
    cfg = {"prompt": "ab", "max_new_tokens": 30, "temperature": 1.0, "top_k": None}
    texts = {p: generate_sample(model, tok, {**cfg, "top_p": p}, 5, torch.device("cpu")) for p in (0.3, 1.0, None)}
    want = model.generate(torch.tensor([list(b"ab")]), 30, temperature=1.0, top_p=0.3,
                          generator=torch.Generator().manual_seed(5))
    assert texts[0.3] == generated_text(tok, want[0], "ab")
    assert texts[1.0] == texts[None] == generate_sample(model, tok, cfg, 5, torch.device("cpu")) != texts[0.3]
