"""DeepSpec's DSpark checkpoint layout: synthetic checkpoints in that exact layout load, match an independent
re-implementation of that layout's forward, and our export round-trips."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_dspark import DSparkDraftModel
from hf_dspark.compat import export_deepspec
from hf_dspark.testing import tiny_target

D, H, KV, HD, FF, V, R, GAMMA, LAYERS, MASK = 32, 4, 2, 8, 64, 96, 8, 4, 2, 95
TARGET_LAYERS = [0, 2]


# the draft decoder's Qwen3 config, as both DeepSpec and z-lab save it (the target's width and vocabulary)
QWEN3_DRAFT = {
    "model_type": "qwen3",
    "hidden_size": D,
    "intermediate_size": FF,
    "num_attention_heads": H,
    "num_key_value_heads": KV,
    "head_dim": HD,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "vocab_size": V,
    "num_hidden_layers": LAYERS,
}


def deepspec_checkpoint(folder, head="vanilla", seed=0):
    """A random checkpoint written the way DeepSpec saves Qwen3DSparkModel (names and config fields)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    sd = {"fc.weight": rnd(D, len(TARGET_LAYERS) * D), "hidden_norm.weight": 1 + rnd(D), "norm.weight": 1 + rnd(D)}
    for i in range(LAYERS):
        p = f"layers.{i}."
        sd |= {
            p + "self_attn.q_proj.weight": rnd(H * HD, D),
            p + "self_attn.k_proj.weight": rnd(KV * HD, D),
            p + "self_attn.v_proj.weight": rnd(KV * HD, D),
            p + "self_attn.o_proj.weight": rnd(D, H * HD),
            p + "self_attn.q_norm.weight": 1 + rnd(HD),
            p + "self_attn.k_norm.weight": 1 + rnd(HD),
            p + "mlp.gate_proj.weight": rnd(FF, D),
            p + "mlp.up_proj.weight": rnd(FF, D),
            p + "mlp.down_proj.weight": rnd(D, FF),
            p + "input_layernorm.weight": 1 + rnd(D),
            p + "post_attention_layernorm.weight": 1 + rnd(D),
        }
    sd |= {"markov_head.markov_w1.weight": rnd(V, R), "markov_head.markov_w2.weight": rnd(V, R)}
    if head == "gated":
        sd |= {"markov_head.gate_proj.weight": rnd(R, D + R), "markov_head.gate_proj.bias": rnd(R)}
    sd |= {"confidence_head.proj.weight": rnd(1, D + R), "confidence_head.proj.bias": rnd(1)}
    sd |= {"embed_tokens.weight": rnd(V, D), "lm_head.weight": rnd(V, D)}
    config = {
        "architectures": ["Qwen3DSparkModel"],
        **QWEN3_DRAFT,
        "num_target_layers": 4,
        "block_size": GAMMA,
        "mask_token_id": MASK,
        "target_layer_ids": TARGET_LAYERS,
        "num_anchors": 512,
        "markov_rank": R,
        "markov_head_type": head,
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "tie_word_embeddings": False,
        "attention_bias": False,
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return sd


def reference_forward(sd, ctx_hidden, anchor, prev, ctx_len, head="vanilla"):
    """The DeepSpec layout's math written out directly from its tensors (no hf_dspark code)."""

    def rms(x, w, eps=1e-6):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):  # x [heads, L, hd]
        inv = 1.0 / (10000.0 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
        ang = pos.double()[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1).float(), torch.cat([ang.sin(), ang.sin()], -1).float()
        x1, x2 = x[..., : HD // 2], x[..., HD // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    ctx = rms(ctx_hidden @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    emb = sd["embed_tokens.weight"]
    x = torch.stack([emb[anchor]] + [emb[MASK]] * (GAMMA - 1))
    q_pos, k_pos = torch.arange(ctx_len, ctx_len + GAMMA), torch.arange(ctx_len + GAMMA)
    for i in range(LAYERS):
        p = f"layers.{i}."
        h = rms(x, sd[p + "input_layernorm.weight"])
        q = (h @ sd[p + "self_attn.q_proj.weight"].T).view(GAMMA, H, HD).transpose(0, 1)
        kv_in = torch.cat([ctx, h])
        k = (kv_in @ sd[p + "self_attn.k_proj.weight"].T).view(-1, KV, HD).transpose(0, 1)
        v = (kv_in @ sd[p + "self_attn.v_proj.weight"].T).view(-1, KV, HD).transpose(0, 1)
        q = rope(rms(q, sd[p + "self_attn.q_norm.weight"]), q_pos)
        k = rope(rms(k, sd[p + "self_attn.k_norm.weight"]), k_pos)
        k, v = k.repeat_interleave(H // KV, 0), v.repeat_interleave(H // KV, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(HD), -1) @ v  # bidirectional, sees all context
        x = x + att.transpose(0, 1).reshape(GAMMA, H * HD) @ sd[p + "self_attn.o_proj.weight"].T
        h = rms(x, sd[p + "post_attention_layernorm.weight"])
        act = torch.nn.functional.silu(h @ sd[p + "mlp.gate_proj.weight"].T) * (h @ sd[p + "mlp.up_proj.weight"].T)
        x = x + act @ sd[p + "mlp.down_proj.weight"].T
    out = rms(x, sd["norm.weight"])
    e = sd["markov_head.markov_w1.weight"][prev]
    code = e
    if head == "gated":
        code = e * torch.sigmoid(
            torch.cat([out, e], -1) @ sd["markov_head.gate_proj.weight"].T + sd["markov_head.gate_proj.bias"]
        )
    logits = out @ sd["lm_head.weight"].T + code @ sd["markov_head.markov_w2.weight"].T
    conf = torch.cat([out, e], -1) @ sd["confidence_head.proj.weight"].T + sd["confidence_head.proj.bias"]
    return logits, conf[:, 0]


def target_with(sd):
    """A tiny Qwen3 target whose embedding and LM head are the checkpoint's copies."""
    target = tiny_target("qwen3", vocab_size=V, layers=4, tie_word_embeddings=False)
    with torch.no_grad():
        target.model.embed_tokens.weight.copy_(sd["embed_tokens.weight"])
        target.lm_head.weight.copy_(sd["lm_head.weight"])
    return target


@pytest.mark.parametrize("head", ["vanilla", "gated"])
def test_deepspec_checkpoint_matches_reference_forward(tmp_path, head):
    sd = deepspec_checkpoint(tmp_path / "ckpt", head)
    draft = DSparkDraftModel.from_pretrained(tmp_path / "ckpt").attach(target_with(sd))
    c = draft.config
    assert (c.block_size, c.mask_token_id, c.head_rank, c.target_layer_ids) == (GAMMA, MASK, R, TARGET_LAYERS)
    assert c.head_type == {"vanilla": "markov", "gated": "gated"}[head] and c.qk_norm and c.confidence_with_head
    ctx_len = 6
    ctx_hidden = torch.randn(ctx_len, len(TARGET_LAYERS) * D, generator=torch.Generator().manual_seed(1))
    anchor, prev = 7, torch.tensor([7, 11, 12, 13])
    ref_logits, ref_conf = reference_forward(sd, ctx_hidden, anchor, prev, ctx_len, head)
    with torch.no_grad():
        kv = draft.context_key_values(ctx_hidden[None], torch.arange(ctx_len)[None])
        out = draft(draft.embed_block(torch.tensor([anchor])), torch.arange(ctx_len, ctx_len + GAMMA)[None], kv)
        bias, feat = draft.sequential_head.teacher_forced(prev[None], out.hidden_states)
        conf = draft.confidence.logit(out.hidden_states, feat)
    torch.testing.assert_close(out.logits[0] + bias[0], ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conf[0], ref_conf, rtol=1e-4, atol=1e-4)


def test_export_round_trip_gives_identical_logits(tmp_path):
    target = tiny_target("qwen3", vocab_size=V, layers=4, tie_word_embeddings=False)
    draft = DSparkDraftModel.from_target(target, block_size=GAMMA, num_draft_layers=2, head_rank=R, mask_token_id=MASK)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    export_deepspec(draft, tmp_path / "export")
    raw = json.loads((tmp_path / "export" / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3DSparkModel"] and raw["markov_head_type"] == "vanilla"
    keys = set(load_file(tmp_path / "export" / "model.safetensors"))
    assert {
        "markov_head.markov_w1.weight",
        "confidence_head.proj.weight",
        "embed_tokens.weight",
        "lm_head.weight",
        "layers.1.self_attn.k_norm.weight",
        "fc.weight",
        "hidden_norm.weight",
    } <= keys
    back = DSparkDraftModel.from_pretrained(tmp_path / "export").attach(target)
    a, b = draft.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.tensor([[5, 9, 14, 3]])
    kw = dict(max_new_tokens=10, do_sample=False)
    assert target.generate(ids, assistant_model=back, **kw).tolist() == target.generate(ids, **kw).tolist()


def test_export_refusals(tmp_path):
    llama = tiny_target("llama")
    with pytest.raises(ValueError, match="needs per-head q/k norms"):
        export_deepspec(DSparkDraftModel.from_target(llama, block_size=4, head_rank=8), tmp_path)
    qwen = tiny_target("qwen3")
    with pytest.raises(ValueError, match="learned mask vector"):
        export_deepspec(DSparkDraftModel.from_target(qwen, block_size=4, head_rank=8), tmp_path)
    restricted = DSparkDraftModel.from_target(qwen, block_size=4, head_rank=8, mask_token_id=3).set_draft_vocab([1, 2])
    with pytest.raises(ValueError, match=r"no draft vocabulary \(this draft proposes 2 tokens\): pass whole_vocab"):
        export_deepspec(restricted, tmp_path)
    assert not (tmp_path / "model.safetensors").exists()  # nothing half-written


@pytest.mark.parametrize("head_vocab", ["full", "draft"])
def test_deepspec_export_of_a_draft_vocabulary_draft_widens_it(tmp_path, head_vocab):
    """``whole_vocab=True`` (what `hf-dspark export --format deepspec` passes) writes a draft-vocabulary draft as the
    same draft over the whole vocabulary: it loads back equal, tensor for tensor, to ``set_draft_vocab(None)`` of the
    original (W2's rows for the other tokens zero when it stored draft rows only), and decodes the target's output."""
    target = tiny_target("qwen3", vocab_size=V, layers=4, tie_word_embeddings=True)
    torch.manual_seed(1)
    draft = DSparkDraftModel.from_target(target, block_size=GAMMA, head_rank=R, mask_token_id=MASK)
    with torch.no_grad():
        draft.sequential_head.markov_w2.weight.normal_()
    draft.set_draft_vocab(list(range(0, V, 3))).set_head_vocab(head_vocab)
    export_deepspec(draft, tmp_path / "ds", whole_vocab=True)
    loaded = DSparkDraftModel.from_pretrained(tmp_path / "ds")
    draft.set_draft_vocab(None)
    assert loaded.config.draft_vocab_size is None and loaded.config.head_vocab == "full"
    expected, got = draft.state_dict(), loaded.state_dict()
    assert sorted(expected) == sorted(got)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    ids = torch.tensor([[5, 6, 7, 8]])
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=loaded), plain)


def test_unknown_layout_and_wrong_target(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["Foo"]}))
    with pytest.raises(ValueError, match="unknown checkpoint layout"):
        DSparkDraftModel.from_pretrained(tmp_path / "x")
    sd = deepspec_checkpoint(tmp_path / "ckpt")
    draft = DSparkDraftModel.from_pretrained(tmp_path / "ckpt")
    other = tiny_target("qwen3", vocab_size=V, layers=5)
    with pytest.raises(ValueError, match="num_hidden_layers: draft expects 4, target has 5"):
        other.generate(torch.tensor([[5, 6]]), max_new_tokens=3, assistant_model=draft)
    # a checkpoint with a tensor DeepSpec's layout does not have is refused by name
    sd["extra.weight"] = torch.zeros(2)
    save_file(sd, str(tmp_path / "ckpt" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected \['extra.weight'\]"):
        DSparkDraftModel.from_pretrained(tmp_path / "ckpt")


def test_cli_export(tmp_path):
    from hf_dspark.cli import main

    target = tiny_target("qwen3", vocab_size=V, layers=4, tie_word_embeddings=False)
    target.save_pretrained(tmp_path / "target")
    DSparkDraftModel.from_target(target, block_size=GAMMA, head_rank=R, mask_token_id=MASK).save_pretrained(
        tmp_path / "draft"
    )
    main(
        [
            "export",
            "--target",
            str(tmp_path / "target"),
            "--draft",
            str(tmp_path / "draft"),
            "--out",
            str(tmp_path / "ds"),
            "--format",
            "deepspec",
        ]
    )
    assert json.loads((tmp_path / "ds" / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    assert DSparkDraftModel.from_pretrained(tmp_path / "ds").config.mask_token_id == MASK


def dflash_checkpoint(folder, seed=0, num_target_layers=4):
    """A random checkpoint in z-lab's DFlashDraftModel layout (no embedding/LM head, dflash_config)."""
    sd = deepspec_checkpoint(folder, seed=seed)
    sd = {k: v for k, v in sd.items() if not k.startswith(("markov_head", "confidence_head", "embed", "lm_head"))}
    config = {
        "architectures": ["DFlashDraftModel"],
        **QWEN3_DRAFT,
        "num_target_layers": num_target_layers,
        "block_size": GAMMA,
        "layer_types": ["full_attention"] * LAYERS,
        "tie_word_embeddings": False,
        "dflash_config": {"target_layer_ids": TARGET_LAYERS, "mask_token_id": MASK},
    }
    save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    return sd


def test_dflash_checkpoint_matches_reference_and_decodes_losslessly(tmp_path):
    ref_sd = deepspec_checkpoint(tmp_path / "ref")  # same seed: same backbone tensors, plus embedding/LM head
    dflash_checkpoint(tmp_path / "dflash")
    target = target_with(ref_sd)
    draft = DSparkDraftModel.from_pretrained(tmp_path / "dflash").attach(target)
    c = draft.config
    assert (c.draft_offset, c.num_draft_tokens, c.head_type, c.confidence_head) == (1, GAMMA - 1, "none", False)
    ctx_len = 5
    ctx_hidden = torch.randn(ctx_len, len(TARGET_LAYERS) * D, generator=torch.Generator().manual_seed(2))
    ref_logits, _ = reference_forward(ref_sd, ctx_hidden, 7, torch.zeros(GAMMA, dtype=torch.long), ctx_len)
    # the reference adds DeepSpec's Markov bias for previous token 0: take it back out (DFlash has no head)
    bias = ref_sd["markov_head.markov_w1.weight"][0] @ ref_sd["markov_head.markov_w2.weight"].T
    with torch.no_grad():
        kv = draft.context_key_values(ctx_hidden[None], torch.arange(ctx_len)[None])
        out = draft(draft.embed_block(torch.tensor([7])), torch.arange(ctx_len, ctx_len + GAMMA)[None], kv)
    torch.testing.assert_close(out.logits[0], ref_logits - bias, rtol=1e-4, atol=1e-4)
    # DFlash convention in the loop: B slots propose B-1 tokens, and greedy decoding stays exact
    ids = torch.tensor([[5, 9, 14, 3]])
    kw = dict(max_new_tokens=12, do_sample=False)
    assert target.generate(ids, assistant_model=draft, **kw).tolist() == target.generate(ids, **kw).tolist()
    assert max(draft.stats.proposed) == GAMMA - 1


def test_dflash_checkpoint_for_another_target_is_refused(tmp_path):
    sd = deepspec_checkpoint(tmp_path / "ref")
    (tmp_path / "dflash").mkdir()
    dflash_checkpoint(tmp_path / "dflash", num_target_layers=36)
    draft = DSparkDraftModel.from_pretrained(tmp_path / "dflash")
    with pytest.raises(ValueError, match="num_hidden_layers: draft expects 36, target has 4"):
        target_with(sd).generate(torch.tensor([[5, 6]]), max_new_tokens=3, assistant_model=draft)


def test_deepspec_layout_carries_the_rnn_head(tmp_path):
    """The RNN head goes out as DeepSpec's ``markov_head_type: rnn`` (its ``joint_proj`` is our ``rnn_cell``) and
    comes back tensor for tensor; the reloaded draft decodes the target's greedy output. (Against DeepSpec's own
    RNNHead: scripts/deepspec_crosscheck.py, benchmarks/results/deepspec_crosscheck.json.)"""
    target = tiny_target("qwen3", vocab_size=V, layers=4, tie_word_embeddings=False)
    draft = DSparkDraftModel.from_target(target, block_size=GAMMA, head_type="rnn", head_rank=R, mask_token_id=MASK)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    export_deepspec(draft, tmp_path / "export")
    raw = json.loads((tmp_path / "export" / "config.json").read_text())
    assert raw["markov_head_type"] == "rnn" and raw["markov_rank"] == R
    keys = set(load_file(tmp_path / "export" / "model.safetensors"))
    assert {"markov_head.joint_proj.weight", "markov_head.joint_proj.bias", "markov_head.markov_w2.weight"} <= keys
    back = DSparkDraftModel.from_pretrained(tmp_path / "export").attach(target)
    assert back.config.head_type == "rnn"
    a, b = draft.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.tensor([[5, 9, 14, 3]])
    kw = dict(max_new_tokens=12, do_sample=False)
    assert target.generate(ids, assistant_model=back, **kw).tolist() == target.generate(ids, **kw).tolist()


def test_deepspec_crosscheck_script_names_what_it_needs(tmp_path, monkeypatch):

    from scripts.deepspec_crosscheck import main

    monkeypatch.delenv("DEEPSPEC_SRC", raising=False)
    with pytest.raises(SystemExit, match="name DeepSpec's source: --deepspec PATH or DEEPSPEC_SRC=PATH"):
        main(["--out", str(tmp_path / "r.json")])
    import transformers

    if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 18):
        with pytest.raises(SystemExit, match=r"DynamicCache.crop\(length\), removed in 5.18; run under 5.17"):
            main(["--deepspec", str(tmp_path), "--out", str(tmp_path / "r.json")])
    else:
        with pytest.raises(SystemExit, match="is not a DeepSpec checkout"):
            main(["--deepspec", str(tmp_path), "--out", str(tmp_path / "r.json")])
    assert not (tmp_path / "r.json").exists()
