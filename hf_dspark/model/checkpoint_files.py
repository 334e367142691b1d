"""The files of a draft checkpoint, found and read with errors that name the path and the file at fault.

    checkpoint_folder   a local folder, or a Hub repo fetched into the cache ( config + safetensors files only)
    read_config         config.json as a dict
    check_weight_files  every safetensors file of the folder opens (a truncated download is named, not deserialised)

Every checkpoint layout goes through these before its own loader, so a user who mistypes a path, points at the
wrong folder or holds a half-downloaded file reads which path and which file, not a message from deep inside
``huggingface_hub``, ``json`` or ``safetensors``.
"""

from __future__ import annotations

import json
from pathlib import Path

# from_pretrained's download options, honoured by the layout probe as transformers honours them
HUB_DOWNLOAD_KWARGS = ("revision", "token", "cache_dir", "local_files_only", "force_download", "proxies")


def looks_like_path(name: str) -> bool:
    """A name no Hub repo id can be: absolute, relative to the current or home folder, or with more than one '/'."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name


def checkpoint_folder(name_or_path, kwargs: dict | None = None) -> Path:
    """The local folder holding the checkpoint ``name_or_path`` (its ``subfolder`` kwarg applied).

    A local folder is used as it is. Anything else is a Hub repo id, fetched (``*.json`` and ``*.safetensors``) with
    the download options in ``kwargs``. Raises ``FileNotFoundError`` naming the path when it is a file, a missing
    path or a repo that could not be fetched."""
    kwargs = kwargs or {}
    subfolder = kwargs.get("subfolder") or ""
    name = str(name_or_path)
    folder = Path(name).expanduser()
    if folder.is_file():
        raise FileNotFoundError(f"{name} is a file: a draft checkpoint is a folder (config.json + model.safetensors)")
    if not folder.is_dir():
        if looks_like_path(name):
            raise FileNotFoundError(f"{name}: no such folder (a draft checkpoint is a folder or a Hub repo id)")
        from huggingface_hub import snapshot_download

        hub = {k: kwargs[k] for k in HUB_DOWNLOAD_KWARGS if kwargs.get(k) is not None}
        where = f"{subfolder}/" if subfolder else ""
        try:
            folder = Path(snapshot_download(name, allow_patterns=[f"{where}*.json", f"{where}*.safetensors"], **hub))
        except Exception as e:  # offline, unknown repo, invalid id, gated: one message naming both readings
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise FileNotFoundError(
                f"{name}: no local folder of that name, and no Hub repo could be fetched under it "
                f"({type(e).__name__}: {first})"
            ) from e
    folder = folder / subfolder
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder}: no such folder (subfolder={subfolder!r})")
    return folder


def read_config(folder: Path) -> dict:
    """``folder/config.json`` as a dict. ``FileNotFoundError`` when it is missing, ``ValueError`` naming the file
    and the place when it is not a JSON object."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} has no config.json: not a saved draft (a draft folder holds config.json and model.safetensors)"
        )
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}): the file is damaged or not a model config") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{path} holds a JSON {type(raw).__name__}, not an object: not a model config")
    return raw


def check_weight_files(folder: Path) -> list[Path]:
    """The safetensors files of ``folder`` (the one file, or those its index names), each checked to open.

    ``FileNotFoundError`` naming the folder or the file when one is missing; ``ValueError`` naming the file when
    safetensors cannot read its header or its data is cut short (an interrupted download or copy)."""
    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a safetensors index (a 'weight_map' of tensor -> file): {e}") from e
        files = [folder / n for n in names]
    else:
        files = [folder / "model.safetensors"]
        if not files[0].is_file():
            raise FileNotFoundError(f"{folder} has no model.safetensors (nor model.safetensors.index.json)")
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f} is missing (named by {index.name})")
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError for unreadable files)
            raise ValueError(f"{f} is not a readable safetensors file ({e}): re-save or re-download it") from e
    return files
