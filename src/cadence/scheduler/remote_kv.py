"""Prompt KV that crosses engines: what the scheduler half of the KV connector
(engine/kv_connector/) reserves, asks for and hands back. Pure data and block ids; the
bytes are the worker half's business.

A disaggregated request lives on two engines:

* on the decode engine it is `RemoteKV.LOAD`: admission reserves blocks for its whole
  prompt (adopting prefix-cache hits) and parks it, taking no compute, until a
  `KVLoad` has filled the blocks of every prompt token but the last. The last token is
  computed here, so the first output token is sampled by the same sampler, generator and
  penalties as in a colocated engine;
* on the prefill engine it is `RemoteKV.SEND`: it computes every prompt token but the
  last, samples nothing, and then holds its blocks, read-only, until the reader says it
  is done (`release_sent_kv`).

Blocks that a transfer may still be writing are never freed: a load the runner started
is cancelled first, and its blocks wait for the runner's result.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class RemoteKV(enum.Enum):
    """Which side of a transfer a request is on."""

    LOAD = "load"  # decode engine: the prompt's KV arrives from a prefill engine
    SEND = "send"  # prefill engine: compute the prompt's KV and hold it for a reader


@dataclass(slots=True)
class KVReservation:
    """A decode engine has blocks for a request's prompt.

    The KV of tokens `[num_cached_tokens, num_tokens)` must arrive; when
    `num_cached_tokens >= num_tokens` the prefix cache had it all and the request runs here
    with no transfer.
    """

    request_id: str
    num_cached_tokens: int
    num_tokens: int

    @property
    def needs_transfer(self) -> bool:
        return self.num_cached_tokens < self.num_tokens


@dataclass(slots=True)
class KVPrefilled:
    """A prefill engine computed a request's prompt KV and holds it in `block_ids`
    (block i holds tokens `[i * block_size, (i + 1) * block_size)`)."""

    request_id: str
    block_ids: list[int]
    num_tokens: int


@dataclass(slots=True)
class KVLoad:
    """For the runner: copy the source's `remote_block_ids` into `local_block_ids`."""

    request_id: str
    source: Any  # the transport's description of where the blocks live; opaque here
    remote_block_ids: list[int]
    local_block_ids: list[int]


@dataclass(slots=True)
class KVLoadResult:
    """What became of a `KVLoad`: its first `num_blocks_loaded` blocks arrived whole.

    `error` is None only when every block arrived. Once a result is reported the runner
    no longer writes into the load's blocks.
    """

    request_id: str
    num_blocks_loaded: int
    error: str | None = None


@dataclass(slots=True)
class KVLoadOutcome:
    """How a parked request left its wait: every token loaded, or how far it got."""

    request_id: str
    num_tokens_loaded: int  # counted from position 0, prefix-cache hits included
    num_tokens_wanted: int
    error: str | None

    @property
    def complete(self) -> bool:
        return self.error is None and self.num_tokens_loaded >= self.num_tokens_wanted
