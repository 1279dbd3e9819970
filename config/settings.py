"""Process settings from SLUICE_* environment variables (built explicitly, never at import)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from platformdirs import user_cache_dir, user_data_dir
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="ignore")

    # Where things are
    redis_url: str = "redis://127.0.0.1:6379/0"  # also redis+cluster:// and redis+sentinel://
    # Celery's broker for bulk jobs (Celery cannot use a Redis Cluster): default redis_url
    # when that is one server or Sentinel's primary; required with a cluster.
    jobs_broker_url: str | None = None
    models_file: Path | None = None
    cache_dir: Path = Field(default_factory=lambda: Path(user_cache_dir("sluice")))
    data_dir: Path = Field(default_factory=lambda: Path(user_data_dir("sluice")))

    # The api
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=8000, ge=0, le=65535)
    api_keys: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # Tenants and their keys (YAML, config/tenants.py): keys as digests with a scope and a
    # tenant, tenants with weights, queue shares and limits. SLUICE_API_KEYS' keys join it,
    # each a tenant of its own.
    keys_file: Path | None = None
    # An idle keep-alive connection is held this long: longer than clients keep theirs (httpx and
    # the OpenAI SDK: 5 s) and than a load balancer's idle timeout (60 s is common), so the client
    # side always closes first; a server that closes first races a client reusing the connection.
    api_keep_alive_s: float = Field(default=65.0, gt=0)
    # Slow clients (api/connections.py): a request's headers must all arrive within
    # api_header_timeout_s of its first byte (a new connection's: of its opening), and its body
    # within api_body_timeout_s of the headers plus a second per api_body_min_rate bytes that
    # came; else the connection is closed. At most api_max_connections are open per api process.
    api_header_timeout_s: float = Field(default=20.0, gt=0)
    api_body_timeout_s: float = Field(default=30.0, gt=0)
    api_body_min_rate: int = Field(default=1024, gt=0)
    api_max_connections: int = Field(default=2048, gt=0)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    max_prompt_chars: int = Field(default=200_000, gt=0)  # also /tokenize's prompt
    # Requests one OpenAI call makes (prompts × n): refused with 413 before any per-row work.
    max_choices_per_call: int = Field(default=1024, gt=0)
    max_streams_per_key: int = Field(default=256, gt=0)  # open SSE streams of one api key, per api process
    max_wait_s: float = Field(default=300.0, gt=0)  # longest long-poll / synchronous infer
    # Rows of one infer request; an Arrow body's columns and decoded size are checked from its
    # metadata before anything is decompressed (a few KB of ZSTD can decode to gigabytes).
    max_rows_per_request: int = Field(default=10_000, gt=0)
    max_arrow_columns: int = Field(default=64, gt=0)
    max_decoded_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    sse_idle_timeout_s: float = Field(default=300.0, gt=0)  # an SSE stream with no event this long closes
    # Redis connections of one api process, whatever the number of open streams: a few shared
    # reply-stream readers (api_redis_connections // 8, at most 8), one pub/sub, the rest a pool.
    api_redis_connections: int = Field(default=32, ge=4, le=1024)

    # Lifetimes of what a request leaves in Redis. Steady-state memory is about
    # rate x result_ttl_s x bytes per finished request (docs/delivery.md, "Retention").
    result_ttl_s: int = Field(default=3600, gt=0)  # a finished request's status and result
    reply_ttl_s: int = Field(default=60, gt=0)  # its reply stream, after the final
    status_ttl_s: int = Field(default=86400, gt=0)  # an unfinished request's status and reply stream
    cancel_ttl_s: int = Field(default=3600, gt=0)

    # Delivery
    lease_timeout_s: float = Field(default=30.0, gt=0)
    max_deliveries: int = Field(default=3, gt=0)
    # How often the api sweeps each model's streams for entries past their deadline that no
    # worker started (no live worker, or a dead one's lease): they end `expired` (expire.lua).
    expire_interval_s: float = Field(default=5.0, gt=0)
    dlq_max_len: int = Field(default=10_000, gt=0)  # dead letters kept per model (approximate MAXLEN)
    # "strict": the embedded Redis fsyncs every write (appendfsync always) and, on a server with
    # WAITAOF (Redis 7.2+), a 202 is given only once the admission is on disk.
    durability: Literal["default", "strict"] = "default"
    # With replicas (a cluster's, or Sentinel's primary's): a 202 only once the admission is on
    # this many replicas (else 503 not_durable), and a worker's commit waits for them too
    # (WAIT): what a failover can lose (docs/scaling.md, "Redis Cluster and Sentinel").
    redis_wait_replicas: int = Field(default=0, ge=0)
    max_queued: int = Field(default=1000, gt=0)  # entries of both lanes together, per model
    # The part of max_queued the bulk lane may hold: the rest is always left to interactive.
    bulk_queue_share: float = Field(default=0.5, gt=0, lt=1)
    # Engine slots a worker never fills from the bulk lane (batch jobs, low priority): an
    # interactive request arriving behind a flood of them starts at once. At most capacity - 1.
    interactive_reserved_slots: int = Field(default=1, ge=0)
    # Tenants take turns on each lane of a model, by served tokens over weight (docs/delivery.md,
    # "Fair share"); false: one FIFO queue per lane, as before tenants.
    fair_share: bool = True
    # Engine slots a worker fills only from tenants running fewer than their part of it, while
    # more than one tenant is active: a light tenant's request starts at once, not when a heavy
    # tenant's ends. At most capacity - 1; with one tenant active it takes every slot.
    tenant_reserved_slots: int = Field(default=1, ge=0)
    # Prefix affinity (a deployment's prefix_affinity, with fair share on): the longest a request
    # waits for the worker owning its prefix group while another has a free slot.
    prefix_affinity_wait_ms: float = Field(default=30.0, ge=0)
    request_timeout_s: float = Field(default=600.0, gt=0)

    # Workers
    heartbeat_interval_s: float = Field(default=2.0, gt=0)
    worker_ttl_s: float = Field(default=10.0, gt=0)
    cancel_poll_s: float = Field(default=0.2, gt=0)
    shutdown_timeout_s: float = Field(default=30.0, ge=0)
    log_max_len: int = Field(default=10_000, gt=0)
    # A log record over this many bytes keeps only the start of its prompt and output, so the
    # log holds at most about log_max_len x log_max_record_bytes per model.
    log_max_record_bytes: int = Field(default=4096, ge=512)
    # Where the worker's --metrics-port listens, and the URL it advertises in /v1/workers
    # (default http://<host name>:<port>/metrics: the address other hosts reach it by).
    worker_metrics_host: str = "0.0.0.0"
    worker_metrics_url: str | None = None

    # Files and bulk jobs
    files_dir: Path | None = None  # default: <data_dir>/files
    max_file_bytes: int = Field(default=200 * 1024 * 1024, gt=0)
    file_ttl_s: int = Field(default=30 * 86400, gt=0)  # a file without expires_after (OpenAI's default)
    max_files_per_key: int = Field(default=10_000, gt=0)  # files one api key keeps (its uploads past it: 400)
    # `sluice up --from oci://...` serves only artifacts signed by this Ed25519 public key (PEM)
    # when it is set; unset, a signature is not checked (cli/signing.py).
    artifact_public_key: Path | None = None
    batch_ttl_s: int = Field(default=30 * 86400, gt=0)  # a finished batch object
    # A batch input file: at most this many requests (non-blank lines; OpenAI's limit is 50,000)
    # of at most this many bytes each, refused at batches.create; the jobs worker reads it a
    # line at a time (docs/operations.md, "Security").
    max_batch_lines: int = Field(default=50_000, gt=0)
    max_batch_line_bytes: int = Field(default=2 * 1024 * 1024, gt=0)
    bulk_outstanding: int = Field(default=64, gt=0)  # rows of one job on the bulk stream at once
    job_lock_ttl_s: float = Field(default=15.0, gt=0)
    jobs_concurrency: int = Field(default=4, gt=0)

    # Webhooks (docs/webhooks.md): the sender's limits. Endpoints on private, loopback and
    # link-local addresses are refused unless allowed (a sender runs inside the operator's network).
    webhooks_allow_private: bool = False
    webhooks_timeout_s: float = Field(default=10.0, gt=0)  # one delivery's request, connect to last byte
    webhooks_retry_period_s: float = Field(default=72 * 3600.0, gt=0)  # then the dead-letter list
    webhooks_retry_base_s: float = Field(default=5.0, gt=0)  # the first retry's delay; doubled each time
    webhooks_concurrency: int = Field(default=8, gt=0)  # deliveries in flight per endpoint, per sender
    webhooks_lease_s: float = Field(default=60.0, gt=0)  # a dead sender's events are taken over after it

    @property
    def files_path(self) -> Path:
        return self.files_dir or self.data_dir / "files"

    # The null engine (`sluice worker --engine null`), for tests and queue benchmarks
    null_token_delay_s: float = Field(default=0.0, ge=0)
    null_delay_s: float = Field(default=0.0, ge=0)  # before a request's first token (its prefill)
    null_crash_on: str | None = None  # a prompt containing this kills the worker (fault tests)
    null_composition: bool = False  # tokens depend on how many requests run at once (see NullEngine)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        if isinstance(value, str):
            return [k.strip() for k in value.split(",") if k.strip()]
        return value
