"""The verify's LM head in the transposed orientation: same numbers as F.linear, used only where it is measured to
pay and only on a plain nn.Linear, restored after, and DSpark greedy still equals plain greedy through it."""

import pytest
import torch
import torch.nn.functional as F

from hf_dspark import DSparkDraftModel
from hf_dspark.decoding import lm_head
from hf_dspark.decoding.lm_head import MAX_ROWS, few_rows_linear, head_orientation, transposed_pays, verify_head
from hf_dspark.testing import tiny_target


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(1, 16), (2, 16), (3, 3, 16), (MAX_ROWS, 16), (MAX_ROWS + 1, 16), (0, 16)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_few_rows_linear_equals_linear(dtype, tol, shape, with_bias):
    g = torch.Generator().manual_seed(len(shape) + shape[0])
    x = torch.randn(shape, generator=g).to(dtype)
    weight = torch.randn(40, 16, generator=g).to(dtype)
    bias = torch.randn(40, generator=g).to(dtype) if with_bias else None
    out = few_rows_linear(x, weight, bias)
    ref = F.linear(x, weight, bias)
    assert out.shape == ref.shape == (*shape[:-1], 40) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref.double(), rtol=tol, atol=tol * 16)


@pytest.fixture
def transposed(monkeypatch):
    """Makes every head count as one where the transposed orientation pays."""
    monkeypatch.setattr(lm_head, "transposed_pays", lambda weight: True)


def test_verify_head_reroutes_a_plain_linear_and_restores_it(transposed):
    target = tiny_target()
    head = target.get_output_embeddings()
    assert head_orientation(target) == "transposed"
    with verify_head(target):
        assert "forward" in vars(head)
        h = torch.randn(1, 5, head.in_features)
        torch.testing.assert_close(head(h), F.linear(h, head.weight))
    assert "forward" not in vars(head)
    with verify_head(target):
        route = vars(head)["forward"]
        assert head_orientation(target) == "transposed"  # its own route does not count as someone else's patch
        with verify_head(target):
            assert vars(head)["forward"] is route
        assert vars(head)["forward"] is route  # the inner block leaves the outer one's route in place
    assert "forward" not in vars(head)
    with pytest.raises(RuntimeError, match="inside"):
        with verify_head(target):
            raise RuntimeError("inside")
    assert "forward" not in vars(head)  # restored on the way out of an error too


def test_verify_head_leaves_wrapped_or_unpaying_heads_alone(transposed, monkeypatch):
    target = tiny_target()
    head = target.get_output_embeddings()
    handle = head.register_forward_hook(lambda module, args, out: out)
    assert head_orientation(target) == "linear"
    with verify_head(target):
        assert "forward" not in vars(head)
    handle.remove()
    head.forward = lambda x: torch.nn.functional.linear(x, head.weight)  # someone else's patch
    assert head_orientation(target) == "linear"
    with verify_head(target):
        assert vars(head)["forward"].__name__ == "<lambda>"
    del head.forward
    monkeypatch.setattr(lm_head, "transposed_pays", lambda weight: False)
    assert head_orientation(target) == "linear"
    with verify_head(target):
        assert "forward" not in vars(head)


def test_transposed_pays_is_timed_once_and_only_for_large_cpu_heads(monkeypatch):
    timed = []

    def fake_seconds(fn, reps=3):
        timed.append(fn)
        return 1.0 if fn.func is F.linear else 0.5

    monkeypatch.setattr(lm_head, "_median_seconds", fake_seconds)
    monkeypatch.setattr(lm_head, "_choices", {})
    large = torch.zeros(lm_head.MIN_ELEMENTS // 64, 64)
    assert transposed_pays(large) and len(timed) == 2
    assert transposed_pays(large) and len(timed) == 2  # cached
    assert not transposed_pays(torch.zeros(96, 32))  # too small to matter: not timed
    assert not transposed_pays(torch.zeros(lm_head.MIN_ELEMENTS // 64, 64, device="meta"))  # not a CPU
    assert len(timed) == 2


@pytest.mark.parametrize("rows", [1, 3])
def test_greedy_through_the_transposed_head_matches_plain(transposed, monkeypatch, rows):
    calls = []
    original = lm_head.few_rows_linear

    def spy(x, weight, bias=None):
        calls.append(x.numel() // x.shape[-1])
        return original(x, weight, bias)

    monkeypatch.setattr(lm_head, "few_rows_linear", spy)
    target = tiny_target(dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.decoding.verify_mode = "fixed"
    ids = torch.randint(3, 96, (rows, 7), generator=torch.Generator().manual_seed(rows))
    ref = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=draft)
    assert out.tolist() == ref.tolist()
    assert any(2 <= n <= MAX_ROWS for n in calls)  # the verify blocks went through it
