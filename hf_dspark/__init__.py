"""hf-dspark: lossless DSpark speculative decoding for Hugging Face transformers.

``target.generate(**inputs, custom_generate=hf_dspark.dspark_generate, draft=draft)`` runs DSpark decoding through
transformers' public extension point. ``import hf_dspark`` also registers the ``dspark`` model type with the Auto
classes and routes ``target.generate(..., assistant_model=draft)`` to DSpark decoding when ``draft`` is a
:class:`DSparkDraftModel` (see :mod:`hf_dspark.integration.generate`; ``hf_dspark.disable()`` undoes that route).

The parts, lowest first (each imports only parts before it; ``tests/test_layering.py`` checks it): ``scheduling``
(how much each round verifies: pure policy and the verify modes), ``settings`` (``DecodingConfig``), ``model`` (what
the draft's weights compute), ``compat`` (checkpoint formats), ``decoding`` (the loop, drafting, verification,
lookup, trees, cost measurement), ``integration`` (how ``generate`` gets here), then ``training``, ``evaluation``
and the command line. The model reads other layouts and writes Hub files through the two hooks installed below.
"""

from transformers import AutoConfig, AutoModel

from .compat import read_layout
from .decoding.costs import measure_sps
from .decoding.stats import DSparkStats
from .integration.generate import disable, dspark_generate, enable, is_enabled
from .integration.hub_generate import write_custom_generate
from .model.configuration_dspark import DSparkConfig
from .model.modeling_dspark import DSparkDraftModel, DSparkOutput
from .settings import DecodingConfig

__version__ = "0.1.0"

AutoConfig.register("dspark", DSparkConfig, exist_ok=True)
AutoModel.register(DSparkConfig, DSparkDraftModel, exist_ok=True)
DSparkDraftModel.read_layout = staticmethod(read_layout)
DSparkDraftModel.write_hub_files = staticmethod(write_custom_generate)
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
