"""`DecodingConfig`: how a draft decodes, apart from what its weights compute.

transformers keeps ``generation_config.json`` apart from ``config.json``; a DSpark draft does the same with
``decoding_config.json``: the verify mode and its limits, lookup drafting, recalibration and token trees. A draft
carries its saved defaults as ``draft.decoding`` (written by ``save_pretrained``, read by ``from_pretrained``);
a ``generate`` call may override any of them for itself (``custom_generate=hf_dspark.dspark_generate,
verify_mode="fixed"``), and :meth:`DecodingConfig.resolve` turns defaults plus overrides into the one validated
value the decode loop reads, with ``"auto"`` resolved. Checkpoints written before the split kept these fields in
``config.json``; they load with the fields moved across (:meth:`DecodingConfig.from_legacy`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .scheduling.modes import PRICED_MODES, VERIFY_MODES
from .scheduling.policy import VERIFY_LAYOUTS

DECODING_CONFIG_NAME = "decoding_config.json"
# The most tokens one row verifies in one forward (``verify_limit``, ``lookup_max_tokens``, a tree's node budget):
# the SPS profile is measured at every width a call may verify before the call starts, so an unbounded width is a
# hang, not a plan. 256 is 8x the widest tree measured to pay anywhere here (32 nodes), and past what EAGLE-2-style
# engines verify on a GPU (about 60).
MAX_VERIFY_WIDTH = 256
MAX_LOOKUP_NGRAM = 64  # each lookup tries every n from lookup_max_ngram down: its cost grows with n


def resolve_mode(verify_mode: str, has_confidence_head: bool) -> str:
    """``verify_mode`` with ``"auto"`` resolved: ``scheduled`` for a draft with a confidence head, else ``fixed``."""
    if verify_mode == "auto":
        return "scheduled" if has_confidence_head else "fixed"
    return verify_mode


def _is_int(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


@dataclass
class DecodingConfig:
    """How a draft decodes (the fields of ``decoding_config.json``); every value is checked by :meth:`validate`.

    Verification:
        verify_mode: ``auto`` (``scheduled`` with a confidence head, else ``fixed``), ``fixed`` (verify all γ),
            ``threshold`` (the prefix with c_k ≥ ``confidence_threshold``), ``scheduled`` (Algorithm 1 with the
            target's SPS profile) or ``async`` (capacity from confidences two rounds old, filled by current ones).
        verify_limit: at most this many draft tokens (tree nodes, for a tree) verified per row and round, in every
            mode (``None``: γ, or γ · ``tree_top_k`` for a tree). At most ``MAX_VERIFY_WIDTH`` (256); a chain
            verifies at most γ whatever the limit, and a tree's default budget γ · ``tree_top_k`` is clamped to
            256 nodes.
        confidence_threshold: the ``threshold`` mode's cut, in [0, 1].
        verify_layout: what ``scheduled``/``async`` assume a verify step costs in a batch. ``padded``: this
            package's loop, which verifies an [R, 1 + ℓ] block, so the planners choose whole columns; ``packed``:
            the paper's per-token Algorithm 1 (B = Σ_r (1 + ℓ_r)), for engines with ragged kernels. Identical for
            one row.
        confidence_recalibration: (``scheduled``/``async``) shift the head's confidences, per call, toward the
            acceptance observed in that call's own earlier rounds (``hf_dspark.scheduling.recalibration``).
        cost_recalibration: (``scheduled``/``async`` with measured costs; no ``draft.sps_profile`` set) time each
            round against its price and ask a drafted round to beat a plain step by the premium drafted rounds
            showed over plain ones in that call (``hf_dspark.scheduling.observed.ObservedRounds``). Greedy calls only:
            the output is the same whatever is verified, while a sampling call whose rounds followed wall time
            would draw other random numbers and lose its seeded reproducibility. Two greedy calls may then verify
            differently (their stats differ, never their tokens).
        greedy_lookahead: (``scheduled`` on the ``padded`` layout, one row, or trees; greedy decoding) choose the
            verify width (a tree's node count) with the best Θ among all of them instead of stopping at the first
            that does not raise Θ (the ``packed`` multi-row plan keeps its early stop), so a jagged SPS
            profile (flat from 5 to 21 slots in bfloat16 on a CPU with bf16 units) does not end the plan at its
            first step. Lossless in greedy decoding, where the kept tokens are the target's own choices whatever
            is verified; sampling calls always keep the early stop, which is what keeps them exact (a plan that
            looked past a drop would verify a sampled token according to the token itself).
        verify_buckets: pad each round's verify block to the next of a few widths (the powers of two below the
            call's widest block, the draft's whole block and the widest; for γ = 8 chains these are 1, 2, 4, 8 and
            9 slots a row, 32-node trees add 16, 32 and 33), so that a call's verify forward runs in a handful of
            shapes, which capturing it (one CUDA graph a shape) needs.
            The priced modes then price each width at its bucket's cost, so they fill a bucket they pay for.
            Lossless (padding is masked and never read); off by default, since padding costs its slots wherever
            the forward's cost grows with its width (a CPU).
    Lookup drafting (``hf_dspark.decoding.lookup``; off while ``lookup_max_ngram`` is 0):
        lookup_max_ngram, lookup_min_ngram: in a round with one row running, if the row's last n tokens (n from
            ``lookup_max_ngram`` down to ``lookup_min_ngram``) occurred earlier in its history, the tokens that
            followed them are verified (a branch of the tree, or instead of the drafted chain). Lossless either way.
        lookup_max_tokens: the most tokens a continuation verifies (``None``: γ; never more than ``verify_limit``,
            nor than the room left before ``max_length``; at most 256). ``lookup_max_ngram`` is at most 64.
        lookup_adaptive: a call's first lookup verifies at most γ tokens, each lookup accepted in full doubles that
            width up to ``lookup_max_tokens``, and one cut short sets it back to γ (chains and trees alike).
    Token trees (``hf_dspark.decoding.tree``):
        tree_top_k: children per node (1: one chain; at most 256, and at most the tokens the draft can propose,
            checked when a call starts). Above 1, every row of a call verifies a tree of its own
            (a batch in one forward): the draft's top ``tree_top_k`` tokens under each of the ``min(tree_top_k, 4)``
            most valuable nodes of each depth, lookup continuations as branches.
        tree_lookup_merge: (trees with lookup on) ``False``: a row whose lookup finds a continuation verifies that
            branch alone that round and is not drafted (the chain route's choice: it saves the draft's pass and
            the head's expansion, which on a CPU cost as much as the branches return); ``True``: such rows are
            drafted too and both proposals merge in one tree.
    """

    verify_mode: str = "auto"
    verify_limit: int | None = None
    confidence_threshold: float = 0.5
    verify_layout: str = "padded"
    confidence_recalibration: bool = True
    cost_recalibration: bool = True
    greedy_lookahead: bool = False
    verify_buckets: bool = False
    lookup_max_ngram: int = 0
    lookup_min_ngram: int = 2
    lookup_max_tokens: int | None = None
    lookup_adaptive: bool = False
    tree_top_k: int = 1
    tree_lookup_merge: bool = False

    def __post_init__(self) -> None:
        self.validate()
        object.__setattr__(self, "_validating", True)

    def __setattr__(self, name: str, value) -> None:
        """Assigning a field validates at once, as ``generate`` would at the next call, with the same message; a
        refused value leaves the old one in place. A name that is no field is refused (a typo would otherwise be
        a silent no-op). Fields that constrain each other (``lookup_min_ngram`` ≤ ``lookup_max_ngram``) are
        checked together: change several at once with ``draft.decoding = draft.decoding.replace(...)``."""
        if not self.__dict__.get("_validating"):  # __init__ assigns one field at a time; __post_init__ validates
            object.__setattr__(self, name, value)
            return
        if name not in self.field_names():
            raise AttributeError(f"{name!r} is not a DSpark decoding setting; known: {list(self.field_names())}")
        old = getattr(self, name)
        object.__setattr__(self, name, value)
        try:
            self.validate()
        except ValueError:
            object.__setattr__(self, name, old)
            raise

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def describe(cls, name: str) -> str:
        """The field's entry in this class's docstring, on one line (what the CLI's generated flags show)."""
        # entries start 8 spaces in ("name: ..." or "a, b: ..."); section headings start 4 spaces in
        entries = re.split(r"\n(?= {8}[a-z_, ]+: | {4}\S)", cls.__doc__)
        entry = next(e for e in entries if name in e.split(":", 1)[0].replace(" ", "").split(","))
        return re.split(r"(?<=[a-z)`]\.) ", " ".join(entry.split(":", 1)[1].split()))[0]  # its first sentence

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field that cannot work."""
        if self.verify_mode not in VERIFY_MODES:
            raise ValueError(f"verify_mode must be one of {VERIFY_MODES}, got {self.verify_mode!r}")
        if self.verify_limit is not None and not (
            _is_int(self.verify_limit, 0) and self.verify_limit <= MAX_VERIFY_WIDTH
        ):
            raise ValueError(
                f"verify_limit must be an int from 0 to {MAX_VERIFY_WIDTH} (or None: γ), got {self.verify_limit!r}"
            )
        threshold = self.confidence_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 <= threshold <= 1:
            raise ValueError(f"confidence_threshold must lie in [0, 1], got {threshold!r}")
        if self.verify_layout not in VERIFY_LAYOUTS:
            raise ValueError(f"verify_layout must be one of {VERIFY_LAYOUTS}, got {self.verify_layout!r}")
        if not isinstance(self.confidence_recalibration, bool):
            raise ValueError(f"confidence_recalibration must be True or False, got {self.confidence_recalibration!r}")
        if not isinstance(self.cost_recalibration, bool):
            raise ValueError(f"cost_recalibration must be True or False, got {self.cost_recalibration!r}")
        if not isinstance(self.greedy_lookahead, bool):
            raise ValueError(f"greedy_lookahead must be True or False, got {self.greedy_lookahead!r}")
        if not isinstance(self.verify_buckets, bool):
            raise ValueError(f"verify_buckets must be True or False, got {self.verify_buckets!r}")
        if not (_is_int(self.lookup_max_ngram, 0) and self.lookup_max_ngram <= MAX_LOOKUP_NGRAM):
            raise ValueError(
                f"lookup_max_ngram must be an int from 0 (off) to {MAX_LOOKUP_NGRAM}, got {self.lookup_max_ngram!r}"
            )
        if self.lookup_max_ngram and not (
            _is_int(self.lookup_min_ngram, 1) and self.lookup_min_ngram <= self.lookup_max_ngram
        ):
            raise ValueError(
                f"lookup_min_ngram must be an int between 1 and lookup_max_ngram ({self.lookup_max_ngram}), "
                f"got {self.lookup_min_ngram!r}"
            )
        if self.lookup_max_tokens is not None and not (
            _is_int(self.lookup_max_tokens, 1) and self.lookup_max_tokens <= MAX_VERIFY_WIDTH
        ):
            raise ValueError(
                f"lookup_max_tokens must be an int from 1 to {MAX_VERIFY_WIDTH} (or None: γ), "
                f"got {self.lookup_max_tokens!r}"
            )
        if not isinstance(self.lookup_adaptive, bool):
            raise ValueError(f"lookup_adaptive must be True or False, got {self.lookup_adaptive!r}")
        if not (_is_int(self.tree_top_k, 1) and self.tree_top_k <= MAX_VERIFY_WIDTH):
            raise ValueError(
                f"tree_top_k must be an int from 1 (a chain) to {MAX_VERIFY_WIDTH}, got {self.tree_top_k!r}"
            )
        if not isinstance(self.tree_lookup_merge, bool):
            raise ValueError(f"tree_lookup_merge must be True or False, got {self.tree_lookup_merge!r}")

    @property
    def priced(self) -> bool:
        """Whether this mode prices rounds (SPS profile, drafting cost, back-off, recalibration)."""
        return self.verify_mode in PRICED_MODES

    def replace(self, **overrides) -> DecodingConfig:
        """A copy with the non-``None`` ``overrides`` (field names only; anything else raises ``ValueError``)."""
        unknown = sorted(set(overrides) - set(self.field_names()))
        if unknown:
            raise ValueError(f"unknown DSpark decoding settings {unknown}: use any of {list(self.field_names())}")
        return dataclasses.replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def resolve(self, has_confidence_head: bool, **overrides) -> DecodingConfig:
        """What one call decodes with: these defaults, the call's non-``None`` ``overrides`` on top, validated
        (fields may have been assigned since construction), ``"auto"`` resolved to ``scheduled`` with a confidence
        head and ``fixed`` without; ``ValueError`` for a mode the draft cannot run."""
        settings = self.replace(**overrides)  # validates
        settings.verify_mode = resolve_mode(settings.verify_mode, has_confidence_head)
        if not has_confidence_head and settings.verify_mode != "fixed":
            raise ValueError(
                f"verify_mode={settings.verify_mode!r} needs a confidence head (the draft has confidence_head=False)"
            )
        return settings

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict, source: str = "decoding settings") -> DecodingConfig:
        """Build from a dict; ``ValueError`` naming ``source`` and the keys for unknown ones."""
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(f"{source}: unknown decoding settings {unknown}; known: {list(cls.field_names())}")
        try:
            return cls(**values)
        except ValueError as err:
            raise ValueError(f"{source}: {err}") from None

    @classmethod
    def from_legacy(cls, config: dict) -> DecodingConfig:
        """The decoding fields that a checkpoint written before the split kept in its ``config.json``."""
        return cls.from_dict({k: v for k, v in config.items() if k in cls.field_names()}, "DSparkConfig")

    def save_pretrained(self, save_directory: str | os.PathLike) -> Path:
        """Write ``decoding_config.json`` into ``save_directory`` (through a temporary file: never a torn one)."""
        path = Path(save_directory) / DECODING_CONFIG_NAME
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> DecodingConfig:
        """Read ``folder/decoding_config.json``; ``FileNotFoundError``/``ValueError`` naming the file."""
        path = Path(folder) / DECODING_CONFIG_NAME
        try:
            values = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a JSON object of decoding settings")
        return cls.from_dict(values, str(path))
