"""The error a user gets for model files on disk they can fix: one line, no traceback."""

from __future__ import annotations

# What a user reads after a problem with the cache: the cache folder is theirs to choose.
CACHE_HINT = "point --download-dir (download_dir= in LLM) at another folder"


class ModelFilesError(OSError):
    """A model's files on disk cannot be used. The message is one line that names the path,
    says what is wrong and what to do; `cadence serve` prints it instead of a traceback."""
