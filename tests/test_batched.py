"""Batched DSpark generation: every row equals its own plain greedy output; finished rows stop verifying."""

import pytest
import torch
from helpers import PAD, PROMPTS, left_pad
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_dspark import DSparkDraftModel
from hf_dspark.decoding.versions import CACHE_FIELD
from hf_dspark.scheduling.policy import SPSProfile
from hf_dspark.testing import tiny_target


def new_tokens(row, eos):
    row = row.tolist()
    if eos is not None and eos in row:
        row = row[: row.index(eos) + 1]
    return row


def scripted_draft(draft, refs, right):
    """Patch ``draft`` (batched over PROMPTS, left-padded) so slot k of row r proposes the row's reference token
    when ``right(r, k)``, and a wrong one otherwise (head "none": the base logits are the proposals)."""
    original = draft.forward

    def forward(
        block_embeds, block_positions, context, attention_mask=None, compute_logits=True, context_positions=None
    ):
        out = original(block_embeds, block_positions, context, attention_mask, compute_logits)
        logits = torch.full_like(out.logits, -1e4)
        for i, r in enumerate(draft.stats.round_rows[-1]):  # finished rows have left the batch
            for k, pos in enumerate(block_positions[i].tolist()):
                j = pos + 1 - len(PROMPTS[r])  # index into the row's new tokens
                good = int(refs[r][j]) if 0 <= j < len(refs[r]) else 3
                logits[i, k, good if right(r, k) else (good + 1) % 96] = 1e4
        out.logits = logits
        return out

    draft.forward = forward


@pytest.mark.parametrize("tree_top_k", [1, 3])  # chains, then each row its own token tree
@pytest.mark.parametrize("mode", ["fixed", "threshold", "scheduled", "async"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_greedy_equals_per_row_plain_greedy(mode, arch, tree_top_k):
    target = tiny_target(arch, dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.decoding.verify_mode = mode
    draft.decoding.tree_top_k = tree_top_k
    draft.decoding.confidence_threshold = 0.5
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0 / (1.0 + 0.1 * B))
    # an EOS that row 0 produces early, so rows finish at different times
    probe = target.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=20, do_sample=False)[0, len(PROMPTS[0]) :]
    eos = int(probe[4])
    refs = [
        new_tokens(
            target.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=eos)[0, len(p) :], eos
        )
        for p in PROMPTS
    ]
    ids, mask = left_pad(PROMPTS)
    out = target.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=20,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=PAD,
        assistant_model=draft,
    )
    width = ids.shape[1]
    for r, ref in enumerate(refs):
        assert new_tokens(out[r, width:], eos) == ref, f"row {r}"
        # after a row's end the output holds only padding, as in plain generate
        assert out[r, width + len(ref) :].eq(PAD).all()
    assert out.shape[1] == width + max(len(r) for r in refs)
    # finished rows stop consuming verify budget: rounds after row 0's end verify fewer rows
    sizes = [len(v) for v in draft.stats.verify_rounds]
    assert sizes[0] == 4 and min(sizes) < 4 and sizes == sorted(sizes, reverse=True)
    assert draft.stats.tree_fallback is None


@pytest.mark.parametrize("tree_top_k", [1, 3])
@pytest.mark.parametrize("mode", ["fixed", "scheduled"])
def test_finished_rows_leave_the_batch(mode, tree_top_k, monkeypatch):
    """A row that finishes is dropped from the target's and the draft's caches: later rounds draft and verify only
    the rows still running (chains or trees), every row still equals its own plain greedy output, and (scheduled,
    no user profile) the SPS profile follows the shrinking batch in power-of-two sizes."""
    from transformers import DynamicCache

    from hf_dspark.decoding import checks, costs, tree_rounds
    from hf_dspark.scheduling.policy import SPSProfile

    target = tiny_target("llama", dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.decoding.verify_mode = mode
    draft.decoding.tree_top_k = tree_top_k
    monkeypatch.setattr(
        tree_rounds, "tree_draft_seconds", lambda draft, top_k, rows: 0.0
    )  # its timing drafts trees too
    measured, draft_rows, verify_rows = [], [], []
    fake = lambda t, grid, rows: measured.append(rows) or SPSProfile.from_callable(lambda B: 1 / B**0.1)  # noqa: E731
    monkeypatch.setattr(costs, "measure_profile", fake)
    real_draft, real_target = draft.forward, target.forward
    monkeypatch.setattr(draft, "forward", lambda e, p, *a, **k: draft_rows.append(len(p)) or real_draft(e, p, *a, **k))
    monkeypatch.setattr(target, "forward", lambda **k: verify_rows.append(len(k["input_ids"])) or real_target(**k))

    ids, mask = left_pad(PROMPTS)
    width = ids.shape[1]
    budgets = {tuple(row): n for row, n in zip(ids.tolist(), [3, 20, 9, 14], strict=True)}  # new tokens per row

    class RowBudget(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):  # the loop asks one row at a time
            return torch.tensor([input_ids.shape[1] - width >= budgets[tuple(input_ids[0, :width].tolist())]])

    refs = [target.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False)[0, len(p) :] for p in PROMPTS]
    checks.tree_refusal(target, DynamicCache(config=target.config))  # its one-time probe of the target, done here
    verify_rows.clear()
    out = target.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=20,
        do_sample=False,
        pad_token_id=PAD,
        stopping_criteria=StoppingCriteriaList([RowBudget()]),
        assistant_model=draft,
    )
    for r, n in enumerate(budgets.values()):
        assert out[r, width : width + n].tolist() == refs[r][:n].tolist(), f"row {r}"
        assert out[r, width + n :].eq(PAD).all()
    rounds = draft.stats.round_rows
    assert [sorted(set(map(tuple, rounds)), key=len, reverse=True)] == [[(0, 1, 2, 3), (1, 2, 3), (1, 3), (1,)]]
    assert verify_rows[1:] == [len(rows) for rows in rounds]  # after the prefill: one verify per round
    assert draft_rows == sorted(draft_rows, reverse=True) and draft_rows[0] == 4
    if mode == "scheduled":
        assert measured == [4, 2, 1]  # 3 rows are priced by the 4-row profile
    else:
        assert measured == [] and draft_rows[-1] == 1


@pytest.mark.parametrize("tree_top_k", [1, 3])
def test_return_dict_keeps_every_row_in_the_returned_cache(tree_top_k):
    target = tiny_target("llama", dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.decoding.verify_mode = "fixed"
    draft.decoding.tree_top_k = tree_top_k
    probe = target.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=12, do_sample=False)[0, len(PROMPTS[0]) :]
    ids, mask = left_pad(PROMPTS)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=int(probe[2]), pad_token_id=PAD)
    plain = target.generate(ids, **kw)
    out = target.generate(ids, return_dict_in_generate=True, assistant_model=draft, **kw)
    assert out.sequences.tolist() == plain.tolist()
    assert getattr(out, CACHE_FIELD).layers[0].keys.shape[0] == 4
    assert len(draft.stats.round_rows[-1]) < 4  # rows did finish early, and stayed in the batch


def test_profile_rows_rounds_up_to_a_power_of_two_within_the_batch():
    from hf_dspark.decoding.costs import profile_rows

    assert [profile_rows(n, 16) for n in (16, 15, 9, 8, 5, 3, 2, 1)] == [16, 16, 16, 8, 8, 4, 2, 1]
    assert [profile_rows(n, 12) for n in (11, 9, 7)] == [12, 12, 8]


def test_batched_rows_accept_different_amounts():
    """With an oracle draft right for some rows and wrong for others, rows advance by different amounts per
    round and the caches stay consistent (outputs still exact)."""
    target = tiny_target("llama", dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="none")
    draft.decoding.verify_mode = "fixed"
    refs = [target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :] for p in PROMPTS]
    ids, mask = left_pad(PROMPTS)
    width = ids.shape[1]
    offsets = [width - len(p) for p in PROMPTS]
    scripted_draft(draft, refs, lambda r, k: r % 2 == 0)  # even rows: always right; odd rows: always wrong
    out = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False, assistant_model=draft)
    for r in range(4):
        assert out[r, width:].tolist() == refs[r].tolist(), f"row {r}"
    assert offsets  # (left padding really was present)
    acc = draft.stats.accepted
    assert max(acc) == 4 and min(acc) == 0


def test_smollm2_batch_of_four_prompts(smollm2):
    target, tokenizer = smollm2
    texts = [
        "What is 7 times 8?",
        "Write a haiku about the sea and the wind over it at night.",
        "def add(a, b):",
        "List three prime numbers larger than one hundred and explain how you checked each of them.",
    ]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
        for t in texts
    ]
    assert len({len(p) for p in prompts}) == 4
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(target, block_size=4, num_draft_layers=1, head_rank=16)
    draft.sps_profile = SPSProfile.from_table({1: 10.0, 8: 8.0, 40: 3.0})
    eos = tokenizer.eos_token_id
    refs = [
        new_tokens(target.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p) :], eos)
        for p in prompts
    ]
    ids, mask = left_pad(prompts)
    ids[mask == 0] = tokenizer.pad_token_id
    out = target.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, assistant_model=draft)
    for r, ref in enumerate(refs):
        assert new_tokens(out[r, ids.shape[1] :], eos) == ref, texts[r]


def test_verify_limit_caps_every_mode():
    target = tiny_target("llama", dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=6, head_rank=8)
    draft.decoding.verify_mode, draft.decoding.verify_limit = "fixed", 2
    ids, mask = left_pad(PROMPTS[:2])
    out = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant_model=draft)
    assert max(max(v) for v in draft.stats.verify_rounds) == 2
    for r, p in enumerate(PROMPTS[:2]):
        ref = target.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0, len(p) :]
        assert out[r, ids.shape[1] :].tolist() == ref.tolist()


def _throughput_benchmark():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "scheduler_throughput.py"
    spec = importlib.util.spec_from_file_location("scheduler_throughput", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_throughput_table_ratios_by_hand():
    mode = lambda t, **kw: {"tokens": 64, "seconds": 64 / t, "tok_per_s": t, **kw}  # noqa: E731
    row = {
        "R": 4,
        "prompts": 8,
        "plain": mode(50.0),
        "fixed-2": mode(40.0, tau=1.3, verify_per_request=2.0),
        "fixed-4": mode(45.0, tau=1.3, verify_per_request=4.0),
        "scheduled": mode(54.0, tau=1.3, verify_per_request=1.5),
        "oracle": mode(60.0, tau=1.3, verify_per_request=1.0),
    }
    result = {"date": "2026-11-29", "dtype": "bfloat16", "threads": 2, "max_new_tokens": 64, "gamma": 8, "rows": [row]}
    table = _throughput_benchmark().markdown(result)
    # scheduled / best fixed = 54 / 45, scheduled / oracle = 54 / 60
    assert "| 4 | 8 | 50.0 | 40.0 | 45.0 | 54.0 | 60.0 | 1.50 | 1.20 | 0.90 |" in table
    assert table.startswith("Measured 2026-11-29, bfloat16, 2 threads, 64 new tokens per prompt, γ = 8")
    # with per-pass rates recorded, the ratio cells add the lowest and highest single-pass ratio
    row["scheduled"]["pass_tok_per_s"] = [50.0, 58.0]
    row["fixed-4"]["pass_tok_per_s"] = [50.0, 40.0]  # the best fixed mode overall
    row["oracle"]["pass_tok_per_s"] = [60.0, 60.0]
    table = _throughput_benchmark().markdown(result)
    assert "| 1.50 | 1.20 (1.00–1.45) | 0.90 (0.83–0.97) |" in table


def test_throughput_benchmark_oracle_verifies_exactly_the_accepted_tokens():
    """benchmarks/scheduler_throughput.py's hindsight oracle: same rounds and output as fixed γ, but every token it
    verifies is accepted (rows right for 2 slots, then wrong, so fixed γ = 4 verifies rejected tokens)."""
    bench = _throughput_benchmark()

    target = tiny_target("llama", dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="none")
    refs = [target.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :] for p in PROMPTS]
    ids, mask = left_pad(PROMPTS)
    scripted_draft(draft, refs, lambda r, k: k < draft.config.draft_offset + 2)  # right for 2 tokens, then wrong
    kw = dict(attention_mask=mask, max_new_tokens=16, do_sample=False, assistant_model=draft)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    runs, real = {}, (bench.proposers.draft_block, bench.chains.choose_lengths)
    diverged = set()
    for name in ("fixed", "oracle"):
        draft.decoding.verify_mode, draft.decoding.verify_limit = "fixed", None
        with bench.hindsight(plain.tolist(), diverged) if name == "oracle" else bench.nullcontext():
            out = target.generate(ids, **kw)
        assert out.tolist() == plain.tolist(), name
        runs[name] = draft.stats
    fixed, oracle = runs["fixed"], runs["oracle"]
    assert oracle.proposed == oracle.accepted and max(oracle.accepted) == 2 and not diverged
    assert fixed.committed == oracle.committed and sum(fixed.proposed) > sum(oracle.proposed)
    # a reference that a row leaves (as bf16 ties can make it): that row verifies everything from then on
    wrong = plain.tolist()
    wrong[1][ids.shape[1] + 3] = (wrong[1][ids.shape[1] + 3] + 1) % 96
    with bench.hindsight(wrong, diverged):
        out = target.generate(ids, **kw)
    assert out.tolist() == plain.tolist() and diverged == {1}
    assert (bench.proposers.draft_block, bench.chains.choose_lengths) == real  # the loop is restored
