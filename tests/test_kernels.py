"""Triton head kernels (run by the Triton interpreter on CPU) against their PyTorch reference."""

import pytest
import torch
from dspark_heads import lowrank_step, lowrank_step_reference
from scipy.stats import chisquare

from hf_dspark import DSparkDraftModel
from hf_dspark.testing import tiny_target

TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _inputs(R, V, r, dtype, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(
        base_logits=torch.randn(R, V, generator=g).to(dtype),
        prev=torch.randint(0, V, (R,), generator=g),
        w1=torch.randn(V, r, generator=g).to(dtype),
        w2=(torch.randn(V, r, generator=g) * 0.3).to(dtype),
        hidden=torch.randn(R, d, generator=g).to(dtype),
        conf_weight=torch.randn(d + r, generator=g).to(dtype),
        conf_bias=0.25,
    )


# Every pair of option values occurs in some case (rows R ∈ {1, 3, 17} × dtypes give 9; V ∈ {1000, 333} and
# r ∈ {8, 64} are spread so that R×V, R×r, V×r, V×dtype and r×dtype are all covered): 9 cases instead of 36.
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
PAIRWISE = [(1, 1000, 8, F32), (1, 333, 64, F16), (1, 1000, 64, BF16), (3, 333, 64, F32), (3, 1000, 8, F16),
            (3, 333, 8, BF16), (17, 1000, 64, F32), (17, 333, 8, F16), (17, 1000, 8, BF16)]  # fmt: skip


def test_the_case_list_covers_every_pair_of_options():
    import itertools

    options = [sorted({case[i] for case in PAIRWISE}, key=str) for i in range(4)]
    assert [len(o) for o in options] == [3, 2, 2, 3]
    for i, j in itertools.combinations(range(4), 2):
        seen = {(case[i], case[j]) for case in PAIRWISE}
        assert seen == set(itertools.product(options[i], options[j])), (i, j)


@pytest.mark.parametrize(("R", "V", "r", "dtype"), PAIRWISE)
def test_markov_step_matches_reference(R, V, r, dtype):
    kw = _inputs(R, V, r, dtype)
    # block_v does not divide V (333 = 2·128 + 77, 1000 = 512 + 488): masked tails are exercised
    block_v = 128 if V < 500 else 512
    logits, tokens, lse, conf = lowrank_step(**kw, temperature=0.7, conf_temperature=1.5, block_v=block_v)
    ref_logits, ref_tokens, ref_lse, ref_conf = lowrank_step_reference(**kw, temperature=0.7, conf_temperature=1.5)
    tol = TOL[dtype]
    torch.testing.assert_close(logits, ref_logits, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=tol, atol=tol)
    torch.testing.assert_close(conf, ref_conf, rtol=tol, atol=tol)
    assert torch.equal(tokens, ref_logits.argmax(-1))  # the argmax of its own logits, exactly
    assert torch.equal(tokens, ref_tokens)


@pytest.mark.parametrize("sample", [False, True])
def test_masked_logits_with_whole_tiles_at_minus_inf(sample):
    """A draft vocabulary sets most logits to -inf: tiles that are entirely -inf must not turn lse into NaN."""
    R, V, r = 4, 1000, 8
    kw = _inputs(R, V, r, torch.float32, seed=2)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[torch.tensor([3, 4, 150, 700, 999])] = True  # tiles of 128: 1, 2, 3, 4, 6 and 7 hold nothing
    kw["base_logits"] = kw["base_logits"].masked_fill(~keep, float("-inf"))
    logits, tokens, lse, conf = lowrank_step(**kw, block_v=128, sample=sample, seed=3)
    ref_logits, _, ref_lse, ref_conf = lowrank_step_reference(**kw)
    assert lse.isfinite().all()
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits)
    torch.testing.assert_close(conf, ref_conf)
    assert keep[tokens].all()  # argmax and Gumbel-max samples stay inside the allowed set


@pytest.mark.parametrize("sample", [False, True])
def test_last_program_reduces_more_tiles_than_one_chunk(sample):
    """More partials than the reduce loop's chunk (LAUNCH_BLOCKS["BLOCK_T"]): 1000 / 8 = 125 tiles = 2 chunks.
    Row 0: a tie between a tile of the first chunk and one of the second (the lower index wins, as argmax).
    Row 1: the whole first chunk at -inf (logsumexp stays finite). Row 2: the maximum in the second chunk."""
    from dspark_heads.lowrank_step import LAUNCH_BLOCKS

    R, V, r, block_v = 3, 1000, 8, 8
    assert V // block_v > LAUNCH_BLOCKS["BLOCK_T"]
    g = torch.Generator().manual_seed(5)
    U, w2, code = torch.randn(R, V, generator=g), torch.zeros(V, r), torch.zeros(R, r)
    U[0, 100], U[0, 900] = 50.0, 50.0
    U[1, : 64 * block_v] = float("-inf")
    U[2, 777] = 60.0
    logits, tokens, lse, _ = lowrank_step(U, w2, code=code, block_v=block_v, sample=sample, seed=7)
    ref_logits, _, ref_lse, _ = lowrank_step_reference(U, w2, code=code)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, ref_logits)
    if not sample:
        assert tokens.tolist() == [100, ref_logits[1].argmax().item(), 777]
    assert tokens[1] >= 64 * block_v  # never a token of the -inf chunk


@pytest.mark.parametrize("R", [1, 5])
def test_rnn_code_step_matches_reference(R):
    V, r = 300, 8
    g = torch.Generator().manual_seed(1)
    U, code, w2 = torch.randn(R, V, generator=g), torch.randn(R, r, generator=g), torch.randn(V, r, generator=g)
    logits, tokens, _, conf = lowrank_step(U, w2, code=code, block_v=64)
    ref = lowrank_step_reference(U, w2, code=code)
    torch.testing.assert_close(logits, ref[0], rtol=1e-4, atol=1e-4)
    assert torch.equal(tokens, ref[1]) and conf is None


def test_sampled_tokens_follow_the_distribution():
    """Gumbel-max sampling in the kernel: 800 rows of the same logits, chi-square at α = 1e-3 (seed fixed).

    (The interpreter runs one program per row serially, ~30 ms each: the sample is kept small and the
    temperature strong enough that a kernel ignoring it is rejected at p < 1e-6 by the same test.)"""
    V, R, T = 5, 800, 0.5
    U = torch.tensor([[1.0, 0.5, -0.3, 1.4, 0.0]]).expand(R, V).contiguous()
    w2, code = torch.zeros(V, 4), torch.zeros(R, 4)
    _, tokens, _, _ = lowrank_step(U, w2, code=code, temperature=T, sample=True, seed=1234, block_v=8)
    counts = torch.bincount(tokens, minlength=V).double().numpy()

    def expected(p):
        p = p.double().numpy()
        return p / p.sum() * counts.sum()

    assert chisquare(counts, expected(torch.softmax(U[0] / T, -1))).pvalue > 1e-3
    assert chisquare(counts, expected(torch.softmax(U[0], -1))).pvalue < 1e-6  # temperature ignored: rejected
    # reproducible for a seed, different across seeds
    small, small_code = U[:50].contiguous(), code[:50]
    again = lowrank_step(small, w2, code=small_code, temperature=T, sample=True, seed=1234, block_v=8)[1]
    other = lowrank_step(small, w2, code=small_code, temperature=T, sample=True, seed=99, block_v=8)[1]
    assert torch.equal(tokens[:50], again) and not torch.equal(again, other)


@pytest.mark.parametrize(
    ("edit", "error", "message"),
    [
        (dict(base_logits=torch.zeros(2, 50, dtype=torch.int64)), TypeError, "base_logits must have dtype"),
        (dict(w2=torch.zeros(49, 8)), ValueError, r"w2 must be \[V=50, r\]"),
        (dict(prev=torch.zeros(3, dtype=torch.int64)), ValueError, r"prev must have shape \(2,\)"),
        (dict(w1=torch.zeros(50, 8, device="meta")), ValueError, "w1 is on meta"),
        (dict(prev=None), ValueError, "give prev and w1"),
        (dict(temperature=0.0), ValueError, "temperature must be > 0"),
    ],
)
def test_bad_input_raises_before_launch(edit, error, message):
    kw = dict(
        base_logits=torch.zeros(2, 50),
        w2=torch.zeros(50, 8),
        prev=torch.zeros(2, dtype=torch.int64),
        w1=torch.zeros(50, 8),
    )
    kw.update(edit)
    with pytest.raises(error, match=message):
        lowrank_step(**kw)


@pytest.mark.parametrize(
    ("head", "vocab", "head_vocab"),
    [
        ("markov", False, "full"),
        ("rnn", False, "full"),
        ("gated", False, "full"),
        ("markov", True, "full"),
        ("rnn", True, "draft"),
        ("gated", True, "draft"),
    ],
)
def test_greedy_generation_through_kernels_equals_torch_path(head, vocab, head_vocab, monkeypatch):
    import hf_dspark.model.kernel_dispatch

    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type=head, head_rank=8)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_(0, 1.0)
    if vocab:
        draft.set_draft_vocab(torch.arange(0, 96, 3)).set_head_vocab(head_vocab)  # "draft": W2 holds 32 rows
    # the same rounds on both paths: the interpreted Triton kernels run far slower here, and rounds priced by their
    # observed times would (rightly) verify differently
    draft.decoding.cost_recalibration = False
    ids = torch.tensor([[5, 9, 14, 3, 77]])
    monkeypatch.setenv("HF_DSPARK_KERNELS", "torch")
    torch_out = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=draft)
    torch_stats = draft.stats
    monkeypatch.setenv("HF_DSPARK_KERNELS", "triton")
    calls = []
    original = hf_dspark.model.kernel_dispatch.fused_head_step
    monkeypatch.setattr(
        "hf_dspark.decoding.drafting.fused_head_step", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    kernel_out = target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=draft)
    assert calls, "the kernel path was not taken"
    assert (
        kernel_out.tolist() == torch_out.tolist() == target.generate(ids, max_new_tokens=16, do_sample=False).tolist()
    )
    assert draft.stats.accepted == torch_stats.accepted
    for a, b in zip(draft.stats.confidences, torch_stats.confidences, strict=True):
        assert a == pytest.approx(b, abs=1e-5)


@pytest.mark.parametrize(("head", "do_sample"), [("markov", False), ("rnn", False), ("markov", True)])
def test_tree_expansion_through_kernels_equals_torch_path(head, do_sample, monkeypatch):
    """Token trees step the head through the same dispatcher as chains: the kernel path builds the same trees
    (greedy: plain greedy's output; sampling at a temperature, which the kernel fuses and the expansion must not
    apply twice: the same seeded output, since the trees' nodes are the draft's top children either way)."""
    import hf_dspark
    import hf_dspark.model.kernel_dispatch

    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type=head, head_rank=8)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_(0, 1.0)
    draft.decoding.cost_recalibration, draft.decoding.verify_mode, draft.decoding.tree_top_k = False, "fixed", 2
    ids = torch.tensor([[5, 9, 14, 3, 77]])
    kw = dict(max_new_tokens=12, do_sample=do_sample, custom_generate=hf_dspark.dspark_generate, draft=draft)
    if do_sample:
        kw.update(temperature=0.5, top_k=None, top_p=None)

    def run():
        torch.manual_seed(3)
        return target.generate(ids, **kw)

    monkeypatch.setenv("HF_DSPARK_KERNELS", "torch")
    torch_out, torch_stats = run(), draft.stats
    monkeypatch.setenv("HF_DSPARK_KERNELS", "triton")
    calls = []
    original = hf_dspark.model.kernel_dispatch.fused_head_step
    monkeypatch.setattr(
        "hf_dspark.decoding.drafting.fused_head_step", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    kernel_out = run()
    assert calls, "the kernel path was not taken"
    assert draft.stats.tree_fallback is None and max(draft.stats.proposed) > 4  # trees, wider than a chain
    assert kernel_out.tolist() == torch_out.tolist()
    assert draft.stats.proposed == torch_stats.proposed and draft.stats.accepted == torch_stats.accepted
    edges = [e for row in draft.stats.tree_edges for e, _, _ in row]  # the nodes' values, from q at the slot
    assert edges == pytest.approx([e for row in torch_stats.tree_edges for e, _, _ in row], abs=1e-4)
    if not do_sample:
        assert kernel_out.tolist() == target.generate(ids, max_new_tokens=12, do_sample=False).tolist()


def test_backend_switch_is_validated(monkeypatch):
    from hf_dspark.model.kernel_dispatch import backend

    monkeypatch.setenv("HF_DSPARK_KERNELS", "cuda-please")
    with pytest.raises(ValueError, match="HF_DSPARK_KERNELS must be one of"):
        backend()


def test_rank_and_hidden_larger_than_one_chunk():
    """r = 200 runs the rank loop in 4 chunks of 64 (the last one masked); d = 1500 runs the hidden loop twice."""
    kw = _inputs(3, 700, 200, torch.float32, d=1500, seed=3)
    got = lowrank_step(**kw, block_v=256)
    ref = lowrank_step_reference(**kw)
    for a, b in zip(got, ref, strict=True):
        if a.dtype == torch.int64:
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_auto_backend_keeps_the_kernel_for_few_rows(monkeypatch):
    """auto: CUDA tensors of at most AUTO_MAX_ROWS rows take the fused step (it reads W2 once per row, so more rows
    are faster on the PyTorch path); a forced backend ignores the row count; CPU tensors never take it under auto."""
    from hf_dspark.model.kernel_dispatch import AUTO_MAX_ROWS, use_kernels

    draft = DSparkDraftModel.from_target(tiny_target(), block_size=4, num_draft_layers=1, head_rank=8)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setenv("HF_DSPARK_KERNELS", "auto")
    assert use_kernels(draft, cuda, None, rows=1) and use_kernels(draft, cuda, None, rows=AUTO_MAX_ROWS)
    assert not use_kernels(draft, cuda, None, rows=AUTO_MAX_ROWS + 1)
    assert not use_kernels(draft, cpu, None, rows=1)
    monkeypatch.setenv("HF_DSPARK_KERNELS", "triton")
    assert use_kernels(draft, cpu, None, rows=AUTO_MAX_ROWS + 1)
    monkeypatch.setenv("HF_DSPARK_KERNELS", "torch")
    assert not use_kernels(draft, cuda, None, rows=1)


def test_a_head_added_from_outside_runs_through_drafting_kernels_and_exports_by_name(monkeypatch, tmp_path):
    """What a contributor writes for a new sequential head: one LowRankHead subclass in hf_dspark.model.heads.HEADS.
    Drafting, the fused kernel (through the public interface) and the checkpoint formats take it as it is."""
    from torch import nn

    from hf_dspark.compat import export_speculators
    from hf_dspark.model.heads import HEADS, LowRankHead

    class TanhHead(LowRankHead):  # code = tanh(W1[x_{k-1}] + P h_k)
        def __init__(self, vocab_size, hidden_size, rank, out_rows=None):
            super().__init__()
            self.markov_w1 = nn.Embedding(vocab_size, rank)
            self.proj = nn.Linear(hidden_size, rank, bias=False)
            self.markov_w2 = nn.Linear(rank, out_rows or vocab_size, bias=False)

        def low_rank_code(self, prev, h, state=None):
            e = self.markov_w1(prev)
            return torch.tanh(e + self.proj(h)), e, state

    monkeypatch.setitem(HEADS, "tanh", TanhHead)
    target = tiny_target("llama")
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_type="tanh", head_rank=8)
    # every block verified whole: scheduled rounds follow wall time (cost recalibration), and a loaded machine then
    # drafts in one call where it backed off in the other, so their confidences could not be compared round by round
    draft.decoding.verify_mode = "fixed"
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_(0, 1.0)
    ids = torch.tensor([[5, 9, 14, 3, 77]])
    plain = target.generate(ids, max_new_tokens=16, do_sample=False).tolist()
    monkeypatch.setenv("HF_DSPARK_KERNELS", "torch")
    assert target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=draft).tolist() == plain
    torch_confidences = draft.stats.confidences
    monkeypatch.setenv("HF_DSPARK_KERNELS", "triton")
    assert target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=draft).tolist() == plain
    for a, b in zip(draft.stats.confidences, torch_confidences, strict=True):
        assert a == pytest.approx(b, abs=1e-5)
    with pytest.raises(ValueError, match="sequential head 'tanh' has no counterpart there"):
        export_speculators(draft, tmp_path / "spec")
