"""Ref-counted KV blocks, a free queue in eviction order, and the prefix-cache map."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockKey:
    """What a cached full block holds: its tokens, chained on the previous block's digest.

    The digest is SHA-256 over the parent's digest and the token ids, so it stands for
    the whole prefix: equal digests mean equal prefixes unless SHA-256 collides. Python's
    own hash would not do, since colliding prompts can be constructed on purpose to read
    another user's KV. A hit is also confirmed on this block's own tokens.
    """

    parent_digest: bytes | None
    token_ids: tuple[int, ...]
    # Where a token's K/V depends on which tokens were the prompt's (an engine that runs
    # prompt rows on kernels of their own), a block that holds generated tokens says how
    # many of its tokens were the prompt's; None where that does not matter.
    prompt_tokens: int | None = None
    digest: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        payload = (self.parent_digest or b"") + array("q", self.token_ids).tobytes()
        if self.prompt_tokens is not None:
            payload += b"prompt" + array("q", [self.prompt_tokens]).tobytes()
        object.__setattr__(self, "digest", hashlib.sha256(payload).digest())


class BlockPool:
    """All KV blocks of the cache, by id.

    A block with refcount 0 sits in the free queue, least recently freed first. If it
    still holds a cached prefix it stays findable through the hash map until it is
    handed out again, which is what makes freed prefixes reusable.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[bytes, int] = {}  # block digest -> block id
        self.block_keys: list[BlockKey | None] = [None] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """The fraction of blocks that requests hold."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the head of the free queue, evicting their cache entries."""
        if count > len(self.free_queue):
            raise RuntimeError(f"asked for {count} blocks with {len(self.free_queue)} free")
        block_ids = []
        for _ in range(count):
            block_id, _ = self.free_queue.popitem(last=False)
            self._uncache(block_id)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take another reference to blocks that may be in use or sitting free."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; blocks that reach 0 join the tail of the free queue."""
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_queue[block_id] = None
            elif self.ref_counts[block_id] < 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")

    def lookup(self, key: BlockKey) -> int | None:
        """The block holding exactly `key`, if one is cached."""
        block_id = self.cached_blocks.get(key.digest)
        if block_id is None or self.block_keys[block_id] != key:
            return None
        return block_id

    def cache(self, block_id: int, key: BlockKey) -> None:
        """Register a full block for prefix reuse; the first block with a key keeps it."""
        if self.block_keys[block_id] is not None:
            return
        self.block_keys[block_id] = key
        self.cached_blocks.setdefault(key.digest, block_id)

    def _uncache(self, block_id: int) -> None:
        key = self.block_keys[block_id]
        if key is None:
            return
        self.block_keys[block_id] = None
        if self.cached_blocks.get(key.digest) == block_id:
            del self.cached_blocks[key.digest]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use keep their contents)."""
        self.cached_blocks.clear()
        self.block_keys = [None] * self.num_blocks

    def check_integrity(self, expected_ref_counts: dict[int, int]) -> None:
        """Assert the pool agrees with the block tables that reference it.

        `expected_ref_counts` maps block id to how many block tables hold it.
        """
        for block_id in range(self.num_blocks):
            expected = expected_ref_counts.get(block_id, 0)
            actual = self.ref_counts[block_id]
            assert actual == expected, f"block {block_id}: refcount {actual}, tables hold {expected}"
            assert (block_id in self.free_queue) == (actual == 0), (
                f"block {block_id}: refcount {actual} but in free queue: {block_id in self.free_queue}"
            )
        for digest, block_id in self.cached_blocks.items():
            key = self.block_keys[block_id]
            assert key is not None and key.digest == digest, f"cache entry for block {block_id} is stale"
