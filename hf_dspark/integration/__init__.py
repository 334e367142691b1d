"""How ``generate`` reaches DSpark.

``generate.py``: ``dspark_generate``, the callable ``target.generate(custom_generate=...)`` takes, and the
reversible hook that routes ``assistant_model=<DSparkDraftModel>`` to it; ``hub_generate.py``: the
``custom_generate/`` folder a draft's Hub repository carries; ``versions.py``: what differs between the
transformers releases we support.
"""
