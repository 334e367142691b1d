"""Scheduling: how many draft tokens (or tree nodes) each round verifies.

``policy.py`` is the policy and only that, pure functions of numbers: the SPS profile as a table, the paper's
Algorithm 1 and its variants, the column plan, back-off, trees' node choice. ``recalibration.py`` shifts the
confidences a call observes against what it accepts. ``costs.py`` holds every measurement the policy is fed:
timed verify steps, SPS profiles and their disk cache, the staleness probe, the draft's own cost.
"""
