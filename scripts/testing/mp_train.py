"""Run by test_training_multiprocess under `accelerate launch` (2 CPU processes): train a tiny draft, dump params."""

import json
import sys

import torch
from accelerate import Accelerator

from hf_dspark import DSparkDraftModel
from hf_dspark.testing import tiny_rows, tiny_target
from hf_dspark.training.trainer import TrainConfig, train

out = sys.argv[1]
acc = Accelerator(cpu=True)
assert acc.num_processes == 2, f"expected 2 processes, got {acc.num_processes}"
torch.set_num_threads(1)
target = tiny_target("llama", seed=1)
rows = tiny_rows(target, n=8, new_tokens=20)
torch.manual_seed(0)
draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
before = draft.fc.weight.detach().clone()
draft = train(
    target,
    draft,
    rows,
    f"{out}/run",
    TrainConfig(steps=4, lr=3e-3, anchors=4, save_every=4),
    accelerator=acc,
    progress=False,
    log=lambda s: None,
)
flat = torch.cat([p.detach().flatten() for p in draft.parameters()])
with open(f"{out}/rank{acc.process_index}.json", "w") as f:
    json.dump(
        {"params": flat.tolist(), "moved": float((draft.fc.weight - before).abs().max()), "world": acc.num_processes}, f
    )
