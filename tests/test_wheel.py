"""The package as a user installs it: a wheel built from this checkout, installed into a fresh environment, used
from an empty folder outside the checkout. It must carry everything its commands read (the card template, the
demo, the shipped draft), and require neither Triton nor matplotlib (extras: the PyTorch path runs without Triton,
and the commands skip their plots without matplotlib)."""

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

DECODE = """
import torch, hf_dspark
from hf_dspark import DSparkDraftModel
from hf_dspark.testing import tiny_target
target = tiny_target("llama", vocab_size=96)
torch.manual_seed(0)
draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8)
ids = torch.tensor([[5, 6, 7, 8]])
plain = target.generate(ids, max_new_tokens=16, do_sample=False)
assert torch.equal(target.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=draft), plain)
print("decoded", hf_dspark.__file__, draft.stats.rounds)
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python, bin folder, wheel path, an empty working folder) of a fresh environment holding the wheel.

    The fresh environment sees this environment's dependencies through a path entry (not its .pth files, so the
    checkout's editable install stays out of it) and has the wheel installed on its own."""
    base = tmp_path_factory.mktemp("wheel")
    # build from a copy of the files a clone has (tracked, or new and not ignored): the build writes its own
    # build/ and egg-info beside the sources, and must neither litter the checkout nor pick up stale files there
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True,
                            check=True).stdout.decode().split("\0")  # fmt: skip
    source = base / "source"
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    dist = base / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                    str(source)], check=True, cwd=base, timeout=600)  # fmt: skip
    wheel = next(dist.glob("hf_dspark-*.whl"))
    env_dir = base / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    python = env_dir / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, timeout=600)  # fmt: skip
    work = base / "empty"
    work.mkdir()
    return python, env_dir / "bin", wheel, work


def run(installed, *argv, timeout=600):
    _, bin_dir, _, work = installed
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    result = subprocess.run(list(argv), cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{argv} failed:\n{result.stdout}\n{result.stderr}"
    run.stderr = result.stderr  # the last command's, for the notes and warnings a test reads
    return result.stdout


def test_the_wheel_carries_what_the_commands_read_and_needs_no_triton_or_matplotlib(installed):
    _, _, wheel, _ = installed
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        metadata = z.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "hf_dspark/model_cards/dspark_draft.md" in names
    assert "hf_dspark/demo/app.py" in names
    assert "hf_dspark/checkpoints/smollm2-135m-instruct-dspark/model.safetensors" in names
    requires = [line.removeprefix("Requires-Dist: ") for line in metadata.splitlines() if line.startswith("Requires")]
    # a CPU-only install needs neither Triton (~1 GB installed, never run on a CPU) nor matplotlib (plots are skipped
    # with a note): both come with extras only
    base = [r for r in requires if "extra ==" not in r]
    assert not [r for r in base if r.startswith(("triton", "matplotlib"))], base
    assert 'triton; sys_platform == "linux" and extra == "kernels"' in requires
    assert 'matplotlib; extra == "plots"' in requires
    assert {"torch>=2.4", "transformers<6,>=5.17"} <= set(base) or {"torch>=2.4", "transformers>=5.17,<6"} <= set(base)


def test_installed_package_runs_from_an_empty_folder(installed, tmp_path_factory):
    python, _, _, work = installed
    where = run(installed, str(python), "-c", "import hf_dspark; print(hf_dspark.__file__)").strip()
    assert where.startswith(str(python.parents[1])), where  # the wheel's copy, not the checkout's
    assert run(installed, "hf-dspark", "--version").startswith("hf-dspark 0.1.0 (transformers ")
    assert "--port PORT" in run(installed, "hf-dspark", "demo", "--help")

    # a tiny Qwen3-style target and draft, saved where a user keeps them
    models = tmp_path_factory.mktemp("models")
    run(
        installed,
        str(python),
        "-c",
        f"""
import torch
from hf_dspark import DSparkDraftModel
from hf_dspark.testing import tiny_target
target = tiny_target("qwen3")
target.save_pretrained({str(models / "target")!r})
draft = DSparkDraftModel.from_target(target, block_size=4, head_rank=8, qk_norm=True, mask_token_id=7)
draft.set_draft_vocab(list(range(0, 96, 2)))
draft.to(torch.bfloat16).save_pretrained({str(models / "draft")!r})
""",
    )
    assert run(installed, "hf-dspark", "card", "--draft", str(models / "draft")).startswith("wrote ")
    assert "# draft" in (models / "draft" / "README.md").read_text()
    target = ["--target", str(models / "target")]
    for fmt in ("speculators", "deepspec"):
        out = models / f"export-{fmt}"
        extra = ["--verifier", "org/tiny-qwen3"] if fmt == "speculators" else []
        printed = run(installed, "hf-dspark", "export", "--format", fmt, "--draft", str(models / "draft"), *target,
                      "--out", str(out), *extra)  # fmt: skip
        assert printed.startswith(f"wrote {out}") and "bfloat16" in printed  # the draft's own dtype
        config = json.loads((out / "config.json").read_text())
        if fmt == "speculators":
            assert config["speculators_config"]["verifier"]["name_or_path"] == "org/tiny-qwen3"
            assert config["draft_vocab_size"] == 48
            assert "warning" not in run.stderr
        else:  # DeepSpec's layout has no draft vocabulary: said, not refused
            assert "note: DeepSpec's layout has no draft vocabulary" in run.stderr
    # without --verifier the local target folder is all it can record: written, with a warning naming the remedy
    run(installed, "hf-dspark", "export", "--draft", str(models / "draft"), *target, "--out", str(models / "local"))
    assert f"warning: the exported config names the verifier '{models / 'target'}', which is a path" in run.stderr
    assert "--verifier ORG/NAME" in run.stderr
    assert "decoded " + str(python.parents[1]) in run(installed, str(python), "-c", DECODE)
    assert sorted(p.name for p in work.iterdir()) == []  # nothing written into the folder it ran from
