"""The prefix scheduler (Algorithm 1), its asynchronous variant, and SPS profiles."""

import itertools
import json
import random
import weakref

import pytest
import torch

import hf_dspark
from hf_dspark import DSparkConfig
from hf_dspark.decoding import costs
from hf_dspark.scheduling.modes import choose_lengths, choose_tree_nodes
from hf_dspark.scheduling.policy import (
    ColumnPlan,
    SPSProfile,
    fill_top_k,
    plan_capacity,
    plan_capacity_width,
    plan_verify_lengths,
    plan_verify_width,
)
from hf_dspark.testing import tiny_target

COUNTEREXAMPLE = SPSProfile.from_table({1: 1.0, 2: 0.5, 3: 0.45})
# the bf16 verify profile of the embedded target on a 2-core CPU (pinned_costs_bfloat16.json, rounded): 2-4 slots cost
# ~1.05x one slot, then a step to 5 slots, then flat to 9 and beyond
BF16_STEPS = SPSProfile.from_table({1: 26.2, 2: 24.8, 3: 24.8, 4: 24.5, 5: 22.4, 9: 22.4, 13: 22.3})


def plan_without_early_stop(confidences, sps):
    """The broken variant: keep searching past a drop and take the global best prefix of the admission order."""
    conf = torch.as_tensor(confidences, dtype=torch.float64)
    surv = conf.cumprod(-1)
    order = sorted(
        [(float(surv[r, j]), r, j + 1) for r in range(conf.shape[0]) for j in range(conf.shape[1])],
        key=lambda c: (-c[0], c[2], c[1]),
    )
    lengths, best, B, tau = [0] * conf.shape[0], [0] * conf.shape[0], conf.shape[0], float(conf.shape[0])
    theta_best = tau * sps(B)
    for a, r, j in order:
        lengths[r], B, tau = j, B + 1, tau + a
        if tau * sps(B) > theta_best:
            theta_best, best = tau * sps(B), list(lengths)
    return best


@pytest.mark.parametrize("c2", [0.0, 0.3, 0.9, 1.0])
def test_paper_counterexample_early_stop_never_looks_at_c2(c2):
    conf = torch.tensor([[0.8, c2]])
    assert plan_verify_lengths(conf, COUNTEREXAMPLE) == [0]


def test_without_early_stop_the_choice_depends_on_c2():
    assert plan_without_early_stop([[0.8, 0.9]], COUNTEREXAMPLE) == [2]  # Θ_2 = 2.72 · 0.45 = 1.134 > 1.0
    assert plan_without_early_stop([[0.8, 0.0]], COUNTEREXAMPLE) == [0]  # x_1 verified only when x_1 made c_2 high


def _theta(lengths, conf, sps):
    surv = conf.cumprod(-1)
    tau = len(lengths) + sum(float(surv[r, : lengths[r]].sum()) for r in range(len(lengths)))
    return tau * sps(len(lengths) + sum(lengths))


def test_brute_force_small_problems():
    rng = random.Random(0)
    for _ in range(300):
        R, gamma = rng.randint(1, 3), rng.randint(1, 4)
        conf = torch.tensor([[rng.random() for _ in range(gamma)] for _ in range(R)], dtype=torch.float64)
        rates = sorted((rng.uniform(0.1, 2.0) for _ in range(R * (gamma + 1))), reverse=True)
        sps = SPSProfile.from_table({b: rates[b - 1] for b in range(1, R * (gamma + 1) + 1)})
        got = plan_verify_lengths(conf, sps)
        # expected: walk the admission order, keep the best prefix, stop at the first drop
        surv = conf.cumprod(-1)
        order = sorted(
            [(float(surv[r, j]), r, j + 1) for r in range(R) for j in range(gamma)], key=lambda c: (-c[0], c[2], c[1])
        )
        lengths, expected, best = [0] * R, [0] * R, _theta([0] * R, conf, sps)
        for _, r, j in order:
            lengths[r] = j
            theta = _theta(lengths, conf, sps)
            if theta > best:
                best, expected = theta, list(lengths)
            else:
                break
        assert got == expected
        assert _theta(got, conf, sps) >= _theta([0] * R, conf, sps)  # never worse than verifying nothing
        assert all(0 <= n <= gamma for n in got)
        # no subset of prefixes in the admission order beats the global optimum reported by the broken search
        broken = plan_without_early_stop(conf, sps)
        assert _theta(broken, conf, sps) >= _theta(got, conf, sps) - 1e-12


def _random_problem(rng):
    R, gamma = rng.randint(1, 3), rng.randint(1, 4)
    conf = torch.tensor([[rng.random() for _ in range(gamma)] for _ in range(R)], dtype=torch.float64)
    rates = sorted((rng.uniform(0.1, 2.0) for _ in range(R * (gamma + 1))), reverse=True)
    return conf, SPSProfile.from_table({b: rates[b - 1] for b in range(1, R * (gamma + 1) + 1)})


def _theta_padded(width, conf, sps):
    R = conf.shape[0]
    return (R + float(conf.cumprod(-1)[:, :width].sum())) * sps(R * (1 + width))


def test_padded_planner_walks_columns_with_early_stop():
    rng = random.Random(1)
    for _ in range(300):
        conf, sps = _random_problem(rng)
        got = plan_verify_width(conf, sps)
        expected = 0
        for width in range(1, conf.shape[1] + 1):
            if _theta_padded(width, conf, sps) <= _theta_padded(expected, conf, sps):
                break
            expected = width
        assert got == expected
        assert _theta_padded(got, conf, sps) >= _theta_padded(0, conf, sps)
        if conf.shape[0] == 1:  # one row: a column is a token, so it is Algorithm 1 itself
            assert [got] == plan_verify_lengths(conf, sps)
        # the asynchronous width is the global optimum over columns
        thetas = [_theta_padded(w, conf, sps) for w in range(conf.shape[1] + 1)]
        assert plan_capacity_width(conf, sps) == max(range(len(thetas)), key=lambda w: thetas[w])


@pytest.mark.parametrize("c2", [0.0, 0.3, 0.9, 1.0])
def test_padded_planner_passes_the_counterexample(c2):
    assert plan_verify_width(torch.tensor([[0.8, c2]]), COUNTEREXAMPLE) == 0


def test_padded_planner_prices_a_column_not_a_token():
    # two rows at c = 0.9; widening the [2, 1] block to [2, 2] costs SPS 1.0 -> 0.6 whatever fills it
    sps = SPSProfile.from_table({2: 1.0, 3: 0.6, 4: 0.6, 6: 0.3})
    conf = torch.tensor([[0.9, 0.1], [0.9, 0.1]])
    # per token (packed): the first token alone gives Θ = 2.9 · 0.6 = 1.74 < 2.0 -> stop, verify nothing
    assert plan_verify_lengths(conf, sps) == [0, 0]
    # per column (padded): both first tokens for the same price, Θ = 3.8 · 0.6 = 2.28 > 2.0; the next column
    # gives (3.8 + 0.18) · 0.3 < 2.28 -> stop
    assert plan_verify_width(conf, sps) == 1
    caps = [2, 2]
    assert choose_lengths("scheduled", conf, caps, [], sps, 0.5, "padded") == [1, 1]
    assert choose_lengths("scheduled", conf, caps, [], sps, 0.5, "packed") == [0, 0]
    # a row's cap (length limit, finished row) bounds it whatever the width
    assert choose_lengths("scheduled", conf, [2, 0], [], sps, 0.5, "padded") == [0, 0]
    flat = SPSProfile.from_callable(lambda B: 1.0)
    assert choose_lengths("scheduled", conf, [2, 1], [], flat, 0.5, "padded") == [2, 1]
    with pytest.raises(ValueError, match="verify_layout must be one of"):
        choose_lengths("scheduled", conf, caps, [], sps, 0.5, "ragged")
    with pytest.raises(ValueError, match="verify_layout must be one of"):
        DSparkConfig(verify_layout="ragged")


def _fed(plan, conf):
    """Feed the columns of conf [R, γ] until the plan closes -> (columns it saw, what admit said each time)."""
    said = []
    for k in range(conf.shape[1]):
        said.append(plan.admit(conf[:, k]))
        if not said[-1]:
            break
    return said


def test_column_plan_matches_the_whole_block_plans():
    rng = random.Random(7)
    for _ in range(300):
        conf, sps = _random_problem(rng)
        R, gamma = conf.shape
        caps = [rng.randint(0, gamma) for _ in range(R)]
        zeroed = torch.where(torch.arange(gamma)[None] < torch.tensor(caps)[:, None], conf, 0.0)
        # scheduled: Algorithm 1 over columns on the capped confidences, each row cut at its cap
        plan = ColumnPlan(caps, sps=sps)
        said = _fed(plan, conf)
        width = plan_verify_width(zeroed, sps)
        assert plan.lengths == [min(width, cap) for cap in caps]
        assert plan.width == width and said == [True] * width + [False] * (len(said) - width)
        assert plan.admit(torch.ones(R)) is False and plan.lengths == [min(width, cap) for cap in caps]  # closed
        # threshold (0 included: a cap still bounds a row whose confidences all pass)
        threshold = rng.choice([0.0, 0.3, 0.5, 0.8])
        plan = ColumnPlan(caps, threshold=threshold)
        _fed(plan, conf)
        expected = [next((j for j in range(cap) if conf[r, j] < threshold), cap) for r, cap in enumerate(caps)]
        assert plan.lengths == expected
        assert choose_lengths("threshold", conf, caps, [], sps, threshold) == expected


def test_column_plan_with_lookahead_finds_the_best_width_of_all_columns():
    """``lookahead`` (greedy decoding): the width with the best Θ over every column, past drops of a jagged profile
    (the asynchronous planner's global search, on the current confidences), though the plan may close before the
    last column once no later one can win; the early-stop plan never verifies more."""
    rng = random.Random(11)
    closed_early = grew = 0
    for trial in range(300):
        conf, sps = _random_problem(rng)
        R, gamma = conf.shape
        if trial % 2:  # a step profile, as measured: slots come in buckets of 3 that cost the same
            sps = SPSProfile.from_table({b: sps.table[3 * ((b - 1) // 3) + 1] for b in sps.table})
        caps = [rng.randint(0, gamma) for _ in range(R)]
        zeroed = torch.where(torch.arange(gamma)[None] < torch.tensor(caps)[:, None], conf, 0.0)
        plan = ColumnPlan(caps, sps=sps, lookahead=True)
        said = _fed(plan, conf)
        thetas = [_theta_padded(w, zeroed, sps) for w in range(max(caps) + 1)]  # no row verifies past its cap
        width = plan.width
        assert thetas[width] >= max(thetas) * (1 - 1e-12) and plan.lengths == [min(width, cap) for cap in caps]
        assert all(theta < thetas[width] * (1 - 1e-12) for theta in thetas[:width])  # the fewest among equals
        assert len(said) >= width and said[:-1] == [True] * (len(said) - 1)
        closed_early += not said[-1] and len(said) < gamma
        grew += width > plan_verify_width(zeroed, sps)
    assert closed_early >= 30 and grew >= 1
    # one row on BF16_STEPS: the early stop ends at the 4 -> 5 slot step (3 tokens); the 5 survivals after it
    # (0.25 ... 0.10) ride one flat stretch, and lookahead verifies all 8
    jagged = BF16_STEPS
    conf = torch.tensor([[0.8, 0.75, 0.7, 0.6, 0.8, 0.8, 0.8, 0.8]], dtype=torch.float64)
    plan = ColumnPlan([8], sps=jagged, lookahead=True)
    assert _fed(plan, conf) == [True] * 7 + [False] and plan.lengths == [8]
    assert plan_verify_width(conf, jagged) == 3
    with pytest.raises(ValueError, match="lookahead plans with an SPS profile"):
        ColumnPlan([2], threshold=0.5, lookahead=True)


def test_tree_choice_with_lookahead_is_the_best_count_of_all():
    """choose_tree_nodes(lookahead=True) returns the node count with the best Θ (the fewest among equals); the
    early stop returns the first local best; a flat stretch after a drop is what lookahead reaches."""
    rng = random.Random(5)
    for _ in range(200):
        values = sorted((rng.random() for _ in range(rng.randint(1, 20))), reverse=True)
        rates = sorted((rng.uniform(0.1, 2.0) for _ in range(len(values) + 1)), reverse=True)
        sps = SPSProfile.from_table({b: rates[b - 1] for b in range(1, len(values) + 2)})
        drafting = rng.choice([0.0, 0.05])
        priced = sps.plus_seconds(drafting)
        thetas = [(1 + sum(values[:B])) * priced(1 + B) for B in range(len(values) + 1)]
        best = max(range(len(thetas)), key=lambda B: thetas[B])
        assert choose_tree_nodes("scheduled", values, sps, 0.5, drafting, lookahead=True)[0] == best
        assert choose_tree_nodes("scheduled", values, sps, 0.5, drafting)[0] <= best
    # on BF16_STEPS the step from 4 to 5 slots stops Algorithm 1 at 3 nodes (Θ 56.4 -> 54.9), but 5 to 9 slots cost
    # the same, and all 8 nodes reach Θ 65.9
    jagged = BF16_STEPS
    values = [0.6, 0.4, 0.3, 0.15, 0.14, 0.13, 0.12, 0.1]
    assert choose_tree_nodes("scheduled", values, jagged, 0.5) == (3, True)
    assert choose_tree_nodes("scheduled", values, jagged, 0.5, lookahead=True) == (8, True)


def test_column_plan_bad_input():
    sps = SPSProfile.from_callable(lambda B: 1.0 / B)
    with pytest.raises(ValueError, match="exactly one of sps"):
        ColumnPlan([2], sps=sps, threshold=0.5)
    with pytest.raises(ValueError, match="exactly one of sps"):
        ColumnPlan([2])
    with pytest.raises(ValueError, match="a column of 3 confidences for 2 rows"):
        ColumnPlan([2, 2], sps=sps).admit(torch.tensor([0.5, 0.5, 0.5]))
    for bad in (1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"probabilities in \[0, 1\]"):
            ColumnPlan([2, 2], threshold=0.5).admit([0.5, bad])


def test_async_capacity_then_top_k():
    sps = SPSProfile.from_callable(lambda B: 1.0 / (1 + 0.05 * B))
    old = torch.tensor([[0.9, 0.8, 0.7], [0.5, 0.2, 0.1]])
    K = plan_capacity(old, sps)
    # global search: the best K over all prefixes of the admission order, by brute force
    surv = old.double().cumprod(-1)
    a = sorted(surv.flatten().tolist(), reverse=True)
    thetas = [(2 + sum(a[:k])) * sps(2 + k) for k in range(len(a) + 1)]
    assert K == max(range(len(thetas)), key=lambda k: thetas[k])
    now = torch.tensor([[0.2, 0.9, 0.9], [0.95, 0.9, 0.5]])
    lengths = fill_top_k(now, K)
    assert sum(lengths) == min(K, 6)
    assert fill_top_k(now, 2) == [0, 2]  # row 1 has the highest survivals now
    assert fill_top_k(now, 0) == [0, 0]


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({}, "SPS table is empty"),
        ({1: 1.0, 2: 0.0}, "non-positive"),
        ({1: 1.0, 2: -3.0}, "non-positive"),
        ({1: 1.0, 2: 1.5}, r"not non-increasing in B: SPS\(2\) = 1.5 > SPS\(1\) = 1.0"),
        ({0: 1.0}, "B = 0"),
    ],
)
def test_bad_sps_tables(table, message):
    with pytest.raises(ValueError, match=message):
        SPSProfile.from_table(table)


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        (torch.tensor([0.5, 0.5]), r"must be \[R, γ\]"),
        (torch.tensor([[0.5, 1.2]]), r"probabilities in \[0, 1\]"),
        (torch.tensor([[-0.1, 0.5]]), r"probabilities in \[0, 1\]"),
        (torch.tensor([[float("nan"), 0.5]]), r"probabilities in \[0, 1\]"),
    ],
)
def test_bad_confidences(conf, message):
    with pytest.raises(ValueError, match=message):
        plan_verify_lengths(conf, COUNTEREXAMPLE)


def test_table_interpolation_and_extrapolation():
    sps = SPSProfile.from_table({1: 10.0, 5: 6.0})
    assert sps(1) == 10.0 and sps(3) == pytest.approx(8.0) and sps(10) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="B must be >= 1"):
        sps(0)


def test_measuring_a_profile_shows_progress_and_where_it_is_cached(tmp_path, monkeypatch):
    """The one-time timing (55 s to minutes on a loaded CPU) runs under a progress bar that names the cache folder,
    counts every timed step, and is off where transformers' progress bars are off; the probe shows none."""
    from transformers.utils import logging as hf_logging

    bars = []

    class Bar:
        def __init__(self, **kw):
            self.kw, self.steps = kw, 0
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n=1):
            self.steps += n

    monkeypatch.setattr(costs, "tqdm", Bar)
    target = tiny_target("llama")
    costs.measure_profile(target, grid=[1, 2, 4], context=8, reps=2, cache_dir=tmp_path)
    shown = [b for b in bars if not b.kw["disable"]]
    assert len(shown) == 1 and shown[0].kw["desc"] == f"timing the target's verify steps once (cached in {tmp_path})"
    assert shown[0].kw["total"] == shown[0].steps == 3 * 3 and shown[0].kw["delay"] == 2.0
    bars.clear()
    hf_logging.disable_progress_bar()
    try:
        costs.measure_profile(target, grid=[1, 3], context=8, reps=1, cache_dir=tmp_path)
    finally:
        hf_logging.enable_progress_bar()
    assert bars and all(b.kw["disable"] for b in bars)


def test_measure_caches_and_rebuilds_corrupt_files(tmp_path, monkeypatch):

    target = tiny_target("llama")
    grid = [1, 2, 4]
    now = {"probe": 0.010}  # the engine's speed today, as the probe reads it
    monkeypatch.setattr(costs, "probe_seconds", lambda t, fresh=False: now["probe"])
    timed = []
    real_time = costs.time_verify_steps
    monkeypatch.setattr(costs, "time_verify_steps", lambda *a, **k: timed.append(1) or real_time(*a, **k))
    sps = costs.measure_profile(target, grid=grid, context=16, reps=2, cache_dir=tmp_path)
    files = list(tmp_path.glob("*.json"))
    assert len(files) == 1 and len(timed) == 1
    saved = json.loads(files[0].read_text())
    assert saved["ident"]["dtype"] == "torch.float32" and saved["ident"]["grid"] == grid
    assert saved["probe"] == 0.010
    assert all(sps(b) > 0 for b in grid) and sps(1) >= sps(2) >= sps(4)
    # a second call reads the cache (same numbers, nothing timed), also when the probe moved by less than 30%
    now["probe"] = 0.012
    assert costs.measure_profile(target, grid=grid, context=16, cache_dir=tmp_path).table == sps.table
    assert len(timed) == 1
    # stale: the machine runs 2x slower (or faster) than when the file was measured -> measured again
    for probe in (0.020, 0.005):
        now["probe"] = probe
        costs.measure_profile(target, grid=grid, context=16, reps=1, cache_dir=tmp_path)
        assert json.loads(files[0].read_text())["probe"] == probe
    assert len(timed) == 3
    # a file from before probes were recorded is measured again
    files[0].write_text(json.dumps({"ident": saved["ident"], "table": saved["table"]}))
    costs.measure_profile(target, grid=grid, context=16, reps=1, cache_dir=tmp_path)
    assert len(timed) == 4 and "probe" in json.loads(files[0].read_text())
    files[0].write_text("{not json")
    rebuilt = costs.measure_profile(target, grid=grid, context=16, reps=2, cache_dir=tmp_path)
    assert set(rebuilt.table) == set(grid) and json.loads(files[0].read_text())["table"] and len(timed) == 5
    # a different dtype is a different key
    costs.measure_profile(target.double(), grid=grid, context=16, reps=1, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_probe_is_timed_once_per_target_unless_fresh(monkeypatch):

    target = tiny_target("llama")
    shapes = []
    real_forward = target.forward
    monkeypatch.setattr(
        target, "forward", lambda *a, **k: shapes.append(tuple(k["input_ids"].shape)) or real_forward(*a, **k)
    )
    first = costs.probe_seconds(target)
    assert first > 0 and shapes == [(1, costs.PROBE_CONTEXT)] + [(1, 1)] * 4  # short cache, warm-up + 3
    assert costs.probe_seconds(target) == first and len(shapes) == 5  # remembered
    again = costs.probe_seconds(target, fresh=True)
    assert len(shapes) == 10 and costs.probe_seconds(target) == again


def test_measure_on_batch_shapes(tmp_path, monkeypatch):
    """rows > 1 times [rows, B / rows] blocks, cached under its own key; generate measures the profile for its own
    batch size on the widths it verifies (1 + ℓ, ℓ = 0..γ), once per batch size, unless the user set one."""
    from hf_dspark import DSparkDraftModel

    target = tiny_target("llama")
    shapes, masks = [], []
    real_forward = target.forward

    def spy(*a, **k):
        shapes.append(tuple(k["input_ids"].shape))
        masks.append(k["attention_mask"])
        # the loop's call: explicit positions, no hidden states returned (the loop taps the layers it needs)
        assert not k.get("output_hidden_states") and k["position_ids"].shape == k["input_ids"].shape
        return real_forward(*a, **k)

    monkeypatch.setattr(target, "forward", spy)
    monkeypatch.setattr(costs, "probe_seconds", lambda t, fresh=False: 1.0)
    sps = costs.measure_profile(target, grid=[3, 6, 9], context=8, reps=1, cache_dir=tmp_path, rows=3)
    assert sorted(sps.table) == [3, 6, 9]
    assert shapes == [(3, 8)] + [(3, 1), (3, 2), (3, 3)] * 2  # prefill, then a warm-up pass + 1 pass over B
    # a batch is timed under a left-padding mask (one hole), covering the cache and the new block
    assert [tuple(m.shape) for m in masks] == [(3, 8)] + [(3, 9), (3, 10), (3, 11)] * 2
    assert all(int((m == 0).sum()) == 1 and m[0, 0] == 0 for m in masks)
    masks.clear()
    costs.measure_profile(target, grid=[1, 2], context=8, reps=1, cache_dir=None)
    assert masks == [None] * 5  # one row: the loop passes no mask
    shapes.clear()
    costs.measure_profile(target, grid=[3, 6, 9], context=8, reps=1, cache_dir=tmp_path)  # one row: another key
    assert len(list(tmp_path.glob("*.json"))) == 2
    with pytest.raises(ValueError, match="multiple of rows = 2"):
        costs.measure_profile(target, grid=[2, 3], context=8, reps=1, cache_dir=None, rows=2)

    calls = []
    monkeypatch.setattr(
        costs,
        "measure_profile",
        lambda t, grid, rows: calls.append((rows, grid)) or SPSProfile.from_callable(lambda B: 1.0),
    )
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    for rows in (4, 4, 1):
        costs.sps_profile(draft, target, rows)
    assert calls == [(4, [4, 8, 12, 16, 20]), (1, [1, 2, 3, 4, 5])]
    draft.sps_profile = user = SPSProfile.from_table({1: 2.0})
    assert costs.sps_profile(draft, target, 4) is user and len(calls) == 2


def test_exhaustive_lengths_are_prefixes():
    for c in itertools.product([0.0, 0.3, 0.99], repeat=3):
        lengths = plan_verify_lengths(torch.tensor([c]), SPSProfile.from_callable(lambda B: 1 / B**0.2))
        n = lengths[0]
        assert all(x > 0 for x in c[:n])  # only candidates with positive survival are admitted


def test_measure_sps_ahead_of_generate(monkeypatch):
    """hf_dspark.measure_sps(draft, R) leaves generate nothing to measure for a batch of R; bad sizes are refused."""
    from hf_dspark import DSparkDraftModel

    target = tiny_target("llama")
    calls = []
    fake = lambda t, grid, rows: calls.append(rows) or SPSProfile.from_callable(lambda B: 1.0 / B)  # noqa: E731
    monkeypatch.setattr(costs, "measure_profile", fake)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    assert hf_dspark.measure_sps(draft, 1, 2) is draft and calls == [1, 2]
    draft.decoding.verify_mode = "scheduled"
    target.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), assistant_model=draft, max_new_tokens=6, do_sample=False)
    assert calls == [1, 2]
    # an entry left by another target that lived at the same address is not reused
    key = next(k for k in costs.measured_sps(draft) if k[-1] == 1)
    other = tiny_target("llama")
    costs.measured_sps(draft)[key] = (weakref.ref(other), costs.measured_sps(draft)[key][1])
    assert hf_dspark.measure_sps(draft, 1) is draft and calls == [1, 2, 1]
    with pytest.raises(ValueError, match="batch sizes must be positive integers, got 0"):
        hf_dspark.measure_sps(draft, 0)
    with pytest.raises(RuntimeError, match="not attached"):
        hf_dspark.measure_sps(DSparkDraftModel(draft.config), 1)


def test_plus_seconds_prices_a_round_with_its_draft():
    sps = SPSProfile.from_table({1: 10.0, 5: 5.0})
    priced = sps.plus_seconds(0.1)
    assert priced(1) == pytest.approx(1 / (0.1 + 0.1)) and priced(5) == pytest.approx(1 / (0.2 + 0.1))
    assert all(priced(b) >= priced(b + 1) for b in range(1, 12))
    assert sps.plus_seconds(0.0) is sps
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="extra seconds per step"):
            sps.plus_seconds(bad)


def test_drafting_pays_by_hand():
    from hf_dspark.scheduling.policy import drafting_pays

    flat = SPSProfile.from_callable(lambda B: 10.0)  # a verify step takes 0.1 s whatever its size
    conf = torch.tensor([[0.5, 0.5]])  # expected tokens verifying both: 1 + 0.5 + 0.25 = 1.75
    assert drafting_pays(conf, [2], 1, flat, 0.05)  # 1.75 / 0.15 s = 11.7 tokens/s > 10 plain
    assert not drafting_pays(conf, [2], 1, flat, 0.1)  # 1.75 / 0.2 s = 8.75 < 10
    assert not drafting_pays(conf, [0], 1, flat, 0.001)  # nothing verified: drafting was pure cost
    assert drafting_pays(conf, [1], 1, flat, 0.04)  # 1.5 / 0.14 = 10.7
    # a padded batch of 2 rows with one still generating pays for 2·(1 + ℓ) slots and a 2-row plain step
    steep = SPSProfile.from_callable(lambda B: 10.0 / B)
    assert not drafting_pays(conf, [2], 2, steep, 0.0)  # 1.75 / 0.6 s < 1 / 0.2 s
    assert not drafting_pays(torch.tensor([[0.9, 0.9]]), [1], 1, steep, 0.0)  # 1.9 / 0.2 s < 1 / 0.1 s
    sublinear = SPSProfile.from_callable(lambda B: 10.0 / B**0.5)
    assert drafting_pays(torch.tensor([[0.9, 0.9]]), [1], 1, sublinear, 0.0)  # 1.9 / 0.141 s > 1 / 0.1 s
    with pytest.raises(ValueError, match="2 lengths"):
        drafting_pays(conf, [1, 1], 1, flat, 0.0)
    with pytest.raises(ValueError, match="rows = 1 must cover the 2 generating rows"):
        drafting_pays(torch.full((2, 2), 0.5), [1, 1], 1, flat, 0.0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        drafting_pays(torch.tensor([[1.5, 0.5]]), [1], 1, flat, 0.0)


def test_draft_seconds_is_measured_once_per_batch_size():
    from hf_dspark import DSparkDraftModel

    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    blocks = []
    real = draft.forward
    draft.forward = lambda *a, **k: blocks.append(a[0].shape) or real(*a, **k)
    first = costs.draft_seconds(draft, 2, reps=2)
    assert first > 0 and len(blocks) == 3 and all(s[:2] == (2, 4) for s in blocks)  # warm-up + 2, [R, γ] blocks
    assert costs.draft_seconds(draft, 2) == first and len(blocks) == 3
    costs.draft_seconds(draft, 1, reps=1)
    state = torch.random.get_rng_state()
    costs.draft_seconds(draft, 1, do_sample=True, reps=1)
    assert len(blocks) == 7 and len(costs.measured_draft_seconds(draft)) == 3
    # sampled blocks leave the global generator as they found it: a seeded generate reproduces whether or not
    # its first call measured the draft
    assert torch.equal(torch.random.get_rng_state(), state)
    draft.forward = real
    draft.decoding.verify_mode = "scheduled"
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1.0)
    ids = torch.tensor([[5, 6, 7, 8]])
    outs = []
    for _ in range(2):
        costs.measured_draft_seconds(draft).clear()
        torch.manual_seed(0)
        first = target.generate(ids, assistant_model=draft, do_sample=True, max_new_tokens=12)  # measures
        torch.manual_seed(0)
        outs += [first, target.generate(ids, assistant_model=draft, do_sample=True, max_new_tokens=12)]  # cached
    assert all(torch.equal(o, outs[0]) for o in outs)


def test_tree_node_choice_is_a_function_of_numbers():
    from hf_dspark.scheduling.modes import choose_tree_nodes

    values = [0.9, 0.8, 0.5, 0.2, 0.05]  # ranked: most valuable first, each node's parent before it
    assert choose_tree_nodes("fixed", values, None, 0.5) == (5, True)
    assert choose_tree_nodes("threshold", values, None, 0.5) == (3, True)
    assert choose_tree_nodes("threshold", values, None, 0.95) == (0, True)
    # a verify of B tokens costs 1 + 0.25 (B - 1) steps: τ·SPS rises while a node adds more than a quarter step
    sps = SPSProfile.from_callable(lambda B: 1.0 / (1.0 + 0.25 * (B - 1)))
    chosen, pays = choose_tree_nodes("scheduled", values, sps, 0.5)
    taus = [1 + sum(values[:b]) for b in range(len(values) + 1)]
    rates = [t * sps(1 + b) for b, t in enumerate(taus)]
    assert chosen == 3 and rates[3] > rates[2] and rates[4] <= rates[3] and pays
    assert choose_tree_nodes("async", values, sps, 0.5) == (chosen, pays)
    # the early stop: a valuable node after a non-improving one is never admitted
    assert choose_tree_nodes("scheduled", [0.9, 0.01, 0.99], sps, 0.5)[0] == 1
    # drafting that costs ten plain steps: each verified node then costs relatively less (more are chosen), but the
    # round's rate falls below a plain step's, so drafting did not pay (the caller backs off)
    costly, pays = choose_tree_nodes("scheduled", values, sps, 0.5, draft_seconds=10.0)
    assert costly > chosen and not pays


def test_batched_tree_node_choice_admits_ranks_across_rows():
    """Two rows in one padded verify: the B-th best node of every row is admitted together (values summed over the
    rows), τ starts at one token per generating row, and a width of 1 + B costs SPS(rows · (1 + B))."""
    from hf_dspark.scheduling.modes import choose_tree_nodes

    sps = SPSProfile.from_callable(lambda B: 1.0 / (1.0 + 0.25 * (B - 1)))
    summed = [0.9 + 0.7, 0.8 + 0.1, 0.5 + 0.0, 0.2]  # row 0: 0.9 0.8 0.5 0.2; row 1: 0.7 0.1
    chosen, pays = choose_tree_nodes("scheduled", summed, sps, 0.5, rows=2, generating=2)
    rates = [(2 + sum(summed[:b])) * sps(2 * (1 + b)) for b in range(len(summed) + 1)]
    best = next(b for b in range(len(summed)) if rates[b + 1] <= rates[b])  # the first rank that does not pay
    assert chosen == best and rates[chosen] > rates[0] and pays == (rates[chosen] > 2 * sps(2))
    # one row of a two-row verify (the other finished but stays in the batch): the padding is still paid for
    alone, _ = choose_tree_nodes("scheduled", [0.9, 0.8, 0.5, 0.2], sps, 0.5, rows=2, generating=1)
    single, _ = choose_tree_nodes("scheduled", [0.9, 0.8, 0.5, 0.2], sps, 0.5)
    assert alone < single


def test_pinned_costs_are_measured_once_and_then_set_without_measuring(tmp_path, monkeypatch):
    """benchmarks/pinned_costs.py: the first call measures the verify profile and drafting costs and writes them;
    a later call (a new process, here a new draft) sets exactly those numbers and measures nothing; a tree width
    the file does not pin, or a draft in another dtype, is refused by name."""
    from benchmarks.pinned_costs import pin_costs
    from hf_dspark import DSparkDraftModel

    monkeypatch.setattr(costs, "CACHE_DIR", tmp_path / "sps")
    target = tiny_target("llama")
    path = tmp_path / "pinned.json"
    first = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    pinned = pin_costs(first, target, path, max_width=9, tree_top_k=[2])
    assert json.loads(path.read_text()) == pinned and max(map(int, pinned["sps"])) == 9

    def measured(*args, **kwargs):
        raise AssertionError("a pinned cost was measured")

    for name in ("measure_profile", "_median_seconds"):
        monkeypatch.setattr(costs, name, measured)
    second = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    assert pin_costs(second, target, path, max_width=9, tree_top_k=[2]) == pinned
    assert costs.sps_profile(second, target, 1, max_width=9).table == {int(b): s for b, s in pinned["sps"].items()}
    assert costs.draft_seconds(second, 1) == pinned["chain_seconds"]
    assert costs.tree_draft_seconds(second, 2) == pinned["tree_seconds"]["2"]
    assert costs.tree_draft_seconds(second, 1) == pinned["tree_seconds"]["1"]  # the narrowed chain, pinned with trees
    older = tmp_path / "older.json"  # a file pinned before the narrowed chain was: its runs measure it, and say so
    older.write_text(json.dumps({**pinned, "tree_seconds": {"2": pinned["tree_seconds"]["2"]}}))
    with pytest.warns(UserWarning, match=r"pins no drafting cost for the narrowed chain"):
        pin_costs(DSparkDraftModel.from_target(target, block_size=4, head_rank=8), target, older, tree_top_k=[2])
    with pytest.raises(ValueError, match=r"pins no drafting cost for trees of top-k \[4\]"):
        pin_costs(second, target, path, tree_top_k=[2, 4])
    assert pinned["dtype"] == "float32" and pinned["device"] == "cpu"
    with pytest.raises(ValueError, match=r"measured in dtype float32 on device cpu, but the draft runs in bfloat16"):
        pin_costs(second.to(torch.bfloat16), target, path, tree_top_k=[2])


def test_drafting_pays_only_by_the_observed_premium():
    """A drafted round worth 2.07x a plain step by the profile pays at a premium of 2.0 and not at 2.1."""
    from hf_dspark.scheduling.policy import drafting_pays

    sps = SPSProfile.from_callable(lambda B: 1 / (0.05 + 0.002 * B))
    confidences = torch.tensor([[0.9, 0.8]])  # 1 + 0.9 + 0.72 tokens in 0.01 + 1 / SPS(3) s; plain: 1 in 1 / SPS(1)
    rate = 2.62 / (0.01 + 0.056) / sps(1)
    assert 2.0 < rate < 2.1
    assert drafting_pays(confidences, [2], 1, sps, 0.01)
    assert drafting_pays(confidences, [2], 1, sps, 0.01, premium=2.0)
    assert not drafting_pays(confidences, [2], 1, sps, 0.01, premium=2.1)


@pytest.mark.parametrize("tree_top_k", [1, 3])
def test_measured_schedules_time_every_round_and_pinned_ones_none(monkeypatch, tree_top_k):
    """With measured costs a scheduled call times each round against its price (drafted rounds at verify +
    drafting, plain ones at a step), chains and trees alike; with ``cost_recalibration=False``, in a sampling call or
    with a profile the user set it times none."""
    from hf_dspark import DSparkDraftModel
    from hf_dspark.decoding import tree_rounds

    made = []

    class Recording(costs.ObservedRounds):
        def __init__(self):
            super().__init__()
            made.append(self)

    monkeypatch.setattr(costs, "ObservedRounds", Recording)
    monkeypatch.setattr(costs, "measure_profile", lambda t, grid, rows: SPSProfile.from_callable(lambda B: 1 / B))
    monkeypatch.setattr(costs, "draft_seconds", lambda draft, rows, do_sample=False: 0.0)
    monkeypatch.setattr(tree_rounds, "tree_draft_seconds", lambda draft, top_k, rows: 0.0)
    target = tiny_target("llama")
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=20, do_sample=False, custom_generate=hf_dspark.dspark_generate, draft=draft,
              verify_mode="scheduled", tree_top_k=tree_top_k, lookup_max_ngram=0)  # fmt: skip
    out = target.generate(ids, **kw)
    assert out.tolist() == target.generate(ids, max_new_tokens=20, do_sample=False).tolist()
    (observed,) = made
    rounds = len(draft.stats.verify_rounds)
    timed = observed.ratios[True] + observed.ratios[False]
    assert rounds - 1 <= len(timed) <= rounds and all(r > 0 for r in timed)  # a chain's last round ends the call
    assert observed.ratios[True]  # drafted rounds were timed
    target.generate(ids, **kw, cost_recalibration=False)  # the setting off: priced by the profile alone
    target.generate(ids, **{**kw, "do_sample": True})  # sampling: wall time must not steer a seeded call's draws
    draft.sps_profile = SPSProfile.from_callable(lambda B: 1 / B)
    target.generate(ids, **kw)
    assert len(made) == 1
