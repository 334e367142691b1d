"""The batch between rounds and what every round of a call reads: the target's forward, the prefill, the state.

    target_forward   one target forward that extends the cache -> logits and the draft's fused context
    prefill          the prompt through the target -> the decode state (first token, both caches)
    Call             what every round of one call reads: the models, the cache, the layer tap, rules, outputs
    DecodeState      the batch between rounds: output buffer, caches, draft context; commit, keep_paths, compact

Invariant between rounds: the target's KV cache holds every committed token of each row except its last one (the
row's *anchor*); the draft's context cache holds the projected keys/values of the same slots. Rows of a batch
accept different numbers of tokens, so the caches keep one column per verified slot and an attention mask marks
the slots that hold committed tokens (rejected drafts and padding are holes). Columns that are holes in every row
at the end of a round are cropped, so a single row never carries holes. docs/design.md explains each choice.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation import LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from .checks import check_finite, keep_cache_slots, sliding_window
from .drafting import DraftContext, LayerTap
from .lm_head import verify_head
from .stats import DSparkStats
from .verify import probs, process
from .versions import cache_argument, takes_logits_to_keep


def target_forward(target, ids, positions, attention_mask, cache, tap: LayerTap, last_logits_only: bool = False):
    """One target forward that extends ``cache``; returns (the model output, the draft's fused context [R, n, d]).
    ``last_logits_only`` (the prefill) asks the model for the last position's logits alone: the prompt's other
    positions need only hidden states, and their LM head would cost more than the rest of a long batched prefill on
    a CPU."""
    extra = {"logits_to_keep": 1} if last_logits_only and takes_logits_to_keep(type(target)) else {}
    extra[cache_argument(type(target))] = cache
    tap.expect(ids.shape[0], ids.shape[1], ids.device)
    with verify_head(target):
        out = target(
            input_ids=ids,
            position_ids=positions,
            attention_mask=attention_mask,
            use_cache=True,
            output_hidden_states=not tap.active,
            **extra,
        )
    return out, tap.fused(out)


@dataclass(frozen=True)
class Rules:
    """How one call chooses tokens and when a row stops, as ``generate`` prepared them: the target's logits
    processors, greedy or sampling, the stopping criteria."""

    processors: LogitsProcessorList
    do_sample: bool
    stopping: StoppingCriteriaList


@dataclass
class DecodeState:
    """The batch between rounds.

    ``tokens`` [R, max_length] holds each row's committed tokens (its left-padded prompt, then new tokens) in its
    first ``lengths[r]`` columns, pad after them; the last committed token is the row's anchor, at position
    ``anchor_positions[r]`` and not yet in the target's cache. ``cache_mask`` [R, S] marks the cache slots that hold
    committed tokens; ``context`` is the draft's cache of the same slots. ``rows[r]`` is row r's index in the
    caller's batch; rows that :meth:`compact` removed wait in ``done``.
    """

    tokens: torch.Tensor
    lengths: list[int]
    finished: list[bool]
    cache: Any
    cache_mask: torch.Tensor
    context: DraftContext
    anchor_positions: torch.Tensor
    rows: list[int]
    done: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.lengths)

    @property
    def active(self) -> list[int]:
        return [r for r, finished in enumerate(self.finished) if not finished]

    def history(self, r: int) -> torch.Tensor:
        """Row r's committed tokens [lengths[r]]: a view of the buffer."""
        return self.tokens[r, : self.lengths[r]]

    def room(self, limit: int, max_length: int) -> list[int]:
        """Per row, the most tokens it may verify this round: ``limit``, within what ``max_length`` leaves after
        the bonus token (0 for a finished row)."""
        return [0 if self.finished[r] else min(limit, max_length - self.lengths[r] - 1) for r in range(self.size)]

    def attention_mask(self, block_valid: torch.Tensor) -> torch.Tensor | None:
        """The target's mask for a verify block: [R, S + W] over the cache and the block (``None``: no holes)."""
        mask = torch.cat([self.cache_mask, block_valid.long()], dim=1)
        return None if bool(mask.all()) else mask

    def commit(self, r: int, new: torch.Tensor, scores: torch.Tensor, stopping_criteria) -> int:
        """Append ``new`` [k] to row r and stop where the stopping criteria (shown each token's processed scores,
        [k, V], one token at a time) stop, exactly where plain ``generate`` would: -> how many were committed.
        Columns past the row's length may hold tokens that were not committed; only ``lengths`` counts."""
        start, k = self.lengths[r], min(new.shape[0], self.tokens.shape[1] - self.lengths[r])
        self.tokens[r, start : start + k] = new[:k]
        for i in range(k):
            self.lengths[r] = start + i + 1
            if bool(stopping_criteria(self.tokens[r : r + 1, : start + i + 1], scores[i : i + 1]).any()):
                self.finished[r] = True
                return i + 1
        if self.lengths[r] == self.tokens.shape[1]:
            self.finished[r] = True
        return k

    def keep_paths(self, paths: list[list[int]], fused: torch.Tensor, positions: torch.Tensor) -> None:
        """After a verify of [R, W] slots: keep in both caches only each row's ``paths[r]`` (its anchor and accepted
        path, in order; empty for a row that keeps nothing), padded to the longest path with holes, so a single row
        never carries holes and no row keeps a rejected branch. When every path is its slots' prefix (every chain,
        and a tree whose walk took only first slots) the caches are cropped, not gathered."""
        used, device = max(len(path) for path in paths), self.tokens.device
        kept = torch.tensor([[True] * len(path) + [False] * (used - len(path)) for path in paths], device=device)
        if all(path == list(range(len(path))) for path in paths):  # crop: no copy
            self.cache.crop(-(positions.shape[1] - used))  # a padded row's extra slots become holes (kept False)
            fused, positions = fused[:, :used], positions[:, :used]
        else:
            index = torch.tensor([path + [0] * (used - len(path)) for path in paths], device=device)  # one transfer
            keep_cache_slots(self.cache, self.cache_mask.shape[1], index)
            fused = fused.gather(1, index[..., None].expand(-1, -1, fused.shape[-1]))
            positions = positions.gather(1, index)
        self.cache_mask = torch.cat([self.cache_mask, kept.long()], dim=1)
        self.context.extend(fused, positions, kept)

    def compact(self) -> torch.Tensor:
        """Drop the finished rows from the batch and both caches (they stop costing verify and draft work):
        -> the indices [R'] of the rows kept."""
        self.done.update({self.rows[r]: self.history(r).clone() for r in range(self.size) if self.finished[r]})
        keep = self.active
        index = torch.tensor(keep, device=self.tokens.device)
        self.cache.batch_select_indices(index)
        self.context.select(index)
        self.tokens, self.cache_mask = self.tokens[index], self.cache_mask[index]
        self.anchor_positions = self.anchor_positions[index]
        self.lengths, self.rows = [self.lengths[r] for r in keep], [self.rows[r] for r in keep]
        self.finished = [False] * len(keep)
        return index

    def sequences(self, batch: int, pad_id: int) -> torch.Tensor:
        """Every row of the caller's batch, in its order: [batch, longest], pad after each row's end."""
        rows = {**self.done, **{self.rows[r]: self.history(r) for r in range(self.size)}}
        width = max(len(h) for h in rows.values())
        out = torch.full((batch, width), pad_id, dtype=torch.long, device=self.tokens.device)
        for r, history in rows.items():
            out[r, : len(history)] = history
        return out


@dataclass
class Outputs:
    """What the call hands back besides the sequences: per-token scores and raw logits (when asked: batch size 1),
    the streamer, and the per-round statistics."""

    stats: DSparkStats
    want_scores: bool = False
    want_logits: bool = False
    streamer: Any = None
    scores: list[torch.Tensor] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def wanted(self) -> bool:
        return self.want_scores or self.want_logits or self.streamer is not None

    def emit(self, tokens: torch.Tensor, scores: torch.Tensor, raw: torch.Tensor) -> None:
        """Committed ``tokens`` [k] with their processed ``scores`` and ``raw`` logits [k, V]."""
        if self.want_scores:
            self.scores += list(scores[: len(tokens)].split(1))
        if self.want_logits:
            self.logits += list(raw[: len(tokens)].split(1))
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())


def prefill(call: Call, input_ids: torch.Tensor, model_kwargs: dict) -> DecodeState:
    """The prompt [R, P] through the target (the last position's logits only) -> the decode state: the target's
    cache and the draft's queued context hold the prompt, and each row holds its first new token as its anchor."""
    target, draft, cache, tap, rules, outputs = call.target, call.draft, call.cache, call.tap, call.rules, call.outputs
    max_length, pad_id = call.max_length, call.pad_id
    R, device = input_ids.shape[0], input_ids.device
    attention_mask = model_kwargs.get("attention_mask")
    cache_mask = attention_mask if attention_mask is not None else torch.ones_like(input_ids)
    positions = (cache_mask.long().cumsum(-1) - 1).clamp_min(0)
    given = model_kwargs.get("position_ids")
    if given is not None and not torch.equal(given[cache_mask.bool()].to(positions), positions[cache_mask.bool()]):
        raise ValueError(
            "DSpark generation counts positions from the attention mask; other position_ids are not supported"
        )
    out, fused = target_forward(target, input_ids, positions, attention_mask, cache, tap, last_logits_only=True)
    if sliding_window(cache) is not None:  # after the prefill, as generate does: keep rejected slots until cropped
        cache.activate_past_recording()
    context = DraftContext.empty(draft, R, input_ids.device)
    context.extend(fused, positions, cache_mask.bool())
    raw = out.logits[:, -1]
    check_finite(raw)
    scores = process(rules.processors, input_ids, raw.float() if raw.dtype != torch.float64 else raw)
    first = torch.multinomial(probs(scores), 1)[:, 0] if rules.do_sample else scores.argmax(-1)
    outputs.emit(first, scores, raw)
    tokens = torch.full((R, max(max_length, input_ids.shape[1] + 1)), pad_id, dtype=torch.long, device=device)
    tokens[:, : input_ids.shape[1]] = input_ids
    state = DecodeState(
        tokens, [input_ids.shape[1]] * R, [False] * R, cache, cache_mask, context, positions[:, -1] + 1, list(range(R))
    )
    for r in range(R):
        state.commit(r, first[r : r + 1], scores[r : r + 1], rules.stopping)
    return state


@dataclass
class Call:
    """What every round of one ``generate`` call reads: the two models, the target's cache, the layer tap that
    fuses the draft's context during target forwards, the rules, the outputs, ``max_length`` and the pad id."""

    target: Any
    draft: Any
    cache: Any
    tap: LayerTap
    rules: Rules
    outputs: Outputs
    max_length: int
    pad_id: int

    @functools.cached_property
    def vocab_size(self) -> int:
        """The target's vocabulary size (read once a call)."""
        return self.target.config.get_text_config().vocab_size
