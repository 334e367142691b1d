"""The SmolLM2 recipe's warm restart: a new run starts from a finished draft, and the ship step records the chain."""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.testing import tiny_target
from recipes.smollm2_ship import load_run, loss_terms, run_history, train_command, unfinished_run
from recipes.smollm2_train import build_draft, in_fraction, is_held_out, record_recipe, run_rows, start_from

ROOT = Path(__file__).resolve().parents[1]


def test_a_new_run_starts_from_a_finished_drafts_weights_and_vocabulary(tmp_path):
    target = tiny_target("llama", vocab_size=96)
    finished = build_draft(target, "markov", mask_token_id=7)
    with torch.no_grad():
        for p in finished.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
    finished.set_draft_vocab([3, 1, 7, 40, 95])
    finished.save_pretrained(tmp_path / "final")

    fresh = build_draft(target, "markov", mask_token_id=7)
    vocab = start_from(fresh, tmp_path / "final")
    assert vocab.tolist() == [1, 3, 7, 40, 95]
    assert fresh.draft_vocab is None  # the trainer is given the vocabulary; the weights stay whole-vocabulary
    theirs = finished.set_draft_vocab(None).state_dict()
    assert fresh.state_dict().keys() == theirs.keys()
    assert all(torch.equal(fresh.state_dict()[k], theirs[k]) for k in theirs)

    other_layout = build_draft(target, "markov")  # no q/k norms, a learned mask vector: not the same recipe
    with pytest.raises(RuntimeError, match="q_norm"):
        start_from(other_layout, tmp_path / "final")


def test_a_new_run_starts_from_a_draft_storing_draft_vocabulary_rows(tmp_path):
    """The shipped draft keeps W2's rows for its draft vocabulary only: a run started from it gets those rows in
    place, zeros for the tokens it never proposed, and the same weights everywhere else."""
    target = tiny_target("llama", vocab_size=96)
    finished = build_draft(target, "markov", mask_token_id=7)
    with torch.no_grad():
        for p in finished.parameters():
            p.add_(torch.randn_like(p))
    vocab = [1, 3, 7, 40, 95]
    finished.set_draft_vocab(vocab)
    whole = {k: v.clone() for k, v in finished.state_dict().items() if k != "draft_vocab"}
    finished.set_head_vocab("draft").save_pretrained(tmp_path / "shipped")

    fresh = build_draft(target, "markov", mask_token_id=7)
    assert start_from(fresh, tmp_path / "shipped").tolist() == vocab
    assert fresh.config.head_vocab == "full" and fresh.state_dict().keys() == whole.keys()
    w2 = "sequential_head.markov_w2.weight"
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in whole.items() if k != w2)
    assert torch.equal(fresh.state_dict()[w2][vocab], whole[w2][vocab])
    assert fresh.state_dict()[w2].count_nonzero(dim=1).gt(0).sum() == len(vocab)


def _finished_draft(target, folder: Path, head: str = "markov", **recipe) -> DSparkDraftModel:
    """The recipe's draft (``build_draft`` with ``head`` and ``recipe``) with its trainable weights moved off their
    initialisation, saved to ``folder``: a stand-in for a finished run."""
    finished = build_draft(target, head, mask_token_id=7, **recipe)
    with torch.no_grad():
        for p in finished.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    finished.save_pretrained(folder)
    return finished


def test_a_deeper_run_grows_a_finished_draft_and_starts_out_computing_the_same(tmp_path):
    """--layers 3 --init-from a 2-layer draft: the finished layers on top, the added bottom layer a residual no-op
    (zero output projections, the target's weights elsewhere), so the first step starts from the finished draft."""
    target = tiny_target("llama", vocab_size=96)
    finished = _finished_draft(target, tmp_path / "final")

    grown = build_draft(target, "markov", mask_token_id=7, layers=3)
    copied_from_target = {k: v.clone() for k, v in grown.layers[0].state_dict().items()}
    start_from(grown, tmp_path / "final")
    added = grown.layers[0].state_dict()
    for key, value in added.items():
        silent = key.startswith(("self_attn.o_proj.", "mlp.down_proj."))
        assert torch.equal(value, torch.zeros_like(value) if silent else copied_from_target[key]), key
    assert torch.equal(grown.layers[1].mlp.up_proj.weight, finished.layers[0].mlp.up_proj.weight)
    assert torch.equal(grown.layers[2].self_attn.q_proj.weight, finished.layers[1].self_attn.q_proj.weight)

    torch.manual_seed(1)
    features = torch.randn(2, 10, finished.config.num_target_features * finished.config.target_hidden_size)
    context_positions = torch.arange(10).expand(2, -1)
    block = finished.embed_block(torch.tensor([5, 9]))
    block_positions = torch.arange(10, 10 + finished.config.block_size).expand(2, -1)
    want = finished(block, block_positions, finished.context_key_values(features, context_positions)).logits
    got = grown(block, block_positions, grown.context_key_values(features, context_positions)).logits
    torch.testing.assert_close(got, want)
    assert got.abs().max() > 0

    grown.save_pretrained(tmp_path / "deeper")
    with pytest.raises(ValueError, match="has 3 draft layers: it cannot start a 2-layer run"):
        start_from(build_draft(target, "markov", mask_token_id=7), tmp_path / "deeper")


def test_a_higher_rank_run_grows_the_head_and_starts_out_computing_the_same(tmp_path):
    """--head-rank 16 --init-from a rank-8 draft: W1's leading columns are the finished ones, the added W2 columns
    and the confidence head's weights on the added features are zero, so every bias and confidence starts out as
    the finished draft's; a lower rank is refused by name."""
    target = tiny_target("llama", vocab_size=96)
    finished = _finished_draft(target, tmp_path / "final", rank=8)

    grown = build_draft(target, "markov", mask_token_id=7, rank=16)
    start_from(grown, tmp_path / "final")
    w1 = grown.sequential_head.markov_w1.weight
    assert w1.shape == (96, 16) and torch.equal(w1[:, :8], finished.sequential_head.markov_w1.weight)
    assert w1[:, 8:].abs().sum() > 0  # the added columns carry a signal for W2's to learn from
    assert torch.equal(grown.sequential_head.markov_w2.weight[:, 8:], torch.zeros(96, 8))

    torch.manual_seed(2)
    prev, h = torch.randint(0, 96, (5,)), torch.randn(5, target.config.hidden_size)
    with torch.no_grad():
        want_bias, want_feature, _ = finished.sequential_head.step(prev, h)
        got_bias, got_feature, _ = grown.sequential_head.step(prev, h)
        torch.testing.assert_close(got_bias, want_bias)
        want = finished.confidence.logit(h, want_feature)
        torch.testing.assert_close(grown.confidence.logit(h, got_feature), want)
    assert want_bias.abs().max() > 0 and want.abs().max() > 0

    with pytest.raises(ValueError, match=r"markov_w1.weight: a finished draft's \(96, 8\) cannot start a run"):
        start_from(build_draft(target, "markov", mask_token_id=7, rank=4), tmp_path / "final")


@pytest.mark.parametrize("head", ["gated", "rnn"])
def test_a_higher_rank_run_of_another_head_is_refused_by_name(tmp_path, head):
    """Only the Markov head's rank grows: a gated or RNN head's rank-shaped weights (gate, recurrent cell) are
    refused naming the weight, before anything is loaded."""
    target = tiny_target("llama", vocab_size=96)
    _finished_draft(target, tmp_path / "final", head, rank=8)
    weight = {"gated": "gate_proj", "rnn": "rnn_cell"}[head]
    with pytest.raises(ValueError, match=rf"sequential_head\.{weight}\.(weight|bias): .* grows only the Markov head"):
        start_from(build_draft(target, head, mask_token_id=7, rank=16), tmp_path / "final")


def write_run(
    state: Path, name: str, steps: int, lr: float, seed: int, init_from: str | None, rows: int = 3000, kd: float = 0
) -> Path:
    run = state / name
    (run / "final").mkdir(parents=True)
    weights = {"ce": 1.0 - kd, "tv": 0.1, "conf": 1.0, "kd": kd}
    cfg = {"steps": steps, "lr": lr, "seed": seed, "anchors": 96, "min_lr_ratio": 0.1, "loss_weights": weights}
    (run / "final" / "train_config.json").write_text(json.dumps(cfg))
    args = argparse.Namespace(
        head="markov", steps=steps, anchors=96, lr=lr, seed=seed, layout="speculators", threads=2,
        init_from=None if init_from is None else state / init_from / "final",
    )  # fmt: skip
    record_recipe(run, args, rows)
    return run


def test_the_ship_step_follows_warm_restarts_back_to_the_first_run(tmp_path):
    write_run(tmp_path, "first", 4000, 3e-3, 0, None, rows=3000)
    write_run(tmp_path, "second", 6000, 2e-3, 1, "first", rows=3000)
    third = write_run(tmp_path, "third", 500, 1e-3, 2, "second", rows=3500, kd=1.0)
    recipe = json.loads((third / "recipe.json").read_text())
    assert "threads" not in recipe and recipe["init_from"] == str(tmp_path / "second" / "final")
    record_recipe(third, argparse.Namespace(head="none", steps=1, init_from=None), 9999)  # a resume keeps the first
    assert json.loads((third / "recipe.json").read_text()) == recipe

    chain = run_history(third)
    assert [(r["run"], r["steps"], r["lr"], r["seed"], r["rows"]) for r in chain] == [
        ("first", 4000, 3e-3, 0, 3000),
        ("second", 6000, 2e-3, 1, 3000),
        ("third", 500, 1e-3, 2, 3500),
    ]
    command = train_command("markov", chain).split(" && ")
    assert command[0] == (
        "python -m recipes.smollm2_train --head markov --run first --steps 4000 --anchors 96 --rows 3000"
    )
    assert command[2] == (
        "python -m recipes.smollm2_train --head markov --run third --steps 500 --anchors 96 --lr 0.001 --seed 2"
        " --rows 3500 --ce 0 --kd 1 --init-from <state>/second/final"
    )
    assert [loss_terms(r) for r in chain[1:]] == [
        "1.0 CE + 0.1 TV + 1.0 confidence BCE",
        "0.1 TV + 1.0 confidence BCE + 1.0 KD",
    ]


def test_an_unfinished_run_is_described_by_its_recipe(tmp_path):
    run = tmp_path / "stopped"
    args = argparse.Namespace(
        head="markov", steps=3000, anchors=64, lr=2e-3, seed=5, ce=0.0, kd=1.0, argmax=0.5, init_from=None,
        references=True, layers_lr=0.1, head_rank=256,
    )  # fmt: skip
    run.mkdir()
    record_recipe(run, args, 4200)
    entry = unfinished_run(run, 1200)
    assert train_command("markov", [entry]) == (
        "python -m recipes.smollm2_train --head markov --run stopped --steps 1200 --anchors 64 --lr 0.002"
        " --layers-lr 0.1 --head-rank 256 --seed 5 --rows 4200 --references --ce 0 --kd 1 --argmax 0.5"
    )
    assert loss_terms(entry) == "0.1 TV + 1.0 confidence BCE + 1.0 KD + 0.5 CE on the target's argmax"


def test_the_recorded_training_command_runs_from_the_repository_root():
    """The command a model card records starts the recipe as written (a recipe imports its siblings as the
    ``recipes`` package, so ``python recipes/smollm2_train.py`` would fail to import them)."""
    entry = {"run": "r", "steps": 1, "lr": 3e-3, "seed": 0, "anchors": 8, "loss_weights": {"ce": 1.0}}
    words = train_command("markov", [entry]).split()
    assert words[:3] == ["python", "-m", "recipes.smollm2_train"]
    done = subprocess.run([sys.executable, *words[1:3], "--help"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and "--references" in done.stdout, done.stderr[-500:]


def test_a_run_reads_the_answer_rows_its_first_start_read(tmp_path):
    rows = [{"id": f"gsm8k_train:{i}"} for i in range(10)]
    fresh = tmp_path / "fresh"
    assert run_rows(fresh, rows) == rows
    assert run_rows(fresh, rows, first=4) == rows[:4]
    fresh.mkdir()
    record_recipe(fresh, argparse.Namespace(head="markov", steps=1, init_from=None), 6)
    grown = [*rows, {"id": "codealpaca:1"}]  # regeneration appended a row since
    assert run_rows(fresh, grown) == rows[:6]
    assert run_rows(fresh, grown, first=9) == rows[:6]  # the run keeps what it started on
    with pytest.raises(ValueError, match="run fresh started on 6 answer rows, but only 5 are here"):
        run_rows(fresh, rows[:5])


def test_a_run_over_reference_answers_records_which_labels_they_had(tmp_path):
    """Reference rows fit CE to the target's distribution (since #48's soft-label rule); runs before it fitted the
    text's tokens and have no ``reference_labels`` in their recipe, so the two can be told apart."""
    for references, expected in [(True, "target distribution"), (False, None)]:
        run = tmp_path / str(references)
        run.mkdir()
        record_recipe(run, argparse.Namespace(head="markov", steps=1, init_from=None, references=references), 6)
        recipe = json.loads((run / "recipe.json").read_text())
        assert recipe["references"] is references and recipe.get("reference_labels") == expected


def test_a_run_with_three_draft_layers_is_rebuilt_and_reproduced_with_three(tmp_path):
    from safetensors.torch import save_file

    target = tiny_target("llama", vocab_size=96, layers=4)
    three = build_draft(target, "markov", layers=3)
    top = target.get_decoder().layers[1:]
    assert len(three.layers) == 3
    assert all(torch.equal(d.mlp.up_proj.weight, t.mlp.up_proj.weight) for d, t in zip(three.layers, top, strict=True))

    run = tmp_path / "deeper"
    (run / "checkpoint-200").mkdir(parents=True)
    args = argparse.Namespace(head="markov", steps=500, anchors=96, lr=3e-3, seed=0, layers=3, init_from=None)
    record_recipe(run, args, 100)
    with torch.no_grad():
        three.layers[2].mlp.up_proj.weight.add_(1.0)
    state = {k: v.contiguous() for k, v in three.state_dict().items() if not k.startswith("target")}
    save_file(state, run / "checkpoint-200" / "model.safetensors")
    loaded, step = load_run(target, None, run, "markov", 200)
    assert step == 200 and len(loaded.layers) == 3
    assert torch.equal(loaded.layers[2].mlp.up_proj.weight, three.layers[2].mlp.up_proj.weight)
    assert train_command("markov", [unfinished_run(run, 200)]) == (
        "python -m recipes.smollm2_train --head markov --run deeper --steps 200 --anchors 96 --layers 3 --rows 100"
    )


def test_a_run_continued_from_the_shipped_draft_carries_its_history_on(tmp_path):
    from recipes.smollm2_ship import runs_before
    from recipes.smollm2_train import shipped_runs

    target = tiny_target("llama", vocab_size=96)
    write_run(tmp_path, "first", 4000, 3e-3, 0, None, rows=3000)
    second = write_run(tmp_path, "second", 6000, 2e-3, 1, "first", rows=3500)
    shipped = tmp_path / "shipped"  # what the ship step leaves in hf_dspark/checkpoints (bfloat16, training.json)
    trained = build_draft(target, "markov", mask_token_id=7)
    with torch.no_grad():
        for p in trained.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p))
    trained.to(torch.bfloat16).set_draft_vocab([1, 7, 40]).save_pretrained(shipped)
    (shipped / "training.json").write_text(json.dumps({"command": "...", "runs": run_history(second)}))

    fresh = build_draft(target, "markov", mask_token_id=7)  # float32, as training runs
    assert start_from(fresh, shipped).tolist() == [1, 7, 40]
    assert fresh.dtype == torch.float32
    theirs = trained.set_draft_vocab(None).state_dict()
    assert all(torch.equal(fresh.state_dict()[k], theirs[k].float()) for k in theirs)

    third = tmp_path / "third"
    third.mkdir()
    args = argparse.Namespace(head="markov", steps=500, anchors=96, lr=1e-3, seed=4, init_from=shipped)
    record_recipe(third, args, 4000)
    (shipped / "training.json").write_text(json.dumps({"runs": [{"run": "later"}]}))  # shipping again later
    assert [r["run"] for r in runs_before(third)] == ["first", "second"]  # copied at the first start
    (third / "final").mkdir()
    cfg = {"steps": 500, "lr": 1e-3, "seed": 4, "anchors": 96, "loss_weights": {"ce": 1.0, "tv": 0.1, "conf": 1.0}}
    (third / "final" / "train_config.json").write_text(json.dumps(cfg))
    chain = run_history(third)
    assert [(r["run"], r["steps"], r["rows"]) for r in chain] == [("first", 4000, 3000), ("second", 6000, 3500),
                                                                  ("third", 500, 4000)]  # fmt: skip
    command = train_command("markov", chain).split(" && ")
    assert command[1].endswith("--rows 3500 --init-from <state>/first/final")
    assert command[2] == (
        "python -m recipes.smollm2_train --head markov --run third --steps 500 --anchors 96 --lr 0.001 --seed 4"
        " --rows 4000 --init-from <draft shipped from second>"
    )

    (shipped / "training.json").write_text(json.dumps({"command": "..."}))  # shipped before runs were recorded
    with pytest.raises(ValueError, match=r"training\.json records no 'runs'"):
        shipped_runs(shipped)
    with pytest.raises(ValueError, match=r"training\.json records no 'runs'"):
        record_recipe(tmp_path / "fourth", args, 4000)


def test_a_runs_draft_loads_with_the_draft_vocabulary_it_trained_over(tmp_path):
    from hf_dspark.training.trainer import VOCAB_FILE

    target = tiny_target("llama", vocab_size=96)
    run = tmp_path / "run"
    build_draft(target, "markov", mask_token_id=7).save_pretrained(run / "final")
    (run / "final" / "train_config.json").write_text(json.dumps({"steps": 300}))
    draft, step = load_run(target, None, run, "markov", None)
    assert step == 300 and draft.draft_vocab is None  # no vocabulary kept: the whole vocabulary
    (run / VOCAB_FILE).write_text(json.dumps([40, 3, 95]))
    draft, _ = load_run(target, None, run, "markov", None)
    assert draft.draft_vocab.tolist() == [3, 40, 95]


def test_row_fractions_are_nested_proportional_and_recorded(tmp_path):
    """A tokens learning curve's subsets: each smaller fraction lies inside every larger one, draws about its share
    of every source, does not decide what is held out, and the run records it (a resume keeps its own, and the
    ship step's command repeats it)."""
    rows = [{"id": f"{source}-{i}"} for source in ("gsm8k", "code", "chat") for i in range(4000)]
    subsets = {f: {r["id"] for r in rows if in_fraction(r, f)} for f in (0.125, 0.25, 0.5, 1.0)}
    assert subsets[0.125] < subsets[0.25] < subsets[0.5] < subsets[1.0] == {r["id"] for r in rows}
    for f in (0.125, 0.25, 0.5):
        for source in ("gsm8k", "code", "chat"):
            share = sum(i.startswith(source) for i in subsets[f]) / 4000
            assert abs(share - f) < 0.03, (f, source, share)
    held = {r["id"] for r in rows if is_held_out(r)}
    assert abs(len(held & subsets[0.25]) / len(held) - 0.25) < 0.06  # the two hashes are independent
    assert in_fraction({"id": "gsm8k-7@reference"}, 0.5) == in_fraction({"id": "gsm8k-7"}, 0.5)
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="row fraction must be in"):
            in_fraction(rows[0], bad)

    run = tmp_path / "quarter"
    run.mkdir()
    record_recipe(run, argparse.Namespace(head="markov", steps=10, init_from=None, row_fraction=0.25), 500)
    record_recipe(run, argparse.Namespace(head="markov", steps=10, init_from=None, row_fraction=1.0), 500)
    assert json.loads((run / "recipe.json").read_text())["row_fraction"] == 0.25
    entry = {"run": "quarter", "steps": 10, "anchors": 48, "lr": 3e-3, "seed": 0, "rows": 500, "row_fraction": 0.25,
             "loss_weights": {"ce": 1.0, "tv": 0.1, "conf": 1.0}}  # fmt: skip
    assert "--rows 500 --row-fraction 0.25" in train_command("markov", [entry])
    assert "--row-fraction" not in train_command("markov", [{**entry, "row_fraction": 1.0}])


def test_the_ablation_replays_every_shipped_run_with_the_other_head():
    """recipes/smollm2_ablation.py: one training command per run of the shipped draft's history, the same budget
    and data (rows, steps, anchors, lr, seed, layers, loss), the other head, each a warm restart of the one before;
    then the issue's eval of the last one beside the shipped draft."""
    from recipes.smollm2_ablation import FIRST_ROWS, SHIPPED, eval_command, replay_commands
    from recipes.smollm2_train import STATE

    runs = json.loads((SHIPPED / "training.json").read_text())["runs"]
    commands = replay_commands(runs, "none", threads=2)
    assert len(commands) == len(runs) >= 2

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1] if name in cmd else None

    for i, (cmd, run) in enumerate(zip(commands, runs, strict=True)):
        assert flag(cmd, "--head") == "none" and flag(cmd, "--run") == f"none-{run['run']}"
        for name in ("steps", "anchors", "lr", "seed", "layers"):
            assert flag(cmd, f"--{name}") == str(run[name])
        assert flag(cmd, "--rows") == str(run["rows"] or FIRST_ROWS)
        assert flag(cmd, "--ce") == str(run["loss_weights"]["ce"])
        assert flag(cmd, "--head-rank") == str(run.get("head_rank", 64))
        previous = None if i == 0 else str(STATE / f"none-{runs[i - 1]['run']}" / "final")
        assert flag(cmd, "--init-from") == previous
    evaluation = eval_command("none", STATE / "none-last" / "final", Path("out"))
    assert evaluation[1:4] == ["-m", "hf_dspark.cli", "eval"] and flag(evaluation, "--verify-mode") == "fixed"
    assert flag(evaluation, "--dtype") == "float32" and flag(evaluation, "--limit") == "30"
    assert evaluation[evaluation.index("--draft") + 1 : evaluation.index("--out")] == [
        f"shipped={SHIPPED}",
        f"none={STATE / 'none-last' / 'final'}",
    ]
