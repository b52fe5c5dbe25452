"""FourierSampler on padded, variable-length samples: ``token_mask`` leaves the padding out of the scores."""

from __future__ import annotations

import pytest
import torch

from lit_dtrain.callbacks import FourierSamplerCallback
from lit_dtrain.callbacks._contract import StepOutputError
from lit_dtrain.data.samplers import FourierSampler


def _sampler(**kw) -> FourierSampler:
    s = FourierSampler(stages=False, **kw)
    s.setup(4)
    return s


def _padded(lengths, T=16, seed=0):
    """Rows of ``T`` token losses whose first ``lengths[i]`` are real; the rest 0, as ``ignore_index`` leaves them."""
    loss = torch.rand(len(lengths), T, generator=torch.Generator().manual_seed(seed)) * 3 + 1
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    return loss.masked_fill(~mask, 0.0), mask


def test_masked_padding_leaves_the_time_score_and_band_energy_to_the_real_tokens():
    loss, mask = _padded([16, 5, 9, 1])
    s = _sampler(score="time", momentum=0.0)  # m1 is the last score itself
    s.observe(loss, torch.arange(4), step=0, token_mask=mask)
    real_means = torch.stack([loss[i, mask[i]].mean() for i in range(4)])
    torch.testing.assert_close(s.m1, real_means)  # without the mask: the row of 5 real tokens of 16 scored 5/16 of it
    real_vars = torch.stack([loss[i, mask[i]].var(unbiased=False) for i in range(4)])
    torch.testing.assert_close(s.profile.float().sum(1), real_vars, rtol=2e-3, atol=1e-3)  # fp16 profile


def test_a_row_with_no_real_token_is_left_out_and_a_full_mask_changes_nothing():
    loss, mask = _padded([16, 0, 16, 16])
    s = _sampler()
    s.observe(loss, torch.arange(4), step=0, token_mask=mask)
    assert s.visits.tolist() == [1, 0, 1, 1] and s.nonfinite_skipped == 1
    plain, full = _sampler(), _sampler()
    loss, _ = _padded([16] * 4)
    plain.observe(loss, torch.arange(4), step=0)
    full.observe(loss, torch.arange(4), step=0, token_mask=torch.ones_like(loss, dtype=torch.bool))
    assert torch.equal(plain.m1, full.m1) and torch.equal(plain.profile, full.profile)


def test_another_window_length_names_the_fix():
    s = _sampler()
    s.observe(*_padded([5, 5, 5, 5], T=8)[:1], torch.arange(4), step=0)
    with pytest.raises(ValueError, match=r"bound to T=8 but got token_loss with T=16: .*pad every batch to the same "
                                         r"length.*'token_mask'"):
        s.observe(_padded([5, 5, 5, 5])[0], torch.arange(4), step=1)


class _Trainer:
    def __init__(self, sampler):
        self.datamodule = type("DM", (), {"sampler": sampler})()
        self.global_step, self.accumulate_grad_batches, self.log_every_n_steps = 0, 1, 50


def test_the_callback_hands_the_step_outputs_token_mask_to_the_sampler():
    s = _sampler(score="time", momentum=0.0)
    cb, trainer = FourierSamplerCallback(), _Trainer(s)
    loss, mask = _padded([16, 5, 9, 1])
    cb.on_train_batch_start(trainer, None, None, 0)
    trainer.global_step = 1  # Lightning advances it before on_train_batch_end
    cb.on_train_batch_end(trainer, None, {"loss": loss.mean(), "token_loss": loss, "index": torch.arange(4),
                                          "token_mask": mask}, None, 0)
    torch.testing.assert_close(s.m1[1], loss[1, :5].mean())
    with pytest.raises(StepOutputError, match=r"'token_mask' is a torch.bool tensor of shape \(4, 8\), not token_"):
        cb.on_train_batch_end(trainer, None, {"token_loss": loss, "index": torch.arange(4),
                                              "token_mask": mask[:, :8]}, None, 1)


def test_the_mask_reads_nothing_back_under_lag_1():
    """lag=1's observe never waits for the device (meta tensors hold no data: any read fails), token_mask too."""
    s = _sampler(lag=1)
    loss, mask = _padded([16, 5, 9, 1])
    stats = s.observe(loss.to("meta"), torch.arange(4, device="meta"), step=0, token_mask=mask.to("meta"))
    assert stats["nonfinite"] is None and s._pending[0].parts[0].device.type == "meta"


def test_the_warning_for_a_row_without_a_real_token_does_not_say_only_nan():
    """A row all padding is left out as a non-finite one; the warning said only 'had a NaN/inf token loss', which
    its loss (0 everywhere, as ignore_index leaves it) never was."""
    s = _sampler()
    cb, trainer = FourierSamplerCallback(), _Trainer(s)
    loss, mask = _padded([16, 0, 9, 1])
    cb.on_train_batch_start(trainer, None, None, 0)
    trainer.global_step = 1
    with pytest.warns(UserWarning, match=r"1 sample\(s\) up to step 0 had a NaN/inf token loss, or no real token in "
                                         r"its token_mask; they are left out"):
        cb.on_train_batch_end(trainer, None, {"loss": loss.mean(), "token_loss": loss, "index": torch.arange(4),
                                              "token_mask": mask}, None, 0)
    assert s.nonfinite_skipped == 1 and torch.isfinite(loss).all()
