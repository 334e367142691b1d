import os

# Triton must see this before anything imports it (transformers and accelerate do): kernels run interpreted on CPU.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

import hf_dspark  # noqa: F401  (enables generate(assistant_model=draft))


@pytest.fixture(scope="session")
def smollm2():
    """(target, tokenizer) for the embedded SmolLM2-135M-Instruct, loaded once per test session."""
    from hf_dspark.embedded import load_target

    return load_target()
