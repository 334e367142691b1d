"""The Gradio demo, driven through its API with gradio_client (a tiny target, offline, on 127.0.0.1)."""

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import pytest
import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.testing import char_tokenizer, tiny_target


@pytest.fixture(scope="module")
def running_demo():
    from hf_dspark.demo.app import build_demo

    target = tiny_target("llama", vocab_size=96, eos_token_id=1, max_position_embeddings=256)
    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    demo = build_demo(target, tokenizer, draft)
    demo.queue().launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    yield demo, target, tokenizer, draft
    demo.close()


def _text(pane_html: str) -> str:
    import html
    import re

    return html.unescape(re.sub(r"<[^>]+>", "", pane_html))


def test_api_compare_gives_identical_outputs_and_speed_figures(running_demo):
    from gradio_client import Client
    from hf_dspark.demo.app import DRAFTED, LOOKED_UP, TARGET

    demo, target, tokenizer, draft = running_demo
    saved = draft.config.to_dict()
    assert demo.local_url.startswith("http://127.0.0.1:")
    client = Client(demo.local_url, verbose=False)
    plain, dspark_html, plain_speed, dspark_speed, stats, chart = client.predict(
        "hello there", False, 0.7, 16, 4, "fixed", True, False, "float32", api_name="/compare"
    )
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello there"}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    expected = tokenizer.decode(
        target.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :], skip_special_tokens=True
    )
    assert plain == expected
    assert f"background:{DRAFTED}" in dspark_html or f"background:{TARGET}" in dspark_html
    assert f"background:{LOOKED_UP}" not in dspark_html  # lookup drafting off: nothing was looked up
    assert _text(dspark_html) == expected  # same text, coloured by round
    n = len(target.generate(ids, max_new_tokens=16, do_sample=False)[0]) - ids.shape[1]
    assert plain_speed.startswith(f"**plain** · {n} tokens · **") and plain_speed.endswith(" tok/s**")
    assert dspark_speed.startswith(f"**DSpark** · {n} tokens · **") and "generating" not in dspark_speed
    assert "speedup" in stats and "τ" in stats
    # greedy in float32: compared, and equal, said first, as a headline
    assert stats.startswith("### Identical to plain greedy, token for token (float32)\n")
    assert chart["columns"] == ["position", "acceptance"]
    assert [row[0] for row in chart["data"]] == ["1", "2", "3", "4"]
    assert all(0.0 <= row[1] <= 1.0 for row in chart["data"])
    # with the sequential head switched off the output is still the target's
    plain_off, dspark_off, *_ = client.predict(
        "hello there", False, 0.7, 16, 4, "fixed", False, False, "float32", api_name="/compare"
    )
    assert plain_off == expected and _text(dspark_off) == expected
    assert "looked up" not in stats
    # with lookup drafting on (the prompt repeats, so some rounds look up) the output is still the target's, and the
    # looked-up rounds are coloured as such
    repeating = "abc abc abc abc abc"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": repeating}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    expected = tokenizer.decode(
        target.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :], skip_special_tokens=True
    )
    plain_lk, dspark_lk, _, _, stats_lk, _ = client.predict(
        repeating, False, 0.7, 16, 4, "fixed", True, True, "float32", api_name="/compare"
    )
    assert plain_lk == expected and _text(dspark_lk) == expected
    looked = int(stats_lk.split(" looked up")[0].rsplit("(", 1)[1])
    assert draft.config.to_dict() == saved  # every request's settings were its own
    assert 0 < looked <= int(stats_lk.split(" rounds")[0].rsplit(" ", 1)[1])
    assert f"background:{LOOKED_UP}" in dspark_lk or f"background:{TARGET}" in dspark_lk


def test_coloured_marks_each_round_by_its_proposer():
    """Round 0 is the prefill's token (the target's); later rounds: accepted tokens in the proposer's colour, then the
    target's own token; rounds whose proposer is not known yet (while streaming) count as drafted."""
    from hf_dspark.demo.app import DRAFTED, LOOKED_UP, TARGET, coloured

    tokenizer = char_tokenizer()
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    rounds = [enc("a"), enc("bcD"), enc("efG"), enc("H"), enc("ijK")]
    html_out = coloured(tokenizer, rounds, [False, True, False])
    spans = [(c, t) for c, t in __import__("re").findall(r'background:(#[0-9a-f]+)">([^<]*)<', html_out)]
    assert spans == [(TARGET, "a"), (DRAFTED, "bc"), (TARGET, "D"), (LOOKED_UP, "ef"), (TARGET, "G"), (TARGET, "H"),
                     (DRAFTED, "ij"), (TARGET, "K")]  # fmt: skip


def test_a_parted_output_is_the_headline_and_its_token_is_outlined():
    """The first click's promise: the summary opens with whether the output is plain greedy's; where a bf16 output
    parts at a near-tie, the headline says so and the parted token is outlined in the DSpark pane."""
    from hf_dspark.demo.app import PARTED, coloured, verdict

    from hf_dspark.evaluation.ties import Divergence

    tokenizer = char_tokenizer()
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    tie = Divergence(3, enc("x")[0], enc("y")[0], {"bfloat16": (9.5, 9.53, 9.53), "float32": (9.51, 9.52, 9.52)}, True)
    headline = verdict(tie, torch.bfloat16, tokenizer)
    assert headline.startswith("### Parts from plain greedy at new token 3 (outlined in red): a bfloat16 near-tie")
    assert "parts at new token 3: " in headline and "float32 precision gives token-for-token identical" in headline
    assert verdict(None, torch.float32, tokenizer) == "### Identical to plain greedy, token for token (float32)"
    for dtype, divergence in ((torch.float32, tie), (torch.bfloat16, Divergence(3, 1, 2, {}, False))):
        assert verdict(divergence, dtype, tokenizer).startswith("### Differs from plain greedy, and not at a")
    rounds = [enc("a"), enc("bcD"), enc("efG")]  # new tokens a b c D e f G: index 3 is "D", 4 is "e"
    for at, text in ((3, "D"), (4, "e"), (0, "a")):
        marked = __import__("re").findall(rf'<span style="background:#[0-9a-f]+;{PARTED}"[^>]*>([^<]*)<', coloured(
            tokenizer, rounds, [False, False], parted_at=at))  # fmt: skip
        assert marked == [text]
    assert _text(coloured(tokenizer, rounds, [False, False], parted_at=4)) == "abcDefG"
    assert PARTED not in coloured(tokenizer, rounds, [False, False])


def test_float32_precision_runs_on_a_float32_copy(tmp_path):
    """A bfloat16 pair offers float32 one click away: the request runs on float32 copies of both models and its
    DSpark output equals plain float32 greedy token for token; the bf16 models are left as they were."""
    from gradio_client import Client
    from hf_dspark.demo.app import build_demo

    target = tiny_target("llama", vocab_size=96, eos_token_id=1, max_position_embeddings=256).to(torch.bfloat16)
    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    demo = build_demo(target, tokenizer, draft)
    demo.queue().launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        client = Client(demo.local_url, verbose=False)
        plain, dspark_html, _, _, stats, _ = client.predict(
            "hello there", False, 0.7, 16, 4, "fixed", True, False, "float32", api_name="/compare"
        )
        with pytest.raises(Exception, match=r"not in the list of choices: \['bfloat16', 'float32'\]"):
            client.predict("hello there", False, 0.7, 16, 4, "fixed", True, False, "float16", api_name="/compare")
    finally:
        demo.close()
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello there"}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    exact = torch.nn.Module.to(__import__("copy").deepcopy(target), torch.float32)
    expected = tokenizer.decode(
        exact.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :], skip_special_tokens=True
    )
    assert plain == expected and _text(dspark_html) == expected
    assert stats.startswith("### Identical to plain greedy, token for token (float32)\n")
    assert target.dtype == torch.bfloat16 and draft.dtype == torch.bfloat16


def test_api_errors_are_messages_not_traces(running_demo):
    from gradio_client import Client

    demo, *_ = running_demo
    client = Client(demo.local_url, verbose=False)
    with pytest.raises(Exception, match="Please enter a prompt"):
        client.predict("   ", False, 0.7, 16, 4, "fixed", True, False, "float32", api_name="/compare")
    with pytest.raises(Exception, match="exceeds the target's context of 256 tokens"):
        client.predict("x" * 30, False, 0.7, 512, 4, "fixed", True, False, "float32", api_name="/compare")


def test_browser_types_a_prompt_and_sees_both_outputs(running_demo, tmp_path):
    """A person's path through the page, in headless Debian Chromium driven by Playwright (no browser download)."""
    from playwright.sync_api import sync_playwright

    demo, *_ = running_demo
    flags = [
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost",
    ]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=flags)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(demo.local_url)
        # at rest: both panes labelled, the legend and the waiting text shown, example prompts offered
        page.get_by_text("DSpark's output appears here").first.wait_for(timeout=30_000)
        assert page.locator("#plain-speed").inner_text().startswith("plain")
        assert page.locator("#dspark-speed").inner_text().startswith("DSpark")
        legend = page.locator("#legend").inner_text()
        assert "drafted by DSpark" in legend and "looked up" in legend and "target's own token" in legend
        page.get_by_text("Repeat this sentence three times").first.click()  # an example fills the prompt
        page.wait_for_function(
            "document.querySelector('#prompt textarea').value.startsWith('Repeat this sentence three times')",
            timeout=30_000,
        )
        page.locator("#prompt textarea").fill("")
        page.locator("#generate").click()  # no prompt yet: a visible message, not a stack trace
        page.get_by_text("Please enter a prompt.").first.wait_for(timeout=30_000)
        assert "Traceback" not in page.content()
        page.locator("#prompt textarea").fill("hello there")
        page.locator("#generate").click()
        page.wait_for_function(
            "document.querySelector('#stats') && document.querySelector('#stats').innerText.includes('speedup')",
            timeout=60_000,
        )
        plain = page.locator("#plain textarea").input_value()
        dspark = page.locator("#dspark").inner_text()
        stats = page.locator("#stats").inner_text()
        speeds = page.locator("#plain-speed").inner_text() + page.locator("#dspark-speed").inner_text()
        page.screenshot(path=str(tmp_path / "demo.png"), full_page=True)
        browser.close()
    assert plain and plain.strip() in dspark.replace("\n", "")
    assert "τ" in stats and speeds.count("tok/s") == 2
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
