"""Hardware-aware verify lengths (docs/method.md, "Prefix scheduler"): the SPS profile and Algorithm 1.

``SPSProfile`` maps B, the number of tokens the target processes in one verification step, to steps per second.
``plan_verify_lengths`` admits draft tokens in order of prefix survival a_{r,j} = Π_{i≤j} c_{r,i} while the
expected throughput Θ = τ·SPS(B) keeps rising, and stops at the first non-improvement. The early stop is what
keeps it lossless: whether x_j is verified never depends on c_{j+1}, which depends on x_j itself.
``plan_capacity`` + ``fill_top_k`` are the asynchronous production variant: the capacity K comes from
confidences two rounds old (a global search is safe there), the current candidates fill the K slots by current
survival.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from .recalibration import AcceptanceRecalibration

# what a verify step is assumed to cost in a batch: ``padded`` verifies an [R, 1 + ℓ] block (whole columns),
# ``packed`` the paper's per-token B = Σ_r (1 + ℓ_r) for engines with ragged kernels
VERIFY_LAYOUTS = ("padded", "packed")


class SPSProfile:
    """Verification steps per second as a function of B (tokens processed in one target step).

    Build it from a measured/handwritten table (``{B: steps_per_second}``, linear interpolation between points;
    beyond the largest B the step time grows in proportion to B), from a callable, or with :meth:`measure`.
    Tables must be non-empty, positive and non-increasing in B (more tokens never make a step faster); a table
    that is not raises ``ValueError`` naming the offending entry.
    """

    def __init__(self, table: dict[int, float] | None = None, fn: Callable[[int], float] | None = None):
        if (table is None) == (fn is None):
            raise ValueError("give exactly one of table or fn")
        self.fn = fn
        self.table: dict[int, float] = {}
        if table is not None:
            if not table:
                raise ValueError("SPS table is empty")
            items = sorted((int(b), float(s)) for b, s in table.items())
            for b, s in items:
                if b < 1:
                    raise ValueError(f"SPS table has B = {b}; B counts tokens and must be >= 1")
                if not s > 0 or s != s or s == float("inf"):
                    raise ValueError(f"SPS table has a non-positive or non-finite rate {s} at B = {b}")
            for (b0, s0), (b1, s1) in itertools.pairwise(items):
                if s1 > s0:
                    raise ValueError(f"SPS table is not non-increasing in B: SPS({b1}) = {s1} > SPS({b0}) = {s0}")
            self.table = dict(items)

    @classmethod
    def from_table(cls, table: dict[int, float]) -> SPSProfile:
        return cls(table=table)

    @classmethod
    def from_callable(cls, fn: Callable[[int], float]) -> SPSProfile:
        return cls(fn=fn)

    def __call__(self, B: int) -> float:
        if B < 1:
            raise ValueError(f"B must be >= 1, got {B}")
        if self.fn is not None:
            value = float(self.fn(B))
            if not value > 0:
                raise ValueError(f"SPS callable returned a non-positive rate {value} at B = {B}")
            return value
        keys = list(self.table)
        if B <= keys[0]:
            return self.table[keys[0]]
        if B >= keys[-1]:
            return self.table[keys[-1]] * keys[-1] / B
        for b0, b1 in itertools.pairwise(keys):
            if b0 <= B <= b1:
                t = (B - b0) / (b1 - b0)
                return self.table[b0] + t * (self.table[b1] - self.table[b0])
        raise AssertionError("unreachable")

    def plus_seconds(self, seconds: float) -> SPSProfile:
        """The profile of a round that also spends ``seconds`` outside the target (drafting the block):
        SPS'(B) = 1 / (1 / SPS(B) + seconds). Still non-increasing in B, so Algorithm 1 applies unchanged."""
        if not seconds >= 0 or seconds == float("inf"):
            raise ValueError(f"extra seconds per step must be finite and >= 0, got {seconds}")
        return self if seconds == 0 else SPSProfile.from_callable(lambda B: 1.0 / (1.0 / self(B) + seconds))

    def bucketed(self, buckets: tuple[int, ...] | None, rows: int) -> SPSProfile:
        """The profile of a verify of ``rows`` rows padded to ``buckets`` (:func:`width_buckets`): B tokens verify
        as ``rows`` rows of the bucket holding ⌈B / rows⌉ slots, so every width within a bucket costs the bucket's
        step (the schedulers then fill a bucket they pay for). ``self`` when ``buckets`` is None."""
        if buckets is None:
            return self
        if rows < 1:
            raise ValueError(f"rows must be >= 1, got {rows}")
        return SPSProfile.from_callable(lambda B: self(rows * bucket_width(-(-B // rows), buckets)))


def width_buckets(widest: int, block: int | None = None) -> tuple[int, ...]:
    """The verify widths (slots a row: anchor + candidates) a call pads to: the powers of two below its ``widest``
    block, the draft's whole ``block`` (1 + γ, the width a chain verifies most, so that it never pads) and
    ``widest`` itself (γ = 8: chains 1, 2, 4, 8, 9; 32-node trees 1, 2, 4, 8, 9, 16, 32, 33). A few shapes a call,
    which is what capturing the verify forward (a CUDA graph a shape) needs, for at most twice the slots."""
    if widest < 1:
        raise ValueError(f"the widest verify must be >= 1 slot, got {widest}")
    powers = {1 << i for i in range((widest - 1).bit_length())}
    return tuple(sorted(w for w in {*powers, block or widest, widest} if w <= widest))


def bucket_width(width: int, buckets: tuple[int, ...]) -> int:
    """The smallest of ``buckets`` (ascending) that holds ``width`` slots; ``ValueError`` past the widest."""
    for bucket in buckets:
        if bucket >= width:
            return bucket
    raise ValueError(f"a verify of {width} slots is wider than the call's widest bucket ({buckets[-1]})")


def _check_confidences(confidences: torch.Tensor) -> torch.Tensor:
    if not isinstance(confidences, torch.Tensor):
        confidences = torch.as_tensor(confidences, dtype=torch.float64)
    if confidences.dim() != 2:
        raise ValueError(f"confidences must be [R, γ], got shape {tuple(confidences.shape)}")
    if not torch.isfinite(confidences).all() or (confidences < 0).any() or (confidences > 1).any():
        raise ValueError("confidences must be probabilities in [0, 1]")
    return confidences.double()


def _sorted_candidates(confidences: torch.Tensor) -> list[tuple[float, int, int]]:
    """All (a_{r,j}, r, j) with a > 0, by survival descending (ties: earlier j, then lower r, so prefixes close)."""
    survival = confidences.cumprod(-1)
    cands = [(float(survival[r, j]), r, j + 1) for r in range(survival.shape[0]) for j in range(survival.shape[1])]
    return sorted((c for c in cands if c[0] > 0), key=lambda c: (-c[0], c[2], c[1]))


def plan_verify_lengths(confidences: torch.Tensor, sps: SPSProfile | Callable[[int], float]) -> list[int]:
    """Algorithm 1: confidences [R, γ] -> draft tokens to verify per row (each row also verifies its anchor).

    Start at ℓ = 0 for every row (B = R, τ = R); admit candidates in order of prefix survival; record the
    lengths whenever Θ = τ·SPS(B) improves; stop at the first admission that does not improve Θ.
    """
    confidences = _check_confidences(confidences)
    R = confidences.shape[0]
    lengths, best = [0] * R, [0] * R
    B, tau = R, float(R)
    theta_best = tau * sps(B)
    for a, r, j in _sorted_candidates(confidences):
        lengths[r] = j
        B += 1
        tau += a
        theta = tau * sps(B)
        if theta > theta_best:
            theta_best, best = theta, list(lengths)
        else:
            break
    return best


class ColumnPlan:
    """Verify lengths planned one draft column at a time, as the draft produces them (left to right).

    ``caps`` [R] bound each row (length limit; 0 for a finished row): confidences beyond a row's cap count as 0.
    Feed confidence columns c_{·,k} [R] for k = 1, 2, … to :meth:`admit`; it says whether column k is verified by
    any row, and once it says no, no later column will be (the plan is closed), so the caller can stop drafting.
    :attr:`lengths` is then the plan: with a ``threshold``, each row verifies its prefix of confidences ≥ it;
    otherwise (``sps`` given) Algorithm 1 on a padded [R, 1 + ℓ] verify block: column ℓ joins while
    Θ(ℓ) = (R + Σ_r Σ_{j ≤ ℓ} a_{r,j})·SPS(R·(1 + ℓ)) improves, a = prefix survival, and the first column that
    does not improve Θ ends the plan. O(R) per column, so the check after each drafted slot costs no re-plan.
    ``recalibration`` (with ``sps``): shift each column's confidences by what the call has observed so far.
    ``lookahead`` (with ``sps``; greedy decoding only, see ``DecodingConfig.greedy_lookahead``): the plan is the
    width with the best Θ of all columns seen, and it closes only once no later column could beat that best even
    if every row's survival stayed where it is (Θ's bound (τ + (j − k)·Σ_r a_r)·SPS(R·(1 + j)) for every j up to
    the largest cap), so :meth:`admit` then says whether drafting should go on, not whether the column is verified.
    """

    def __init__(
        self,
        caps: list[int],
        sps: SPSProfile | Callable[[int], float] | None = None,
        threshold: float | None = None,
        recalibration: AcceptanceRecalibration | None = None,
        lookahead: bool = False,
    ):
        if (sps is None) == (threshold is None):
            raise ValueError("give exactly one of sps (scheduled) or threshold")
        if recalibration is not None and threshold is not None:
            raise ValueError("a threshold applies to the head's own confidences: no recalibration")
        if lookahead and sps is None:
            raise ValueError("lookahead plans with an SPS profile (scheduled), not a threshold")
        self.caps, self.sps, self.threshold, self.recalibration = list(caps), sps, threshold, recalibration
        self.lookahead = lookahead
        R = len(self.caps)
        self.survival = [1.0] * R  # a_{r,ℓ}; with a threshold, 1.0 while row r's prefix passes, else 0.0
        self.passed = [0] * R  # with a threshold: each row's passing prefix
        self.width, self.closed = 0, False
        self.columns = 0  # columns fed so far (the width stops growing at a drop under lookahead)
        self.tau = float(R)
        self.theta = self.tau * sps(R) if sps is not None else 0.0

    def admit(self, column: torch.Tensor | list[float]) -> bool:
        """Confidences [R] of the next column (k = width + 1) -> whether any row verifies it."""
        if self.closed:
            return False
        values = column.tolist() if isinstance(column, torch.Tensor) else list(column)
        if len(values) != len(self.caps):
            raise ValueError(f"a column of {len(values)} confidences for {len(self.caps)} rows")
        if not all(0.0 <= c <= 1.0 for c in values):  # also rejects NaN
            raise ValueError("confidences must be probabilities in [0, 1]")
        self.columns += 1
        k, R = self.columns, len(self.caps)
        if self.recalibration is not None:  # shift the column as given (a tensor from the draft), not a list copy
            raw = column if isinstance(column, torch.Tensor) else torch.tensor(values, dtype=torch.float64)
            values = self.recalibration.apply(raw, start=k - 1).tolist()
        for r, c in enumerate(values):
            if k > self.caps[r]:
                c = 0.0
            elif self.threshold is not None:
                c = 1.0 if c >= self.threshold else 0.0
            self.survival[r] *= c
        if self.threshold is not None:
            admitted = any(self.survival)
        elif self.lookahead:
            rest = sum(self.survival)  # this column's τ, and the most any later column can add
            self.tau += rest
            theta = self.tau * self.sps(R * (1 + k))
            if theta > self.theta:
                self.width, self.theta = k, theta
            self.closed = not any(
                (self.tau + (j - k) * rest) * self.sps(R * (1 + j)) > self.theta
                for j in range(k + 1, max(self.caps) + 1)
            )
            return not self.closed
        else:
            tau = self.tau + sum(self.survival)
            theta = tau * self.sps(R * (1 + k))
            admitted = theta > self.theta
            if admitted:
                self.tau, self.theta = tau, theta
        if admitted:
            self.width = k
            self.passed = [k if a else n for n, a in zip(self.passed, self.survival, strict=True)]
        self.closed = not admitted
        return admitted

    @property
    def lengths(self) -> list[int]:
        """Draft tokens each row verifies under the columns admitted so far."""
        if self.threshold is not None:
            return list(self.passed)
        return [min(self.width, cap) for cap in self.caps]


def plan_verify_width(confidences: torch.Tensor, sps: SPSProfile | Callable[[int], float]) -> int:
    """Algorithm 1 for a padded batch: confidences [R, γ] -> ℓ, the draft columns every row verifies.

    A loop that verifies a left-aligned [R, 1 + ℓ] block (as this package's does, on any attention backend) pays
    for R·(1 + ℓ) slots whatever each row needs, so per-token admission misprices it: one row's token widens
    the block for all rows, and the other rows' tokens in that column then cost nothing. The unit of admission
    is therefore a column: admit columns left to right with τ += Σ_r a_{r,ℓ}, B = R·(1 + ℓ), Θ = τ·SPS(B), and
    stop at the first column that does not improve Θ. Non-anticipating as Algorithm 1 is: whether column ℓ is
    verified depends on the survivals up to ℓ, never on a later c (which depends on the tokens being verified).
    For R = 1 it equals ``plan_verify_lengths``. Zero out confidences a row may not verify (length limit,
    finished rows) before calling; the caller caps each row at its limit. (:class:`ColumnPlan` column by column.)
    """
    confidences = _check_confidences(confidences)
    plan = ColumnPlan([confidences.shape[1]] * confidences.shape[0], sps=sps)
    for k in range(confidences.shape[1]):
        if not plan.admit(confidences[:, k]):
            break
    return plan.width


def plan_capacity_width(old_confidences: torch.Tensor, sps: SPSProfile | Callable[[int], float]) -> int:
    """Asynchronous variant for a padded batch: the width ℓ maximising Θ from confidences two rounds old (a global
    search, safe because this information predates the tokens being verified now)."""
    thetas = _column_thetas(old_confidences, sps)
    return max(range(len(thetas)), key=lambda width: (thetas[width], -width))


def _column_thetas(confidences: torch.Tensor, sps: SPSProfile | Callable[[int], float]) -> list[float]:
    """Θ(ℓ) = τ(ℓ)·SPS(R·(1 + ℓ)) for ℓ = 0..γ, τ(ℓ) = R + Σ_r Σ_{j ≤ ℓ} a_{r,j} (a padded [R, 1 + ℓ] verify)."""
    confidences = _check_confidences(confidences)
    R = confidences.shape[0]
    tau = [float(R), *(R + confidences.cumprod(-1).sum(0).cumsum(0)).tolist()]
    return [t * sps(R * (1 + width)) for width, t in enumerate(tau)]


def plan_capacity(old_confidences: torch.Tensor, sps: SPSProfile | Callable[[int], float]) -> int:
    """Asynchronous variant, step 1: from confidences two rounds old, the number K of draft tokens (over all rows)
    that maximises Θ — a global search without early stop, safe because this information predates the tokens
    being verified now."""
    confidences = _check_confidences(old_confidences)
    R = confidences.shape[0]
    B, tau = R, float(R)
    best_k, theta_best = 0, tau * sps(B)
    for k, (a, _, _) in enumerate(_sorted_candidates(confidences), start=1):
        B += 1
        tau += a
        if tau * sps(B) > theta_best:
            best_k, theta_best = k, tau * sps(B)
    return best_k


def drafting_pays(
    confidences: torch.Tensor,
    lengths: list[int],
    rows: int,
    sps: SPSProfile | Callable[[int], float],
    draft_seconds: float,
    premium: float = 1.0,
) -> bool:
    """Whether a drafted round beats a plain decoding step, in expectation, by ``premium`` (what drafted rounds
    were seen to cost over their price relative to plain ones: :class:`~hf_dspark.scheduling.observed.ObservedRounds`):
    confidences [A, γ] and the planned ``lengths`` [A] of the A rows still generating, in a padded verify of
    ``rows`` batch rows. A drafted round commits Σ_r (1 + Σ_{j ≤ ℓ_r} a_{r,j}) tokens (a = prefix survival) in
    ``draft_seconds`` + 1 / SPS(rows·(1 + max ℓ)) seconds; a plain step commits A tokens in 1 / SPS(rows) seconds.
    The decoding loop asks after each drafted round and stops drafting for a while (exponential backoff) when the
    answer is no: under heavy load, or with a draft whose block costs more than its accepted tokens save,
    speculation is switched off rather than paid for. The decision uses only confidences of a round already
    verified, so it never sees the tokens it is about to verify (lossless)."""
    confidences = _check_confidences(confidences)
    if confidences.shape[0] != len(lengths):
        raise ValueError(f"{confidences.shape[0]} rows of confidences but {len(lengths)} lengths")
    if not 0 < confidences.shape[0] <= rows:
        raise ValueError(f"rows = {rows} must cover the {confidences.shape[0]} generating rows")
    survival = confidences.cumprod(-1)
    expected = sum(1 + float(survival[r, :ell].sum()) for r, ell in enumerate(lengths))
    width = 1 + max(lengths)
    drafted = expected / (draft_seconds + 1.0 / sps(rows * width))
    return drafted > confidences.shape[0] * sps(rows) * premium


def fill_top_k(confidences: torch.Tensor, capacity: int) -> list[int]:
    """Asynchronous variant, step 2: give the ``capacity`` slots to the current candidates with the highest
    prefix survival (closed prefixes per row). -> lengths [R]."""
    confidences = _check_confidences(confidences)
    if capacity < 0:
        raise ValueError(f"capacity must be >= 0, got {capacity}")
    lengths = [0] * confidences.shape[0]
    for _, r, j in _sorted_candidates(confidences)[:capacity]:
        lengths[r] = max(lengths[r], j)
    return lengths


def capped_confidences(
    confidences: torch.Tensor, caps: list[int], recalibration: AcceptanceRecalibration | None = None
) -> torch.Tensor:
    """``confidences`` [R, γ] (recalibrated when ``recalibration`` is given) with every entry past row r's cap
    ``caps[r]`` set to 0, so no planner admits it; on the host."""
    if recalibration is not None:
        confidences = recalibration.apply(confidences)
    allowed = torch.arange(confidences.shape[1], device=confidences.device)[None] < torch.tensor(caps)[:, None]
    return torch.where(allowed, confidences, 0).cpu()


def priced_tree_count(
    values: list[float],
    sps: SPSProfile,
    draft_seconds: float = 0.0,
    rows: int = 1,
    generating: int = 1,
    lookahead: bool = False,
    premium: float = 1.0,
) -> tuple[int, bool]:
    """Algorithm 1 over a tree's ranked nodes (``values``: their path values, ancestors first): admit while
    τ·SPS(1 + B) rises, τ = 1 + Σ values, with the drafting cost ``draft_seconds`` added to every step, and stop at
    the first non-improvement (the early stop keeps the choice from depending on nodes below a rejected one).
    -> (count, whether drafting paid: the plan's expected rate beats a plain step's, ``sps(rows)``, times
    ``premium`` (what a drafted round was seen to cost over its price, relative to a plain one;
    :class:`~hf_dspark.scheduling.observed.ObservedRounds`) with at least one node).

    A batch of ``rows`` rows, ``generating`` of them still generating, verifies [rows, 1 + B] slots: ``values[i]``
    is then the sum over the generating rows of their (i + 1)-th best node's value, τ starts at ``generating`` (each
    row's correction or bonus token), a step of width 1 + B costs 1 / SPS(rows · (1 + B)), and a plain step commits
    ``generating`` tokens at SPS(rows).

    ``lookahead`` (greedy decoding only, see ``DecodingConfig.greedy_lookahead``): the count with the best Θ of all,
    past any drop (the fewest nodes among equals)."""
    priced = sps.plus_seconds(draft_seconds)
    tau, theta, chosen = float(generating), generating * priced(rows), 0
    for B, value in enumerate(values, start=1):
        tau += value
        if tau * priced(rows * (1 + B)) <= theta:
            if lookahead:
                continue
            break
        theta, chosen = tau * priced(rows * (1 + B)), B
    return chosen, chosen > 0 and theta > generating * sps(rows) * premium


def tree_rate(
    values: list[float],
    count: int,
    sps: SPSProfile,
    draft_seconds: float,
    rows: int = 1,
    generating: int = 1,
) -> float:
    """Θ of a drafted round that verifies the ``count`` leading nodes of ``values`` (ranked, summed over the
    ``generating`` rows as in :func:`priced_tree_count`): expected tokens committed per second of drafting and
    verifying, (generating + Σ values[:count]) · SPS'(rows · (1 + count)), SPS' being ``sps`` with ``draft_seconds``
    added to a step. What two ways of drafting the same round (a tree, its chain) are compared by."""
    return (generating + sum(values[:count])) * sps.plus_seconds(draft_seconds)(rows * (1 + count))


def lookahead_tree_settled(
    values: list[float],
    count: int,
    head: int,
    bound: float,
    budget: int,
    sps: SPSProfile,
    draft_seconds: float = 0.0,
    rows: int = 1,
) -> bool:
    """Whether one row's ``lookahead`` choice of ``count`` nodes (:func:`priced_tree_count`) from a partly drafted
    tree is final: nodes still to come are each worth at most ``bound`` and rank after the ``head`` leading ones,
    so no prefix of the final ranking longer than ``head`` reaches τ beyond 1 + Σ values[:head] + (B − head)·bound.
    Final when ``count`` ≤ ``head`` and that bound's Θ stays at or below the chosen Θ for every B up to ``budget``
    (lookahead takes a longer prefix only when it raises Θ)."""
    if count > head:
        return False
    priced = sps.plus_seconds(draft_seconds)
    best = (1 + sum(values[:count])) * priced(rows * (1 + count))
    base = 1 + sum(values[:head])
    return all((base + (B - head) * bound) * priced(rows * (1 + B)) <= best for B in range(head + 1, budget + 1))
