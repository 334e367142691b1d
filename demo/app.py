"""Gradio demo: the same prompt through plain `generate` and through DSpark, side by side.

    hf-dspark demo                           # embedded SmolLM2-135M-Instruct + the shipped draft, offline
    hf-dspark demo --target DIR --draft DIR [--host 127.0.0.1] [--port 7860]
    python -m demo.app ...                   # the same, from a checkout

Both panes are labelled and stream with their own tokens/s. The DSpark pane colours each token by who wrote it:
drafted by the draft and accepted, looked up from the text and accepted (lookup drafting), or the target's own
token (the correction after a rejection, or the bonus after a fully accepted block); a legend says so on the page.
The defaults are the settings the benchmarks found fastest (scheduled verification with lookup drafting).

The demo opens in float32 (``--dtype float32``, the default): its promise is DSpark's output token for token
plain greedy's, and float32 keeps it while bfloat16 does not (a multi-token verify rounds differently from a
one-token step, so a near-tie can flip). The choice was measured on the first example prompt as the page runs it
(benchmarks/results/demo_precision/): on this project's 2-core CPU without bf16 units float32 gave 1.43× (τ 2.95,
identical) against bfloat16's 0.76× (τ 1.72, parted at a near-tie), float32 was the faster on 3 of the 4 examples
and bfloat16 parted from plain greedy on 3 of 4; on a CPU with bf16 units an earlier run gave float32 1.30× against
1.22× on the first example. ``--dtype bfloat16`` (or ``auto``: bfloat16 where the CPU has bf16 units) is there for
speed; its summary then says where and why an output parts from plain greedy, with both candidates' logits, judged
by the rule `hf-dspark bench` applies (:mod:`hf_dspark.evaluation.ties`), and the page's precision switch runs the
same request on a float32 copy of both models, made on first use.
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import os
import time
from threading import Lock, Thread

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr
import torch
from transformers import TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.cli_arguments import host, port
from hf_dspark.evaluation.bench import warm_up
from hf_dspark.evaluation.ties import first_divergence, upcast_copy

DRAFTED, LOOKED_UP, TARGET = "#c8f7c5", "#cfe2ff", "#ffd8a8"
LEGEND = (
    ("drafted by DSpark, accepted by the target", DRAFTED),
    ("looked up from the text, accepted", LOOKED_UP),
    ("the target's own token (correction or bonus)", TARGET),
)
# Prompts where DSpark shines (code and arithmetic the draft predicts well, text that repeats the prompt, which
# lookup drafting copies) and where it does not (open-ended chat, where the draft is accepted least often).
EXAMPLES = [
    "Write a Python function that checks whether a number is prime.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May? Please reason step by step.",
    "Repeat this sentence three times, each on its own line: The quick brown fox jumps over the lazy dog.",
    "Write a short, original poem about a lighthouse keeper who collects lost umbrellas.",
]
PANE = '<div class="dspark-pane" style="white-space:pre-wrap;font-family:monospace;min-height:14em">{}</div>'
WAITING = '<span style="color:#888">DSpark\'s output appears here, coloured as the legend says.</span>'


class RoundRecorder(BaseStreamer):
    """Keeps each round's committed tokens (the first put is the prompt) and forwards them to a text streamer."""

    def __init__(self, forward: BaseStreamer):
        self.rounds: list[list[int]] = []
        self.forward, self.seen_prompt = forward, False

    def put(self, value):
        self.forward.put(value)
        if self.seen_prompt:
            self.rounds.append(value.reshape(-1).tolist())
        self.seen_prompt = True

    def end(self):
        self.forward.end()


PARTED = "outline:2px solid #d00;outline-offset:1px"  # the token where DSpark's greedy output parts from plain's


def coloured(
    tokenizer, rounds: list[list[int]], looked_up: list[bool] | None = None, parted_at: int | None = None
) -> str:
    """HTML of the DSpark output: per round, the accepted proposal (drafted or looked up) then the target's own
    token. ``rounds[0]`` is the prefill's token; ``looked_up[i]`` says whether round i + 1 verified a lookup
    continuation (unknown rounds, while streaming, count as drafted). ``parted_at``: the index of the new token where
    the output parts from plain greedy, outlined in red with the reason one hover away."""
    looked_up = looked_up or []
    parts, index = [], 0
    for i, chunk in enumerate(rounds):
        accepted, own = (chunk[:-1], chunk[-1:]) if i > 0 else ([], chunk)  # round 0 is the prefill token
        proposer = LOOKED_UP if i > 0 and i - 1 < len(looked_up) and looked_up[i - 1] else DRAFTED
        for ids, colour in ((accepted, proposer), (own, TARGET)):
            for piece, parted in _split_at(ids, parted_at - index if parted_at is not None else None):
                text = html.escape(tokenizer.decode(piece, skip_special_tokens=True))
                mark = f";{PARTED}" if parted else ""
                title = ' title="DSpark parts from plain greedy here"' if parted else ""
                parts.append(f'<span style="background:{colour}{mark}"{title}>{text}</span>')
            index += len(ids)
    return PANE.format("".join(parts))


def _split_at(ids: list[int], at: int | None) -> list[tuple[list[int], bool]]:
    """``ids`` as (pieces, whether the piece is the token at index ``at``), empty pieces left out."""
    if at is None or not 0 <= at < len(ids):
        return [(ids, False)] if ids else []
    pieces = [(ids[:at], False), (ids[at : at + 1], True), (ids[at + 1 :], False)]
    return [(p, parted) for p, parted in pieces if p]


def verdict(found, dtype: torch.dtype, tokenizer) -> str:
    """The headline of a greedy comparison (markdown): identical to plain greedy, or where and why not.
    ``found``: :func:`~hf_dspark.evaluation.ties.first_divergence`'s result (``None``: identical)."""
    name = _dtype_name(dtype)
    if found is None:
        return f"### Identical to plain greedy, token for token ({name})"
    line = found.describe(tokenizer)
    if dtype in (torch.float32, torch.float64) or not found.tie:
        return f"### Differs from plain greedy, and not at a near-tie: a bug, please report it\n{line}"
    return (
        f"### Parts from plain greedy at new token {found.index} (outlined in red): a {name} near-tie, not a bug\n"
        f"{line}. In {name} a multi-token verify rounds differently from a one-token step, so a near-tie can flip "
        "under any speculative decoder (transformers' prompt lookup too); float32 precision gives token-for-token "
        "identical output."
    )


def legend_html() -> str:
    chips = "".join(
        f'<span style="background:{colour};padding:0 .4em;margin-right:1em">{html.escape(text)}</span>'
        for text, colour in LEGEND
    )
    # the plain pane in the same monospace as DSpark's, so the two outputs line up for the eye
    style = "<style>#plain textarea{font-family:monospace}</style>"
    return f'{style}<div id="legend" style="font-size:.9em">{chips}</div>'


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def float32_pair(target, draft: DSparkDraftModel):
    """A float32 copy of the target and of the draft (same weights, upcast), the draft attached to the copy."""
    target32 = upcast_copy(target)
    draft32 = type(draft)(draft.config).to(torch.float32)
    draft32.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in draft.state_dict().items()})
    draft32.head_enabled = draft.head_enabled
    draft32.decoding = dataclasses.replace(draft.decoding)
    return target32, draft32.attach(target32)


def build_demo(target, tokenizer, draft: DSparkDraftModel) -> gr.Blocks:
    """The Blocks app for one target/draft pair. API name of the comparison: ``/compare``."""
    max_context = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    lookup_n = draft.decoding.lookup_max_ngram or 3  # what the lookup checkbox turns on: the draft's own N, or 3
    loaded = _dtype_name(target.dtype)
    precisions = [loaded] if loaded == "float32" else [loaded, "float32"]
    pairs = {loaded: (target, draft)}  # precision -> (target, draft); the float32 copy is made on first use
    pairs_lock = Lock()

    def pair_for(precision: str):
        with pairs_lock:
            if precision not in pairs:
                target32, draft32 = float32_pair(target, draft)
                warm(target32, tokenizer, draft32)
                pairs[precision] = (target32, draft32)
            return pairs[precision]

    def divergence(model, ids, out, reference):
        """Where the DSpark output first parts from plain greedy's (greedy runs only; ``None``: identical)."""
        exact = None if model.dtype in (torch.float32, torch.float64) else pair_for("float32")[0]
        return first_divergence(model, out, reference, exact, prompt_len=ids.shape[1])

    def stream(model, ids, gen_kwargs, dspark=None, settings=None):
        text_streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        recorder = RoundRecorder(text_streamer)
        kwargs = dict(gen_kwargs, streamer=recorder)
        if dspark is not None:  # this request's own settings: the shared draft's config is never changed
            kwargs.update(settings, custom_generate=dspark_generate, draft=dspark, return_dict_in_generate=True)
        result = {}

        def run():
            t0 = time.perf_counter()
            try:
                out = model.generate(ids, **kwargs)
                result["out"], result["stats"] = (out.sequences, out.dspark_stats) if dspark else (out, None)
            except Exception as e:  # shown on the page, not lost in the thread
                result["error"] = e
                text_streamer.end()
            result["seconds"] = time.perf_counter() - t0

        thread = Thread(target=run)
        thread.start()
        return text_streamer, recorder, thread, result

    def speed(name: str, n: int, seconds: float, done: bool) -> str:
        rate = n / max(seconds, 1e-6)
        return f"**{name}** · {n} tokens · **{rate:.1f} tok/s**" + ("" if done else " · generating…")

    def compare(prompt, sampling, temperature, max_new_tokens, gamma, mode, head_on=True, lookup=True,
                precision=loaded):  # fmt: skip
        if not prompt or not prompt.strip():
            raise gr.Error("Please enter a prompt.")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
        )["input_ids"]
        if max_context is not None and ids.shape[1] + int(max_new_tokens) > max_context:
            raise gr.Error(
                f"The prompt is {ids.shape[1]} tokens; with {int(max_new_tokens)} new tokens it exceeds the "
                f"target's context of {max_context} tokens."
            )
        if precision != loaded:
            yield "", PANE.format(WAITING), "", "", f"preparing the {precision} copy of both models (once)…", None
        model, dspark = pair_for(precision)
        gen = dict(max_new_tokens=int(max_new_tokens), do_sample=bool(sampling))
        if sampling:
            gen["temperature"] = float(temperature)
        settings = dict(verify_mode=mode, verify_limit=int(gamma), lookup_max_ngram=lookup_n if lookup else 0)
        dspark.head_enabled = bool(head_on)  # an ablation switch on the draft itself (not a per-call setting)
        plain_text, plain_speed = "", ""

        # plain first, then DSpark: run one at a time so the speed figures don't fight over the CPU
        t0 = time.perf_counter()
        streamer, recorder, thread, plain = stream(model, ids, gen)
        for piece in streamer:
            plain_text += piece
            n = sum(len(r) for r in recorder.rounds)
            plain_speed = speed("plain", n, time.perf_counter() - t0, False)
            yield plain_text, PANE.format(WAITING), plain_speed, "", "", None
        thread.join()
        if "error" in plain:
            raise gr.Error(f"plain generate failed: {plain['error']}")
        n_plain = plain["out"].shape[1] - ids.shape[1]
        plain_speed = speed("plain", n_plain, plain["seconds"], True)
        t0 = time.perf_counter()
        streamer, recorder, thread, fast = stream(model, ids, gen, dspark, settings)
        for _ in streamer:
            n = sum(len(r) for r in recorder.rounds)
            live = dspark.stats.looked_up  # the running call's (requests are served one at a time)
            fast_speed = speed("DSpark", n, time.perf_counter() - t0, False)
            yield plain_text, coloured(tokenizer, recorder.rounds, live), plain_speed, fast_speed, "", None
        thread.join()
        if "error" in fast:
            raise gr.Error(f"DSpark generate failed: {fast['error']}")
        n_fast = fast["out"].shape[1] - ids.shape[1]
        stats = fast["stats"]
        found = None if sampling else divergence(model, ids, fast["out"], plain["out"])
        headline = (
            f"### Sampled (T = {float(temperature):g}): each output is a draw from the target's distribution\n"
            if sampling
            else verdict(found, model.dtype, tokenizer) + "\n\n"
        )
        summary = headline + (
            f"**speedup** {plain['seconds'] / fast['seconds'] * n_fast / max(n_plain, 1):.2f}× · "
            f"**τ** {stats.tau:.2f} tokens/round over {stats.rounds} rounds"
            + (f" ({sum(stats.looked_up)} looked up)" if lookup else "")
        )
        acc = stats.position_acceptance()
        chart = {
            "position": [str(k + 1) for k in range(len(acc))],
            "acceptance": [0.0 if a is None else a for a in acc],
        }
        import pandas as pd

        final = coloured(tokenizer, recorder.rounds, stats.looked_up, found.index if found is not None else None)
        yield (
            plain_text,
            final,
            plain_speed,
            speed("DSpark", n_fast, fast["seconds"], True),
            summary,
            pd.DataFrame(chart),
        )

    modes = ["fixed"] + (["threshold", "scheduled", "async"] if draft.confidence is not None else [])
    fastest_mode = "scheduled" if "scheduled" in modes else "fixed"  # the benchmarks' fastest (docs/results.md)
    with gr.Blocks(title="hf-dspark: DSpark vs plain generate") as demo:
        gr.Markdown(
            "# DSpark speculative decoding vs plain `generate`\n"
            "The same target answers the same prompt twice: once token by token, once with a DSpark draft proposing "
            "blocks that the target verifies. The output distribution is the target's either way."
            + ("" if loaded != "float32" else " Both run in float32, so greedy outputs are the same tokens, not just "
               "the same distribution (bfloat16 can flip a near-tie of the logits).")
        )  # fmt: skip
        prompt = gr.Textbox(label="Prompt", lines=3, elem_id="prompt")
        gr.Examples(EXAMPLES, inputs=[prompt], label="Example prompts (code, math, repetition, open-ended chat)")
        with gr.Row():
            sampling = gr.Checkbox(label="sample (else greedy)", value=False)
            temperature = gr.Slider(0.1, 2.0, value=0.7, label="temperature")
            max_new = gr.Slider(8, 512, value=128, step=8, label="max new tokens")
            gamma = gr.Slider(1, draft.config.num_draft_tokens, value=draft.config.num_draft_tokens, step=1,
                              label="γ (max draft tokens verified)")  # fmt: skip
            mode = gr.Dropdown(modes, value=fastest_mode, label="verify mode")
            head_on = gr.Checkbox(label="sequential head", value=draft.sequential_head is not None,
                                  interactive=draft.sequential_head is not None)  # fmt: skip
            lookup = gr.Checkbox(label="lookup drafting (verify repeats of the text)", value=True)
            precision = gr.Radio(precisions, value=loaded, label="precision (float32: identical to plain greedy)",
                                 interactive=len(precisions) > 1, elem_id="precision")  # fmt: skip
        button = gr.Button("Generate", variant="primary", elem_id="generate")
        with gr.Row(equal_height=True):
            with gr.Column():
                gr.Markdown("### plain `generate`")
                plain_speed = gr.Markdown("**plain** · waiting", elem_id="plain-speed")
                plain_out = gr.Textbox(show_label=False, lines=12, elem_id="plain",
                                       placeholder="plain generate's output appears here")  # fmt: skip
            with gr.Column():
                gr.Markdown("### DSpark")
                dspark_speed = gr.Markdown("**DSpark** · waiting", elem_id="dspark-speed")
                gr.HTML(legend_html())
                dspark_out = gr.HTML(PANE.format(WAITING), elem_id="dspark")
        stats = gr.Markdown(elem_id="stats")
        chart = gr.BarPlot(x="position", y="acceptance", title="acceptance by block position (last run)",
                           y_lim=[0, 1])  # fmt: skip
        button.click(compare, [prompt, sampling, temperature, max_new, gamma, mode, head_on, lookup, precision],
                     [plain_out, dspark_out, plain_speed, dspark_speed, stats, chart], api_name="compare")  # fmt: skip
    return demo


def load_pair(target_spec: str, draft_spec: str | None, dtype: str = "float32"):
    """(target, tokenizer, draft): the embedded default, or folders/Hub ids; ``dtype`` as in ``--dtype``."""
    from hf_dspark import embedded
    from hf_dspark.cli import load_target

    target, tokenizer = load_target(target_spec, dtype)
    if draft_spec is not None:
        draft = DSparkDraftModel.from_pretrained(draft_spec, dtype=target.dtype).attach(target)
    elif target_spec == "embedded" and embedded.has_shipped_draft():
        draft = DSparkDraftModel.from_pretrained(embedded.DRAFT_DIR, dtype=target.dtype).attach(target)
    else:
        print("NOTE: no trained draft given or shipped: using an UNTRAINED draft (lossless, but slow).")
        torch.manual_seed(0)
        draft = DSparkDraftModel.from_target(target, block_size=8)
    return target, tokenizer, draft


def warm(target, tokenizer, draft: DSparkDraftModel) -> None:
    """Pay the one-time costs now (SPS profile, the draft's cost, first calls), not inside the first request."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                        return_tensors="pt")["input_ids"]  # fmt: skip
    how, profile_s, first_s = warm_up(target, draft, ids)
    print(f"one-time costs: SPS profile and draft cost {how} in {profile_s:.1f} s, first calls {first_s:.1f} s")


def serve(target: str = "embedded", draft: str | None = None, dtype: str = "float32", host: str = "127.0.0.1",
          port: int = 7860) -> None:  # fmt: skip
    """Load the pair, pay the one-time costs, and serve the page until interrupted."""
    pair = load_pair(target, draft, dtype)
    warm(*pair)
    build_demo(*pair).queue().launch(server_name=host, server_port=port)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m demo.app", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--target", default="embedded", help="'embedded' (SmolLM2), a Hub id or a local folder")
    ap.add_argument("--draft", default=None, help="a draft folder or Hub id (default: the shipped draft)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"],
                    help="float32 (default): DSpark's output token for token plain greedy's; bfloat16 (auto: where the "
                    "CPU has bf16 units) may part at near-ties of the logits, explained in the summary")  # fmt: skip
    ap.add_argument("--host", default="127.0.0.1", type=host, help="address to serve on (0.0.0.0: every interface)")
    ap.add_argument("--port", default=7860, type=port, help="port to serve on")
    args = ap.parse_args(argv)
    serve(args.target, args.draft, args.dtype, args.host, args.port)


if __name__ == "__main__":
    main()
