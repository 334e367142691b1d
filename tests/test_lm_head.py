"""The verify's LM head: one contiguous matrix (bit for bit F.linear), in the transposed orientation only where it is
measured to pay (same numbers to rounding), only on a plain nn.Linear, restored after, and DSpark greedy still equals
plain greedy through it."""

import types

import pytest
import torch
import torch.nn.functional as F

from hf_dspark import DSparkDraftModel
from hf_dspark.decoding import lm_head
from hf_dspark.decoding.lm_head import (
    MAX_ROWS,
    few_rows_linear,
    flat_linear,
    head_orientation,
    rows_matrix,
    transposed_pays,
    verify_head,
)
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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_flat_linear_is_linear_bit_for_bit_on_one_contiguous_matrix(dtype, with_bias):
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(40, 16, generator=g).to(dtype)
    bias = torch.randn(40, generator=g).to(dtype) if with_bias else None
    hidden = torch.randn(3, 9, 16, generator=g).to(dtype)
    for x in (hidden, hidden[:, -1:], hidden[:1, -1:], hidden[:, 2:5], hidden[0], torch.zeros(0, 16, dtype=dtype)):
        rows = rows_matrix(x)
        assert rows.shape == (x.numel() // 16, 16) and rows.is_contiguous()
        assert rows.shape[0] < 2 or rows.stride() == (16, 1)
        out = flat_linear(x, weight, bias)
        assert out.shape == (*x.shape[:-1], 40)
        assert torch.equal(out, F.linear(x.contiguous().clone(), weight, bias))  # the same GEMM as a fresh copy's


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
    with verify_head(target):  # the orientation does not pay: the head is still fed one matrix
        assert vars(head)["forward"].func is flat_linear
    assert "forward" not in vars(head)
    target.to("meta")  # another device: neither the orientation nor the flattening was measured there
    with verify_head(target):
        assert "forward" not in vars(head)


@pytest.mark.parametrize("pays", [False, True])
def test_the_head_never_sees_strided_rows_in_a_dspark_call(monkeypatch, pays):
    """The prefill's ``logits_to_keep=1`` slices [R, 1, d] out of the prompt's states: a strided input that F.linear
    would run as a batched matmul (444 ms against 1.8 ms at 8 rows in bfloat16 on a CPU). Every GEMM the routed
    head runs gets one contiguous matrix, and the output is still plain greedy's."""
    monkeypatch.setattr(lm_head, "transposed_pays", lambda weight: pays)
    inputs, gemm_inputs = [], []
    original_rows = lm_head.rows_matrix

    def rows(x):
        inputs.append(x.is_contiguous())
        out = original_rows(x)
        gemm_inputs.append(out)
        return out

    def linear(x, weight, bias=None):
        gemm_inputs.append(x)
        return F.linear(x, weight, bias)

    monkeypatch.setattr(lm_head, "rows_matrix", rows)
    monkeypatch.setattr(lm_head, "F", types.SimpleNamespace(linear=linear))
    target = tiny_target(dtype=torch.float64)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    ids = torch.randint(3, 96, (3, 7), generator=torch.Generator().manual_seed(3))
    ids[0, :2] = target.generation_config.pad_token_id or 0
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    ref = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant_model=draft)
    assert out.tolist() == ref.tolist()
    assert False in inputs  # the prefill's slice came in strided ...
    assert all(x.dim() == 2 and x.is_contiguous() for x in gemm_inputs)  # ... and no GEMM saw it so


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
