"""Our loop against transformers' own DFlash loop, on the same native drafter (``MuseGlimmerAssistantModel``).

    python -m benchmarks.native_dflash --out benchmarks/results/native_dflash [--reps 5] [--new-tokens 64]
                                       [--samples 1500] [--readme docs/results.md]

Needs a transformers with the native drafter (5.25+). No download: a random Qwen3-shaped target (8 layers, hidden
512) and a random two-layer drafter reading its layers 1, 4 and 6 (block 8, one sliding-window layer of 16
tokens), built with transformers' classes; our draft is the drafter's checkpoint read by
``DSparkDraftModel.from_pretrained``. Rows:

1. Batch 1, greedy, float32: tokens/s of plain ``generate``, transformers' DFlash loop
   (``assistant_model=drafter, speculation_type="dflash"``) and ours (fixed full-block verify; the drafter has no
   confidence head, so ``auto`` is ``fixed`` too), interleaved, median of ``--reps``; the outputs must be identical
   and so must the accepted counts of every round (tests/test_native_dflash.py checks the same in CI).
2. Batch 4, greedy: ours against plain ``generate`` (identical rows); transformers' loop is tried and its error
   recorded.
3. Sampling: the first three tokens of a 6-token-vocabulary target and drafter, ``--samples`` generations per
   route, chi-square p-values against the exact distribution (``hf_dspark.testing``), for both routes.

The random drafter is accepted about as often as chance allows, so row 1 compares what each loop costs per round,
not a trained drafter's speedup. Writes ``native_dflash.json`` and ``native_dflash.md`` into ``--out``, and the
table between the ``native-dflash`` markers of ``--readme``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM
from transformers.generation import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper
from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

from benchmarks.readme_tables import replace_block
from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.testing import chi_square_pvalue, exact_first_tokens

IDS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=0)


def build(vocab: int, hidden: int, layers: int, block: int, window: int, seed: int = 0):
    """(target, drafter, our draft) with fixed seeds; the draft is the drafter's checkpoint through from_pretrained."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    torch.manual_seed(seed)
    heads = max(2, hidden // 64)
    shape = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_attention_heads=heads,
                 num_key_value_heads=heads // 2, head_dim=hidden // heads)  # fmt: skip
    target = Qwen3ForCausalLM(Qwen3Config(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=2048,
                                          tie_word_embeddings=False, **shape, **IDS)).eval()  # fmt: skip
    with torch.no_grad():
        target.lm_head.weight.mul_(4)
    taps = sorted({1, layers // 2, layers - 2})
    kinds = ["sliding_attention", "full_attention"]
    config = MuseGlimmerAssistantConfig(num_hidden_layers=2, block_size=block, mask_token_id=vocab - 1,
                                        target_layer_ids=taps, sliding_window=window, layer_types=kinds,
                                        **shape, **IDS)  # fmt: skip
    drafter = MuseGlimmerAssistantModel(config).eval()
    with tempfile.TemporaryDirectory() as tmp:
        drafter.save_pretrained(tmp)
        draft = DSparkDraftModel.from_pretrained(tmp, target_vocab_size=vocab)
    draft.decoding.verify_mode = "fixed"
    return target, drafter, draft


class Counts:
    """Accepted drafts per round of transformers' DFlash loop, read by wrapping its candidate generator's
    ``update_candidate_strategy`` (called once per round; the first call follows the prefill)."""

    def __init__(self):
        self.rounds: list[int] = []
        self._original = DFlashTokenCandidateGenerator.update_candidate_strategy

    def __enter__(self):
        original = self._original

        def recording(generator, input_ids, scores, num_matches):
            self.rounds.append(int(num_matches))
            return original(generator, input_ids, scores, num_matches)

        DFlashTokenCandidateGenerator.update_candidate_strategy = recording
        return self

    def __exit__(self, *exc):
        DFlashTokenCandidateGenerator.update_candidate_strategy = self._original


def routes(drafter, draft) -> dict[str, dict]:
    return {
        "plain": {},
        "transformers_dflash": {"assistant_model": drafter, "speculation_type": "dflash"},
        "hf_dspark": {"custom_generate": dspark_generate, "draft": draft},
    }


@torch.no_grad()
def speed_batch1(target, drafter, draft, reps: int, new_tokens: int) -> dict:
    prompt = torch.randint(1, target.config.vocab_size - 1, (1, 32), generator=torch.Generator().manual_seed(1))
    times = {name: [] for name in routes(drafter, draft)}
    outputs, their_counts = {}, None
    for rep in range(reps + 1):  # the first pass warms up and is not timed
        for name, kw in routes(drafter, draft).items():
            with Counts() as counts:
                t0 = time.perf_counter()
                out = target.generate(prompt, max_new_tokens=new_tokens, do_sample=False, **kw)
                seconds = time.perf_counter() - t0
            if rep:
                times[name].append(seconds)
            outputs[name] = out[0, prompt.shape[1] :].tolist()
            if name == "transformers_dflash":
                their_counts = counts.rounds[1:]
    tok_s = {name: new_tokens / statistics.median(t) for name, t in times.items()}
    ours = list(draft.stats.accepted)
    return {
        "new_tokens": new_tokens, "reps": reps, "tokens_per_s": tok_s,
        "ours_over_transformers": tok_s["hf_dspark"] / tok_s["transformers_dflash"],
        "ours_over_plain": tok_s["hf_dspark"] / tok_s["plain"],
        "transformers_over_plain": tok_s["transformers_dflash"] / tok_s["plain"],
        "identical_tokens": outputs["hf_dspark"] == outputs["transformers_dflash"] == outputs["plain"],
        "identical_accepted_counts": ours == their_counts, "rounds": len(ours),
        "tau": (sum(ours) + len(ours)) / len(ours),
    }  # fmt: skip


@torch.no_grad()
def batch4(target, drafter, draft, new_tokens: int) -> dict:
    prompts = torch.randint(1, target.config.vocab_size - 1, (4, 24), generator=torch.Generator().manual_seed(2))
    t0 = time.perf_counter()
    ours = target.generate(prompts, max_new_tokens=new_tokens, do_sample=False, custom_generate=dspark_generate,
                           draft=draft)  # fmt: skip
    ours_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    plain = target.generate(prompts, max_new_tokens=new_tokens, do_sample=False)
    plain_s = time.perf_counter() - t0
    try:
        target.generate(prompts, max_new_tokens=new_tokens, do_sample=False, assistant_model=drafter,
                        speculation_type="dflash")  # fmt: skip
        theirs = "ran"
    except Exception as err:  # the peer's own refusal, recorded as it words it
        theirs = f"{type(err).__name__}: {str(err).splitlines()[0]}"
    return {"rows": 4, "identical_to_plain": ours.tolist() == plain.tolist(), "ours_over_plain": plain_s / ours_s,
            "transformers_dflash": theirs}  # fmt: skip


@torch.no_grad()
def sampling(samples: int) -> dict:
    """Chi-square p-values of both routes' first three sampled tokens against the exact distribution."""
    target, drafter, draft = build(vocab=6, hidden=64, layers=4, block=4, window=4, seed=3)
    prompt = torch.tensor([[1, 4, 2]])
    result = {}
    for case, (temperature, top_k) in {"T=1, top-k 4": (1.0, 4), "T=0.7": (0.7, 0)}.items():
        procs = [TemperatureLogitsWarper(temperature)] + ([TopKLogitsWarper(top_k)] if top_k else [])
        probs = exact_first_tokens(target, prompt, LogitsProcessorList(procs), 3)
        row = {}
        for name, kw in routes(drafter, draft).items():
            if name == "plain":
                continue
            torch.manual_seed(0)
            counts = {}
            for _ in range(samples):
                out = target.generate(prompt, max_new_tokens=5, do_sample=True, temperature=temperature,
                                      top_k=top_k or None, top_p=1.0, **kw)  # fmt: skip
                key = tuple(out[0, 3:6].tolist())
                counts[key] = counts.get(key, 0) + 1
            row[name] = chi_square_pvalue(counts, probs)
        result[case] = row
    return {"samples": samples, "p_values": result}


def markdown(report: dict) -> str:
    s, b, p = report["batch1"], report["batch4"], report["sampling"]
    t = s["tokens_per_s"]
    lines = [
        f"# Our loop vs transformers' DFlash loop ({report['device']}, transformers {report['transformers']}, "
        f"{report['date']})", "",
        "Same random native drafter (`MuseGlimmerAssistantModel`) on the same random Qwen3 target; ours reads the "
        "drafter's checkpoint.", "",
        "| | plain | transformers DFlash | hf-dspark |", "|---|---|---|---|",
        f"| batch 1, greedy, tokens/s | {t['plain']:.1f} | {t['transformers_dflash']:.1f} | {t['hf_dspark']:.1f} |",
        f"| vs plain | 1.00× | {s['transformers_over_plain']:.2f}× | {s['ours_over_plain']:.2f}× |",
        f"| batch 4 | ✓ | {'✓' if b['transformers_dflash'] == 'ran' else 'refused'} | "
        f"{'✓ identical to plain' if b['identical_to_plain'] else 'DIFFERS'} ({b['ours_over_plain']:.2f}× plain) |",
    ]  # fmt: skip
    for case, row in p["p_values"].items():
        lines.append(f"| sampling {case}: chi-square p ({p['samples']} samples) | | "
                     f"{row['transformers_dflash']:.2f} | {row['hf_dspark']:.2f} |")  # fmt: skip
    lines += ["", f"Ours / transformers at batch 1: **{s['ours_over_transformers']:.2f}×**; identical tokens: "
              f"{s['identical_tokens']}; identical accepted counts in all {s['rounds']} rounds: "
              f"{s['identical_accepted_counts']} (τ {s['tau']:.2f}).",
              f"transformers at batch 4: {b['transformers_dflash']}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--samples", type=int, default=1500)
    ap.add_argument("--readme", type=Path, help="also write the table between its native-dflash markers")
    args = ap.parse_args(argv)
    if not hasattr(transformers, "MuseGlimmerAssistantModel"):
        raise SystemExit(f"transformers {transformers.__version__} has no native DFlash drafter: install 5.25 or newer")
    target, drafter, draft = build(vocab=16, hidden=512, layers=8, block=8, window=16)
    report = {
        "device": f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)", "torch": torch.__version__,
        "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"),
        "batch1": speed_batch1(target, drafter, draft, args.reps, args.new_tokens),
        "batch4": batch4(target, drafter, draft, args.new_tokens),
        "sampling": sampling(args.samples),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "native_dflash.json").write_text(json.dumps(report, indent=1) + "\n")
    summary = markdown(report)
    (args.out / "native_dflash.md").write_text(summary)
    print(summary)
    if args.readme is not None:
        replace_block(args.readme, "native-dflash", summary.split("\n", 2)[2].strip())  # without the title
    return report


if __name__ == "__main__":
    main()
