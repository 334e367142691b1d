"""hf-dspark: lossless DSpark speculative decoding for Hugging Face transformers.

``import hf_dspark`` registers the ``dspark`` model type with the Auto classes and routes
``target.generate(..., assistant_model=draft)`` to DSpark decoding when ``draft`` is a :class:`DSparkDraftModel`
(see :mod:`hf_dspark.integration`; ``hf_dspark.disable()`` undoes it).
"""

from transformers import AutoConfig, AutoModel

from .configuration_dspark import DSparkConfig
from .integration import disable, enable, is_enabled
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
    "disable",
    "enable",
    "is_enabled",
]
