"""hf-dspark: lossless DSpark speculative decoding for Hugging Face transformers.

``target.generate(**inputs, custom_generate=hf_dspark.dspark_generate, draft=draft)`` runs DSpark decoding through
transformers' public extension point. ``import hf_dspark`` also registers the ``dspark`` model type with the Auto
classes and routes ``target.generate(..., assistant_model=draft)`` to DSpark decoding when ``draft`` is a
:class:`DSparkDraftModel` (see :mod:`hf_dspark.integration`; ``hf_dspark.disable()`` undoes that route).
"""

from transformers import AutoConfig, AutoModel

from .configuration_dspark import DSparkConfig
from .costs import measure_sps
from .decoding_config import DecodingConfig
from .integration import disable, dspark_generate, enable, is_enabled
from .modeling_dspark import DSparkDraftModel, DSparkOutput
from .stats import DSparkStats

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
