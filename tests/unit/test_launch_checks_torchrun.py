"""torchrun launches the per-node check must also see: a list of device ids (one process per id), and one worker
per node on several nodes (LOCAL_WORLD_SIZE=1), and ``accelerator=auto`` on a machine without a GPU (one CPU process,
not the 0 GPUs it has)."""

from __future__ import annotations

import pytest
import torch

from lit_dtrain._launch_checks import check_torchrun_launch
from lit_dtrain.errors import ConfigError


@pytest.mark.parametrize(("overrides", "env", "message"), [
    (("trainer=ddp_cpu", "trainer.devices=[0]"), {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"},
     "trainer.devices=[0] starts 1 process(es) per node, but torchrun started LOCAL_WORLD_SIZE=2 workers per node"),
    ((), {"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2"},  # torchrun --nnodes=2 --nproc_per_node=1; num_nodes left at 1
     "trainer.num_nodes=1 x 1 workers per node = 1 processes, but torchrun's WORLD_SIZE=2: set trainer.devices=1 "
     "trainer.num_nodes=2"),
    pytest.param(("trainer.devices=auto", "trainer.accelerator=auto"), {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"},
                 "trainer.devices=auto starts 1 process(es) per node",  # accelerator auto without a GPU: the CPU
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="auto picks the GPUs here")),
])
def test_a_torchrun_launch_the_trainer_does_not_match_is_refused(tiny_cfg, overrides, env, message):
    with pytest.raises(ConfigError) as e:
        check_torchrun_launch(tiny_cfg(*overrides), {"TORCHELASTIC_RUN_ID": "abc", **env})
    assert str(e.value).startswith(message), str(e.value)


def test_a_list_of_device_ids_that_matches_torchrun_is_accepted(tiny_cfg):
    check_torchrun_launch(tiny_cfg("trainer=ddp_cpu", "trainer.devices=[0,1]"),
                          {"TORCHELASTIC_RUN_ID": "abc", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2"})
