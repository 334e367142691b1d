"""Retake docs/demo.png: the demo on the embedded default, one prompt, in headless Chromium.

    python scripts/demo_screenshot.py [--example N] [--out docs/demo.png] [--dtype float32]

The page's defaults are used (greedy, 128 new tokens, the draft's block size, scheduled verification with lookup
drafting); the prompt is picked from the page's examples by clicking it, as a visitor would; the one-time costs
are paid before the request, as `hf-dspark demo` does.
"""

import argparse
import os

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from hf_dspark.demo.app import EXAMPLES, build_demo, load_pair, warm

FLAGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1, EXCLUDE localhost"]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--example", type=int, default=0, help="which of the page's example prompts to click")
    ap.add_argument("--out", default="docs/demo.png")
    ap.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    pair = load_pair("embedded", None, args.dtype)
    warm(*pair)
    demo = build_demo(*pair)
    demo.queue().launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=FLAGS)
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(demo.local_url)
            page.get_by_text(EXAMPLES[args.example][:40]).first.click()
            page.wait_for_function("document.querySelector('#prompt textarea').value.length > 0", timeout=30_000)
            page.locator("#generate").click()
            page.wait_for_function(
                "document.querySelector('#stats') && document.querySelector('#stats').innerText.includes('speedup')",
                timeout=300_000,
            )
            page.wait_for_timeout(1500)  # let the bar chart draw
            page.screenshot(path=args.out, full_page=True)
            print(page.locator("#stats").inner_text())
            browser.close()
    finally:
        demo.close()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
