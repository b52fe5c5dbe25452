"""FourierSamplerCallback with a datamodule of one's own (not LMDataModule): the table goes into the checkpoint."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lit_dtrain.callbacks import FourierSamplerCallback
from lit_dtrain.data.samplers import FourierSampler


class _Seqs(Dataset):
    def __init__(self, n: int = 13, T: int = 16):
        self.tokens = torch.randint(11, (n, T + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return {"x": self.tokens[i, :-1], "y": self.tokens[i, 1:], "index": i}


class _StepBatches(torch.utils.data.Sampler):
    """The user's batch sampler: draws each batch from the FourierSampler by the datamodule's step count."""

    def __init__(self, dm):
        self.dm = dm

    def __len__(self):
        return 4

    def __iter__(self):
        for _ in range(len(self)):
            self.dm.step += 1
            yield self.dm.sampler.global_batch(self.dm.step - 1, 3).tolist()


class _DM(L.LightningDataModule):
    def __init__(self):
        super().__init__()
        self.ds, self.step = _Seqs(), 0
        self.sampler = FourierSampler(stages=False, variant="magnitude")
        self.sampler.setup(len(self.ds))

    def train_dataloader(self):
        return DataLoader(self.ds, batch_sampler=_StepBatches(self))

    def state_dict(self):  # its own position only: the sampler's table is not its concern
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


class _LM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11))

    def training_step(self, batch, batch_idx):
        logits = self.net(batch["x"])
        token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch["y"], reduction="none")
        return {"loss": token_loss.mean(), "token_loss": token_loss.detach(), "index": batch["index"]}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(steps: int, root, ckpt_path=None) -> tuple[L.Trainer, _DM]:
    torch.manual_seed(0)
    dm = _DM()
    trainer = L.Trainer(max_steps=steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=root, callbacks=[FourierSamplerCallback()])
    trainer.fit(_LM(), datamodule=dm, ckpt_path=ckpt_path)
    return trainer, dm


def test_a_resume_keeps_the_table_of_a_datamodule_of_ones_own(tmp_path):
    trainer, _ = _fit(2, tmp_path)
    trainer.save_checkpoint(tmp_path / "mid.ckpt")  # mid-epoch: 2 of the epoch's 4 batches
    _, resumed = _fit(5, tmp_path, tmp_path / "mid.ckpt")
    _, straight = _fit(5, tmp_path)
    assert int(resumed.sampler.visits.sum()) == int(straight.sampler.visits.sum()) == 14  # 5 steps of 3, a repeat
    for key, value in straight.sampler.state_dict().items():  # it started the table over: 9 visits
        assert torch.equal(torch.as_tensor(resumed.sampler.state_dict()[key]), torch.as_tensor(value)), key


def test_a_datamodule_without_a_sampler_is_told_how_to_give_it_one():
    trainer = type("T", (), {"datamodule": L.LightningDataModule()})()
    with pytest.raises(TypeError, match=r"got none: LightningDataModule has no attribute 'sampler'; pass .*LMDataModule"
                                        r".*, give a datamodule of your own a 'sampler' attribute, a FourierSampler"):
        FourierSamplerCallback.sampler_of(trainer)
