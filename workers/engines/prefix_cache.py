"""A simulated prefix cache: vLLM's automatic prefix caching reduced to what placement depends
on. KV-cache blocks are keyed by their chained hash (protocol/prefix.py), a request's hit is the
run of its leading full blocks found in the cache, and the least recently used blocks go first
when room is needed. Counted as vLLM counts (PrefixCacheStats): queries and hits in tokens.

The null engine uses it (workers/engines/null.py) and so does the placement simulator
(bench/prefix_sim.py), so that both report the counters a vLLM worker reports.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class PrefixCacheCounters:
    """Cumulative, in tokens: what was looked up (each prompt's tokens) and what was found; and
    the cache's size in blocks of `block_size` tokens (vLLM's num_gpu_blocks and block_size,
    None until known: vLLM on the CPU takes blocks of 128 tokens where a GPU takes 16)."""

    queries: int = 0
    hits: int = 0
    blocks: int | None = None
    block_size: int | None = None

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class SimulatedPrefixCache:
    """`capacity_blocks` blocks of `block_size` tokens, least recently used evicted first."""

    def __init__(self, capacity_blocks: int, block_size: int = 16):
        if capacity_blocks < 0 or block_size <= 0:
            raise ValueError("capacity_blocks must be 0 or more and block_size more than 0")
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.counters = PrefixCacheCounters(blocks=capacity_blocks, block_size=block_size)
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: bytes) -> bool:
        return block in self._blocks

    def cached_blocks(self, blocks: Sequence[bytes]) -> int:
        """How many of these leading blocks the cache holds now (a lookup that touches nothing)."""
        n = 0
        for block in blocks:
            if block not in self._blocks:
                break
            n += 1
        return n

    def admit(self, blocks: Sequence[bytes], prompt_tokens: int) -> int:
        """A prompt of `prompt_tokens` whose full blocks are `blocks` (chained hashes, in order)
        starts: its cached leading blocks are hits, and all its blocks become the most recently
        used (its new ones computed and kept, evicting the least recently used). Returns the
        tokens found cached. As in vLLM, a prompt's last token is always computed: a prompt
        that is all cached blocks counts one block less as hit."""
        hit_blocks = self.cached_blocks(blocks)
        if hit_blocks and hit_blocks * self.block_size >= prompt_tokens:
            hit_blocks -= 1
        hits = hit_blocks * self.block_size
        self.counters.queries += prompt_tokens
        self.counters.hits += hits
        for block in blocks:
            if block in self._blocks:
                self._blocks.move_to_end(block)
            elif self.capacity_blocks:
                self._blocks[block] = None
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
        return hits
