"""The 2-rank fits of test_preemption_epoch_end_dist.py (gloo, CPU, 127.0.0.1): a user's own regression under
Lightning's ``Trainer(strategy="ddp")``, a plain DataLoader, ``max_epochs=3`` (4 optimizer steps an epoch, validated
after steps 2 and 4 of each), ``PreemptionCheckpoint``; SIGTERM in the validation that ends epoch 0 to rank 1 alone,
then to both, each followed by a resume from the saved file; and a straight run."""

from __future__ import annotations

import os
import signal

import lightning as L
import torch

from tests.conftest import leave_rank
from tests.dist._foreign_project_jobs import Regression, _flat


class _Validated(Regression):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"]), sync_dist=True)


class _SigtermInValidation(L.Callback):
    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks, self.sent = ranks, False

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking and trainer.global_step == 4 and trainer.global_rank in self.ranks:
            if not self.sent:
                self.sent = True
                os.kill(os.getpid(), signal.SIGTERM)


def _fit(root: str, callbacks: list, ckpt_path: str | None = None) -> dict:
    from torch.utils.data import DataLoader

    from lit_dtrain.callbacks import WSDScheduler

    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(4, generator=g), "y": torch.randn(1, generator=g)} for _ in range(40)]
    wsd = WSDScheduler(warmup_steps=2, decay_fraction=0.4)
    module = _Validated()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, limit_train_batches=4,
                        val_check_interval=0.5, callbacks=[*callbacks, wsd], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root)
    stopped = None
    try:
        trainer.fit(module, DataLoader(data[:32], batch_size=4), DataLoader(data[32:], batch_size=4),
                    ckpt_path=ckpt_path)
    except SystemExit as e:  # Lightning's SIGTERMException
        stopped = type(e).__name__
    return {"stopped": stopped, "step": trainer.global_step, "params": _flat(module.state_dict()),
            "wsd": _flat(wsd.state_dict())}


def _worker(rank: int, port: int, root: str) -> None:
    from lit_dtrain.callbacks import PreemptionCheckpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0",
                      LOCAL_RANK=str(rank), RANK=str(rank))
    torch.set_num_threads(1)
    results = {"straight": _fit(root, [])}
    for name, ranks in (("one", (1,)), ("both", (0, 1))):
        ckpt = os.path.join(root, name)
        results[name] = _fit(root, [_SigtermInValidation(ranks), PreemptionCheckpoint(dirpath=ckpt)])
        if rank == 0:
            saved = torch.load(os.path.join(ckpt, "last.ckpt"), weights_only=False)
            results[name]["saved"] = (saved["global_step"], saved["epoch"])
        results[name + "_resumed"] = _fit(root, [PreemptionCheckpoint(dirpath=ckpt)],
                                          os.path.join(ckpt, "last.ckpt"))
    torch.save(results, os.path.join(root, f"rank{rank}.pt"))
    leave_rank()
