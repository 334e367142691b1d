"""Token trees: the tree's bookkeeping, its verify mask, exact acceptance (greedy = plain token for token, sampling
checked by chi-square), branches that the chain cannot accept, and the fallbacks to chains, named."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM
from transformers.generation import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

import hf_dspark
from hf_dspark import DSparkConfig, DSparkDraftModel
from hf_dspark.decoding import checks
from hf_dspark.decoding.state import DecodeState
from hf_dspark.decoding.tree import TokenTree, VerifiedTree
from hf_dspark.decoding.verify import walk
from hf_dspark.scheduling import trees as tree_scheduling
from hf_dspark.testing import tiny_target


def _tree() -> TokenTree:
    """anchor ─ 5 (0.6) ─ 7 (0.5)
               └ 8 (0.2)
    └ 6 (0.3) ─ 9 (0.9)"""
    tree = TokenTree()
    a = tree.add(-1, 5, 0.6, "draft", top=True)
    b = tree.add(-1, 6, 0.3, "draft")
    tree.add(a, 7, 0.5 / 0.6, "draft", top=True)
    tree.add(a, 8, 0.2 / 0.6, "draft")
    tree.add(b, 9, 0.9, "draft", top=True)
    return tree


def _tree_rounds(settings, draft_tokens: int, **prices):
    """A call's tree rounds with no proposers, its schedule priced as given (``sps``, ``drafting``,
    ``chain_drafting``, ``observed``), as ``price`` would set them."""
    from hf_dspark.decoding.tree_rounds import TreeRounds

    rounds = TreeRounds(settings, draft_tokens, [], None)
    rounds.schedule = dataclasses.replace(rounds.schedule, **prices)
    return rounds


def test_tree_values_multiply_along_paths_and_ranking_keeps_parents_first():
    tree = _tree()
    assert tree.depths == [1, 1, 2, 2, 2]
    assert tree.values[4] == pytest.approx(0.27)
    assert tree.ranked(max_depth=2) == [0, 2, 1, 4, 3]  # 0.6, 0.5, 0.3, 0.27, 0.2
    assert tree.ranked(max_depth=1) == [0, 1]
    assert tree.select(budget=3, max_depth=2) == [0, 1, 2]  # by depth, parents before children


def test_a_lookup_path_merges_shared_prefixes_and_raises_its_ancestors():
    tree = _tree()
    nodes = tree.add_path([6, 9, 4], [0.95, 0.95, 0.95], "lookup")
    assert nodes[:2] == [1, 4]  # 6 and 6-9 were already there
    assert len(tree) == 6 and tree.parents[5] == 4 and tree.depths[5] == 3
    assert tree.sources[1] == {"draft", "lookup"} and tree.sources[5] == {"lookup"}
    assert tree.edges[1] == 0.95  # the larger estimate wins
    assert all(tree.values[tree.parents[n]] >= tree.values[n] for n in range(len(tree)) if tree.parents[n] >= 0)
    ranked = tree.ranked(max_depth=3)
    assert all(tree.parents[n] < 0 or ranked.index(tree.parents[n]) < ranked.index(n) for n in ranked)


def test_verified_tree_mask_positions_and_children():
    tree = _tree()
    verified = VerifiedTree.of(tree, tree.select(budget=5, max_depth=2))  # nodes 0..4 in depth order
    assert verified.nodes == [0, 1, 2, 3, 4]
    assert verified.parent_slots == [-1, 0, 0, 1, 1, 2]
    assert verified.slot_tokens.tolist() == [5, 6, 7, 8, 9] and verified.slot_depths == [1, 1, 2, 2, 2]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [1, 0, 1, 0, 0, 0],
            [1, 1, 0, 1, 0, 0],
            [1, 1, 0, 0, 1, 0],
            [1, 0, 1, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(verified.ancestors("cpu"), expected)
    mask = verified.attention_mask(torch.tensor([[1, 0, 1]]), torch.float32)
    assert mask.shape == (1, 1, 6, 9)
    allowed = mask[0, 0] == 0
    assert torch.equal(allowed[:, :3], torch.tensor([[True, False, True]]).expand(6, 3))
    assert torch.equal(allowed[:, 3:], expected)
    assert float(mask.min()) == torch.finfo(torch.float32).min
    assert verified.children == {(0, 5): 1, (0, 6): 2, (1, 7): 3, (1, 8): 4, (2, 9): 5}


def test_walk_descends_into_any_child_the_target_chooses_and_stops_at_the_first_it_does_not():
    tree = _tree()
    verified = VerifiedTree.of(tree, [0, 1, 2, 3, 4])
    raw = torch.full((6, 12), -5.0)
    raw[0, 6] = 5  # the anchor's choice: 6, the draft's second child
    raw[2, 9] = 5  # after 6: 9, a child
    raw[5, 11] = 5  # after 6 9: 11, not in the tree -> the correction
    result = walk(verified, raw, torch.tensor([1, 2, 3]), LogitsProcessorList(), do_sample=False)
    assert result.slots == [2, 5] and int(result.next_token) == 11
    assert result.scores.shape == (3, 12) and torch.equal(result.scores, raw[[0, 2, 5]])


def test_walk_processes_each_slot_with_its_own_path():
    """A repetition penalty at slot s sees the history plus slot s's path, not the block's other branches."""
    tree = TokenTree()
    tree.add(-1, 4, 0.5, "draft")
    tree.add(-1, 5, 0.5, "draft")
    verified = VerifiedTree.of(tree, [0, 1])
    raw = torch.zeros(3, 8)
    raw[:, 4] = 1.0
    raw[0, 5] = 2.0  # the anchor picks 5 ...
    raw[2, 4], raw[2, 5] = 1.5, 1.6  # ... whose path penalises 5 (1.6 / 10 < 1.5), so 4 follows
    penalty = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(10.0)])
    result = walk(verified, raw, torch.tensor([1, 2]), penalty, do_sample=False)
    assert result.slots == [2] and int(result.next_token) == 4


def test_walk_tests_a_sampled_chain_against_its_q():
    """A chain's token drawn from q is kept with probability min(1, p/q), and after a rejection the new token comes
    from norm(max(0, p - q)): p = (0.6, 0.4, 0) at the anchor, the chain's token 0 drawn from q = (0.8, 0, 0.2) is
    kept 3/4 of the time, and a rejection can only yield token 1 (the residual's whole mass). q on a branched tree
    is refused by name (its children are the draft's top choices, not draws)."""
    torch.manual_seed(0)
    raw = torch.log(torch.tensor([[0.6, 0.4, 1e-30], [0.2, 0.3, 0.5]]))
    chain = VerifiedTree.chain(torch.tensor([0]), torch.tensor([[0.8, 0.0, 0.2]]))
    kept, after_rejection = 0, set()
    for _ in range(4000):
        result = walk(chain, raw, torch.tensor([7]), LogitsProcessorList(), do_sample=True)
        if result.slots == [1]:
            kept += 1
        else:
            after_rejection.add(int(result.next_token))
    assert abs(kept / 4000 - 0.75) < 0.03 and after_rejection == {1}
    tree = _tree()
    branched = VerifiedTree.of(tree, [0, 1])
    branched.probs = torch.full((2, 12), 1 / 12)
    with pytest.raises(ValueError, match="tested along a chain"):
        walk(branched, torch.zeros(3, 12), torch.tensor([1]), LogitsProcessorList(), do_sample=True)


def _prompt(seed=0, length=9, vocab=96):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (1, length), generator=g)


def _tree_generate(target, draft, ids, **kw):
    return target.generate(ids, custom_generate=hf_dspark.dspark_generate, draft=draft, do_sample=False, **kw)


@pytest.mark.parametrize(
    ("arch", "head", "mode"),
    [
        ("llama", "none", "fixed"),
        ("qwen3", "none", "scheduled"),
        ("llama", "markov", "scheduled"),
        ("qwen3", "markov", "threshold"),
        ("llama", "gated", "threshold"),
        ("qwen3", "gated", "fixed"),
        ("llama", "rnn", "fixed"),
        ("qwen3", "rnn", "scheduled"),
    ],
)  # pairwise over (arch, head, mode)
def test_tree_greedy_matches_plain_generate(arch, head, mode):
    from hf_dspark.scheduling.policy import SPSProfile

    target = tiny_target(arch)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type=head, head_rank=8)
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0 / (1.0 + 0.05 * B))
    for seed, (top_k, lookup) in enumerate([(2, 0), (4, 3), (3, 2)]):
        ids = _prompt(seed, length=5 + 3 * seed)
        ref = target.generate(ids, max_new_tokens=24, do_sample=False)
        out = _tree_generate(target, draft, ids, max_new_tokens=24, tree_top_k=top_k, verify_mode=mode,
                             lookup_max_ngram=lookup)  # fmt: skip
        assert out.tolist() == ref.tolist()
        stats = draft.stats
        assert stats.tree_fallback is None and sum(stats.committed) == 23
        if mode == "fixed":  # every round verifies a tree wider than a chain
            assert max(stats.proposed) > 4 and max(stats.depths) == 4


SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    max_position_embeddings=256,
)
SLIDING = {"mistral", "gemma2", "gemma3_text", "exaone4"}  # their default configs have sliding-window layers
FAMILIES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo",
    "olmo2",
    "granite",
    "starcoder2",
    "cohere",
    "glm",
    "stablelm",
    "gpt_neox",
    "falcon",
    "phi",
    "smollm3",
    "mixtral",
    "exaone4",
]


@pytest.mark.parametrize("model_type", FAMILIES)
def test_tree_greedy_matches_plain_across_families(model_type):
    """Every family verifies trees exactly, one row or a padded batch, or verifies chains and names why (sliding
    windows)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SMALL)).eval()
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=8)
    ids = _prompt(0, length=7)
    ref = target.generate(ids, max_new_tokens=12, do_sample=False)
    out = _tree_generate(target, draft, ids, max_new_tokens=12, tree_top_k=3, verify_mode="fixed")
    assert out.tolist() == ref.tolist()
    if model_type in SLIDING:
        assert draft.stats.tree_fallback == "the target has sliding-window attention layers"
    else:
        assert draft.stats.tree_fallback is None and max(draft.stats.proposed) > 4
    # a left-padded batch: each row its own tree, its own mask and positions, in one forward
    from helpers import left_pad

    ids, mask = left_pad([_prompt(1, length=7)[0].tolist(), _prompt(2, length=4)[0].tolist()])
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    out = _tree_generate(target, draft, ids, attention_mask=mask, max_new_tokens=10, tree_top_k=3,
                         verify_mode="fixed", pad_token_id=0)  # fmt: skip
    assert out.tolist() == ref.tolist()
    assert (draft.stats.tree_fallback is None) == (model_type not in SLIDING)


class SecondChoiceOracle:
    """A head-less draft whose base logits at slot 0 rank the reference token second (the wrong token first,
    q = 0.62 / 0.38) and at later slots put all mass on the reference: a chain accepts nothing, a top-2 tree
    accepts the whole block through the draft's second child."""

    def __init__(self, draft, reference):
        self.reference = reference[0]
        original = draft.forward

        def forward(block_embeds, block_positions, context, attention_mask=None, compute_logits=True,
                    context_positions=None):  # fmt: skip
            out = original(block_embeds, block_positions, context, attention_mask, compute_logits)
            logits = torch.full_like(out.logits, -1e4)
            for k, pos in enumerate(block_positions[0].tolist()):
                token = int(self.reference[pos + 1]) if pos + 1 < len(self.reference) else 3
                logits[0, k, token] = 1e4
                if k == 0:
                    logits[0, k, (token + 1) % logits.shape[-1]] = 1e4 + 0.5
            out.logits = logits
            return out

        draft.forward = forward


def test_a_tree_accepts_the_drafts_second_choice_where_the_chain_accepts_nothing():
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="none", confidence_head=False)
    ids = _prompt(1)
    ref = target.generate(ids, max_new_tokens=21, do_sample=False)
    SecondChoiceOracle(draft, ref)
    chain = _tree_generate(target, draft, ids, max_new_tokens=21, verify_mode="fixed", lookup_max_ngram=0)
    assert chain.tolist() == ref.tolist()
    assert set(draft.stats.accepted) == {0}
    tree = _tree_generate(target, draft, ids, max_new_tokens=21, verify_mode="fixed", tree_top_k=2,
                          lookup_max_ngram=0)  # fmt: skip
    assert tree.tolist() == ref.tolist()
    stats = draft.stats
    assert stats.accepted[:-1] == [4] * (stats.rounds - 1) and stats.proposed[0] == 8
    # the values: the accepted second child of slot 0 was valued 0.38 and was no top child
    taken = [edge for entry in stats.tree_edges for edge in entry if edge[2] and not edge[1]]
    assert taken and all(abs(v - 0.3775) < 1e-3 for v, _, _ in taken)


def test_tree_caches_hold_only_the_accepted_path():
    """After a tree round the target's cache equals the cache of a plain forward over the committed tokens."""
    target = tiny_target("qwen3")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=8)
    ids = _prompt(2)
    out = _tree_generate(target, draft, ids, max_new_tokens=15, tree_top_k=3, verify_mode="fixed",
                         return_dict_in_generate=True)  # fmt: skip
    cache, sequence = out.past_key_values, out.sequences
    assert draft.stats.rounds > 1 and draft.stats.tree_fallback is None
    with torch.no_grad():
        plain = target(sequence[:, :-1], use_cache=True).past_key_values
    assert cache.get_seq_length() == sequence.shape[1] - 1
    for mine, theirs in zip(cache.layers, plain.layers, strict=True):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(("mode", "lookup"), [("fixed", 0), ("scheduled", 3), ("threshold", 2)])
def test_batched_trees_match_plain_generate_row_for_row(mode, lookup):
    """Each row of a left-padded batch verifies its own tree (one forward for all rows) and equals its own plain
    greedy output, rows finishing at different times."""
    from helpers import left_pad

    from hf_dspark.scheduling.policy import SPSProfile

    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=8)
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0 / (1.0 + 0.02 * B))
    prompts = [[5, 17, 33, 2, 9], [12, 3, 40], [70, 71, 72, 70, 71, 72, 70]]
    ids, mask = left_pad(prompts)
    kw = dict(attention_mask=mask, max_new_tokens=14, do_sample=False, pad_token_id=0)
    eos = int(target.generate(ids[1:2, -3:], max_new_tokens=6, do_sample=False)[0, -2])  # row 1 ends early
    ref = target.generate(ids, eos_token_id=eos, **kw)
    out = target.generate(ids, eos_token_id=eos, custom_generate=hf_dspark.dspark_generate, draft=draft,
                          tree_top_k=3, verify_mode=mode, lookup_max_ngram=lookup, **kw)  # fmt: skip
    assert out.tolist() == ref.tolist()
    stats = draft.stats
    assert stats.tree_fallback is None and len(stats.verify_rounds[0]) == 3
    assert min(map(len, stats.verify_rounds)) < 3  # finished rows left the batch
    if mode == "fixed":  # every row's first round verifies a tree wider than a chain
        assert min(stats.verify_rounds[0]) > 4


def test_keep_paths_keeps_each_rows_path_in_order_and_pads_with_holes():
    """After a batched tree verify, both caches keep each row's anchor + accepted path (gathered in order) and
    nothing else; shorter paths are padded with holes that the cache mask marks."""
    from transformers import DynamicCache

    from hf_dspark.decoding.drafting import DraftContext
    from hf_dspark.decoding.state import DecodeState

    target = tiny_target("llama")
    R, S, W = 2, 3, 4  # 3 committed slots, then a verify block of 4 slots
    cache = DynamicCache(config=target.config)
    code = (10 * torch.arange(R)[:, None] + torch.arange(S + W)).float()  # entry = 10 · row + column
    for layer in range(target.config.num_hidden_layers):
        keys = code[:, None, :, None].expand(R, 2, S + W, 8).clone()
        cache.update(keys, keys + 100, layer)
    context = DraftContext([], [], torch.ones(R, S, dtype=torch.bool), torch.zeros(R, 0, dtype=torch.long))
    state = DecodeState(torch.zeros(R, 12, dtype=torch.long), [4, 4], [False, False], cache,
                        torch.tensor([[0, 1, 1], [1, 1, 1]]), context, torch.tensor([3, 3]), [0, 1])  # fmt: skip
    fused, positions = code[:, S:, None].expand(R, W, 5), 3 + torch.tensor([[0, 1, 1, 2], [0, 1, 2, 3]])
    state.keep_paths([[0, 2], [0, 1, 3]], fused, positions)
    kept = torch.tensor([[S + 0, S + 2, S + 0], [10 + S, 10 + S + 1, 10 + S + 3]]).float()
    for layer in cache.layers:
        assert layer.keys.shape == (R, 2, S + 3, 8)
        assert torch.equal(layer.keys[:, 0, :S, 0], code[:, :S]) and torch.equal(layer.keys[:, 0, S:, 0], kept)
        assert torch.equal(layer.values[:, 1, S:, 3], kept + 100)
    assert state.cache_mask.tolist() == [[0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    queued_fused, queued_positions, queued_valid = context.pending[-1]
    assert torch.equal(queued_fused[..., 0], kept) and queued_positions.tolist() == [[3, 4, 3], [3, 4, 6]]
    assert queued_valid.tolist() == [[True, True, False], [True, True, True]]


def test_keep_paths_crops_when_every_path_is_its_slots_prefix(monkeypatch):
    """When each row keeps slots 0, 1, ..., n (a plain step, or only top children accepted) the cache is cropped
    rather than gathered: the same entries in the same columns, a shorter row's extra columns marked as holes."""
    from transformers import DynamicCache

    from hf_dspark.decoding import state as state_module
    from hf_dspark.decoding.drafting import DraftContext
    from hf_dspark.decoding.state import DecodeState

    monkeypatch.setattr(state_module, "keep_cache_slots", lambda *a: pytest.fail("gathered a prefix path"))
    target = tiny_target("llama")
    R, S, W = 2, 3, 4
    cache = DynamicCache(config=target.config)
    code = (10 * torch.arange(R)[:, None] + torch.arange(S + W)).float()
    for layer in range(target.config.num_hidden_layers):
        keys = code[:, None, :, None].expand(R, 2, S + W, 8).clone()
        cache.update(keys, keys + 100, layer)
    context = DraftContext([], [], torch.ones(R, S, dtype=torch.bool), torch.zeros(R, 0, dtype=torch.long))
    state = DecodeState(torch.zeros(R, 12, dtype=torch.long), [4, 4], [False, False], cache,
                        torch.ones(R, S, dtype=torch.long), context, torch.tensor([3, 3]), [0, 1])  # fmt: skip
    fused, positions = code[:, S:, None].expand(R, W, 5), 3 + torch.arange(W).expand(R, W)
    state.keep_paths([[0, 1], [0, 1, 2]], fused, positions)
    for layer in cache.layers:
        assert layer.keys.shape == (R, 2, S + 3, 8)
        assert torch.equal(layer.keys[:, 0, :, 0], code[:, : S + 3])
        assert torch.equal(layer.values[:, 1, :, 3], code[:, : S + 3] + 100)
    assert state.cache_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]]
    assert context.pending[-1][2].tolist() == [[True, True, False], [True, True, True]]


def test_a_batch_of_chains_verifies_with_plain_causal_attention():
    """When every row verifies a chain (a drafted block, or a tree whose chosen nodes are a chain) the block needs no
    4D mask: slot positions, and the causal 2D mask over the cache and the valid slots (None without holes, the
    cheaper path); a branch in any row brings the tree mask and depth positions back."""
    from hf_dspark.decoding.verification import verify_block

    class State:
        def __init__(self, cache_mask):
            self.cache_mask = torch.tensor(cache_mask)
            self.tokens = torch.arange(12).reshape(len(cache_mask), -1)
            self.lengths = [4] * len(cache_mask)
            self.anchor_positions = torch.tensor([3] * len(cache_mask))

        size = property(lambda self: len(self.lengths))
        attention_mask = DecodeState.attention_mask

    tree = _tree()
    chain = VerifiedTree.of(tree, [0, 2])  # 5 → 7: slot 2's parent is slot 1
    branched = VerifiedTree.of(tree, [0, 1])  # 5 and 6, both children of the anchor
    assert chain.is_chain and not branched.is_chain and VerifiedTree.of(tree, []).is_chain
    assert VerifiedTree.chain(torch.tensor([5, 7])).children == chain.children
    one = verify_block(State([[1, 1, 1]]), [chain], 0, torch.float32)
    assert one.mask is None and one.tokens.tolist() == [[3, 5, 7]] and one.positions.tolist() == [[3, 4, 5]]
    assert verify_block(State([[1, 1, 1]]), [VerifiedTree.of(tree, [])], 0, torch.float32).mask is None
    assert verify_block(State([[0, 1, 1]]), [chain], 0, torch.float32).mask.tolist() == [[0, 1, 1, 1, 1, 1]]
    short = VerifiedTree.chain(torch.tensor([5]))
    both = verify_block(State([[1, 1, 1]] * 2), [chain, short], 0, torch.float32)
    assert both.mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]]
    assert both.tokens.tolist() == [[3, 5, 7], [9, 5, 0]]
    finished = verify_block(State([[1, 1, 1]] * 2), [chain, None], 0, torch.float32)
    assert finished.mask.tolist() == [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]
    tree_block = verify_block(State([[1, 1, 1]]), [branched], 0, torch.float32)
    assert tree_block.mask.shape == (1, 1, 3, 6) and tree_block.positions.tolist() == [[3, 4, 4]]
    mixed = verify_block(State([[1, 1, 1]] * 2), [branched, chain], 0, torch.float32)
    assert mixed.mask.shape == (2, 1, 3, 6) and mixed.positions.tolist() == [[3, 4, 4], [3, 4, 5]]


@pytest.mark.parametrize("merge", [False, True])
def test_a_row_with_a_lookup_continuation_is_drafted_only_when_merging(monkeypatch, merge):
    """With lookup on, by default a row whose lookup finds a continuation verifies that branch alone (the draft's
    pass and expansion are skipped); ``tree_lookup_merge=True`` drafts it too and merges both in one tree. Exact
    either way."""
    from hf_dspark.decoding import loop

    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=8)
    ids = torch.tensor([[5, 17, 33, 2, 9]])  # this tiny target's greedy output falls into a loop that lookup finds
    trees = []
    real = loop.propose
    monkeypatch.setattr(loop, "propose", lambda *a: trees.extend(real(*a)) or trees[-1:])
    ref = target.generate(ids, max_new_tokens=30, do_sample=False)
    out = _tree_generate(target, draft, ids, max_new_tokens=30, tree_top_k=3, verify_mode="fixed",
                         lookup_max_ngram=3, tree_lookup_merge=merge)  # fmt: skip
    assert out.tolist() == ref.tolist()
    kinds = [set().union(*tree.sources) for tree in trees if len(tree)]
    assert {"lookup"} in kinds or {"lookup", "draft"} in kinds  # some round found a continuation
    assert {"draft"} in kinds  # and some round drafted without one
    assert ({"lookup", "draft"} in kinds) == merge
    assert ({"lookup"} in kinds) == (not merge)
    # a round counts as looked up when it verified a lookup branch, accepted or not, as the chain route counts it
    verified = draft.stats.looked_up
    assert len(verified) == len(trees)
    if not merge:  # a lone row's lookup-only tree is verified whole
        assert verified == [len(tree) > 0 and "lookup" in set().union(*tree.sources) for tree in trees]
    assert any(verified) and not all(verified)


def test_the_scheduler_prices_drafting_only_for_rows_that_drafted(monkeypatch):
    """A round's drafting cost is charged per row whose tree holds draft nodes (a lookup-only row drafted nothing),
    and only a round that drafted moves the back-off."""
    from hf_dspark.decoding.proposers import RowRequest
    from hf_dspark.scheduling.policy import SPSProfile
    from hf_dspark.settings import DecodingConfig

    charged = []
    monkeypatch.setattr(tree_scheduling, "choose_tree_nodes", lambda *a: charged.append(a[4]) or (1, False))
    rounds = _tree_rounds(DecodingConfig(verify_mode="scheduled", tree_top_k=3), 4,
                                 sps=SPSProfile.from_callable(lambda B: 1.0), drafting=0.01)  # fmt: skip
    schedule = rounds.schedule
    drafted, looked_up = TokenTree(), TokenTree()
    drafted.add(-1, 5, 0.6, "draft", top=True)
    looked_up.add_path([7, 8], [0.5, 0.5], "lookup")
    request = RowRequest(0, torch.tensor([1, 2]), torch.tensor(2), 4, 8, LogitsProcessorList())
    rounds.select([drafted, looked_up], [request, request], 2)
    assert charged == [pytest.approx(0.01)] and schedule.backoff.length == 1  # one row drafted; not worth it: back off
    rounds.select([looked_up, looked_up], [request, request], 2)
    assert charged[-1] == 0.0 and schedule.backoff.length == 1  # nothing drafted: no cost, the back-off stays


def test_one_rows_lookup_continuation_alone_is_verified_whole():
    """A round whose one row's tree is a lookup continuation alone (nothing drafted) verifies all of it, as the chain
    route verifies a looked-up continuation, where Algorithm 1 over the per-token lookup rate would cut it; a drafted
    tree and a batch's lookups keep the scheduler's count."""
    from hf_dspark.decoding.proposers import RowRequest
    from hf_dspark.scheduling.policy import SPSProfile
    from hf_dspark.settings import DecodingConfig

    steep = SPSProfile.from_callable(lambda B: 1 / (1 + 0.5 * (B - 1)))  # each slot adds half a plain step
    rounds = _tree_rounds(DecodingConfig(verify_mode="scheduled", tree_top_k=3), 8, sps=steep)
    request = RowRequest(0, torch.tensor([1, 2]), torch.tensor(2), 8, 8, LogitsProcessorList())
    looked_up, drafted = TokenTree(), TokenTree()
    looked_up.add_path([7, 8, 9, 10, 11], [0.3] * 5, "lookup")
    drafted.add_path([7, 8, 9, 10, 11], [0.3] * 5, "draft")
    assert [len(nodes) for nodes in rounds.select([looked_up], [request], 1)] == [5]
    assert rounds.select([drafted], [request], 1) == [[]]  # 0.3 a node does not pay half a step
    assert rounds.select([looked_up, looked_up], [request, request], 2) == [[], []]


def test_sliding_window_targets_verify_chains_and_say_so():
    config = MistralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=6, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    target = MistralForCausalLM(config).eval()
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=8)
    ids = _prompt(3)
    ref = target.generate(ids, max_new_tokens=16, do_sample=False)
    out = _tree_generate(target, draft, ids, max_new_tokens=16, tree_top_k=2)
    assert out.tolist() == ref.tolist()
    assert draft.stats.tree_fallback == "the target has sliding-window attention layers"


def test_tree_refusals_are_measured_and_named(monkeypatch):
    from transformers import DynamicCache

    target = tiny_target("llama")
    cache = DynamicCache(config=target.config)
    target(torch.tensor([[3, 4]]), past_key_values=cache)
    assert checks.honours_tree_mask(target)
    assert checks.tree_refusal(target, cache) is None
    monkeypatch.setattr(target.config, "_attn_implementation", "flash_attention_2")
    assert "flash_attention_2" in checks.tree_refusal(target, cache)
    monkeypatch.undo()
    # a model that ignores the 4D mask (here: one that drops it) is found out by the probe, not by its name
    other = tiny_target("qwen3")
    original = other.forward

    def causal_only(*args, attention_mask=None, **kw):
        return original(*args, **kw)

    monkeypatch.setattr(other, "forward", causal_only)
    assert not checks.honours_tree_mask(other)


def test_tree_top_k_is_validated_by_name():
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=8)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="tree_top_k must be an int from 1 \\(a chain\\) to 256"):
            _tree_generate(target, draft, _prompt(), max_new_tokens=4, tree_top_k=bad)
    with pytest.raises(ValueError, match="tree_top_k must be an int from 1 \\(a chain\\) to 256"):
        DSparkConfig(tree_top_k=0)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(tree_top_k=10**6), r"tree_top_k must be an int from 1 \(a chain\) to 256, got 1000000"),
        (dict(tree_top_k=4, verify_limit=10**6), "verify_limit must be an int from 0 to 256"),
        (dict(lookup_max_ngram=10**6), r"lookup_max_ngram must be an int from 0 \(off\) to 64"),
        (dict(lookup_max_ngram=3, lookup_max_tokens=10**6), "lookup_max_tokens must be an int from 1 to 256"),
        (dict(tree_top_k=40), "tree_top_k=40 asks for more children per node than the 24 tokens this draft can"),
    ],
)
def test_size_settings_are_refused_before_anything_is_measured(settings, message, monkeypatch):
    """``tree_top_k=10**6`` hung: the cost profile was measured at two million widths before anything was checked.
    Every size-like setting is bounded by name, and a tree wider than the draft's vocabulary is refused at the call,
    before the prefill and before any measurement."""
    from hf_dspark.decoding import tree_rounds

    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=8)
    draft.set_draft_vocab(list(range(24)))

    def measured(*args, **kw):
        raise AssertionError("measured before the settings were checked")

    monkeypatch.setattr(tree_rounds, "sps_profile", measured)
    monkeypatch.setattr(tree_rounds, "tree_draft_seconds", measured)
    monkeypatch.setattr(target, "forward", measured)  # not even the prefill ran
    with pytest.raises(ValueError, match=message):
        _tree_generate(target, draft, _prompt(), max_new_tokens=4, verify_mode="scheduled", **settings)


def test_a_trees_default_node_budget_is_clamped_to_the_widest_verify():
    from hf_dspark.decoding.tree_rounds import TreeRounds
    from hf_dspark.settings import MAX_VERIFY_WIDTH, DecodingConfig

    wide = TreeRounds(DecodingConfig(tree_top_k=200), draft_tokens=8, proposers=[], lookup=None)
    assert wide.budget == wide.schedule.budget == MAX_VERIFY_WIDTH == 256  # γ · k = 1,600 nodes, clamped
    assert TreeRounds(DecodingConfig(tree_top_k=4), 8, [], None).schedule.budget == 32  # below it: γ · k
    assert TreeRounds(DecodingConfig(tree_top_k=200, verify_limit=40), 8, [], None).schedule.budget == 40


@pytest.mark.parametrize("head", ["markov", "rnn"])
def test_a_draft_vocabulary_gives_the_same_tree_without_the_full_vocabulary(head):
    """Without processors, the tree proposer chooses children inside the draft vocabulary (LM head and head bias
    over its rows only): the same nodes, values and tokens as the full-vocabulary path, which processors take."""
    from transformers.generation import LogitsProcessor

    from hf_dspark.decoding.drafting import DraftContext
    from hf_dspark.decoding.proposers import DraftTreeProposer, RowRequest

    class Identity(LogitsProcessor):
        def __call__(self, input_ids, scores):
            return scores

    target = tiny_target("llama", dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type=head, head_rank=8)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_(0, 3.0)
    draft.set_draft_vocab(list(range(3, 96, 3)))
    trees = []
    for processors in (LogitsProcessorList(), LogitsProcessorList([Identity()])):
        ctx = DraftContext.empty(draft, 1, torch.device("cpu"))
        feats = draft.fuse_context(torch.randn(1, 6, len(draft.config.target_layer_ids) * 32, dtype=torch.float64,
                                               generator=torch.Generator().manual_seed(0)))  # fmt: skip
        ctx.extend(feats, torch.arange(6)[None], torch.ones(1, 6, dtype=torch.bool))
        tree = TokenTree()
        request = RowRequest(0, torch.tensor([7, 8, 9, 10, 11, 12, 13]), torch.tensor(6), 4, 100, processors)
        DraftTreeProposer(draft, ctx, top_k=3).propose([tree], [request])
        trees.append(tree)
    subset, full = trees
    assert len(subset) > 3 and subset.tokens == full.tokens and subset.parents == full.parents
    assert subset.values == pytest.approx(full.values, rel=1e-9)
    assert set(subset.tokens) <= set(range(3, 96, 3))
    ids = _prompt(4)
    ref = target.generate(ids, max_new_tokens=16, do_sample=False)
    assert _tree_generate(target, draft, ids, max_new_tokens=16, tree_top_k=3).tolist() == ref.tolist()


def _drafted_tree(draft, seed: int, top_k: int, budget: int, settled=None, request_top_k=None) -> TokenTree:
    """One row's tree from ``draft`` (block 6, float64) over a random 6-slot context drawn with ``seed``: anchor 9,
    at most 5 deep, ``budget`` nodes, the schedule's ``settled`` and the request's ``top_k`` if given."""
    from hf_dspark.decoding.drafting import DraftContext
    from hf_dspark.decoding.proposers import DraftTreeProposer, RowRequest

    ctx = DraftContext.empty(draft, 1, torch.device("cpu"))
    feats = draft.fuse_context(torch.randn(1, 6, len(draft.config.target_layer_ids) * 32, dtype=torch.float64,
                                           generator=torch.Generator().manual_seed(seed)))  # fmt: skip
    ctx.extend(feats, torch.arange(6)[None], torch.ones(1, 6, dtype=torch.bool))
    tree = TokenTree()
    request = RowRequest(
        0,
        torch.tensor([7, 8, 9]),
        torch.tensor(6),
        5,
        budget,
        LogitsProcessorList(),
        top_k=request_top_k,
        settled=settled,
    )
    DraftTreeProposer(draft, ctx, top_k=top_k).propose([tree], [request])
    return tree


def _node_paths(tree: TokenTree, nodes) -> list[tuple[tuple[int, ...], float]]:
    """Each node as (its token path from the anchor, its value): comparable across trees."""

    def path(n):
        return () if n < 0 else (*path(tree.parents[n]), tree.tokens[n])

    return [(path(n), tree.values[n]) for n in nodes]


@pytest.mark.parametrize("top_k", [3, 8])
def test_a_budget_drafts_fewer_nodes_but_selects_the_unbounded_trees_best(top_k):
    """A round's node budget B bounds what the proposer adds (at most B children a depth, at most ``TREE_BEAM``
    parents expanded), and the B nodes selected are the same token paths, values and order as in the tree drafted
    without a budget."""
    from hf_dspark.decoding.proposers import TREE_BEAM

    target = tiny_target("llama", dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=6, head_rank=8)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_(0, 3.0)

    def drafted(budget: int) -> TokenTree:
        return _drafted_tree(draft, 1, top_k, budget)

    paths = _node_paths
    unbounded = drafted(10**6)
    expanded = min(top_k, TREE_BEAM)
    assert max(unbounded.depths) == 5 and len(unbounded) == top_k + 4 * expanded * top_k
    for budget in (1, 5, 12):
        tree = drafted(budget)
        assert all(tree.depths.count(d) <= budget for d in range(1, 6))
        assert len(tree) < len(unbounded) if budget < expanded * top_k else len(tree) == len(unbounded)
        assert paths(tree, tree.select(budget, 5)) == paths(unbounded, unbounded.select(budget, 5))


@pytest.mark.parametrize("mode", ["scheduled", "threshold"])
def test_expansion_stops_once_the_schedule_cannot_change_its_choice(mode):
    """A single row's expansion stops as soon as the schedule's early stop falls on a node worth more than any
    deeper one could be; the nodes the schedule then selects are the same token paths, values and order as from the
    whole tree, over steep and flat verify profiles, and the expansion does stop early on some of them."""
    from functools import partial

    from hf_dspark.decoding.proposers import RowRequest
    from hf_dspark.scheduling.policy import SPSProfile
    from hf_dspark.settings import DecodingConfig

    target = tiny_target("llama", dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=6, head_rank=8)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_(0, 3.0)

    def drafted(seed: int, top_k: int, settled=None) -> TokenTree:
        with torch.no_grad():  # sure drafts (deep, slowly falling values) and unsure ones
            draft.confidence.confidence_head.bias.fill_(4.0 if seed % 2 else 0.0)
        return _drafted_tree(draft, seed, top_k, 24, settled)

    paths = _node_paths
    profiles = [lambda B: 1 / (1 + 0.05 * B), lambda B: 1 / (1 + 0.3 * B), lambda B: 1 / (1 + 0.01 * B)]
    smaller = 0
    cases = [(k, threshold, sps) for k in (2, 3, 4) for threshold in (0.3, 0.1) for sps in profiles for _ in (0, 1)]
    for seed, (top_k, threshold, sps) in enumerate(cases):
        settings = DecodingConfig(verify_mode=mode, tree_top_k=top_k, verify_limit=24, confidence_threshold=threshold)
        rounds = _tree_rounds(settings, 6, sps=SPSProfile.from_callable(sps), drafting=0.02)
        schedule = rounds.schedule
        request = RowRequest(0, torch.tensor([7, 8, 9]), torch.tensor(6), 5, 24, LogitsProcessorList())
        whole = drafted(seed, top_k)
        early = drafted(seed, top_k, partial(schedule.settled, 1, 5))
        chosen = rounds.select([whole], [request], 1)[0]
        assert paths(early, rounds.select([early], [request], 1)[0]) == paths(whole, chosen)
        assert set(paths(early, range(len(early)))) <= set(paths(whole, range(len(whole))))
        smaller += len(early) < len(whole)
    assert smaller >= 3


def test_a_settled_choice_holds_whatever_deeper_nodes_join():
    """The rule behind the early stop, on random trees and profiles: when ``settled`` says a tree's choice is final,
    adding any deeper nodes worth at most the bound (even exactly the bound) leaves the selected nodes unchanged;
    and it does say so on a share of them. Also with ``greedy_lookahead`` on step profiles, where the choice may
    grow past a drop."""
    import random

    from hf_dspark.decoding.proposers import RowRequest
    from hf_dspark.scheduling.policy import SPSProfile
    from hf_dspark.settings import DecodingConfig

    rng = random.Random(0)
    request = RowRequest(0, torch.tensor([7]), torch.tensor(1), 8, 16, LogitsProcessorList())
    settled_count = {"threshold": 0, "scheduled": 0, "lookahead": 0}
    for trial in range(900):
        tree, frontier = TokenTree(), [-1]
        for _ in range(rng.randint(1, 4)):  # levels, each expanding the best two nodes of the last one
            children = [tree.add(p, rng.randrange(50), rng.random() ** 0.3, "draft") for p in frontier for _ in (0, 1)]
            frontier = sorted(children, key=lambda n: -tree.values[n])[:2]
        slope, drafting = rng.choice([0.02, 0.1, 0.4]), rng.choice([0.0, 0.05])
        kind = ("threshold", "scheduled", "lookahead")[trial % 3]
        mode = "threshold" if kind == "threshold" else "scheduled"
        settings = DecodingConfig(verify_mode=mode, tree_top_k=2, verify_limit=16, confidence_threshold=0.4,
                                  greedy_lookahead=kind == "lookahead")  # fmt: skip
        steps = rng.choice([1, 4, 8]) if kind == "lookahead" else 1  # slots in buckets that cost the same
        sps = SPSProfile.from_callable(lambda B, a=slope, w=steps: 1 / (1 + a * w * ((B + w - 1) // w)))
        rounds = _tree_rounds(settings, 8, sps=sps, drafting=drafting)
        schedule = rounds.schedule
        bound, depth = max(tree.values[n] for n in frontier), max(tree.depths)
        if not schedule.settled(1, 8, tree, bound, depth):
            continue
        settled_count[kind] += 1
        before = [(tree.tokens[n], tree.depths[n], tree.values[n]) for n in rounds.select([tree], [request], 1)[0]]
        for parent in frontier:  # the deepest values a later level could bring: the parent's own (edge 1) and below
            for edge in (1.0, 0.99999, rng.random()):
                tree.add(parent, 100 + len(tree), edge, "draft")
        after = [(tree.tokens[n], tree.depths[n], tree.values[n]) for n in rounds.select([tree], [request], 1)[0]]
        assert after == before
    assert min(settled_count.values()) >= 5


def test_tree_scores_and_streamer_match_plain_generate():
    """output_scores / output_logits and a streamer see each committed token once, with plain generate's scores."""
    from transformers.generation.streamers import BaseStreamer

    class Collect(BaseStreamer):
        def __init__(self):
            self.parts = []

        def put(self, value):
            self.parts.append(value.flatten().tolist())

        def end(self):
            pass

    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=8)
    ids = _prompt(5)
    kw = dict(max_new_tokens=14, return_dict_in_generate=True, output_scores=True, output_logits=True)
    ref = target.generate(ids, do_sample=False, **kw)
    streamer = Collect()
    out = _tree_generate(target, draft, ids, tree_top_k=3, verify_mode="fixed", streamer=streamer, **kw)
    assert out.sequences.tolist() == ref.sequences.tolist() and draft.stats.tree_fallback is None
    assert len(out.scores) == len(ref.scores) == 14 and len(out.logits) == 14
    for mine, theirs in zip(out.scores, ref.scores, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(out.logits, ref.logits, strict=True):
        torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    assert [t for part in streamer.parts[1:] for t in part] == out.sequences[0, ids.shape[1] :].tolist()


def test_a_batch_prices_its_tree_drafting_once_a_round():
    """The rows of a batch share the backbone pass, so a round of trees is priced at the batch's drafting cost, once:
    the schedule's count is Algorithm 1's over the summed values with that cost, and a round that one row's cost
    times R would have called a loss (backing off from drafting) is kept."""
    from hf_dspark.decoding.proposers import RowRequest
    from hf_dspark.scheduling.modes import choose_tree_nodes
    from hf_dspark.scheduling.policy import SPSProfile
    from hf_dspark.settings import DecodingConfig

    sps = SPSProfile.from_callable(lambda B: 1 / (0.05 + 0.002 * B))  # a step of 4 rows costs ~0.058 s
    settings = DecodingConfig(verify_mode="scheduled", tree_top_k=2, verify_limit=8)
    trees, requests = [], []
    for r in range(4):
        tree = TokenTree()
        node = tree.add(-1, 10 + r, 0.6, "draft", top=True)
        tree.add(-1, 20 + r, 0.3, "draft")
        tree.add(node, 30 + r, 0.7, "draft", top=True)
        trees.append(tree)
        requests.append(RowRequest(r, torch.tensor([5]), torch.tensor(1), 4, 8, LogitsProcessorList()))
    drafting = 0.02  # the whole batch's round
    rounds = _tree_rounds(settings, 4, sps=sps, drafting=drafting)
    schedule = rounds.schedule
    summed = [4 * v for v in (0.6, 0.42, 0.3)]
    want, pays = choose_tree_nodes("scheduled", summed, sps, 0.5, drafting, 4, 4)
    assert want == 3 and pays
    chosen = rounds.select(trees, requests, 4)
    assert [len(nodes) for nodes in chosen] == [3] * 4 and schedule.backoff.left == 0
    assert choose_tree_nodes("scheduled", summed, sps, 0.5, 4 * drafting, 4, 4)[1] is False  # R-fold: a "loss"


def test_tree_drafting_cost_is_measured_for_the_batch(monkeypatch):
    """``tree_draft_seconds(draft, k, rows)`` times one backbone pass over ``rows`` rows and every row's tree
    expansion, once per (k, rows); a one-row measurement is a separate entry."""
    from hf_dspark.decoding import costs, proposers

    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    backbones, expanded = [], []
    real_backbone, real_expand = proposers.draft_backbone, proposers.DraftTreeProposer.expand
    monkeypatch.setattr(proposers, "draft_backbone", lambda d, c, anchors, *a: backbones.append(anchors.shape[0])
                        or real_backbone(d, c, anchors, *a))  # fmt: skip
    monkeypatch.setattr(proposers.DraftTreeProposer, "expand", lambda self, trees, requests, *a: expanded.append(
        [r.row for r in requests]) or real_expand(self, trees, requests, *a))  # fmt: skip
    monkeypatch.setattr(costs, "_median_seconds", lambda run, device, reps: run() or 0.25)
    assert costs.tree_draft_seconds(draft, 2, 3) == 0.25
    assert backbones == [3] and expanded == [[0, 1, 2]]
    assert costs.tree_draft_seconds(draft, 2, 3) == 0.25 and backbones == [3]  # measured once
    costs.tree_draft_seconds(draft, 2)
    assert backbones == [3, 1] and expanded == [[0, 1, 2], [0]]


@pytest.mark.parametrize("processors", [False, True])
def test_a_batch_expands_each_row_as_if_it_were_drafted_alone(processors):
    """The batched expansion (every row's frontier through the head together, one depth at a time) grows each
    row's tree as drafting that row alone does: same token paths, values and confidences, with rows of
    different depths, budgets, early stops and histories (and the call's logits processors on each node's path)."""
    from hf_dspark.decoding.drafting import DraftContext
    from hf_dspark.decoding.proposers import DraftTreeProposer, RowRequest

    target = tiny_target("llama", dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=6, head_rank=8)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_(0, 3.0)
    width = len(draft.config.target_layer_ids) * 32
    feats = torch.randn(3, 6, width, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    chosen = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.8)]) if processors else LogitsProcessorList()
    # (history, max depth, budget): a deep row, a shallow one, one whose small budget stops it early
    rows = [([7, 8, 9], 5, 40), ([3, 4], 2, 40), ([11, 5, 6, 2], 5, 3)]

    def requests(indices):
        return [RowRequest(r, torch.tensor(rows[r][0]), torch.tensor(6), rows[r][1], rows[r][2], chosen)
                for r in indices]  # fmt: skip

    def context(indices):
        ctx = DraftContext.empty(draft, len(indices), torch.device("cpu"))
        ctx.extend(draft.fuse_context(feats[indices]), torch.arange(6).expand(len(indices), -1),
                   torch.ones(len(indices), 6, dtype=torch.bool))  # fmt: skip
        return ctx

    batch = [TokenTree() for _ in rows]
    DraftTreeProposer(draft, context([0, 1, 2]), top_k=4).propose(batch, requests([0, 1, 2]))
    for r in range(3):
        alone = TokenTree()
        request = requests([r])[0]
        request.row = 0
        DraftTreeProposer(draft, context([r]), top_k=4).propose([alone], [request])
        got, want = _node_paths(batch[r], range(len(batch[r]))), _node_paths(alone, range(len(alone)))
        # a batched matmul may round differently in the last bits (float64 here), never enough to reorder nodes
        assert [p for p, _ in got] == [p for p, _ in want] and len(want) > 1
        assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-12)
        assert batch[r].confidences == pytest.approx(alone.confidences, rel=1e-12)
    assert max(batch[1].depths) == 2 and len(batch[2]) < len(batch[0])


def test_a_narrowed_request_drafts_the_drafts_chain():
    """A request with ``top_k=1`` gets the draft's chain from a wider proposer: the same nodes, tokens and values as a
    proposer of one child per node, every node the draft's top child, one a depth."""
    target = tiny_target("llama", dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=6, head_rank=8)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_(0, 3.0)
        draft.confidence.confidence_head.bias.fill_(4.0)  # sure drafts: the chain runs the block's depth
    for seed in range(3):
        narrowed = _drafted_tree(draft, seed, 4, 24, request_top_k=1)
        chain = _drafted_tree(draft, seed, 1, 24)
        wide = _drafted_tree(draft, seed, 4, 24)
        assert _node_paths(narrowed, range(len(narrowed))) == _node_paths(chain, range(len(chain)))
        assert narrowed.depths == list(range(1, 6)) and all(narrowed.top) and len(wide) > len(narrowed)


def _two_branch_trees(rows: int, branch: float, sure: float = 0.9) -> tuple[list[TokenTree], list]:
    """``rows`` trees with a chain (``sure``, then ``sure`` of that) and a second child at depth 1 worth ``branch``."""
    from hf_dspark.decoding.proposers import RowRequest

    trees, requests = [], []
    for r in range(rows):
        tree = TokenTree()
        node = tree.add(-1, 10 + r, sure, "draft", top=True)
        tree.add(node, 30 + r, sure, "draft", top=True)
        tree.add(-1, 20 + r, branch, "draft")
        trees.append(tree)
        requests.append(RowRequest(r, torch.tensor([5]), torch.tensor(1), 4, 8, LogitsProcessorList()))
    return trees, requests


def test_a_round_whose_chain_beats_its_tree_narrows_the_next_rounds():
    """Under load a tree's drafting can cost more than its extra nodes return: after a drafted round whose chain
    (at the chain's drafting cost) has the better Θ, the next drafted rounds ask for one child per node and are
    priced at the chain's cost; the narrowing doubles while chains keep winning, skips no plain step, and is reset
    by a round where the tree is worth its cost."""
    from hf_dspark.scheduling.modes import choose_tree_nodes
    from hf_dspark.scheduling.policy import SPSProfile, tree_rate
    from hf_dspark.settings import DecodingConfig

    sps = SPSProfile.from_callable(lambda B: 1 / (0.05 + 0.002 * B))
    settings = DecodingConfig(verify_mode="scheduled", tree_top_k=2, verify_limit=8)
    rounds = _tree_rounds(settings, 4, sps=sps, drafting=0.03, chain_drafting=0.01)
    schedule = rounds.schedule
    trees, requests = _two_branch_trees(4, 0.05)
    ranked = [4 * v for v in (0.9, 0.81, 0.05)]
    tree_count = choose_tree_nodes("scheduled", ranked, sps, 0.5, 0.03, 4, 4)[0]
    chain_count = choose_tree_nodes("scheduled", ranked[:2], sps, 0.5, 0.01, 4, 4)[0]
    assert tree_rate(ranked[:2], chain_count, sps, 0.01, 4, 4) > tree_rate(ranked, tree_count, sps, 0.03, 4, 4)

    state = SimpleNamespace(  # what requests() reads of a batch
        size=4, active=[0, 1, 2, 3], history=lambda r: torch.tensor([5]), anchor_positions=torch.ones(4, dtype=int),
        room=lambda limit, max_length: [4] * 4,
    )  # fmt: skip

    rounds.select(trees, requests, 4)
    assert (schedule.narrowing.left, schedule.narrowing.length, schedule.backoff.left) == (1, 1, 0)
    narrowed = rounds.requests(state, 100, LogitsProcessorList())
    assert [r.top_k for r in narrowed] == [1] * 4 and all(r.draft for r in narrowed)
    assert schedule.round_drafting == 0.01
    rounds.select(*_two_branch_trees(4, 0.05), 4)  # the narrowed round (its tree as drafted is not weighed)
    assert (schedule.narrowing.left, schedule.narrowing.length) == (0, 1)
    assert [r.top_k for r in rounds.requests(state, 100, LogitsProcessorList())] == [None] * 4
    assert schedule.round_drafting == 0.03
    rounds.select(*_two_branch_trees(4, 0.05), 4)  # the chain wins again: twice as long
    assert (schedule.narrowing.left, schedule.narrowing.length) == (2, 2)
    schedule.narrowing.left, schedule.chain_drafting = 0, 0.03  # a tree round where the chain saves nothing
    rounds.select(*_two_branch_trees(4, 0.6), 4)
    assert (schedule.narrowing.left, schedule.narrowing.length) == (0, 0)


def test_a_round_after_a_back_off_probes_with_the_chain():
    """A drafted tree round not worth a plain step turns drafting off for a while; the round that then drafts again
    asks for the chain only, priced at the chain's cost (a probe at a tree's cost is what the back-off saves); a
    probe that pays resets the back-off, and the round after it drafts the tree again."""
    from hf_dspark.scheduling.policy import SPSProfile
    from hf_dspark.settings import DecodingConfig

    sps = SPSProfile.from_callable(lambda B: 1 / (0.05 + 0.002 * B))
    settings = DecodingConfig(verify_mode="scheduled", tree_top_k=2, verify_limit=8)
    rounds = _tree_rounds(settings, 4, sps=sps, drafting=0.03, chain_drafting=0.01)
    schedule = rounds.schedule
    state = SimpleNamespace(  # what requests() reads of a batch
        size=4, active=[0, 1, 2, 3], history=lambda r: torch.tensor([5]), anchor_positions=torch.ones(4, dtype=int),
        room=lambda limit, max_length: [4] * 4,
    )  # fmt: skip

    def top_ks():
        return [(r.draft, r.top_k) for r in rounds.requests(state, 100, LogitsProcessorList())]

    assert top_ks() == [(True, None)] * 4 and schedule.round_drafting == 0.03
    rounds.select(*_two_branch_trees(4, 0.5, sure=0.02), 4)  # worth more than its chain, less than a plain step
    assert (schedule.backoff.length, schedule.backoff.left, schedule.narrowing.left) == (1, 1, 0)
    assert top_ks() == [(False, None)] * 4
    assert top_ks() == [(True, 1)] * 4 and schedule.round_drafting == 0.01  # the probe: the chain, at its cost
    rounds.select(*_two_branch_trees(4, 0.01, sure=0.02), 4)  # it did not pay either: twice as long
    assert (schedule.backoff.length, schedule.backoff.left) == (2, 2)
    assert top_ks() == [(False, None)] * 4 and top_ks() == [(False, None)] * 4
    assert top_ks() == [(True, 1)] * 4
    rounds.select(*_two_branch_trees(4, 0.05), 4)  # this probe pays: drafting is back, trees first
    assert (schedule.backoff.length, schedule.backoff.left, schedule.narrowing.left) == (0, 0, 0)
    assert top_ks() == [(True, None)] * 4 and schedule.round_drafting == 0.03


def test_narrowed_tree_rounds_decode_exactly_plain_greedy(monkeypatch):
    """With tree drafting priced far above a chain's, the schedule narrows its rounds to chains: the output is still
    plain greedy, one row and a batch, and the stats count the narrowed rounds."""
    from hf_dspark.decoding import tree_rounds
    from hf_dspark.scheduling.policy import SPSProfile

    monkeypatch.setattr(tree_rounds, "tree_draft_seconds", lambda draft, top_k, rows: 0.0 if top_k == 1 else 0.5)
    target = tiny_target("llama", dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1 / (0.01 + 0.001 * B))
    for ids in (_prompt(4), torch.cat([_prompt(4), _prompt(5)])):  # one row; a batch of two (same length)
        ref = torch.cat([target.generate(row[None], max_new_tokens=24, do_sample=False) for row in ids])
        out = _tree_generate(target, draft, ids, max_new_tokens=24, tree_top_k=3, verify_mode="scheduled",
                             confidence_recalibration=False)  # fmt: skip
        assert out.tolist() == ref.tolist()
        rounds = len(draft.stats.verify_rounds)
        assert rounds >= 5 and draft.stats.narrowed_rounds >= rounds // 2, (rounds, draft.stats.narrowed_rounds)


def test_a_drafted_round_must_beat_a_plain_step_by_the_premium_the_call_observed(monkeypatch):
    """With measured costs the schedule times its rounds against their prices: a drafted round (verify + drafting)
    that ran at 1.8x its price while plain rounds ran at theirs must beat a plain step by that factor, so a round
    worth 1.5x a plain step by the profile backs off; a profile the user set is taken as it is."""
    from hf_dspark.decoding import tree_rounds
    from hf_dspark.scheduling.observed import ObservedRounds
    from hf_dspark.scheduling.policy import SPSProfile
    from hf_dspark.settings import DecodingConfig

    observed = ObservedRounds()
    assert observed.premium() == 1.0
    observed.observe(True, 0.1, 0.2)
    observed.observe(True, 0.1, 0.2)
    observed.observe(False, 0.05, 0.05)
    assert observed.ratio(True) == pytest.approx(6 / 4) and observed.premium() == pytest.approx(1.5 / 1.0)

    sps = SPSProfile.from_callable(lambda B: 1 / (0.05 + 0.002 * B))
    settings = DecodingConfig(verify_mode="scheduled", tree_top_k=2, verify_limit=8)
    rounds = _tree_rounds(settings, 4, sps=sps, drafting=0.03, observed=ObservedRounds())
    schedule = rounds.schedule
    trees, requests = _two_branch_trees(4, 0.05)  # Θ = 10.84 / 0.104 s against 4 / 0.058 s: 1.51x a plain step
    chosen = rounds.select(trees, requests, 4)
    assert [len(nodes) for nodes in chosen] == [2] * 4 and schedule.backoff.left == 0
    assert schedule.observed.pending == (True, pytest.approx(1 / sps(12) + 0.03))
    rounds.time_round(0.104 * 1.8)
    assert schedule.observed.ratios[True] == [pytest.approx(1.8)] and schedule.observed.pending is None
    for _ in range(7):
        schedule.observed.observe(True, 0.1, 0.18)
    assert schedule.observed.premium() > 1.51
    rounds.select(*_two_branch_trees(4, 0.05), 4)
    assert schedule.backoff.length == 1 and schedule.backoff.left == 1

    monkeypatch.setattr(tree_rounds, "sps_profile", lambda *a, **k: sps)
    monkeypatch.setattr(tree_rounds, "tree_draft_seconds", lambda draft, top_k, rows: 0.01)
    measured = tree_rounds.TreeRounds(settings, 4, [], None)
    measured.price(SimpleNamespace(draft=SimpleNamespace(sps_profile=None), target=None), 4)
    pinned = tree_rounds.TreeRounds(settings, 4, [], None)
    pinned.price(SimpleNamespace(draft=SimpleNamespace(sps_profile=sps), target=None), 4)
    assert measured.observed is not None and pinned.observed is None
