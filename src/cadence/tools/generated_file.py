"""The command line of a generator whose output is committed: write it, or `--check`
that the committed copy is what the generator makes now (tests and CI run the check)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def write_or_check(output: Path, text: str, module: str, description: str, argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the committed file instead of writing")
    args = parser.parse_args(argv)
    if args.check:
        if not output.exists() or output.read_text(encoding="utf-8") != text:
            print(f"{output} is stale: run python -m {module}", file=sys.stderr)
            return 1
        return 0
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text, encoding="utf-8")
    return 0
