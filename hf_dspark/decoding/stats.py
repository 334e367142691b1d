"""Per-round statistics of DSpark decoding: τ, per-position conditional acceptance, verify lengths."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DSparkStats:
    """What happened in each verification round of one or more ``generate`` calls.

    ``proposed[i]``: draft tokens verified in round i (ℓ); ``accepted[i]``: how many survived (n ≤ ℓ);
    ``committed[i]``: tokens committed that round (n + 1 unless generation stopped inside the block);
    ``confidences[i]``: the draft's confidences for those ℓ tokens (``None`` for a lookup continuation or a draft
    without a confidence head). Every per-entry list lines up with ``proposed``.
    In a batch, every active row's verification in a round is one entry; ``verify_rounds`` keeps the verify
    lengths the scheduler chose per round (one list per round, one entry per active row) and ``round_rows`` the
    batch indices of those rows (rows leave the batch when they finish). ``looked_up[i]`` says whether entry i
    verified a lookup continuation (``DecodingConfig.lookup_max_ngram``) rather than the draft's block (for a tree:
    whether any verified node came from a lookup, accepted or not); τ and the per-position acceptance count both
    kinds.

    Token trees (``tree_top_k`` > 1): ``proposed[i]`` counts the tree's nodes verified, ``depths[i]`` its deepest
    node's depth (a chain's depth is its length), and ``tree_edges[i]`` lists, for each verified node whose parent
    was on the accepted path, (its edge value, whether it was the draft's top child, whether the target took it):
    the data of the values' calibration. ``tree_fallback`` says why a call that asked for trees verified chains;
    ``narrowed_rounds`` counts the tree rounds the scheduler drafted as chains (a tree did not pay its drafting).
    """

    num_draft_tokens: int  # the most draft tokens a drafted entry verifies (a lookup continuation may verify more)
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    confidences: list[list[float] | None] = field(default_factory=list)
    verify_rounds: list[list[int]] = field(default_factory=list)  # per round: ℓ chosen for each active row
    round_rows: list[list[int]] = field(default_factory=list)  # per round: the batch index of each active row
    looked_up: list[bool] = field(default_factory=list)  # per entry: verified a lookup continuation, not a draft
    depths: list[int] = field(default_factory=list)  # per entry: the deepest verified slot (a chain: ℓ)
    tree_edges: list[list[tuple[float, bool, bool]] | None] = field(default_factory=list)
    tree_fallback: str | None = None
    narrowed_rounds: int = 0

    def record(self, proposed: int, accepted: int, committed: int, confidences: list[float] | None = None,
               looked_up: bool = False, depth: int | None = None,
               tree_edges: list[tuple[float, bool, bool]] | None = None) -> None:  # fmt: skip
        self.depths.append(proposed if depth is None else depth)
        self.tree_edges.append(tree_edges)
        self.proposed.append(proposed)
        self.accepted.append(accepted)
        self.committed.append(committed)
        self.looked_up.append(looked_up)
        self.confidences.append(confidences)

    @property
    def rounds(self) -> int:
        return len(self.proposed)

    @property
    def tau(self) -> float:
        """Mean tokens committed per round, bonus/correction token included (the paper's acceptance length)."""
        return sum(self.committed) / self.rounds if self.rounds else 0.0

    def position_acceptance(self) -> list[float | None]:
        """Conditional acceptance per position k = 1..num_draft_tokens: P(k accepted | 1..k-1 accepted and k was
        verified) (a tree counts as verifying position k when it reaches depth k).

        ``None`` where no round reached position k. Positions past num_draft_tokens, which only lookup
        continuations reach (``lookup_max_tokens``), are not reported.
        """
        out = []
        for k in range(1, self.num_draft_tokens + 1):
            reached = sum(1 for p, a in zip(self.depths, self.accepted, strict=True) if p >= k and a >= k - 1)
            passed = sum(1 for p, a in zip(self.depths, self.accepted, strict=True) if p >= k and a >= k)
            out.append(passed / reached if reached else None)
        return out
