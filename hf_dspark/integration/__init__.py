"""How ``generate`` reaches DSpark.

``generate.py``: ``dspark_generate``, the callable ``target.generate(custom_generate=...)`` takes (its settings
keywords generated from ``DecodingConfig``), and the reversible hook that routes
``assistant_model=<DSparkDraftModel>`` to it; ``hub_generate.py``: the ``custom_generate/`` folder a draft's Hub
repository carries (``hf_dspark/__init__.py`` installs its writer on the model class).
"""
