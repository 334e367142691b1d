"""The Triton kernel compiled ahead of time for real GPUs (sm_80, sm_90) with Triton's bundled ptxas, no GPU
needed: every variant the dispatcher can launch must compile, within the register and stack goals."""

from benchmarks.kernel_resources import GOALS, VOCABS, compile_all, variants


def test_every_variant_compiles_for_sm80_and_sm90_within_the_goals():
    records = compile_all([80, 90], jobs=2)
    compiles = {(r["arch"], r["variant"]) for r in records}  # one binary per variant serves every vocabulary
    assert len(compiles) == 2 * len(variants()) == 48 and len(records) == len(compiles) * len(VOCABS)
    assert {r["arch"] for r in records} == {"sm_80", "sm_90"}
    over = [
        f"{r['arch']} {r['variant']}: {r['registers']} registers, {r['stack_bytes']} B stack"
        for r in records
        if r["registers"] > GOALS["registers"] or r["stack_bytes"] > GOALS["stack_bytes"]
    ]
    assert not over, "kernel variants over the resource goals:\n" + "\n".join(sorted(set(over)))
    assert all(r["registers"] > 0 and r["shared_bytes"] >= 0 for r in records)
