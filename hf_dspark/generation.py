"""The DSpark decoding loop, gpt-fast style: one function per idea.

    prefill        target forward over the prompt; first token; draft context from the target's hidden states
    draft_block    one backbone pass, then the sequential head left to right -> tokens, q, confidences
    verify_block   target forward over anchor + ℓ draft tokens -> accepted prefix + correction/bonus token
    dspark_decode  the loop: draft, verify, commit (crop caches, extend the draft context, stream, stop)

Invariant between rounds: the target's KV cache holds every committed token except the last one (the *anchor*);
the draft's context cache holds the projected keys/values of exactly those same positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation import GenerateDecoderOnlyOutput, GenerationConfig, LogitsProcessorList
from transformers.generation.stopping_criteria import StoppingCriteriaList

from .kernels import fused_head_step, fused_temperature, use_kernels
from .modeling_dspark import DSparkDraftModel
from .stats import DSparkStats
from .verify import greedy_accept, rejection_sample


def _probs(scores: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores.float() if scores.dtype in (torch.float16, torch.bfloat16) else scores, dim=-1)


def _process(logits_processor: LogitsProcessorList, ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Apply the target's logits processors to one position: ids [1, T] (everything before it), scores [1, V]."""
    return logits_processor(ids, scores) if logits_processor else scores


@dataclass
class DraftContext:
    """The draft's cache of projected context keys/values, one (k, v) pair per draft layer: [1, KV, L, hd]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor  # [1, L]: sequence positions of the cached entries (for padding masks)
    valid: torch.Tensor  # [1, L] bool: False for left padding

    def extend(self, draft: DSparkDraftModel, features: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor):
        """Project only the new hidden states features [1, n, m·d_t] and append them."""
        new = draft.context_key_values(features.to(draft.dtype), positions)
        self.keys = [torch.cat([k, nk], dim=2) for k, (nk, _) in zip(self.keys, new, strict=True)]
        self.values = [torch.cat([v, nv], dim=2) for v, (_, nv) in zip(self.values, new, strict=True)]
        self.positions = torch.cat([self.positions, positions], dim=1)
        self.valid = torch.cat([self.valid, valid], dim=1)

    @classmethod
    def empty(cls, draft: DSparkDraftModel, device: torch.device) -> DraftContext:
        c = draft.config
        kv = torch.empty(1, c.num_key_value_heads, 0, c.head_dim, device=device, dtype=draft.dtype)
        n = len(draft.layers)
        return cls(
            [kv] * n,
            [kv] * n,
            torch.empty(1, 0, dtype=torch.long, device=device),
            torch.empty(1, 0, dtype=torch.bool, device=device),
        )


@dataclass
class Proposal:
    """A drafted block: tokens [ℓ], processed draft probabilities q [ℓ, V] (sampling only), confidences [ℓ] or None."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    confidences: torch.Tensor | None


def target_features(draft: DSparkDraftModel, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The target layers the draft reads, hidden_states[l + 1] for l in target_layer_ids: -> [1, n, m·d_t]."""
    return torch.cat([hidden_states[layer + 1] for layer in draft.config.target_layer_ids], dim=-1)


def _target_forward(target, ids, positions, attention_mask, cache):
    return target(
        input_ids=ids,
        position_ids=positions,
        attention_mask=attention_mask,
        cache=cache,
        use_cache=True,
        output_hidden_states=True,
    )


def _torch_slot(draft, logits, h_k, prev, state, ids, logits_processor, do_sample, conf_temperature):
    """One slot on the PyTorch path: head bias, confidence, the target's processors, argmax or sample.
    -> (token [1], processed probs [1, V] or None, confidence [1] or None, head state)."""
    head, conf_head, feature, conf = draft.sequential_head, draft.confidence, None, None
    if head is not None:
        bias, feature, state = head.step(prev, h_k, state)
        logits = logits + bias
    if conf_head is not None:
        conf = conf_head.calibrated(conf_head.logit(h_k, feature), conf_temperature)
    scores = _process(
        logits_processor, ids, logits.to(torch.float32 if logits.dtype != torch.float64 else logits.dtype)
    )
    if not do_sample:
        return scores.argmax(-1), None, conf, state
    p = _probs(scores)
    return torch.multinomial(p, 1)[:, 0], p, conf, state


def _kernel_slot(draft, logits, h_k, prev, state, ids, logits_processor, do_sample, conf_temperature):
    """The same slot through the fused Triton step (temperature is the only processing it fuses)."""
    temperature = fused_temperature(logits_processor)
    _, token, p, conf, state = fused_head_step(
        draft, logits, h_k, prev, state, temperature, do_sample, conf_temperature
    )
    return token, p, conf, state


@torch.no_grad()
def draft_block(
    draft: DSparkDraftModel,
    context: DraftContext,
    sequence: torch.Tensor,
    anchor_position: int,
    max_tokens: int,
    logits_processor: LogitsProcessorList,
    do_sample: bool,
) -> Proposal:
    """Propose up to ``max_tokens`` (≤ γ) tokens after the anchor ``sequence[0, -1]``.

    One backbone forward gives U, h for all slots; the sequential head then adds its bias left to right, each
    position's logits are processed exactly like the target's, and a token is chosen (argmax or sample).
    """
    gamma = draft.config.block_size
    device = sequence.device
    anchor = sequence[:, -1]
    if max_tokens == 0:
        no_conf = None if draft.confidence is None else torch.empty(0, device=device)
        return Proposal(anchor.new_empty(0), None, no_conf)
    positions = torch.arange(anchor_position, anchor_position + gamma, device=device)[None]
    mask = None
    if not bool(context.valid.all()):
        mask = torch.cat([context.valid, torch.ones(1, gamma, dtype=torch.bool, device=device)], dim=1)
        mask = mask[:, None, :].expand(1, gamma, -1)
    out = draft(draft.embed_block(anchor), positions, list(zip(context.keys, context.values, strict=True)), mask)
    temps = draft.config.sts_temperatures
    step = _kernel_slot if use_kernels(draft, device, logits_processor) else _torch_slot
    tokens, probs, confs = [], [], []
    prev, state, ids = anchor, None, sequence
    for k in range(max_tokens):
        token, p, conf, state = step(
            draft, out.logits[:, k], out.hidden_states[:, k], prev, state, ids, logits_processor, do_sample,
            temps[k] if temps else None,
        )  # fmt: skip
        tokens.append(token)
        if p is not None:
            probs.append(p)
        if conf is not None:
            confs.append(conf)
        prev = token
        ids = torch.cat([ids, token[:, None]], dim=1)
    return Proposal(
        tokens=torch.cat(tokens),
        probs=torch.cat(probs) if do_sample else None,
        confidences=torch.cat(confs) if confs else None,
    )


def _check_supported(generation_config: GenerationConfig, input_ids: torch.Tensor, model_kwargs: dict) -> None:
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"DSpark generation currently supports batch size 1, got a batch of {input_ids.shape[0]}: "
            "call generate once per prompt."
        )
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("DSpark generation does not return attentions or hidden states.")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError("DSpark generation needs input_ids (inputs_embeds is not supported).")


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
    **model_kwargs,
):
    """DSpark decoding with the arguments ``GenerationMixin.generate`` prepares for a decoding method.

    Returns the full sequences [1, T] (prompt + new tokens), or a ``GenerateDecoderOnlyOutput`` when
    ``return_dict_in_generate``. ``draft.stats`` holds the per-round statistics afterwards.
    """
    _check_supported(generation_config, input_ids, model_kwargs)
    if synced_gpus:
        raise ValueError("DSpark generation does not support synced_gpus (ZeRO-3 / FSDP sharded generation).")
    if not draft.is_attached or draft.target is not target:
        draft.attach(target)
    cache = model_kwargs.get("cache")
    if cache is None:
        raise ValueError("DSpark generation needs use_cache=True (a cache the verifier can crop).")
    do_sample = generation_config.do_sample
    want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    want_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    scores_out, logits_out = [], []
    stats = DSparkStats(block_size=draft.config.block_size)
    draft.stats = stats
    max_length = generation_config.max_length

    # --- prefill ------------------------------------------------------------------------------------------------
    attention_mask = model_kwargs.get("attention_mask")
    padded = attention_mask is not None  # generate drops an all-ones mask; keep passing one only if it had zeros
    mask = attention_mask if padded else torch.ones_like(input_ids)
    positions = (mask.long().cumsum(-1) - 1).clamp_min(0)
    out = _target_forward(target, input_ids, positions, attention_mask, cache)
    context = DraftContext.empty(draft, input_ids.device)
    context.extend(draft, target_features(draft, out.hidden_states), positions, mask.bool())
    raw = out.logits[:, -1]
    scores = _process(logits_processor, input_ids, raw.float() if raw.dtype != torch.float64 else raw)
    first = torch.multinomial(_probs(scores), 1)[:, 0] if do_sample else scores.argmax(-1)
    if want_scores:
        scores_out.append(scores)
    if want_logits:
        logits_out.append(raw)
    sequence = torch.cat([input_ids, first[:, None]], dim=1)
    mask = torch.cat([mask, mask.new_ones(1, 1)], dim=1)
    next_position = int(positions[0, -1]) + 1  # position of the anchor
    if streamer is not None:
        streamer.put(first.cpu())
    finished = bool(stopping_criteria(sequence, scores).any())

    # --- rounds -------------------------------------------------------------------------------------------------
    while not finished:
        remaining = max_length - sequence.shape[1]
        ell_max = min(draft.config.block_size, remaining - 1)
        proposal = draft_block(draft, context, sequence, next_position, ell_max, logits_processor, do_sample)
        ell = proposal.tokens.shape[0]

        # verify: anchor + ℓ draft tokens in one target forward
        block = torch.cat([sequence[:, -1], proposal.tokens])[None]
        block_positions = torch.arange(next_position, next_position + ell + 1, device=block.device)[None]
        full_mask = torch.cat([mask, mask.new_ones(1, ell)], dim=1) if padded else None
        out = _target_forward(target, block, block_positions, full_mask, cache)
        raw = out.logits[0]
        raw = raw.float() if raw.dtype != torch.float64 else raw
        candidate = torch.cat([sequence, proposal.tokens[None]], dim=1)
        base = sequence.shape[1]
        target_scores = torch.cat(
            [_process(logits_processor, candidate[:, : base + i], raw[i : i + 1]) for i in range(ell + 1)]
        )
        if do_sample:
            n, nxt = rejection_sample(proposal.tokens, proposal.probs, _probs(target_scores))
        else:
            n, nxt = greedy_accept(proposal.tokens, target_scores)
        new_tokens = torch.cat([proposal.tokens[:n], nxt[None]])

        # commit token by token so stopping criteria (EOS, max_length, stop strings) cut exactly where plain
        # generate would have stopped
        committed = 0
        for i in range(n + 1):
            sequence = torch.cat([sequence, new_tokens[i : i + 1][None]], dim=1)
            committed += 1
            if want_scores:
                scores_out.append(target_scores[i : i + 1])
            if want_logits:
                logits_out.append(raw[i : i + 1])
            if bool(stopping_criteria(sequence, target_scores[i : i + 1]).any()):
                finished = True
                break
        stats.record(ell, n, committed, proposal.confidences.tolist() if proposal.confidences is not None else None)
        if streamer is not None:
            streamer.put(new_tokens[:committed].cpu())
        if finished:
            break

        # the target cache keeps the anchor and the n accepted tokens; the draft context gains the same positions
        cache.crop(-(ell - n))
        mask = torch.cat([mask, mask.new_ones(1, n + 1)], dim=1)
        kept = slice(0, n + 1)
        context.extend(
            draft,
            target_features(draft, out.hidden_states)[:, kept],
            block_positions[:, kept],
            torch.ones(1, n + 1, dtype=torch.bool, device=block.device),
        )
        next_position += n + 1

    if streamer is not None:
        streamer.end()
    if generation_config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(
            sequences=sequence,
            scores=tuple(scores_out) if want_scores else None,
            logits=tuple(logits_out) if want_logits else None,
            cache=cache,
        )
    return sequence
