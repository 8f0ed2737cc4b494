"""A model's files on disk are usable, or one line says which file is not and what to do.

The engine loads weights in its own process, where a truncated safetensors file surfaces
as the library's "incomplete metadata" deep inside a dead engine's traceback, naming no
file. Reading every file's header beforehand (a few kilobytes each) finds a file cut short
or with a mangled header in the process the user started, and names it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from cadence.engine.loader import safetensors_files
from cadence.engine.model_files_error import ModelFilesError

_LENGTH_BYTES = 8  # a safetensors file starts with its header's length, a little-endian u64
_MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit


def check_model_files(path: str) -> None:
    """Raise ModelFilesError for a model path that does not exist, or a safetensors file
    in it that is missing, truncated or has an unreadable header. Reads headers only.

    A folder with no weights at all passes: a router needs only the tokenizer, and the
    loader says what a serving engine misses.
    """
    if not os.path.exists(path):
        raise ModelFilesError(
            f"model {path} does not exist; name an HF folder (config.json, safetensors) or a .gguf file"
        )
    for file in _weight_files(path):
        problem = _safetensors_problem(file)
        if problem is not None:
            raise ModelFilesError(f"{file} {problem}; copy or download the model again")


def _weight_files(path: str) -> list[str]:
    """The files the loader will open; none where the path holds no weights."""
    try:
        return safetensors_files(path)
    except FileNotFoundError:
        return []
    except (ValueError, KeyError, TypeError, AttributeError) as error:  # the shard index
        raise ModelFilesError(
            f"{path}'s model.safetensors.index.json is unreadable ({error}); copy or download the model again"
        ) from error


def _safetensors_problem(file: str) -> str | None:
    """What is wrong with the file's framing, or None: its size must be exactly the header
    plus the end of the last tensor, as the safetensors library requires."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(_LENGTH_BYTES), "little")
            if size < _LENGTH_BYTES or length > size - _LENGTH_BYTES:
                return f"is truncated ({size} bytes, too short for its own header)"
            if length > _MAX_HEADER_BYTES:
                return "has a corrupt header (its length is not plausible)"
            header = json.loads(f.read(length))
    except FileNotFoundError:
        return "is missing (model.safetensors.index.json lists it)"
    except OSError as error:
        return f"cannot be read ({error.strerror})"
    except ValueError:
        return "has a corrupt header (not JSON)"
    end = _data_end(header)
    if end is None:
        return "has a corrupt header (no tensor offsets)"
    expected = _LENGTH_BYTES + length + end
    if size != expected:
        return f"is truncated or corrupt ({size} bytes where its header describes {expected})"
    return None


def _data_end(header: Any) -> int | None:
    """Where the last tensor's bytes end, counted from the end of the header."""
    if not isinstance(header, dict):
        return None
    ends = [0]
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return None
        ends.append(offsets[1])
    return max(ends)
