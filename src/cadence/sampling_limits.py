"""The bounds a sampling value must keep for the engine's sampler to hold it.

The engine checks `SamplingParams` against them and the OpenAI schema checks request
bodies against the same numbers, so a request the server accepts is one the engine
takes. Standard library only: the client SDK imports it through the schema.
"""

from __future__ import annotations

MAX_LOGPROBS = 20
INT64_MAX = 2**63 - 1
# The sampler computes in float32: a larger float64 would become infinity there.
FLOAT32_MAX = 3.4028234663852886e38
