"""Block tables for requests: slot allocation, prefix caching, forking and copy-on-write."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cadence.scheduler.block_pool import BlockKey, BlockPool
from cadence.scheduler.request import Request

BlockCopy = tuple[int, int]  # (source block id, destination block id)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: how many blocks of how many tokens, and prefix reuse."""

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Whether a token's K/V depends on where its request's prompt ends (an engine that runs
    # prompt rows on kernels of their own): then the blocks' keys say (BlockKey.prompt_tokens).
    keys_mark_prompt: bool = False


class KVCacheManager:
    """Owns the block pool and every request's block table.

    The scheduler asks it for room for new tokens; it never hands out a block that is
    shared with another request for writing (copy-on-write), and it never writes into a
    block that the prefix cache serves to others.

    Every in-place swap of a block id (copy-on-write) is noted in the request's
    `replaced_block_indices`, so the step's `SchedulerOutput` can tell the model runner
    (scheduler/output.py). A feature that edits a block table any other way while the
    runner holds the request must note that too.
    """

    def __init__(self, config: CacheConfig) -> None:
        self.block_size = config.block_size
        self.enable_prefix_caching = config.enable_prefix_caching
        self.keys_mark_prompt = config.keys_mark_prompt
        self.pool = BlockPool(config.num_blocks)
        # Prompt tokens of first admissions looked up in the prefix cache, and found there.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def usage(self) -> float:
        return self.pool.usage

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids whose cached KV equals the start of the request's tokens.

        At least one token is always left to compute, since its logits give the next
        token; so a hit covers at most (num_tokens - 1) tokens, in whole blocks.
        """
        if not self.enable_prefix_caching or request.skip_prefix_cache:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for key in self.block_keys(request, max_blocks):
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def count_lookup(self, request: Request, num_cached: int) -> None:
        """Count a request's first admission in the prefix-cache totals (vLLM's queries and
        hits, in tokens); later admissions, after a preemption or a wait for KV, repeat it."""
        if request.prefix_lookup_counted or not self.enable_prefix_caching or request.skip_prefix_cache:
            return
        request.prefix_lookup_counted = True
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_cached

    def block_keys(self, request: Request, num_blocks: int) -> list[BlockKey]:
        """Keys of the request's first `num_blocks` full blocks, computing only new ones."""
        keys, tokens, size = request.block_keys, request.token_ids, self.block_size
        while len(keys) < num_blocks:
            start = len(keys) * size
            prompt = request.num_prompt_tokens - start
            marked = self.keys_mark_prompt and prompt < size
            parent = keys[-1].digest if keys else None
            keys.append(BlockKey(parent, tuple(tokens[start : start + size]), max(prompt, 0) if marked else None))
        return keys[:num_blocks]

    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_prefix: list[int] | None = None
    ) -> list[BlockCopy] | None:
        """Make room for the request's next `num_new_tokens` tokens.

        `cached_prefix` (from `find_cached_prefix`, for a request that holds no blocks
        yet) is adopted first and counts as computed. Returns the block copies that must
        happen before this step writes, or None, changing nothing, when the pool is short.
        """
        cached_prefix = cached_prefix or []
        num_computed = request.num_computed_tokens + len(cached_prefix) * self.block_size
        num_held = len(request.block_ids) + len(cached_prefix)
        num_needed = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - num_held)
        write_block_index = num_computed // self.block_size
        needs_copy = (
            write_block_index < len(request.block_ids)
            and self.pool.ref_counts[request.block_ids[write_block_index]] > 1
        )
        # Cached blocks sitting free are about to be taken out of the free queue.
        num_revived = sum(1 for b in cached_prefix if self.pool.ref_counts[b] == 0)
        if num_needed + needs_copy > self.pool.num_free_blocks - num_revived:
            return None

        copies: list[BlockCopy] = []
        if cached_prefix:
            self.pool.touch(cached_prefix)
            request.block_ids.extend(cached_prefix)
            request.num_computed_tokens = num_computed
            self._register(request, len(request.block_ids))
        if needs_copy:
            shared = request.block_ids[write_block_index]
            (private,) = self.pool.allocate(1)
            self.pool.free([shared])
            request.block_ids[write_block_index] = private
            request.replaced_block_indices.append(write_block_index)
            copies.append((shared, private))
            # The private copy is registered again once it is full.
            request.num_registered_blocks = min(request.num_registered_blocks, write_block_index)
        request.block_ids.extend(self.pool.allocate(num_needed))
        return copies

    def cache_computed_blocks(self, request: Request) -> None:
        """Register the request's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        self._register(request, num_full)

    def _register(self, request: Request, num_full_blocks: int) -> None:
        if num_full_blocks <= request.num_registered_blocks:
            return
        keys = self.block_keys(request, num_full_blocks)
        for index in range(request.num_registered_blocks, num_full_blocks):
            self.pool.cache(request.block_ids[index], keys[index])
        request.num_registered_blocks = num_full_blocks

    def fork(self, parent: Request, child: Request) -> None:
        """Give `child` shared references to the blocks of the parent's whole prompt.

        The child then recomputes only the last prompt token, for logits of its own; its
        first write lands in a shared block and is served by copy-on-write.
        """
        num_prompt_blocks = cdiv(parent.num_prompt_tokens, self.block_size)
        shared = parent.block_ids[:num_prompt_blocks]
        self.pool.touch(shared)
        child.block_ids = list(shared)
        child.num_registered_blocks = min(parent.num_registered_blocks, parent.num_prompt_tokens // self.block_size)
        child.num_computed_tokens = parent.num_prompt_tokens - 1

    def free(self, request: Request) -> None:
        """Release the request's blocks; the tail goes first so it is evicted first."""
        self.pool.free(reversed(request.block_ids))
        request.block_ids = []
        request.replaced_block_indices.clear()
        request.num_registered_blocks = 0
        request.num_computed_tokens = 0

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()

    def check_integrity(self, requests: list[Request], other_holders: Iterable[list[int]] = ()) -> None:
        """Assert refcounts, the free queue and every block table agree; `other_holders`
        are block lists held outside any request's table."""
        expected: dict[int, int] = {}
        for block_ids in other_holders:
            for block_id in block_ids:
                expected[block_id] = expected.get(block_id, 0) + 1
        for request in requests:
            assert len(set(request.block_ids)) == len(request.block_ids), f"{request.request_id} holds a block twice"
            assert len(request.block_ids) * self.block_size >= request.num_computed_tokens, (
                f"{request.request_id}: {request.num_computed_tokens} computed tokens "
                f"in {len(request.block_ids)} blocks"
            )
            for block_id in request.block_ids:
                expected[block_id] = expected.get(block_id, 0) + 1
        self.pool.check_integrity(expected)
