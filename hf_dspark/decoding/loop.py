"""The DSpark decoding loop, gpt-fast style: one function per idea, and a loop that fits on a screen.

    prefill          (state.py) the prompt through the target -> the decode state (first token, both caches)
    call_settings    what this call decodes with: the draft's settings or the call's, adjusted for sampling
    schedule         the call's rounds: token trees (tree_rounds.py) or chains (chain.py), priced for the batch
    play_round       one round, chains or trees: propose, choose, verify in one forward, observe
    dspark_decode    prefill, then one round after another until every row has stopped

A round asks the call's rounds (:class:`~hf_dspark.decoding.costs.PricedRounds`: chains or trees) what each row
requests, runs their proposers, lets their schedule choose what each row verifies, verifies every row in one target
forward, accepts exactly and advances both caches (:mod:`hf_dspark.decoding.state` states the invariant between
rounds), then shows them what was accepted. Rows that finish leave the batch (``compact``) so they stop costing
verify and draft work.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
from transformers.generation import GenerateDecoderOnlyOutput, GenerationConfig, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from ..model.modeling_dspark import DSparkDraftModel
from ..settings import DecodingConfig
from .chain import chain_schedule
from .checks import check_cache, check_settings_fit, check_supported
from .costs import PricedRounds, profile_rows
from .drafting import LayerTap
from .proposers import propose
from .state import Call, DecodeState, Outputs, Rules, prefill
from .stats import DSparkStats
from .tree_rounds import tree_schedule
from .verification import verify
from .versions import CACHE_FIELD, cache_from


@dataclass
class DSparkGenerateOutput(GenerateDecoderOnlyOutput):
    """``generate``'s output with ``return_dict_in_generate=True``, plus this call's own per-round statistics
    (``draft.stats`` is whichever call on the draft finished last, which differs when threads share a draft)."""

    dspark_stats: DSparkStats | None = None


def call_settings(draft: DSparkDraftModel, settings: DecodingConfig | None, do_sample: bool) -> DecodingConfig:
    """This call's settings (default: the draft's own, resolved), checked against the draft; a sampling call keeps
    Algorithm 1's early stop (it is what keeps sampling exact) and no wall-time recalibration (decisions that follow
    wall time would change which random draws a seeded call makes)."""
    settings = settings or draft.decoding.resolve(draft.confidence is not None)
    check_settings_fit(settings, draft)
    if do_sample and (settings.greedy_lookahead or settings.cost_recalibration):
        settings = dataclasses.replace(settings, greedy_lookahead=False, cost_recalibration=False)
    return settings


def schedule(call: Call, settings: DecodingConfig, state: DecodeState) -> PricedRounds:
    """The call's rounds, priced for the batch: token trees when the settings ask for them and the target can have
    them (else the reason is in the stats), chains otherwise."""
    draft, stats = call.draft, call.outputs.stats
    rounds = tree_schedule(draft, call.target, call.cache, settings, stats, state.context)
    rounds = rounds or chain_schedule(draft, settings, state.context)
    rounds.price(call, state.size)
    return rounds


def play_round(call: Call, rounds: PricedRounds, state: DecodeState) -> None:
    """One round for every active row: the rounds' requests, their proposers' candidates, the schedule's choice
    (each row's chain or tree), the one verify (:func:`~hf_dspark.decoding.verification.verify`: one forward, exact
    walks, both caches keep the accepted paths), then what the rounds learn from the walks."""
    start, stats = time.perf_counter(), call.outputs.stats
    requests = rounds.requests(state, call.max_length, call.rules.processors, call.rules.do_sample)
    candidates = propose(rounds.proposers, requests, rounds.empty)
    verified = rounds.choose(call, candidates, requests, state)
    stats.verify_rounds.append([verified[r].size for r in state.active])
    walks = verify(call, state, verified, rounds.buckets)
    rounds.observe(call, candidates, requests, verified, walks)
    if state.active:
        rounds.time_round(time.perf_counter() - start)  # acceptance read the logits on the host: it is done


@torch.no_grad()
def dspark_decode(
    target,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    draft: DSparkDraftModel,
    streamer=None,
    synced_gpus: bool = False,
    settings: DecodingConfig | None = None,
    **model_kwargs,
):
    """DSpark decoding with the arguments ``GenerationMixin.generate`` prepares for a decoding method.

    ``input_ids`` [R, P] is a left-padded batch. ``settings``: this call's resolved decoding settings (default: the
    draft's own, ``draft.decoding``). Returns the sequences [R, P + new] (rows that finish early are padded with the
    pad token, as plain ``generate`` does), or a :class:`DSparkGenerateOutput` (``GenerateDecoderOnlyOutput`` plus
    this call's ``dspark_stats``) when ``return_dict_in_generate``. ``draft.stats`` is the last finished call's
    statistics.
    """
    g, batch, cache = generation_config, input_ids.shape[0], cache_from(model_kwargs)
    check_call(target, draft, g, input_ids, model_kwargs, streamer, synced_gpus, cache)
    stats = draft.stats = DSparkStats(num_draft_tokens=draft.config.num_draft_tokens)  # the running call's
    returned = g.return_dict_in_generate
    outputs = Outputs(stats, returned and g.output_scores, returned and g.output_logits, streamer)
    # rows leave the batch as they finish, unless the caller asked for the cache back (it then covers every row)
    compact = hasattr(cache, "batch_select_indices") and not returned
    settings = call_settings(draft, settings, g.do_sample)
    pad_id = int(g._pad_token_tensor) if g._pad_token_tensor is not None else 0
    rules = Rules(logits_processor, g.do_sample, stopping_criteria)
    with LayerTap(target, draft) as tap:
        call = Call(target, draft, cache, tap, rules, outputs, g.max_length, pad_id)
        state = prefill(call, input_ids, model_kwargs)
        rounds = schedule(call, settings, state)
        while state.active:
            stats.round_rows.append([state.rows[r] for r in state.active])
            play_round(call, rounds, state)
            if compact and any(state.finished) and state.active:
                rounds.keep_rows(state.compact())
                rounds.price(call, state.size, profile_rows(state.size, batch))
    if streamer is not None:
        streamer.end()
    draft.stats = stats  # the last call to finish; its own stats come back on a dict output
    return finish(state, outputs, cache, batch, pad_id, returned)


def check_call(target, draft, generation_config, input_ids, model_kwargs, streamer, synced_gpus, cache) -> None:
    """Refuse what this loop cannot do, naming it, before the prefill; attach the draft to this target."""
    check_supported(generation_config, input_ids, model_kwargs, streamer)
    if synced_gpus:
        raise ValueError("DSpark generation does not support synced_gpus (ZeRO-3 / FSDP sharded generation).")
    if not draft.follows(target):  # first use, another target, or either moved to another dtype or device since
        draft.attach(target)
    check_cache(cache, input_ids.shape[0], generation_config.max_length)


def finish(state: DecodeState, outputs: Outputs, cache, batch: int, pad_id: int, returned: bool):
    """The sequences [batch, longest], or the dict output with this call's scores, logits, stats and cache."""
    sequences = state.sequences(batch, pad_id)
    if not returned:
        return sequences
    return DSparkGenerateOutput(
        sequences=sequences,
        scores=tuple(outputs.scores) if outputs.want_scores else None,
        logits=tuple(outputs.logits) if outputs.want_logits else None,
        dspark_stats=outputs.stats,
        **{CACHE_FIELD: cache},
    )
