"""The Hub route: a draft's repository that also carries ``custom_generate/generate.py``, so that

    target.generate(**inputs, custom_generate="<draft repo id>", trust_remote_code=True)

loads the draft from that same repository and runs DSpark decoding. ``hf-dspark push`` and
``DSparkDraftModel.push_to_hub`` write these files; the code they write only calls this package's public API.
"""

from __future__ import annotations

from pathlib import Path

FOLDER = "custom_generate"

_TEMPLATE = '''"""DSpark speculative decoding with the draft in this repository (hf-dspark).

    target.generate(**inputs, custom_generate="{repo}", trust_remote_code=True, max_new_tokens=128)

loads the draft from {repo} once per target model and decodes with it, losslessly. Pass ``draft=`` to use another
DSparkDraftModel, and hf-dspark's per-call settings (``verify_mode=``, ``verify_limit=``, ...) as keywords.
"""

import weakref

from transformers import StoppingCriteriaList, StopStringCriteria

import hf_dspark
from hf_dspark import DSparkDraftModel

DRAFT_REPO = {repo!r}
_drafts = weakref.WeakKeyDictionary()  # target model -> its draft, loaded on first use


def generate(model, draft=None, **kwargs):
    if draft is None:
        draft = _drafts.get(model)
        if draft is None:
            draft = DSparkDraftModel.from_pretrained(DRAFT_REPO, dtype=model.dtype).to(model.device).attach(model)
            _drafts[model] = draft
    kwargs = {{k: v for k, v in kwargs.items() if not (k == "assistant_model" and v is None)}}
    # generate hands a custom_generate callable no tokenizer, so stop strings travel as a criterion
    stops, tokenizer = kwargs.pop("stop_strings", None), kwargs.pop("tokenizer", None)
    if stops:
        if tokenizer is None:
            raise ValueError("stop_strings need tokenizer= (the target's tokenizer)")
        stops = [stops] if isinstance(stops, str) else list(stops)
        criteria = StoppingCriteriaList(kwargs.pop("stopping_criteria", None) or [])
        kwargs["stopping_criteria"] = StoppingCriteriaList([*criteria, StopStringCriteria(tokenizer, stops)])
    return model.generate(custom_generate=hf_dspark.dspark_generate, draft=draft, **kwargs)
'''


def write_custom_generate(folder: str | Path, repo_id: str) -> Path:
    """Write ``custom_generate/generate.py`` and ``requirements.txt`` for ``repo_id`` into ``folder``; returns the
    ``custom_generate`` folder."""
    out = Path(folder) / FOLDER
    out.mkdir(parents=True, exist_ok=True)
    (out / "generate.py").write_text(_TEMPLATE.format(repo=repo_id))
    (out / "requirements.txt").write_text("hf-dspark\n")
    return out
