"""What the benches take from tests/: the fixed evaluation text, perplexity, the server harness
and the synthetic streaming server.

The benches run as scripts (``python bench/<name>.py``, or ``python <name>.py`` in bench/),
which puts bench/ on sys.path but not the repository root, where the package `tests` lives:
the root is appended here, in this one place. Appended, not put first, so that none of the
root's folders hides an installed package.
"""

from __future__ import annotations

import os
import sys

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.support.quant_eval import EVAL_TEXT, perplexity
from tests.support.server_harness import ServerProcess
from tests.support.synthetic_server import SyntheticServerProcess

__all__ = ["EVAL_TEXT", "ServerProcess", "SyntheticServerProcess", "perplexity"]
