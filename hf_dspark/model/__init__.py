"""The draft model: what its weights compute.

``DSparkConfig`` (``config.json``) and ``DSparkDraftModel`` (the context projection, the KV-injected draft layers,
the block forward, ``save_pretrained``/``from_pretrained``); the sequential heads (Markov, gated Markov, RNN) and
the confidence head (``heads.py``); the dispatch between their Triton step and the PyTorch one
(``kernel_dispatch.py``); and the confidence calibration fitted once per draft, sequential temperature scaling
(``sts.py``); a checkpoint's files, found and checked (``checkpoint_files.py``). Nothing here decodes:
``hf_dspark.decoding`` drives the model. This package imports nothing of ``hf_dspark`` but ``settings`` (the
draft's ``decoding`` defaults); other checkpoint layouts and the Hub's ``custom_generate/`` files reach it through
two hooks ``hf_dspark/__init__.py`` installs (``read_layout``, ``write_hub_files``).
"""
