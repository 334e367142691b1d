"""Decoding: one speculative round after another until the row ends.

``loop.py`` is the whole loop (``prefill``, then plan → draft → verify → accept per round over a ``DecodeState``);
``drafting.py`` the draft's side of a round (the target's layer outputs it reads, the block it proposes);
``verify.py`` greedy acceptance and exact rejection sampling; ``lookup.py`` n-gram continuations; ``tree.py`` and
``proposers.py`` token trees and the proposers that grow them; ``lm_head.py`` the verify's LM head; ``checks.py``
the inputs the loop refuses; ``stats.py`` per-round statistics; ``config.py`` ``DecodingConfig``, how to decode
(``decoding_config.json`` beside the weights, overridden per call). How many tokens a round verifies is decided
in ``hf_dspark.scheduling``.
"""
