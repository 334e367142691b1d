"""The decoding loop keeps only the target layers the draft reads (forward hooks), not every layer's states."""

import pytest
import torch

from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.decoding import state
from hf_dspark.decoding.drafting import LayerTap, target_features
from hf_dspark.testing import tiny_target


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tapped_features_equal_the_hidden_states_they_replace(arch):
    target = tiny_target(arch, layers=6)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    reference = draft.fuse_context(target_features(draft, target(ids, output_hidden_states=True).hidden_states))
    layers = target.get_decoder().layers
    hooks = [len(layer._forward_hooks) for layer in layers]  # transformers registers some of its own
    with LayerTap(target, draft) as tap:
        assert tap.active
        tap.expect(2, 9, ids.device)
        out = target(ids, output_hidden_states=False)
        assert out.hidden_states is None
        fused = tap.fused(out)  # the layers summed one by one as they ran, not concatenated and multiplied once
        assert fused.shape == (2, 9, draft.config.hidden_size)
        torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-6)
    assert [len(layer._forward_hooks) for layer in layers] == hooks  # ours removed on exit


def test_a_draft_reading_the_last_layer_falls_back_to_hidden_states():
    """The last layer's hidden_states entry is after the final norm, which a hook on the layer would not see."""
    target = tiny_target("llama", layers=4)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8, target_layer_ids=[1, 3])
    ids = torch.tensor([[5, 6, 7, 8]])
    with LayerTap(target, draft) as tap:
        assert not tap.active
        out = target(ids, output_hidden_states=True)
        assert torch.equal(tap.fused(out), draft.fuse_context(target_features(draft, out.hidden_states)))
    ref = target.generate(ids, max_new_tokens=10, do_sample=False)
    out = target.generate(ids, max_new_tokens=10, do_sample=False, custom_generate=dspark_generate, draft=draft)
    assert out.tolist() == ref.tolist()


def test_generate_asks_for_no_hidden_states_and_leaves_no_hooks(monkeypatch):
    target = tiny_target("llama", layers=6)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.decoding.verify_mode = "fixed"
    hooks = [len(layer._forward_hooks) for layer in target.get_decoder().layers]
    asked = []
    forward = target.forward

    def spy(*args, **kwargs):
        asked.append(kwargs.get("output_hidden_states"))
        return forward(*args, **kwargs)

    monkeypatch.setattr(target, "forward", spy)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    out = target.generate(ids, max_new_tokens=12, do_sample=False, custom_generate=dspark_generate, draft=draft)
    monkeypatch.undo()
    assert out.tolist() == target.generate(ids, max_new_tokens=12, do_sample=False).tolist()
    assert asked and not any(asked)
    assert [len(layer._forward_hooks) for layer in target.get_decoder().layers] == hooks
    monkeypatch.setattr(state, "check_finite", lambda logits, valid=None: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        target.generate(ids, max_new_tokens=4, custom_generate=dspark_generate, draft=draft)
    assert [len(layer._forward_hooks) for layer in target.get_decoder().layers] == hooks  # removed on errors too
