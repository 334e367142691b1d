"""Evaluation: τ and per-position acceptance from hand-built traces; `hf-dspark eval` end to end."""

import json

import pytest
import torch

from hf_dspark import DSparkDraftModel, DSparkStats
from hf_dspark.evaluation.evaluate import load_prompts, summarize
from hf_dspark.testing import char_tokenizer, tiny_target


def trace(proposed, accepted, committed, gamma=4):
    s = DSparkStats(num_draft_tokens=gamma)
    for p, a, c in zip(proposed, accepted, committed, strict=True):
        s.record(p, a, c)
    return s


def test_tau_and_position_acceptance_by_hand():
    # prompt 1: rounds accept 4/4 (+bonus), 1/4, 0/4 ; prompt 2: 2/2, 3/4 (the last cut by EOS after 2 tokens)
    s1 = trace([4, 4, 4], [4, 1, 0], [5, 2, 1])
    s2 = trace([2, 4], [2, 3], [3, 2])
    r = summarize([s1, s2])
    assert r["rounds"] == 5
    assert r["tau"] == pytest.approx((5 + 2 + 1 + 3 + 2) / 5)
    # position 1: reached in all 5 rounds, accepted in 4 (not the 0/4 round)
    # position 2: reached by rounds with ≥1 accepted and ℓ ≥ 2: 4 rounds (4/4, 1/4, 2/2, 3/4); accepted in 3
    # position 3: reached by rounds with ≥2 accepted and ℓ ≥ 3: 4/4, 3/4 -> both accept
    # position 4: reached by 4/4 and 3/4 -> 1 of 2
    assert r["position_acceptance"] == [pytest.approx(4 / 5), pytest.approx(3 / 4), 1.0, 0.5]
    assert r["verify_rate"] == pytest.approx(10 / 18)
    assert r["mean_verified"] == pytest.approx(18 / 5)


def test_unknown_dataset_and_malformed_line(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset 'gsm9k'"):
        load_prompts("gsm9k")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"turns": ["ok"]}\n{"turns": ["fine"]}\n{"turn": ["oops"]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: malformed prompt line"):
        load_prompts(str(bad))
    assert load_prompts(str(bad), limit=2) == ["ok", "fine"]
    assert len(load_prompts("humaneval", limit=3)) == 3


def test_cli_eval_end_to_end(tmp_path):
    from hf_dspark.cli import main

    target = tiny_target("llama", vocab_size=96, eos_token_id=1)
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    draft.save_pretrained(tmp_path / "draft")
    out = tmp_path / "out"
    DSparkDraftModel.from_target(target, block_size=4, head_type="none").save_pretrained(tmp_path / "none")
    drafts = [f"markov={tmp_path / 'draft'}", f"none={tmp_path / 'none'}"]
    args = ["--target", str(tmp_path / "target"), "--draft", *drafts, "--out", str(out)]
    main(
        [
            "eval",
            *args,
            "--datasets",
            "gsm8k",
            "mt-bench",
            "--limit",
            "2",
            "--max-new-tokens",
            "12",
            "--verify-mode",
            "fixed",
        ]
    )
    results = json.loads((out / "eval.json").read_text())
    assert [(r["draft"], r["dataset"], r["temperature"]) for r in results] == [
        (d, name, t) for d in ("markov", "none") for name in ("gsm8k", "mt-bench") for t in (0.0, 1.0)
    ]
    for r in results:
        assert r["prompts"] == 2 and r["tau"] >= 1.0 and len(r["position_acceptance"]) == 4
        assert r["tokens_per_s"] > 0
    md = (out / "eval.md").read_text()
    assert md.count("\n") == 2 + 8 and "| markov | gsm8k | 0.0 | 2 |" in md and "| none | mt-bench | 1.0 | 2 |" in md
    assert (out / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "tau.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_refuses_a_draft_for_another_target(tmp_path):
    from hf_dspark.cli import main

    target = tiny_target("llama", vocab_size=96)
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    DSparkDraftModel.from_target(tiny_target("llama", hidden_size=48), block_size=4, head_rank=8).save_pretrained(
        tmp_path / "draft"
    )
    with pytest.raises(SystemExit, match="hf-dspark eval: error: This DSpark draft was built for another target"):
        main(["eval", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--limit", "1"])
    DSparkDraftModel.from_target(target, block_size=4, head_rank=8).save_pretrained(tmp_path / "ok")
    with pytest.raises(SystemExit, match="two drafts are labelled 'a'"):
        main(["eval", "--target", str(tmp_path / "target"), "--draft", f"a={tmp_path / 'ok'}", f"a={tmp_path / 'ok'}"])


def test_commands_that_plot_finish_without_matplotlib(tmp_path, monkeypatch, capsys):
    """matplotlib is an extra (``plots``): without it `bench` writes its JSON and table, says in one line which plot
    it skipped, and exits 0; so do the eval and calibration plots. It failed after its work was done."""
    import sys

    from hf_dspark.cli import main
    from hf_dspark.evaluation.evaluate import plot_acceptance, plot_tau
    from hf_dspark.plotting import reliability_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    target = tiny_target("llama", vocab_size=96, eos_token_id=1)
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    DSparkDraftModel.from_target(target, block_size=4, head_rank=8).save_pretrained(tmp_path / "draft")
    out = tmp_path / "out"
    main(["bench", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"), "--datasets",
          "humaneval", "--limit", "1", "--max-new-tokens", "4", "--gammas", "--out", str(out)])  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.md"]
    err = capsys.readouterr().err
    hint = "pip install matplotlib, the package's plots extra"
    note = f"note: matplotlib is not installed, so {out / 'speedup.png'} is not drawn ({hint})"
    assert note in err.splitlines()
    results = [{"dataset": "gsm8k", "temperature": 0.0, "tau": 2.0, "position_acceptance": [0.5]}]
    assert plot_acceptance(results, tmp_path / "a.png") is None and plot_tau(results, tmp_path / "t.png") is None
    assert reliability_plot(torch.zeros(4, 2), torch.ones(4, 2), [1.0, 1.0], tmp_path / "r.png") is None
    assert not any(tmp_path.glob("*.png"))
    assert "a.png is not drawn" in capsys.readouterr().err


def test_cli_bench_end_to_end(tmp_path):
    from hf_dspark.cli import main

    target = tiny_target("llama", vocab_size=96, eos_token_id=1)
    target.save_pretrained(tmp_path / "target")
    char_tokenizer().save_pretrained(tmp_path / "target")
    DSparkDraftModel.from_target(target, block_size=4, head_rank=8).save_pretrained(tmp_path / "markov")
    none = DSparkDraftModel.from_target(target, block_size=4, head_type="none", confidence_head=False)
    none.save_pretrained(tmp_path / "none")
    out = tmp_path / "out"
    main(
        [
            "bench",
            "--target",
            str(tmp_path / "target"),
            "--draft",
            f"markov={tmp_path / 'markov'}",
            f"none={tmp_path / 'none'}",
            "--datasets",
            "humaneval",
            "--limit",
            "2",
            "--max-new-tokens",
            "10",
            "--gammas",
            "2",
            "4",
            "8",
            "--lookup",
            "3",
            "--lookup-min",
            "1",
            "--out",
            str(out),
        ]
    )
    (result,) = json.loads((out / "bench.json").read_text())
    names = [m["method"] for m in result["methods"]]
    assert names == [
        "plain",
        "prompt-lookup",
        "markov-fixed2",
        "markov-fixed4",
        "markov-scheduled",
        "markov-scheduled+lookup",
        "none-fixed2",
        "none-fixed4",
        "none-fixed+lookup",
    ]
    plain = result["methods"][0]
    assert plain["speedup"] == 1.0 and plain["tau"] is None
    assert all(m["tau"] >= 1.0 for m in result["methods"][2:]) and all(m["tok_per_s"] > 0 for m in result["methods"])
    rates = {m["method"]: m["lookup_rate"] for m in result["methods"]}
    assert rates["plain"] is None and rates["markov-scheduled"] == rates["none-fixed4"] == 0.0
    assert 0.0 <= rates["markov-scheduled+lookup"] <= 1.0
    assert (out / "bench.md").read_text().count("| humaneval |") == 9
    assert (out / "speedup.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied_logits", [False, True])
def test_bench_output_check(dtype, tied_logits):
    """float32: any mismatch with plain greedy stops the run. bfloat16: a mismatch is counted when the first
    differing token ties the target's top logit, and stops the run otherwise."""
    from hf_dspark.evaluation.bench import Method, bench, markdown_table

    target = tiny_target("llama", vocab_size=96, dtype=dtype)
    if tied_logits:  # every vocabulary row equal: all logits tie at every step
        target.lm_head.weight.data[:] = target.lm_head.weight.data[0].clone()
    tokenizer = char_tokenizer()

    def off_by_one(ids, **kw):  # a "method" whose last token differs from plain greedy's
        out = target.generate(ids, **kw)
        out[0, -1] = (out[0, -1] + 1) % 96
        return out

    methods = [Method("plain", lambda ids, **kw: target.generate(ids, **kw)), Method("wrong", off_by_one)]
    run = lambda: bench(target, tokenizer, methods, "humaneval", limit=2, max_new_tokens=4, progress=False)  # noqa: E731
    if dtype == torch.float32 or not tied_logits:
        with pytest.raises(RuntimeError, match=r"wrong produced a different greedy output than plain .* prompt 0"):
            run()
        return
    result = run()
    assert [m["same_as_plain"] for m in result["methods"]] == [2, 0]
    table = markdown_table([result])
    assert "| humaneval | plain |" in table and table.rstrip().endswith("| 0/2 |")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bench_records_a_baselines_mismatch(dtype):
    """Another library's method (``baseline=True``) that parts from plain greedy with no tie is recorded, with
    where it parts, and the run goes on; the same method not marked a baseline stops the run."""
    from hf_dspark.evaluation.bench import Method, bench, markdown_table

    target = tiny_target("llama", vocab_size=96, dtype=dtype)
    tokenizer = char_tokenizer()

    def off_by_one(ids, **kw):
        out = target.generate(ids, **kw)
        out[0, -1] = (out[0, -1] + 1) % 96
        return out

    plain = Method("plain", lambda ids, **kw: target.generate(ids, **kw))
    result = bench(target, tokenizer, [plain, Method("theirs", off_by_one, baseline=True)], "humaneval",
                   limit=2, max_new_tokens=4, progress=False)  # fmt: skip
    theirs = result["methods"][1]
    assert theirs["same_as_plain"] == 0 and [u["prompt"] for u in theirs["unexplained"]] == [0, 1]
    assert all("parts at new token 3" in u["divergence"] and "NOT a tie" in u["divergence"]
               for u in theirs["unexplained"])  # fmt: skip
    assert result["methods"][0]["unexplained"] == []
    assert markdown_table([result]).rstrip().endswith("| 0/2 (2 no tie) |")
    with pytest.raises(RuntimeError, match="ours produced a different greedy output"):
        bench(target, tokenizer, [plain, Method("ours", off_by_one)], "humaneval", limit=1, max_new_tokens=4,
              progress=False)  # fmt: skip


def test_paired_speedup_by_hand():
    """The geometric mean of per-prompt speedups: a prompt run during a slow spell of the host (both methods slowed)
    weighs like any other, where the ratio of total times follows the slow prompt."""
    from hf_dspark.evaluation.bench import paired_speedup

    plain = {"seconds": [1.0, 10.0], "tokens": [10, 10]}
    assert paired_speedup(plain, {"seconds": [0.5, 5.0], "tokens": [10, 10]}) == pytest.approx(2.0)
    assert paired_speedup(plain, {"seconds": [0.5, 10.0], "tokens": [10, 10]}) == pytest.approx(2**0.5)  # total: 1.05
    assert paired_speedup(plain, {"seconds": [0.5, 10.0], "tokens": [10, 20]}) == pytest.approx(2.0)  # per token
    assert paired_speedup(plain, {"seconds": [0.5, 10.0], "tokens": [10, 0]}) == pytest.approx(2.0)  # no token: out
    assert paired_speedup({"seconds": [1.0], "tokens": [0]}, {"seconds": [1.0], "tokens": [3]}) is None


def test_bench_rows_carry_each_prompts_time_and_the_paired_speedup():
    from hf_dspark.evaluation.bench import Method, bench, markdown_table, paired_speedup

    target, tokenizer = tiny_target("llama", vocab_size=96), char_tokenizer()
    plain = Method("plain", lambda ids, **kw: target.generate(ids, **kw))
    again = Method("again", lambda ids, **kw: target.generate(ids, **kw))
    result = bench(target, tokenizer, [plain, again], "humaneval", limit=3, max_new_tokens=4, progress=False)
    rows = {m["method"]: m for m in result["methods"]}
    for m in rows.values():
        assert len(m["seconds"]) == len(m["tokens"]) == 3 and all(t == 4 for t in m["tokens"])
        assert sum(m["tokens"]) / sum(m["seconds"]) == pytest.approx(m["tok_per_s"])
    assert rows["plain"]["paired_speedup"] == pytest.approx(1.0)
    assert rows["again"]["paired_speedup"] == pytest.approx(paired_speedup(rows["plain"], rows["again"]))
    table = markdown_table([result])
    assert "| speedup vs plain | paired speedup | τ |" in table
    assert f"| {rows['again']['paired_speedup']:.2f}× | - | 3/3 |" in table
    for m in result["methods"]:  # a result written before the paired speedup was recorded: no such column
        del m["paired_speedup"]
    assert "paired" not in markdown_table([result])


def test_tie_check_asks_a_float32_copy_too():
    """A bfloat16 forward can separate two tokens by more than two rounding units that float32 puts within them
    (accumulated rounding over a long context): the float32 copy's verdict counts; without it, or when float32
    separates them too, the mismatch is no tie."""
    import copy

    from hf_dspark.evaluation.ties import first_divergence, parts_at_a_tie

    low = tiny_target("llama", vocab_size=96, dtype=torch.bfloat16)
    torch.manual_seed(0)
    low.lm_head.weight.data.normal_(0, 2.0)  # well-separated logits in the low-precision model
    tied = copy.deepcopy(low).float()
    tied.lm_head.weight.data[:] = tied.lm_head.weight.data[0].clone()  # every logit equal in float32
    separated = copy.deepcopy(low).float()
    prefix = torch.tensor([[5, 6, 7]])
    logits = low(prefix).logits[0, -1].float()
    best, worst = int(logits.argmax()), int(logits.argmin())
    plain, other = torch.tensor([[5, 6, 7, best]]), torch.tensor([[5, 6, 7, worst]])
    assert not parts_at_a_tie(low, other, plain)
    assert not parts_at_a_tie(low, other, plain, exact=separated)
    assert parts_at_a_tie(low, other, plain, exact=tied)
    found = first_divergence(low, other, plain, exact=tied, prompt_len=3)
    assert (found.index, found.token, found.reference_token, found.tie) == (0, worst, best, True)
    assert list(found.logits) == ["bfloat16", "float32"]
    assert found.logits["bfloat16"] == (logits[worst].item(), logits[best].item(), logits[best].item())
    assert "parts at new token 0" in found.describe() and "a near-tie" in found.describe()
    assert "NOT a tie" in first_divergence(low, other, plain, prompt_len=3).describe()
    assert first_divergence(low, plain, plain) is None
    shorter = first_divergence(low, plain[:, :3], plain)
    assert not shorter.tie and shorter.index == 3


def _write_results_main():
    """``scripts/write_results.py``'s ``main`` (a maintainer script of the repository, not part of the package)."""
    import runpy
    from pathlib import Path

    return runpy.run_path(str(Path(__file__).parents[1] / "scripts" / "write_results.py"), run_name="script")["main"]


def test_results_page_and_readme_summary_are_written_from_json(tmp_path):
    main = _write_results_main()

    ctx = {"machine": "x86_64 2 cores (Linux)", "threads": 2, "device": "cpu", "dtype": "float32", "date": "2026-11-29"}
    ev = [
        {
            "dataset": "gsm8k",
            "temperature": 0.0,
            "prompts": 30,
            "tau": 2.5,
            "verify_rate": 0.4,
            "tokens_per_s": 20.0,
            "position_acceptance": [0.6, 0.5],
            **ctx,
        }
    ]
    methods = [
        {"method": "plain", "median_tok_per_s": 15.0, "tok_per_s": 15.0, "speedup": 1.0, "tau": None},
        {"method": "markov-scheduled", "median_tok_per_s": 25.0, "tok_per_s": 24.0, "speedup": 1.6, "tau": 2.5},
    ]
    be = [{"dataset": "gsm8k", "prompts": 30, "max_new_tokens": 128, **ctx, "methods": methods}]
    (tmp_path / "eval.json").write_text(json.dumps(ev))
    (tmp_path / "bench.json").write_text(json.dumps(be))
    page, readme = tmp_path / "results.md", tmp_path / "README.md"
    page.write_text("# x\n\n## Results\n\n<!-- results:start -->\nold\n<!-- results:end -->\n\n## After\n")
    readme.write_text("# y\n\n## Results\n\n<!-- summary:start -->\nold\n<!-- summary:end -->\n\nFull tables.\n")
    args = ["--eval", str(tmp_path / "eval.json"), "--bench", str(tmp_path / "bench.json")]
    main([*args, "--out", str(page), "--readme", str(readme)])
    summary = readme.read_text()
    assert "old" not in summary and summary.endswith("<!-- summary:end -->\n\nFull tables.\n")
    assert "| dataset | plain tok/s | markov-scheduled |" in summary
    assert "| gsm8k | 15.0 | 1.60× (2.50) |" in summary
    assert "Measured 2026-11-29 on x86_64 2 cores (Linux), 2 threads, float32, greedy, 30 prompts" in summary
    text = page.read_text()
    assert "old" not in text and text.endswith("<!-- results:end -->\n\n## After\n")
    assert "Measured 2026-11-29 on x86_64 2 cores (Linux), 2 threads, cpu, float32" in text
    assert "| dspark | gsm8k | 0.0 | 30 | 2.50 | 0.40 | 20.0 | 0.60 0.50 |" in text
    assert "| gsm8k | markov-scheduled | 25.0 | 1.60× | 2.50 | 30/30 |" in text
    assert "; τ: 30 prompts per dataset; wall-clock: 30 prompts per dataset." in text


def test_results_merge_bench_runs_keeping_each_runs_baseline(tmp_path):
    """Two bench runs (e.g. a draft benchmarked later) in one table: every ratio stays against its own run's plain,
    the second run's baselines are shown and marked, eval runs concatenate, plots are written; runs over different
    prompt counts refuse to merge."""
    from benchmarks.readme_tables import merge_bench

    main = _write_results_main()

    ctx = {"machine": "m", "threads": 2, "device": "cpu", "dtype": "bfloat16", "date": "2026-11-29"}

    def method(name, tps, speedup):
        return {"method": name, "median_tok_per_s": tps, "tok_per_s": tps, "speedup": speedup, "tau": None}

    run1 = [{"dataset": "gsm8k", "prompts": 30, **ctx, "methods": [method("plain", 20.0, 1.0), method("a", 22.0, 1.1)]}]
    run2 = [{"dataset": "gsm8k", "prompts": 30, **ctx, "methods": [method("plain", 18.0, 1.0), method("b", 27.0, 1.5)]}]
    run2[0]["date"] = "2026-11-30"  # a draft benchmarked the next day
    curve = {"verify_rate": 0.4, "tokens_per_s": 20.0, "position_acceptance": [0.5, 0.4]}

    def ev(draft, date):
        return [
            {
                "draft": draft,
                "dataset": "gsm8k",
                "temperature": 0.0,
                "prompts": 30,
                "tau": 1.5,
                **curve,
                **ctx,
                "date": date,
            }
        ]

    evals = {"e1.json": ev("markov", "2026-11-29"), "e2.json": ev("rnn", "2026-11-30")}
    for name, data in {"b1.json": run1, "b2.json": run2, **evals}.items():
        (tmp_path / name).write_text(json.dumps(data))
    readme = tmp_path / "results.md"
    readme.write_text("# x\n")
    main(
        [
            "--out",
            str(readme),
            "--readme",
            "none",
            "--plots",
            str(tmp_path / "plots"),
            "--eval",
            str(tmp_path / "e1.json"),
            str(tmp_path / "e2.json"),
            "--bench",
            str(tmp_path / "b1.json"),
            str(tmp_path / "b2.json"),
        ]
    )
    text = readme.read_text()
    assert "| dataset | method | tok/s (median) | speedup vs plain | τ | = plain | run |" in text
    assert "| gsm8k | a | 22.0 | 1.10× | - | 30/30 | 1 |" in text
    assert "| gsm8k | plain (run 2) | 18.0 | 1.00× | - | 30/30 | 2 |" in text
    assert "| gsm8k | b | 27.0 | 1.50× | - | 30/30 | 2 |" in text
    # rows from different days say which day each was measured
    assert "Measured 2026-11-29 and 2026-11-30 (per row below) on m, 2 threads" in text
    assert "Bench runs: 1 measured 2026-11-29, 2 measured 2026-11-30." in text
    assert "| markov | gsm8k | 0.0 | 30 | 1.50 | 0.40 | 20.0 | 0.50 0.40 | 2026-11-29 |" in text
    assert "| rnn | gsm8k | 0.0 | 30 | 1.50 | 0.40 | 20.0 | 0.50 0.40 | 2026-11-30 |" in text
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["acceptance.png", "speedup.png", "tau.png"]
    short = [{**run2[0], "prompts": 10}]
    with pytest.raises(ValueError, match="bench run 2 has no 'gsm8k' results with 30 prompts"):
        merge_bench([run1, short])


def test_results_script_never_touches_the_current_folder_and_creates_its_page(tmp_path, monkeypatch):
    """The results writer is a maintainer script: its defaults name this repository's files (found from the script,
    not the current folder); run elsewhere it leaves that folder's README alone and creates a missing --out page.
    The package's CLI has no `results` command."""
    import json

    from hf_dspark.cli import main as cli_main

    main = _write_results_main()
    ctx = {"machine": "m", "threads": 2, "device": "cpu", "dtype": "float32", "date": "2026-12-04"}
    methods = [{"method": "plain", "median_tok_per_s": 10.0, "tok_per_s": 10.0, "speedup": 1.0, "tau": None}]
    (tmp_path / "bench.json").write_text(json.dumps([{"dataset": "gsm8k", "prompts": 3, **ctx, "methods": methods}]))
    (tmp_path / "README.md").write_text("# someone else's project\n")
    monkeypatch.chdir(tmp_path)
    main(["--bench", "bench.json", "--out", "new/results.md", "--readme", "none"])
    assert (tmp_path / "README.md").read_text() == "# someone else's project\n"
    page = (tmp_path / "new" / "results.md").read_text()
    assert page.startswith("## Results\n\n<!-- results:start -->\n") and "| gsm8k | plain | 10.0 |" in page
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["results", "--bench", "bench.json"])
    assert exit_info.value.code == 2
