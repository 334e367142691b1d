"""Scheduling: how many draft tokens (or tree nodes) each round verifies; pure, it imports nothing of the package.

``policy.py`` is the policy and only that, pure functions of numbers: the SPS profile as a table, the paper's Algorithm
1 and its variants, the column plan, trees' priced node choice. ``modes/`` holds the verify modes, one registered object
a file, and the functions the loop asks them through. ``schedule.py`` is the state a call's rounds carry between them,
chains and trees alike (prices at bucketed widths, the drafting cost, the back-off, the observed costs); ``chains.py``
and ``trees.py`` add how each route chooses (a length per row; ranked nodes admitted across rows). ``backoff.py`` is the
doubling back-off the schedule uses. ``recalibration.py`` shifts the confidences a call observes against what it
accepts; ``observed.py`` holds the rounds' wall time against their prices. What measures costs by running the models
lives in ``hf_dspark.decoding.costs``.
"""
