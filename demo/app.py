"""Gradio demo: the same prompt through plain `generate` and through DSpark, side by side.

    python -m demo.app                       # embedded SmolLM2-135M-Instruct + the shipped draft, offline
    python -m demo.app --target DIR --draft DIR [--host 127.0.0.1] [--port 7860]

The DSpark output is coloured by round: green tokens were proposed by the draft and accepted, orange is the
target's own token (the correction after a rejection, or the bonus after a fully accepted block).

``--dtype auto`` (the default, as in ``python -m hf_dspark``) runs bfloat16 on CPUs with native bf16 units. There a
greedy output may part from plain greedy at a near-tie of the target's logits; the summary then says where, with
both candidates' logits, judged by the rule `hf-dspark bench` applies (:mod:`hf_dspark.evaluation.ties`).
"""

from __future__ import annotations

import argparse
import html
import os
import time
from threading import Thread

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import gradio as gr
import torch
from transformers import TextIteratorStreamer
from transformers.generation.streamers import BaseStreamer

from hf_dspark import DSparkDraftModel, dspark_generate
from hf_dspark.evaluation.bench import warm_up
from hf_dspark.evaluation.ties import first_divergence, upcast_copy

ACCEPTED, TARGET = "#c8f7c5", "#ffd8a8"


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


def coloured(tokenizer, rounds: list[list[int]]) -> str:
    """HTML of the DSpark output: accepted draft tokens green, the target's token of each round orange."""
    parts = []
    for i, chunk in enumerate(rounds):
        accepted, own = (chunk[:-1], chunk[-1:]) if i > 0 else ([], chunk)  # round 0 is the prefill token
        for ids, colour in ((accepted, ACCEPTED), (own, TARGET)):
            if ids:
                text = html.escape(tokenizer.decode(ids, skip_special_tokens=True))
                parts.append(f'<span style="background:{colour}">{text}</span>')
    return '<div style="white-space:pre-wrap;font-family:monospace">' + "".join(parts) + "</div>"


def build_demo(target, tokenizer, draft: DSparkDraftModel) -> gr.Blocks:
    """The Blocks app for one target/draft pair. API name of the comparison: ``/compare``."""
    max_context = getattr(target.config.get_text_config(), "max_position_embeddings", None)
    lookup_n = draft.config.lookup_max_ngram or 3  # what the lookup checkbox turns on: the draft's own N if it has one
    exact_copy = {}  # the target's weights in float32, made on the first greedy difference in low precision

    def agreement(ids, out, reference) -> str:
        """How the DSpark output compares with plain greedy's (greedy runs only)."""
        strict = target.dtype in (torch.float32, torch.float64)
        if not strict and "model" not in exact_copy:
            exact_copy["model"] = upcast_copy(target)
        found = first_divergence(target, out, reference, exact_copy.get("model"), prompt_len=ids.shape[1])
        if found is None:
            return "identical to plain greedy"
        line = found.describe(tokenizer)
        if strict or not found.tie:
            return f"**differs from plain greedy, and not at a near-tie: a bug, please report it.** {line}"
        return f"{line} ({str(target.dtype)[6:]} rounds a multi-token verify differently from a one-token step)"

    def stream(ids, gen_kwargs, dspark_settings=None):
        text_streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        recorder = RoundRecorder(text_streamer)
        kwargs = dict(gen_kwargs, streamer=recorder)
        if dspark_settings is not None:  # this request's own settings: the shared draft's config is never changed
            kwargs.update(dspark_settings, custom_generate=dspark_generate, draft=draft, return_dict_in_generate=True)
        result = {}

        def run():
            t0 = time.perf_counter()
            out = target.generate(ids, **kwargs)
            result["out"], result["stats"] = (out.sequences, out.dspark_stats) if dspark_settings else (out, None)
            result["seconds"] = time.perf_counter() - t0

        thread = Thread(target=run)
        thread.start()
        return text_streamer, recorder, thread, result

    def compare(prompt, sampling, temperature, max_new_tokens, gamma, mode, head_on=True, lookup=False):
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
        gen = dict(max_new_tokens=int(max_new_tokens), do_sample=bool(sampling))
        if sampling:
            gen["temperature"] = float(temperature)
        settings = dict(verify_mode=mode, verify_limit=int(gamma), lookup_max_ngram=lookup_n if lookup else 0)
        draft.head_enabled = bool(head_on)  # an ablation switch on the draft itself (not a per-call setting)
        plain_text = dspark_html = ""

        def live(name, recorder, t0):
            n = sum(len(r) for r in recorder.rounds)
            return f"generating ({name}): {n} tokens, {n / max(time.perf_counter() - t0, 1e-6):.1f} tok/s"

        # plain first, then DSpark: run one at a time so the speed figures don't fight over the CPU
        t0 = time.perf_counter()
        streamer, recorder, thread, plain = stream(ids, gen)
        for piece in streamer:
            plain_text += piece
            yield plain_text, dspark_html, live("plain", recorder, t0), None
        thread.join()
        t0 = time.perf_counter()
        streamer, recorder, thread, fast = stream(ids, gen, settings)
        for _ in streamer:
            yield plain_text, coloured(tokenizer, recorder.rounds), live("DSpark", recorder, t0), None
        thread.join()
        n_plain = plain["out"].shape[1] - ids.shape[1]
        n_fast = fast["out"].shape[1] - ids.shape[1]
        stats = fast["stats"]
        summary = (
            f"**plain** {n_plain / plain['seconds']:.1f} tok/s · **DSpark** {n_fast / fast['seconds']:.1f} tok/s · "
            f"**speedup** {plain['seconds'] / fast['seconds'] * n_fast / max(n_plain, 1):.2f}× · "
            f"**τ** {stats.tau:.2f} tokens/round over {stats.rounds} rounds"
            + (f" ({sum(stats.looked_up)} looked up)" if lookup else "")
            + ("" if sampling else f"  \n{agreement(ids, fast['out'], plain['out'])}")
        )
        acc = stats.position_acceptance()
        chart = {
            "position": [str(k + 1) for k in range(len(acc))],
            "acceptance": [0.0 if a is None else a for a in acc],
        }
        import pandas as pd

        yield plain_text, coloured(tokenizer, recorder.rounds), summary, pd.DataFrame(chart)

    with gr.Blocks(title="hf-dspark: DSpark vs plain generate") as demo:
        gr.Markdown("# DSpark speculative decoding vs plain `generate`\nSame target, same output distribution.")
        prompt = gr.Textbox(label="Prompt", lines=3, elem_id="prompt")
        with gr.Row():
            sampling = gr.Checkbox(label="sample (else greedy)", value=False)
            temperature = gr.Slider(0.1, 2.0, value=0.7, label="temperature")
            max_new = gr.Slider(8, 512, value=128, step=8, label="max new tokens")
            gamma = gr.Slider(1, draft.config.num_draft_tokens, value=draft.config.num_draft_tokens, step=1,
                              label="γ (max draft tokens verified)")  # fmt: skip
            modes = ["fixed"] + (["threshold", "scheduled", "async"] if draft.confidence is not None else [])
            mode = gr.Dropdown(modes, value=modes[-2] if len(modes) > 1 else "fixed", label="verify mode")
            head_on = gr.Checkbox(label="sequential head", value=draft.sequential_head is not None,
                                  interactive=draft.sequential_head is not None)  # fmt: skip
            lookup = gr.Checkbox(label="lookup drafting (verify repeats of the text)",
                                 value=draft.config.lookup_max_ngram > 0)  # fmt: skip
        button = gr.Button("Generate", variant="primary", elem_id="generate")
        with gr.Row():
            plain_out = gr.Textbox(label="plain generate", lines=12, elem_id="plain")
            dspark_out = gr.HTML(label="DSpark (green: accepted draft tokens, orange: target's token)",
                                 elem_id="dspark")  # fmt: skip
        stats = gr.Markdown(elem_id="stats")
        chart = gr.BarPlot(x="position", y="acceptance", title="acceptance by block position (last run)",
                           y_lim=[0, 1])  # fmt: skip
        button.click(compare, [prompt, sampling, temperature, max_new, gamma, mode, head_on, lookup],
                     [plain_out, dspark_out, stats, chart], api_name="compare")  # fmt: skip
    return demo


def load_pair(target_spec: str, draft_spec: str | None, dtype: str = "auto"):
    """(target, tokenizer, draft): the embedded default, or folders/Hub ids; ``dtype`` as in ``--dtype``."""
    from hf_dspark import embedded
    from hf_dspark.cli import load_target

    if dtype == "auto":
        dtype = str(embedded.fast_dtype()).replace("torch.", "")
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m demo.app", description=__doc__)
    ap.add_argument("--target", default="embedded")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--dtype", default="auto", choices=["float32", "bfloat16", "auto"],
                    help="auto (default): bfloat16 on CPUs with native bf16 units (faster verify; greedy may part at "
                    "near-ties of the logits, explained in the summary), else float32; float32: bit-identical to "
                    "plain greedy")  # fmt: skip
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=7860)
    args = ap.parse_args(argv)
    target, tokenizer, draft = load_pair(args.target, args.draft, args.dtype)
    warm(target, tokenizer, draft)
    demo = build_demo(target, tokenizer, draft)
    demo.queue().launch(server_name=args.host, server_port=args.port)


if __name__ == "__main__":
    main()
