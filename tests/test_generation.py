"""DSpark greedy decoding through generate(assistant_model=draft) equals plain greedy decoding, token for token."""

import copy
import itertools

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList, TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

import hf_dspark
from hf_dspark import DSparkDraftModel
from hf_dspark.decoding import costs, drafting, proposers
from hf_dspark.scheduling import chains
from hf_dspark.testing import tiny_target


def _prompt(seed=0, length=9, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, length), generator=g)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("head", ["none", "markov", "gated", "rnn"])
def test_greedy_matches_plain_generate(arch, dtype, head):
    target = tiny_target(arch, dtype=dtype)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type=head, head_rank=8)
    for seed in range(3):
        ids = _prompt(seed, length=5 + 3 * seed)
        ref = target.generate(ids, max_new_tokens=24, do_sample=False)
        out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft)
        assert out.tolist() == ref.tolist()
        assert sum(draft.stats.committed) == 23  # the first token comes from the prefill


class Oracle:
    """Makes a draft propose the reference continuation, corrupted at chosen block slots.

    Patches the draft's backbone so its base logits put all mass on ``reference[position + 1]`` (or on a wrong
    token at the corrupted slots); with head "none" these are exactly the proposals.
    """

    def __init__(self, draft, reference, wrong_slots=()):
        self.reference, self.wrong_slots, self.vocab = reference[0], set(wrong_slots), draft.config.target_vocab_size
        draft.decoding.verify_mode = "fixed"  # verify every proposal, so acceptance counts are the oracle's
        original = draft.forward

        def forward(
            block_embeds, block_positions, context, attention_mask=None, compute_logits=True, context_positions=None
        ):
            out = original(block_embeds, block_positions, context, attention_mask, compute_logits)
            logits = torch.full_like(out.logits, -1e4)
            for k, pos in enumerate(block_positions[0].tolist()):
                nxt = pos + 1
                token = int(self.reference[nxt]) if nxt < len(self.reference) else 3
                if k in self.wrong_slots:
                    token = (token + 1) % self.vocab
                logits[0, k, token] = 1e4
            out.logits = logits
            return out

        draft.forward = forward


@pytest.mark.parametrize(
    ("wrong_slots", "expected_accepted"),
    [((), 4), ((2,), 2), ((0,), 0)],
    ids=["full-acceptance", "partial-acceptance", "zero-acceptance"],
)
def test_controlled_acceptance(wrong_slots, expected_accepted):
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="none")
    ids = _prompt(1)
    ref = target.generate(ids, max_new_tokens=21, do_sample=False)
    Oracle(draft, ref, wrong_slots)
    out = target.generate(ids, max_new_tokens=21, do_sample=False, assistant_model=draft)
    assert out.tolist() == ref.tolist()
    stats = draft.stats
    # every round but the last (which max_new_tokens may cut short) accepts exactly up to the first wrong slot
    assert stats.accepted[:-1] == [expected_accepted] * (stats.rounds - 1)
    assert stats.committed[:-1] == [expected_accepted + 1] * (stats.rounds - 1)
    assert stats.accepted[-1] <= expected_accepted
    acc = stats.position_acceptance()
    if expected_accepted == 4:
        assert acc == [1.0, 1.0, 1.0, 1.0]
    elif expected_accepted == 2:
        assert acc == [1.0, 1.0, 0.0, None]
    else:
        assert acc == [0.0, None, None, None]


def _eos_inside_block_setup():
    target = tiny_target("llama")
    ids = _prompt(2)
    ref = target.generate(ids, max_new_tokens=30, do_sample=False)
    new = ref[0, ids.shape[1] :].tolist()
    # pick as EOS a token first produced in the middle of a 5-token round (the oracle accepts 4 + bonus)
    for i, tok in enumerate(new):
        if i >= 2 and i % 5 not in (0,) and tok not in new[:i]:
            return target, ids, tok, i
    pytest.fail("no suitable EOS candidate")


def test_eos_inside_block_stops_exactly_like_plain_generate():
    target, ids, eos, index = _eos_inside_block_setup()
    ref = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    assert ref.shape[1] == ids.shape[1] + index + 1 and ref[0, -1] == eos
    full = target.generate(ids, max_new_tokens=30, do_sample=False)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="none")
    Oracle(draft, full)
    out = target.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos, assistant_model=draft)
    assert out.tolist() == ref.tolist()
    assert draft.stats.committed[-1] < 5  # the last round was cut inside its block


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7, 13])
def test_max_new_tokens_inside_block(max_new_tokens):
    target = tiny_target("qwen3")
    ids = _prompt(3)
    full = target.generate(ids, max_new_tokens=40, do_sample=False)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="none")
    Oracle(draft, full)
    out = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft)
    assert out.tolist() == full[:, : ids.shape[1] + max_new_tokens].tolist()
    # verification never runs past max_length: no round proposes more than the room left
    assert sum(draft.stats.committed) == max_new_tokens - 1


def test_max_length_is_respected():
    target = tiny_target("llama")
    ids = _prompt(4)
    draft = DSparkDraftModel.from_target(target, block_size=4)
    ref = target.generate(ids, max_length=ids.shape[1] + 10, do_sample=False)
    out = target.generate(ids, max_length=ids.shape[1] + 10, do_sample=False, assistant_model=draft)
    assert out.tolist() == ref.tolist()


class CountingStreamer(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_every_committed_token_once_in_order():
    target = tiny_target("llama")
    ids = _prompt(5)
    draft = DSparkDraftModel.from_target(target, block_size=4)
    streamer = CountingStreamer()
    out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=draft, streamer=streamer)
    assert streamer.ended
    assert streamer.chunks[0] == ids[0].tolist()  # generate streams the prompt first
    assert [t for chunk in streamer.chunks[1:] for t in chunk] == out[0, ids.shape[1] :].tolist()


def test_text_iterator_streamer():
    from threading import Thread

    class ToyTokenizer:
        def decode(self, ids, **kw):
            return "".join(f"<{i}>" for i in ids)

    target = tiny_target("llama")
    ids = _prompt(6)
    draft = DSparkDraftModel.from_target(target, block_size=4)
    streamer = TextIteratorStreamer(ToyTokenizer(), skip_prompt=True)
    result = {}

    def run():
        result["out"] = target.generate(
            ids, max_new_tokens=12, do_sample=False, assistant_model=draft, streamer=streamer
        )

    thread = Thread(target=run)
    thread.start()
    text = "".join(streamer)
    thread.join()
    assert text == "".join(f"<{i}>" for i in result["out"][0, ids.shape[1] :].tolist())


class StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_stopping_criteria_cut_where_plain_generate_stops():
    target = tiny_target("llama")
    ids = _prompt(7)
    full = target.generate(ids, max_new_tokens=30, do_sample=False)
    stop_token = int(full[0, ids.shape[1] + 9])
    criteria = StoppingCriteriaList([StopAfterToken(stop_token)])
    ref = target.generate(ids, max_new_tokens=30, do_sample=False, stopping_criteria=criteria)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="none")
    Oracle(draft, full)
    out = target.generate(ids, max_new_tokens=30, do_sample=False, stopping_criteria=criteria, assistant_model=draft)
    assert out.tolist() == ref.tolist()


def test_return_dict_in_generate_scores_and_logits():
    target = tiny_target("llama")
    ids = _prompt(8)
    draft = DSparkDraftModel.from_target(target, block_size=4)
    kw = dict(max_new_tokens=15, do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True)
    ref = target.generate(ids, **kw)
    out = target.generate(ids, assistant_model=draft, **kw)
    assert out.sequences.tolist() == ref.sequences.tolist()
    assert len(out.scores) == len(out.logits) == 15
    for a, b in zip(out.scores, ref.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_left_padded_single_prompt():
    target = tiny_target("llama")
    ids = _prompt(9)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
    draft = DSparkDraftModel.from_target(target, block_size=4)
    ref = target.generate(padded, attention_mask=mask, max_new_tokens=16, do_sample=False)
    out = target.generate(padded, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant_model=draft)
    assert out.tolist() == ref.tolist()


def test_repetition_penalty_is_applied_to_draft_and_target_alike():
    target = tiny_target("qwen3")
    ids = _prompt(10)
    draft = DSparkDraftModel.from_target(target, block_size=4)
    kw = dict(max_new_tokens=20, do_sample=False, repetition_penalty=1.5)
    assert target.generate(ids, assistant_model=draft, **kw).tolist() == target.generate(ids, **kw).tolist()


def test_disable_restores_transformers_and_plain_generate_is_untouched():
    target = tiny_target("llama")
    ids = _prompt(11)
    draft = DSparkDraftModel.from_target(target, block_size=4)
    with_hook = target.generate(ids, max_new_tokens=10, do_sample=False)
    hf_dspark.disable()
    try:
        assert not hf_dspark.is_enabled()
        assert target.generate(ids, max_new_tokens=10, do_sample=False).tolist() == with_hook.tolist()
        # without the hook, transformers treats the draft as an ordinary assistant and fails on it
        with pytest.raises(Exception):  # noqa: B017
            target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=draft)
    finally:
        hf_dspark.enable()
    assert hf_dspark.is_enabled()
    out = target.generate(ids, max_new_tokens=10, do_sample=False, assistant_model=draft)
    assert out.tolist() == with_hook.tolist()


def test_draft_context_is_extended_only_with_new_positions(monkeypatch):
    """Each round projects only the hidden states of newly committed tokens (anchor + accepted)."""
    target = tiny_target("llama")
    ids = _prompt(12)
    draft = DSparkDraftModel.from_target(target, block_size=4)
    draft.decoding.verify_mode = "fixed"  # every round drafts (no back-off), so every round projects
    costs.draft_seconds(draft, 1)  # the scheduler's one-off timing of a draft block, on a made-up context
    projected = []
    original = draft.fused_key_values

    def spy(fused, positions):
        projected.append(fused.shape[1])
        return original(fused, positions)

    monkeypatch.setattr(draft, "fused_key_values", spy)
    target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=draft)
    stats = draft.stats
    assert projected[0] == ids.shape[1]
    # a round's slots are projected by the next round's draft block; a last round with no room to draft (one token
    # left) projects nothing, since no draft block follows
    drafted = [i for i in range(1, stats.rounds) if stats.proposed[i] > 0]
    assert drafted[: stats.rounds - 2] == list(range(1, stats.rounds - 1))
    assert projected[1:] == [stats.accepted[i - 1] + 1 for i in drafted]


def test_rounds_that_do_not_draft_queue_their_context_for_the_next_drafted_block(monkeypatch):
    """Back-off rounds project nothing; the next drafted block projects every slot committed since, in one call."""
    from hf_dspark.scheduling.policy import SPSProfile

    target = tiny_target("llama", dtype=torch.float64)
    ids = _prompt(12)
    draft = DSparkDraftModel.from_target(target, block_size=4).double()
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0)  # verifying is free: every drafted round verifies all
    monkeypatch.setattr(costs, "draft_seconds", lambda draft, rows, do_sample=False: 0.0)
    monkeypatch.setattr(chains, "drafting_pays", lambda *args: False)  # back off after every drafted round
    projected = []
    original = draft.fused_key_values
    monkeypatch.setattr(draft, "fused_key_values", lambda f, p: projected.append(f.shape[1]) or original(f, p))
    out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=draft)
    assert out.tolist() == target.generate(ids, max_new_tokens=20, do_sample=False).tolist()
    stats = draft.stats
    drafted = [i for i, lengths in enumerate(stats.verify_rounds) if lengths[0] > 0]
    assert drafted[:4] == [0, 2, 5, 10]  # back-off 1, 2, 4 plain rounds between drafted ones
    expected = [ids.shape[1]] + [
        sum(stats.accepted[j] + 1 for j in range(a, b)) for a, b in itertools.pairwise(drafted)
    ]
    assert projected == expected


def test_head_switched_off_proposes_from_the_backbone_alone():
    from transformers.generation import LogitsProcessorList

    from hf_dspark.decoding.drafting import DraftContext, draft_block

    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_(0, 3.0)
    ctx = DraftContext.empty(draft, 1, torch.device("cpu"))
    feats = draft.fuse_context(torch.randn(1, 5, len(draft.config.target_layer_ids) * 32))
    ctx.extend(feats, torch.arange(5)[None], torch.ones(1, 5, dtype=torch.bool))
    ctx.flush(draft)
    history = [torch.tensor([7, 8, 9, 10, 11, 12])]

    def propose():
        return draft_block(draft, ctx, history, torch.tensor([5]), 4, LogitsProcessorList(), False).tokens[0]

    with torch.no_grad():
        base = draft(
            draft.embed_block(torch.tensor([12])),
            torch.arange(5, 9)[None],
            list(zip(ctx.keys, ctx.values, strict=True)),
        )
    draft.head_enabled = False
    assert propose().tolist() == base.logits[0].argmax(-1).tolist()
    draft.head_enabled = True
    assert propose().tolist() != base.logits[0].argmax(-1).tolist()  # the (strong, random) head changes them
    # and decoding stays exact either way
    ids = _prompt(13)
    kw = dict(max_new_tokens=16, do_sample=False)
    ref = target.generate(ids, **kw).tolist()
    for enabled in (True, False):
        draft.head_enabled = enabled
        assert target.generate(ids, assistant_model=draft, **kw).tolist() == ref


@pytest.mark.parametrize("case", ["free", "steep", "costly-draft"])
def test_scheduler_backs_off_drafting_when_it_does_not_pay(case, monkeypatch):
    """When a drafted round is not worth its cost in expectation (a steep SPS profile and low confidences, so no
    draft token is verified; or a draft block that costs more than a whole verify step, so even verified tokens
    lose), the loop skips the draft for 1, 2, 4, … rounds (plain decode steps). The output is plain greedy either
    way; with a flat profile and a free draft every round drafts."""
    from hf_dspark.scheduling.backoff import MAX_BACKOFF
    from hf_dspark.scheduling.policy import SPSProfile

    steep, cost = {"free": (False, 0.0), "steep": (True, 0.0), "costly-draft": (False, 10.0)}[case]
    monkeypatch.setattr(costs, "draft_seconds", lambda draft, rows, do_sample=False: cost)
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.decoding.verify_mode = "scheduled"
    draft.sps_profile = SPSProfile.from_callable((lambda B: 1.0 / B) if steep else (lambda B: 1.0))
    calls = []
    original = draft.forward
    draft.forward = lambda *a, **k: calls.append(1) or original(*a, **k)
    ids = torch.tensor([[5, 6, 7, 8]])
    kw = dict(max_new_tokens=40, do_sample=False)
    out = target.generate(ids, assistant_model=draft, **kw)
    assert out.tolist() == target.generate(ids, **kw).tolist()
    rounds, verified = draft.stats.rounds, draft.stats.verify_rounds
    if case == "free":  # verifying is free: every round drafts and verifies all it may
        # (the last rounds are capped by max_new_tokens; the very last may have no room left to draft at all)
        assert all(v[0] > 0 for v in verified[:-1]) and verified[0] == [4]
        assert len(calls) == sum(v != [0] for v in verified) >= rounds - 1
        return
    # drafts at rounds 0, 2, 5, 10, 19, 36 only (back-offs 1, 2, 4, 8, 16)
    expected, r, b = [], 0, 0
    while r < rounds:
        expected.append(r)
        b = min(2 * b or 1, MAX_BACKOFF)
        r += b + 1
    assert len(calls) == len(expected) < rounds // 3
    drafted = [i for i, v in enumerate(verified) if v != [0]]
    if case == "steep":  # nothing verified
        assert drafted == [] and rounds == 39  # the prefill gives token 1
    else:  # the plan verifies every drafted token (the last may be capped by max_new_tokens), yet it does not pay
        assert drafted == expected and all(verified[i] == [4] for i in drafted[:-1]) and verified[drafted[-1]][0] > 0


@pytest.mark.parametrize("head", ["none", "markov", "gated", "rnn"])
def test_greedy_drafting_inside_the_draft_vocabulary_equals_the_full_path(head, monkeypatch):
    """With a draft vocabulary, greedy drafting without logits processors picks tokens among len(subset) columns;
    it must propose exactly what the -inf-padded full-vocabulary path proposes, with the same confidences."""
    from transformers.generation import LogitsProcessor, LogitsProcessorList

    from hf_dspark.decoding.drafting import DraftContext, draft_block

    calls = []
    real = drafting._subset_slot
    monkeypatch.setattr(drafting, "_subset_slot", lambda *a, **k: calls.append(1) or real(*a, **k))

    class Identity(LogitsProcessor):  # any processor sends drafting down the full-vocabulary path
        def __call__(self, input_ids, scores):
            return scores

    target = tiny_target("llama", dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type=head, head_rank=8)
    if draft.sequential_head is not None:
        with torch.no_grad():
            draft.sequential_head.markov_w2.weight.normal_(0, 3.0)
    draft.set_draft_vocab(list(range(3, 96, 3)))
    R = 3
    ctx = DraftContext.empty(draft, R, torch.device("cpu"))
    feats = draft.fuse_context(torch.randn(R, 6, len(draft.config.target_layer_ids) * 32, dtype=torch.float64))
    ctx.extend(feats, torch.arange(6).expand(R, 6), torch.ones(R, 6, dtype=torch.bool))
    history = [torch.tensor([7, 8, 9, 10, 11, 12, 13]), torch.tensor([1, 2, 3, 4, 5, 6, 40]), torch.arange(20, 27)]
    args = (draft, ctx, history, torch.full((R,), 6), 4)
    subset = draft_block(*args, LogitsProcessorList(), False)
    assert len(calls) == 4  # one per slot: the subset path ran
    full = draft_block(*args, LogitsProcessorList([Identity()]), False)
    assert len(calls) == 4
    assert subset.tokens.tolist() == full.tokens.tolist()
    assert set(subset.tokens.flatten().tolist()) <= set(range(3, 96, 3))
    if draft.confidence is not None:
        torch.testing.assert_close(subset.confidences, full.confidences, rtol=0, atol=0)


@pytest.mark.parametrize(("mode", "rows"), [("scheduled", 1), ("scheduled", 3), ("threshold", 3)])
def test_drafting_stops_once_the_plan_cannot_grow(mode, rows, monkeypatch):
    """The planners admit columns left to right and stop at the first that fails, so the draft stops there too:
    each block ends one slot past the longest verified prefix (the column that failed), its tokens and confidences
    are those of the whole block, the plan is the one the whole block's confidences give, and the output is plain
    greedy's."""
    from hf_dspark.scheduling.policy import SPSProfile

    target = tiny_target("llama", dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=6, head_rank=8).double()
    draft.decoding.verify_mode, draft.decoding.confidence_threshold = mode, 0.5
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0 / (1.0 + 0.05 * B))
    monkeypatch.setattr(costs, "draft_seconds", lambda draft, rows, do_sample=False: 0.0)
    with torch.no_grad():  # confidences spread over (0, 1), so plans end at different slots
        draft.confidence.confidence_head.weight.normal_(0, 0.3)
    blocks = []
    real = proposers.draft_block

    def spy(*args):
        planner = args[7]
        whole_plan = copy.deepcopy(planner)  # the same plan, fed every slot of the block
        proposal = real(*args)
        whole = real(*args[:7])  # the context was flushed by the first call: the same block again, every slot
        for k in range(whole.tokens.shape[1]):
            if not whole_plan.admit(whole.confidences[:, k]):
                break
        blocks.append((args[4], proposal, whole, whole_plan.lengths))
        return proposal

    monkeypatch.setattr(proposers, "draft_block", spy)
    ids = torch.tensor([[5, 6, 7, 8], [9, 3, 4, 40], [70, 2, 11, 12]][:rows])
    kw = dict(max_new_tokens=24, do_sample=False)
    out = target.generate(ids, assistant_model=draft, **kw)
    assert out.tolist() == target.generate(ids, **kw).tolist()
    rounds = draft.stats.verify_rounds
    assert len(blocks) == len(rounds)
    stopped = 0
    for (asked, proposal, whole, whole_lengths), verified in zip(blocks, rounds, strict=True):
        width = proposal.tokens.shape[1]
        assert torch.equal(proposal.tokens, whole.tokens[:, :width])
        assert torch.equal(proposal.confidences, whole.confidences[:, :width])
        assert verified == whole_lengths  # finished rows leave the batch between rounds: every row is active
        assert width == asked or width == max(verified) + 1
        stopped += width < asked
    assert stopped > 0  # the early stop did happen


def test_prefill_computes_logits_for_the_last_prompt_position_only():
    """The prompt's other positions feed the draft through hidden states; their LM head would be wasted work
    (on a CPU, more than the rest of a long batched prefill)."""
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4)
    draft.decoding.verify_mode = "fixed"
    ids = _prompt(3, length=11)
    shapes = []
    handle = target.register_forward_hook(lambda module, args, out: shapes.append(tuple(out.logits.shape)))
    try:
        out = target.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=draft)
    finally:
        handle.remove()
    assert out.tolist() == target.generate(ids, max_new_tokens=8, do_sample=False).tolist()
    vocab = target.config.vocab_size
    assert shapes[0] == (1, 1, vocab)  # prefill: 11 prompt positions, one row of logits
    assert all(s[1] == n + 1 for s, n in zip(shapes[1:], draft.stats.proposed, strict=True))  # verify: every slot


def test_decode_calibration_data_follows_the_rounds():
    """collect_decode_confidence: one row per full verified block, acceptance 1 before the round's first rejection
    and 0 from it on, logits equal to the confidence head's raw logits; the draft's verify mode is restored."""
    from hf_dspark.training.calibrate import collect_decode_confidence

    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="none")
    ids = _prompt(1)
    ref = target.generate(ids, max_new_tokens=21, do_sample=False)
    Oracle(draft, ref, wrong_slots=(2,))
    draft.decoding.verify_mode, draft.config.sts_temperatures = "scheduled", [2.0] * 4
    draft.decoding.lookup_max_ngram = 2  # as a shipped config may have it: calibration decodes with the draft alone
    raw = []
    original = draft.confidence.logit
    draft.confidence.logit = lambda h, f: raw.append(original(h, f)) or raw[-1]
    logits, accepted = collect_decode_confidence(target, draft, [ids[0].tolist()], max_new_tokens=21, batch_size=1)
    assert draft.decoding.verify_mode == "scheduled" and draft.config.sts_temperatures == [2.0] * 4  # restored
    assert draft.decoding.lookup_max_ngram == 2 and not any(draft.stats.looked_up)
    full = [i for i, p in enumerate(draft.stats.proposed) if p == 4]
    assert len(full) >= 5 and logits.shape == accepted.shape == (len(full), 4)
    assert accepted.tolist() == [[1.0, 1.0, 0.0, 0.0]] * len(full)  # the oracle is wrong at slot 2 only
    slots = torch.stack(raw[: 4 * len(full)]).view(-1, 4)  # drafted slots in order; full blocks come first
    torch.testing.assert_close(logits, slots[: len(full)].double(), rtol=1e-4, atol=1e-4)


def test_decode_calibration_refuses_a_draft_without_confidence_head():
    from hf_dspark.training.calibrate import collect_decode_confidence

    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, confidence_head=False)
    with pytest.raises(ValueError, match="no confidence head"):
        collect_decode_confidence(target, draft, [[5, 6, 7]])


@pytest.mark.parametrize("tree_top_k", [1, 3])
def test_greedy_lookahead_verifies_past_a_drop_and_stays_plain_greedy(monkeypatch, tree_top_k):
    """``greedy_lookahead``: on a profile with one drop (1 slot -> 2 costs 40% more, then flat), Algorithm 1's early
    stop verifies a first draft token only if its survival passes 2/3, while lookahead takes the whole flat block
    once its survivals add up to 2/3; chains and trees verify more tokens and decode exactly plain greedy. A
    sampling call with the setting on plans with the early stop."""
    from hf_dspark.scheduling.policy import SPSProfile

    monkeypatch.setattr(costs, "draft_seconds", lambda draft, rows, do_sample=False: 0.0)
    monkeypatch.setattr(costs, "tree_draft_seconds", lambda draft, top_k, *a, **k: 0.0)
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0 if B == 1 else 0.6)
    ids = _prompt(9)
    reference = target.generate(ids, max_new_tokens=30, do_sample=False).tolist()
    verified = {}
    for lookahead in (False, True):
        out = target.generate(ids, max_new_tokens=30, do_sample=False, custom_generate=hf_dspark.dspark_generate,
                              draft=draft, verify_mode="scheduled", confidence_recalibration=False,
                              tree_top_k=tree_top_k, greedy_lookahead=lookahead)  # fmt: skip
        assert out.tolist() == reference
        verified[lookahead] = sum(draft.stats.proposed)
    assert verified[True] > verified[False]
    planned = []
    original = chains.column_plan
    monkeypatch.setattr(chains, "column_plan", lambda *a: planned.append(a[-1]) or original(*a))
    target.generate(ids, max_new_tokens=6, do_sample=True, custom_generate=hf_dspark.dspark_generate, draft=draft,
                    verify_mode="scheduled", greedy_lookahead=True)  # fmt: skip
    assert planned and not any(planned)
