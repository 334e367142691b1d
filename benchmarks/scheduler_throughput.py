"""Batched throughput of verify modes on the embedded target (issue: confidence-scheduled verification).

    python benchmarks/scheduler_throughput.py [--draft DIR] [--rows 1 4 8 16] [--max-new-tokens 64] [--dtype auto]

For R concurrent prompts of mixed domains (first turns of gsm8k, humaneval, mt-bench, mbpp, math500): total
tokens/s of plain batched ``generate``, DSpark ``fixed`` with γ ∈ {2, 4, 8} (``verify_limit``), ``scheduled``, and
an oracle estimate that verifies exactly the tokens that were going to be accepted (hindsight; an upper bound):
its time is the measured draft time plus Σ_rounds 1 / SPS(Σ_r (n_r + 1)) from the measured SPS table. Modes run
interleaved per R so drift hits all alike. Writes ``benchmarks/results/scheduler_throughput.{json,png}``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel, embedded
from hf_dspark.scheduler import SPSProfile

EVAL = Path(__file__).resolve().parents[2] / "shared" / "data" / "eval"
DOMAINS = ["gsm8k", "humaneval", "mt-bench", "mbpp", "math500"]


def mixed_prompts(n: int, offset: int = 200) -> list[str]:
    """n first-turn prompts, round-robin over domains (from line ``offset`` on, away from the test prompts)."""
    per = {d: (EVAL / f"{d}.jsonl").read_text().split("\n") for d in DOMAINS}
    out = []
    for i in range(n):
        lines = [x for x in per[DOMAINS[i % len(DOMAINS)]] if x.strip()]
        out.append(json.loads(lines[(offset + i) % len(lines)])["turns"][0])
    return out


def batch(tokenizer, texts):
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)["input_ids"]
           for t in texts]  # fmt: skip
    width = max(len(i) for i in ids)
    pad = tokenizer.pad_token_id
    return (
        torch.tensor([[pad] * (width - len(i)) + i for i in ids]),
        torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids]),
    )


def count_new(out, width, eos):
    total = 0
    for row in out[:, width:].tolist():
        total += row.index(eos) + 1 if eos in row else len(row)
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", type=Path, default=None, help="draft folder (default: the shipped draft)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: bfloat16 where the CPU has native bf16 units (see embedded.fast_dtype)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/scheduler_throughput.json"))
    args = ap.parse_args()

    dtype = embedded.fast_dtype() if args.dtype == "auto" else getattr(torch, args.dtype)
    target, tokenizer = embedded.load_target(dtype)
    if args.draft is not None:
        draft = DSparkDraftModel.from_pretrained(args.draft, dtype=dtype).attach(target)
    elif embedded.has_shipped_draft():
        draft = DSparkDraftModel.from_pretrained(embedded.DRAFT_DIR, dtype=dtype).attach(target)
    else:
        raise SystemExit("no trained draft ships yet: pass --draft DIR")
    gamma = draft.config.block_size
    grid = sorted({1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, max(args.rows) * (gamma + 1)})
    sps = SPSProfile.measure(target, grid=grid)
    draft.sps_profile = sps
    eos = tokenizer.eos_token_id
    results = []
    for R in args.rows:
        ids, mask = batch(tokenizer, mixed_prompts(R))
        width = ids.shape[1]
        kw = dict(attention_mask=mask, max_new_tokens=args.max_new_tokens, do_sample=False)
        modes = {"plain": None, **{f"fixed-{g}": ("fixed", g) for g in (2, 4, 8) if g <= gamma},
                 "scheduled": ("scheduled", None)}  # fmt: skip
        row = {"R": R}
        for name, setting in modes.items():
            t0 = time.perf_counter()
            if setting is None:
                out = target.generate(ids, **kw)
            else:
                draft.config.verify_mode, draft.config.verify_limit = setting
                out = target.generate(ids, assistant_model=draft, **kw)
            dt = time.perf_counter() - t0
            n = count_new(out, width, eos)
            row[name] = {"tokens": n, "seconds": dt, "tok_per_s": n / dt}
            if setting is not None:
                st = draft.stats
                budget = [x for rnd in st.verify_rounds for x in rnd]
                row[name].update(tau=st.tau, verify_per_request=sum(budget) / max(len(budget), 1))
                if name == f"fixed-{min(gamma, 8)}":
                    # oracle: the same rounds, verifying exactly the accepted tokens
                    verify = 0.0
                    i = 0
                    for rnd in st.verify_rounds:
                        acc = st.accepted[i : i + len(rnd)]
                        i += len(rnd)
                        verify += 1.0 / sps(sum(a + 1 for a in acc))
                    full_verify = sum(1.0 / sps(sum(v + 1 for v in rnd)) for rnd in st.verify_rounds)
                    oracle_time = dt - full_verify + verify
                    row["oracle"] = {"tokens": n, "seconds": oracle_time, "tok_per_s": n / oracle_time}
            print(f"R={R:2d} {name:10s} {row[name]['tok_per_s']:7.1f} tok/s" + (
                f"  tau {row[name]['tau']:.2f}  verify/request {row[name]['verify_per_request']:.2f}"
                if setting is not None else ""))  # fmt: skip
        print(f"R={R:2d} oracle     {row['oracle']['tok_per_s']:7.1f} tok/s (estimate)")
        results.append(row)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "dtype": str(dtype)[6:], "threads": torch.get_num_threads()}
    args.out.write_text(json.dumps({**meta, "gamma": gamma, "sps": sps.table, "rows": results}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        names = [k for k in results[0] if k != "R"]
        for name in names:
            plt.plot([r["R"] for r in results], [r[name]["tok_per_s"] for r in results], marker="o", label=name)
        plt.xlabel("concurrent prompts R")
        plt.ylabel("total tokens/s")
        plt.legend()
        plt.savefig(args.out.with_suffix(".png"), dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
