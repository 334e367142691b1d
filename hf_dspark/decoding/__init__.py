"""Decoding: one speculative round after another until every row ends.

``loop.py`` is the whole loop (the call's settings and schedule, ``prefill``, then one round after another);
``state.py`` what every round reads and the batch between rounds (``Call``, ``target_forward``, ``prefill``,
``DecodeState``); ``chain.py`` and ``tree_rounds.py`` the two kinds of round (a drafted block per row, or a token
tree per row), each asking its schedule in ``hf_dspark.scheduling``; ``verification.py`` the one verify of both;
``drafting.py`` the draft's side of a round (the target's layer outputs it
reads, the block it proposes); ``verify.py`` greedy acceptance and exact rejection sampling; ``lookup.py`` n-gram
continuations; ``tree.py`` and ``proposers.py`` token trees and the proposers that grow them; ``lm_head.py`` the
verify's LM head; ``checks.py`` the inputs the loop refuses; ``stats.py`` per-round statistics; ``costs.py`` every
measurement of what a round costs; ``versions.py`` what differs between the supported transformers releases. How
to decode is ``hf_dspark.settings.DecodingConfig``; how many tokens a round verifies is decided in
``hf_dspark.scheduling``.
"""
