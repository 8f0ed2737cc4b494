"""What the benches take from tests/: the fixed evaluation text, perplexity, the server harness
and the synthetic streaming server.

tests/ is not a package: its helpers are imported by putting the folder on sys.path, in
this one place.
"""

from __future__ import annotations

import os
import sys

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))

from quant_eval import EVAL_TEXT, perplexity
from server_harness import ServerProcess
from synthetic_server import SyntheticServerProcess

__all__ = ["EVAL_TEXT", "ServerProcess", "SyntheticServerProcess", "perplexity"]
