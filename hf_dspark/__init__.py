"""hf-dspark: lossless DSpark speculative decoding for Hugging Face transformers.

``target.generate(**inputs, custom_generate=hf_dspark.dspark_generate, draft=draft)`` runs DSpark decoding through
transformers' public extension point. ``import hf_dspark`` also registers the ``dspark`` model type with the Auto
classes and routes ``target.generate(..., assistant_model=draft)`` to DSpark decoding when ``draft`` is a
:class:`DSparkDraftModel` (see :mod:`hf_dspark.integration.generate`; ``hf_dspark.disable()`` undoes that route).

The subpackages, each saying in its ``__init__`` what it owns: ``model`` (what the draft's weights compute),
``decoding`` (the loop, drafting, verification, lookup, trees), ``scheduling`` (how much each round verifies),
``integration`` (how ``generate`` gets here), ``compat`` (checkpoint formats), ``training`` and ``evaluation``.
"""

from transformers import AutoConfig, AutoModel

from .decoding.config import DecodingConfig
from .decoding.stats import DSparkStats
from .integration.generate import disable, dspark_generate, enable, is_enabled
from .model.configuration_dspark import DSparkConfig
from .model.modeling_dspark import DSparkDraftModel, DSparkOutput
from .scheduling.costs import measure_sps

__version__ = "0.1.0"

AutoConfig.register("dspark", DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkDraftModel, exist_ok=True)
enable()

__all__ = [
    "DSparkConfig",
    "DSparkDraftModel",
    "DSparkOutput",
    "DSparkStats",
    "DecodingConfig",
    "disable",
    "dspark_generate",
    "enable",
    "is_enabled",
    "measure_sps",
]
