"""A request's prefix key: hashes of its prompt's leading token blocks, so that requests sharing
a prefix share their leading keys (docs/prefix-affinity.md).

The blocks are the engine's KV-cache blocks (the deployment's `block_size`, vLLM's 16 when
unset), and the hashes are chained as vLLM chains its block hashes: block i's key covers every
token of blocks 0..i, so two prompts share the key at depth d exactly when their first d blocks
agree. Only full blocks count (vLLM caches nothing smaller). The entry carries the chain at a
few depths only (PREFIX_DEPTHS blocks), to keep it small: a placement step matches a request to
the worker holding the deepest of them it can find, and groups requests by one of them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from sluice.config.engine import DEFAULT_BLOCK_SIZE

PREFIX_DEPTHS = (1, 2, 4, 8, 16, 32)  # blocks covered by each key the entry carries
KEY_BYTES = 6  # 12 hex digits: a collision merges two groups (a lost hit), nothing worse


def block_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> list[bytes]:
    """The chained hash of each full block (at most `limit` of them): block i's covers blocks 0..i."""
    if block_size <= 0:
        raise ValueError("block_size must be more than 0")
    full = len(token_ids) // block_size
    if limit is not None:
        full = min(full, limit)
    parent = block_size.to_bytes(4, "little")  # the root: keys at different block sizes never meet
    out = []
    for i in range(full):
        tokens = array("q", token_ids[i * block_size:(i + 1) * block_size]).tobytes()
        parent = hashlib.blake2b(parent + tokens, digest_size=KEY_BYTES).digest()
        out.append(parent)
    return out


def prefix_keys(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE,
                depths: Sequence[int] = PREFIX_DEPTHS) -> list[str]:
    """The chained block hash at each of `depths` blocks that the prompt fills, shallowest first
    (hex). A prompt shorter than one block has none: nothing of it can be cached."""
    chain = block_hashes(token_ids, block_size, limit=max(depths))
    return [chain[d - 1].hex() for d in depths if d <= len(chain)]


def prefix_group(prefix: Sequence[str], group_blocks: int,
                 depths: Sequence[int] = PREFIX_DEPTHS) -> str | None:
    """The key a placement groups a request by: the deepest one the entry carries that covers at
    most `group_blocks` blocks (a shorter prompt's deepest key); None for an entry without keys."""
    chosen = None
    for key, depth in zip(prefix, depths):
        if depth > group_blocks and chosen is not None:
            break
        chosen = key
    return chosen
