"""The Gradio demo, driven through its API with gradio_client (a tiny target, offline, on 127.0.0.1)."""

import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import pytest
import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.testing import char_tokenizer, tiny_target


@pytest.fixture(scope="module")
def running_demo():
    from demo.app import build_demo

    target = tiny_target("llama", vocab_size=96, eos_token_id=1, max_position_embeddings=256)
    tokenizer = char_tokenizer()
    torch.manual_seed(0)
    draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
    demo = build_demo(target, tokenizer, draft)
    demo.queue().launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    yield demo, target, tokenizer, draft
    demo.close()


def test_api_compare_gives_identical_outputs_and_speed_figures(running_demo):
    from gradio_client import Client

    demo, target, tokenizer, draft = running_demo
    saved = draft.config.to_dict()
    assert demo.local_url.startswith("http://127.0.0.1:")
    client = Client(demo.local_url, verbose=False)
    plain, dspark_html, stats, chart = client.predict(
        "hello there", False, 0.7, 16, 4, "fixed", True, False, api_name="/compare"
    )
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hello there"}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    expected = tokenizer.decode(
        target.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :], skip_special_tokens=True
    )
    assert plain == expected
    assert "background:#c8f7c5" in dspark_html or "background:#ffd8a8" in dspark_html
    import html
    import re

    assert html.unescape(re.sub(r"<[^>]+>", "", dspark_html)) == expected  # same text, coloured by round
    assert "tok/s" in stats and "speedup" in stats and "τ" in stats
    assert stats.endswith("identical to plain greedy")  # greedy in float32: compared, and equal
    assert chart["columns"] == ["position", "acceptance"]
    assert [row[0] for row in chart["data"]] == ["1", "2", "3", "4"]
    assert all(0.0 <= row[1] <= 1.0 for row in chart["data"])
    # with the sequential head switched off the output is still the target's
    plain_off, dspark_off, _, _ = client.predict(
        "hello there", False, 0.7, 16, 4, "fixed", False, False, api_name="/compare"
    )
    assert plain_off == expected and html.unescape(re.sub(r"<[^>]+>", "", dspark_off)) == expected
    assert "looked up" not in stats
    # with lookup drafting on (the prompt repeats, so some rounds look up) the output is still the target's
    repeating = "abc abc abc abc abc"
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": repeating}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    expected = tokenizer.decode(
        target.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :], skip_special_tokens=True
    )
    plain_lk, dspark_lk, stats_lk, _ = client.predict(
        repeating, False, 0.7, 16, 4, "fixed", True, True, api_name="/compare"
    )
    assert plain_lk == expected and html.unescape(re.sub(r"<[^>]+>", "", dspark_lk)) == expected
    looked = int(stats_lk.split(" looked up")[0].rsplit("(", 1)[1])
    assert draft.config.to_dict() == saved  # every request's settings were its own
    assert 0 < looked <= int(stats_lk.split(" rounds")[0].rsplit(" ", 1)[1])


def test_api_errors_are_messages_not_traces(running_demo):
    from gradio_client import Client

    demo, *_ = running_demo
    client = Client(demo.local_url, verbose=False)
    with pytest.raises(Exception, match="Please enter a prompt"):
        client.predict("   ", False, 0.7, 16, 4, "fixed", True, False, api_name="/compare")
    with pytest.raises(Exception, match="exceeds the target's context of 256 tokens"):
        client.predict("x" * 30, False, 0.7, 512, 4, "fixed", True, False, api_name="/compare")


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
        page.screenshot(path=str(tmp_path / "demo.png"), full_page=True)
        browser.close()
    assert plain and plain.strip() in dspark.replace("\n", "")
    assert "tok/s" in stats and "τ" in stats
    assert (tmp_path / "demo.png").read_bytes()[:4] == b"\x89PNG"
