import os

# Triton must see this before anything imports it (transformers and accelerate do): kernels run interpreted on CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch

import hf_dspark  # noqa: F401  (enables generate(assistant_model=draft))

# Under pytest-xdist (scripts/test.sh runs one worker per core) each worker gets its share of the cores, so the
# real-model tests do not fight over them.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:
    _share = max(1, (os.cpu_count() or 1) // _workers)
    torch.set_num_threads(_share)
    # and so do the processes a test starts (the notebook's kernel, accelerate's workers): OpenMP threads that
    # outnumber the free cores spin against each other (the notebook test took 8x as long without this)
    os.environ["OMP_NUM_THREADS"] = str(_share)


@pytest.fixture(scope="session")
def smollm2():
    """(target, tokenizer) for the embedded SmolLM2-135M-Instruct, loaded once per test session."""
    from hf_dspark.embedded import load_target

    return load_target()
