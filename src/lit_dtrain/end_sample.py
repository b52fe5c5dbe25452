"""The text sample ``train.py`` prints at the end of a run (``sample.*`` in ``conf/train.yaml``).

- Only global rank 0 draws it (it alone prints it); under DDP the other ranks used to draw the same text and
  throw it away, and the run ended only when the slowest of them had.
- It is drawn from the LightningModule's own model, which holds the full weights only under a single-device or
  DDP strategy. Under any other strategy with several ranks (FSDP: the blocks and the root's embeddings, final
  norm and LM head are shards, and a block's forward all-gathers, a collective the other ranks would have to join)
  no sample is drawn; one info line names ``scripts/generate.py`` on the run's ``last.ckpt`` instead.
- It is drawn in fp32, as ``scripts/generate.py`` samples a checkpoint: a ``bf16-true``/``16-true`` model is cast
  to fp32 for the sample and back (exact: both are subsets of fp32), a ``64-true`` one sampled from an fp32 copy.
  (Under FSDP on one rank it is drawn in the run's dtype: its flat parameters are not cast.)
  So the sample is ``generate.py <last.ckpt> --prompt <sample.prompt> --seed <seed>`` (same device type, same
  ``max_new_tokens``/``temperature``/``top_k``/``top_p``); in the run's precision it could draw other text from the
  same weights.
- A SIGTERM or SIGHUP while it is drawn cuts it (``lit_dtrain.sigterm_exit.SampleCut``): the run has finished,
  and its ``summary.json`` and exit come at once, not after the sample (37 s for 1500 tokens on a CPU).
- An empty prompt starts from EOS (a document start), which decodes as a newline; that token is not the user's,
  so it is not printed (as in ``generate.py``).
"""

from __future__ import annotations

import contextlib
import copy
import logging

import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from torch.distributed.fsdp import FullyShardedDataParallel

from lit_dtrain.sigterm_exit import a_stop_signal_cuts_this

log = logging.getLogger(__name__)


def sample_skip_reason(strategy, world_size: int, is_global_zero: bool, checkpoint: str | None) -> str | None:
    """Why this rank draws no end-of-run sample (``""``: silently, a rank other than 0), or None to draw it."""
    if world_size > 1 and not isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)):
        where = checkpoint or "<run dir>/checkpoints/last.ckpt"
        return (f"no end-of-run sample under {type(strategy).__name__} with {world_size} ranks (the model's weights "
                f"are sharded across them); sample the saved weights with: python scripts/generate.py {where}")
    if not is_global_zero:
        return ""
    return None


@contextlib.contextmanager
def in_fp32(model: torch.nn.Module):
    """``model`` with fp32 weights, as ``generate.py`` loads a checkpoint: half-precision weights are cast to fp32
    in place and back afterwards (lossless; ``Llama._apply`` recomputes the RoPE tables each way); fp64 ones are
    copied (a cast back from fp32 would lose their low bits)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if not dtypes or dtypes == {torch.float32}:
        yield model
    elif torch.float64 in dtypes or len(dtypes) > 1:
        yield copy.deepcopy(model).float()
    else:
        (dtype,) = dtypes
        model.float()
        try:
            yield model
        finally:
            model.to(dtype)


def generated_text(tokenizer, out: torch.Tensor, prompt_text: str | bytes) -> str:
    """Decoded ``out`` (prompt + new tokens, 1-D); the EOS that stands in for an empty prompt is left out."""
    start = 1 if len(prompt_text) == 0 else 0
    return tokenizer.decode(out[start:].cpu())


def generate_sample(model: torch.nn.Module, tokenizer, gen_cfg, seed: int, device: torch.device) -> str:
    """The sample of ``sample.*`` from ``model`` (a ``Llama``), drawn in fp32 from ``seed``; "" when
    ``max_new_tokens`` is 0 or the weights are not finite."""
    n_tokens = int(gen_cfg.get("max_new_tokens") or 0)
    if n_tokens <= 0 or not hasattr(model, "generate"):
        return ""
    if not all(torch.isfinite(p).all() for p in model.parameters()):  # torch.multinomial would raise on NaN
        log.warning("no text sample: the model's weights are not finite (the run diverged; val_loss is NaN)")
        return ""
    prompt = str(gen_cfg.get("prompt", "def "))
    ids = torch.as_tensor(tokenizer.prompt_ids(prompt).astype("int64"))[None].to(device)
    g = torch.Generator(device=device.type).manual_seed(int(seed))
    # FSDP units (one rank; with more there is no sample) hold flat parameters whose views a cast would cut off
    fsdp = any(isinstance(m, FullyShardedDataParallel) for m in model.modules())
    with contextlib.nullcontext(model) if fsdp else in_fp32(model) as m:
        with a_stop_signal_cuts_this():  # SampleCut: within in_fp32, which casts the model back whatever happens
            out = m.generate(ids, n_tokens, temperature=float(gen_cfg.get("temperature", 0.8)),
                             top_k=gen_cfg.get("top_k", 40), top_p=gen_cfg.get("top_p", None), generator=g)
    return generated_text(tokenizer, out[0], prompt)
