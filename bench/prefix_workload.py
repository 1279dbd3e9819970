"""The workloads of `sluice bench prefix`: the simulator's (many prefixes, Poisson arrivals) and
the real engine's (8 shared system prompts of about 500 tokens, short user turns, Zipf)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from sluice.protocol.prefix import block_hashes, prefix_group, prefix_keys


@dataclass(frozen=True)
class SimConfig:
    workers: int = 16
    prefixes: int = 64
    zipf: float = 0.0  # 0: every prefix equally likely; s > 0: prefix k drawn with weight 1 / k^s
    prefix_tokens: int = 512
    user_tokens: tuple[int, int] = (16, 96)  # each request's own tokens after its prefix, uniform
    output_tokens: int = 32
    slots: int = 8  # requests a worker runs at once
    cache_blocks: int = 288  # per worker: 8 prefixes' worth of 36 blocks, an eighth of the 64
    block_size: int = 16
    prefill_s_per_token: float = 0.0002  # an uncached prompt token's prefill (512 tokens: 0.1 s)
    decode_s_per_token: float = 0.004
    load: float = 0.8  # arrival rate, as a share of what the workers finish when every prompt misses
    requests: int = 6000
    max_wait_s: float = 0.03  # the bound on the extra wait affinity may add to a request
    heartbeat_s: float = 1.0  # digest: how often a worker reports its digest
    digest_size: int = 8  # digest: the groups a worker reports (its most recent)
    group_blocks: int = 16
    spill_ranks: int = 2  # rendezvous: the ranks that may take a group's entries while its owners are full
    # rendezvous: at each heartbeat the groups seen in the last interval are given to workers by
    # rank with bounded loads: no worker owns more than this times the mean of their requests (a
    # group too heavy for one worker gets the next ranks too); 0: plain rendezvous, rank 1 owns.
    bounded_load: float = 1.3
    # What a worker running nothing takes before entries are overdue: "blocked", the oldest entry
    # whose preferred worker has no free slot (it could not start there now); "any", the oldest
    # entry; "off": nothing.
    idle_pulls: Literal["blocked", "any", "off"] = "blocked"
    seed: int = 0


@dataclass
class Entry:
    rid: int
    arrived: float
    group: str
    blocks: list[bytes]
    prompt_tokens: int


def workload(config: SimConfig) -> list[Entry]:
    """Requests arriving as a Poisson process, each a prefix (uniform or Zipf) plus its own tokens."""
    rnd = random.Random(config.seed)
    weights = [1.0 / (k + 1) ** config.zipf for k in range(config.prefixes)]
    miss_s = (config.prefix_tokens + sum(config.user_tokens) / 2) * config.prefill_s_per_token
    service_s = miss_s + config.output_tokens * config.decode_s_per_token
    # What the workers finish when every prompt misses: slots, or the prefill unit, whichever binds.
    capacity = config.workers * min(config.slots / service_s, 1.0 / miss_s)
    rate = config.load * capacity
    out, now = [], 0.0
    for rid in range(config.requests):
        now += rnd.expovariate(rate)
        p = rnd.choices(range(config.prefixes), weights)[0]
        tokens = [p * 1_000_003 + i for i in range(config.prefix_tokens)]
        tokens += [rnd.randrange(2**31) for _ in range(rnd.randint(*config.user_tokens))]
        group = prefix_group(prefix_keys(tokens, config.block_size), config.group_blocks) or f"r{rid}"
        out.append(Entry(rid, now, group, block_hashes(tokens, config.block_size), len(tokens)))
    return out


SYSTEM_PROMPTS = 8
SYSTEM_WORDS = 380  # about 500 tokens of SmolLM2's tokenizer
_TOPICS = ("billing", "shipping", "returns", "warranty", "accounts", "security", "travel", "recipes")
_WORDS = ("customer", "policy", "answer", "always", "never", "politely", "order", "refund", "detail",
          "step", "confirm", "number", "date", "explain", "briefly", "clearly", "escalate", "record",
          "check", "offer")


def system_prompt(k: int) -> str:
    """Shared system prompt k: a topic, then about SYSTEM_WORDS words drawn from its own seed."""
    rnd = random.Random(k)
    body = " ".join(rnd.choice(_WORDS) for _ in range(SYSTEM_WORDS))
    return f"You are the {_TOPICS[k % len(_TOPICS)]} assistant #{k}. Rules: {body}"


def chat_workload(requests: int, *, zipf: float = 1.0, seed: int = 0) -> list[list[dict[str, str]]]:
    """`requests` chat conversations: a system prompt drawn Zipf(`zipf`) from SYSTEM_PROMPTS (0:
    uniform), then a short user turn of its own."""
    rnd = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf for k in range(SYSTEM_PROMPTS)]
    out = []
    for i in range(requests):
        k = rnd.choices(range(SYSTEM_PROMPTS), weights)[0]
        question = " ".join(rnd.choice(_WORDS) for _ in range(rnd.randint(4, 16)))
        out.append([{"role": "system", "content": system_prompt(k)},
                    {"role": "user", "content": f"Question {i}: {question}?"}])
    return out


def shared_preamble(k: int) -> str:
    """A short shared preamble (over 32 tokens, so over two blocks at vLLM's 16): prompts that open
    with the same one fall into one prefix group (`sluice bench chaos` uses three, so that its
    kills hit the workers owning groups)."""
    return (f"You are assistant number {k} of the chaos run. Answer briefly, plainly and politely, "
            "in English, without lists, code or tables; never ask back, keep to the point, then stop. ")
