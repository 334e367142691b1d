"""A proposer from outside the package, behind the one interface ``propose(candidates, requests)``, on both routes:
its continuations are verified exactly, and the rounds count them as its own (neither drafted nor looked up)."""

import torch

from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.decoding import chain, loop, tree_rounds
from hf_dspark.testing import tiny_target

PROMPT = torch.tensor([[5, 17, 33, 2, 9]])  # this tiny target's greedy output falls into a loop of period 10
PERIOD = 10


class RepeatPeriod:
    """Proposes the (up to) three tokens that came ``PERIOD`` tokens before the ones to come: right wherever the
    text repeats with that period, a deterministic continuation cheap to test against."""

    def __init__(self):
        self.proposed = 0

    def propose(self, candidates, requests):
        for candidate, request in zip(candidates, requests, strict=True):
            start = request.history.shape[0] - PERIOD
            depth = min(request.max_depth, 3)
            if depth > 0 and start >= 0:
                candidate.add_continuation(request.history[start : start + depth], 0.5, "repeat")
                self.proposed += 1


def _generate(target, draft, **settings):
    return target.generate(PROMPT, custom_generate=dspark_generate, draft=draft, max_new_tokens=30,
                           do_sample=False, return_dict_in_generate=True, **settings)  # fmt: skip


def _chain_call(monkeypatch, proposer, verify_mode: str):
    """Plain greedy's output, and a chain call whose rounds list ``proposer`` before the drafted block."""
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=8)
    monkeypatch.setattr(chain.ChainRounds, "proposers", property(lambda self: [proposer, self.drafter]))
    ref = target.generate(PROMPT, max_new_tokens=30, do_sample=False)
    return ref, _generate(target, draft, verify_mode=verify_mode), draft


def test_a_new_proposer_serves_chain_rounds(monkeypatch):
    """Listed before the drafted block, it fills a row whenever it has a continuation, and that round does not
    draft: the row verifies the continuation whole, recorded as neither drafted (no confidences) nor looked up."""
    repeat = RepeatPeriod()
    ref, out, _ = _chain_call(monkeypatch, repeat, "scheduled")
    stats = out.dspark_stats
    assert out.sequences.tolist() == ref.tolist()
    repeated = [i for i, c in enumerate(stats.confidences) if c is None]
    assert len(repeated) == repeat.proposed > 0 and len(repeated) < stats.rounds  # the first rounds drafted
    assert all(1 <= stats.proposed[i] <= 3 for i in repeated) and not any(stats.looked_up)
    assert sum(stats.accepted[i] for i in repeated) > 0  # inside the loop its continuations are right


def test_a_new_proposer_joins_the_draft_in_one_tree(monkeypatch):
    """On the tree route its continuation is a branch merged with the draft's (shared prefixes one node), one
    verify covering both; exact, and not counted as looked up."""
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="markov", head_rank=8)
    repeat, real = RepeatPeriod(), tree_rounds.tree_proposers
    monkeypatch.setattr(tree_rounds, "tree_proposers", lambda *a, **k: [*real(*a, **k), repeat])
    trees, propose = [], loop.propose
    monkeypatch.setattr(loop, "propose", lambda *a: trees.extend(propose(*a)) or trees[-len(a[1]) :])
    ref = target.generate(PROMPT, max_new_tokens=30, do_sample=False)
    out = _generate(target, draft, verify_mode="fixed", tree_top_k=3)
    assert out.sequences.tolist() == ref.tolist()
    kinds = [set().union(*tree.sources) for tree in trees]
    assert kinds.count({"draft", "repeat"}) == repeat.proposed > 0  # merged into the draft's tree each time
    assert set(map(frozenset, kinds)) <= {frozenset({"draft"}), frozenset({"draft", "repeat"}), frozenset()}
    assert not any(out.dspark_stats.looked_up)


class Overreaching(RepeatPeriod):
    """Proposes the loop five times over, past the room its requests give (``max_depth``)."""

    def propose(self, candidates, requests):
        for candidate, request in zip(candidates, requests, strict=True):
            if request.history.shape[0] >= PERIOD and request.max_depth > 0:
                candidate.add_continuation(request.history[-PERIOD:].repeat(5), 0.5, "overreach")
                self.proposed += 1


def test_a_chain_verifies_a_continuation_only_within_its_rows_room(monkeypatch):
    """A continuation longer than the row may verify (its drafted limit, or the room before ``max_length``) is cut
    to it: the output stays plain greedy's, as long as asked, never past it."""
    overreaching = Overreaching()
    ref, out, draft = _chain_call(monkeypatch, overreaching, "fixed")
    assert out.sequences.tolist() == ref.tolist()
    assert overreaching.proposed > 0 and max(out.dspark_stats.proposed) == draft.config.num_draft_tokens
