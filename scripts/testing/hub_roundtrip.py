"""Run in a subprocess by test_hub.py with HF_ENDPOINT pointing at the loopback Hub (huggingface_hub reads its
endpoint at import): push a draft with the CLI and with push_to_hub, pull both back, generate, compare."""

import json
import sys
from pathlib import Path

import torch

from hf_dspark import DSparkDraftModel
from hf_dspark.cli import main
from hf_dspark.testing import char_tokenizer, tiny_target

work = Path(sys.argv[1])
target = tiny_target("llama")
draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
draft.save_pretrained(work / "draft")
main(["push", "--draft", str(work / "draft"), "--repo", "hf-dspark-test/tiny-draft", "--target-id", "tiny-llama"])
draft.push_to_hub("hf-dspark-test/tiny-draft-2")

pulled = DSparkDraftModel.from_pretrained("hf-dspark-test/tiny-draft")
pulled2 = DSparkDraftModel.from_pretrained("hf-dspark-test/tiny-draft-2")
ids = torch.tensor([[5, 9, 14, 3]])
kw = dict(max_new_tokens=12, do_sample=False)
ref = target.generate(ids, assistant_model=draft, **kw).tolist()
result = {
    "same_output": target.generate(ids, assistant_model=pulled, **kw).tolist() == ref,
    "same_output_2": target.generate(ids, assistant_model=pulled2, **kw).tolist() == ref,
    "same_weights": all(
        torch.equal(a, b) for a, b in zip(draft.state_dict().values(), pulled.state_dict().values(), strict=True)
    ),
}
(work / "result.json").write_text(json.dumps(result))

# the Hub route: the pushed repos carry custom_generate/, which loads the draft from the same repo
for repo in ("hf-dspark-test/tiny-draft", "hf-dspark-test/tiny-draft-2"):
    out = target.generate(ids, custom_generate=repo, trust_remote_code=True, **kw)
    result[f"custom_generate {repo}"] = out.tolist() == ref
# from_pretrained's download options reach the layout probe: a cache_dir, then that cache alone
cache = work / "cache"
DSparkDraftModel.from_pretrained("hf-dspark-test/tiny-draft", cache_dir=cache, revision="main")
offline = DSparkDraftModel.from_pretrained("hf-dspark-test/tiny-draft", cache_dir=cache, local_files_only=True)
result["offline_from_cache_dir"] = target.generate(ids, assistant_model=offline, **kw).tolist() == ref
try:
    DSparkDraftModel.from_pretrained("hf-dspark-test/tiny-draft", cache_dir=work / "empty", local_files_only=True)
    result["empty_cache_refused"] = False
except OSError:
    result["empty_cache_refused"] = True
(work / "result.json").write_text(json.dumps(result))
# stop strings through the Hub route: its generate.py turns them into a criterion (callables get no tokenizer)

tokenizer = char_tokenizer()
prompt = tokenizer("hello there", return_tensors="pt")["input_ids"]
stop = tokenizer.decode(target.generate(prompt, max_new_tokens=30, do_sample=False)[0, prompt.shape[1] :])[10:12]
plain = target.generate(prompt, max_new_tokens=30, do_sample=False, stop_strings=[stop], tokenizer=tokenizer)
hub = target.generate(
    prompt,
    max_new_tokens=30,
    do_sample=False,
    stop_strings=[stop],
    tokenizer=tokenizer,
    custom_generate="hf-dspark-test/tiny-draft",
    trust_remote_code=True,
)
result["hub_stop_strings"] = hub.tolist() == plain.tolist() and plain.shape[1] < prompt.shape[1] + 30
(work / "result.json").write_text(json.dumps(result))
