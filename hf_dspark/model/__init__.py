"""The draft model: what its weights compute.

``DSparkConfig`` (``config.json``) and ``DSparkDraftModel`` (the context projection, the KV-injected draft layers,
the block forward, ``save_pretrained``/``from_pretrained``); the sequential heads (Markov, gated Markov, RNN) and
the confidence head (``heads.py``); the dispatch between their Triton step and the PyTorch one
(``kernel_dispatch.py``); and the confidence calibration fitted once per draft, sequential temperature scaling
(``sts.py``). Nothing here decodes: ``hf_dspark.decoding`` drives the model.
"""
