"""What admission and consumption are bounded by (retention, leases, deliveries, durability), one
object each, built from the settings (and a model's own figures) in one place instead of being
passed figure by figure."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from sluice.config.model import ModelConfig
from sluice.config.settings import Settings


@dataclass(frozen=True)
class TenantShare:
    """A tenant's part of a model (docs/delivery.md, "Fair share"): its weight in the share of
    the engine (served tokens over weight stay within a bound across backlogged tenants), and the
    part of max_queued it may hold while another tenant has work queued."""

    weight: float = 1.0
    queue_share: float = 0.5

    def __post_init__(self) -> None:
        if not (self.weight > 0 and 0 < self.queue_share <= 1):
            raise ValueError(f"a tenant's weight must be > 0 and its queue_share in (0, 1]: {self}")

    def max_held(self, max_queued: int) -> int:
        """The entries it may hold while another tenant has work queued (at least one)."""
        return max(int(self.queue_share * max_queued), 1)


@dataclass(frozen=True)
class AdmissionLimits:
    status_ttl_s: int  # an unfinished request's status
    reply_ttl_s: int  # its reply stream, after the final
    cancel_ttl_s: int
    result_ttl_s: int = 3600  # once final, unless admitted with its model's own
    bulk_queue_share: float = 0.5  # the part of max_queued the bulk lane may hold
    strict: bool = False  # strict durability: an admission is on disk before it is accepted
    fsync_timeout_ms: int = 1000
    wait_replicas: int = 0  # replicas an admission must be on before it is accepted
    fair_share: bool = True  # tenants take turns on each lane (off: plain FIFO)

    @classmethod
    def of(cls, settings: Settings, **changes: Any) -> AdmissionLimits:
        """The settings' limits, with `changes` made."""
        return dataclasses.replace(cls(
            status_ttl_s=settings.status_ttl_s, reply_ttl_s=settings.reply_ttl_s,
            cancel_ttl_s=settings.cancel_ttl_s, result_ttl_s=settings.result_ttl_s,
            bulk_queue_share=settings.bulk_queue_share, strict=settings.durability == "strict",
            wait_replicas=settings.redis_wait_replicas, fair_share=settings.fair_share), **changes)


@dataclass(frozen=True)
class ConsumerLimits:
    status_ttl_s: int  # an unfinished request's status
    reply_ttl_s: int  # the reply stream, after the final
    log_max_len: int  # the inference log's entries
    lease_timeout_s: float = 30.0
    max_deliveries: int = 3
    dlq_max_len: int = 10_000
    result_ttl_s: int = 3600  # once final (a request admitted with its own keeps that)
    log_max_record_bytes: int = 4096
    wait_replicas: int = 0  # replicas a commit waits for (WAIT) before it returns
    shards: int = 1  # the model's interactive streams

    @classmethod
    def of(cls, settings: Settings, model: ModelConfig | None = None, **changes: Any) -> ConsumerLimits:
        """The settings' limits, where `model` sets none of its own, with `changes` made."""
        return dataclasses.replace(cls(
            status_ttl_s=settings.status_ttl_s, reply_ttl_s=settings.reply_ttl_s,
            log_max_len=settings.log_max_len, lease_timeout_s=settings.lease_timeout_s,
            max_deliveries=(model and model.max_deliveries) or settings.max_deliveries,
            dlq_max_len=settings.dlq_max_len,
            result_ttl_s=(model and model.result_ttl_s) or settings.result_ttl_s,
            log_max_record_bytes=settings.log_max_record_bytes, wait_replicas=settings.redis_wait_replicas,
            shards=model.shards if model else 1), **changes)
