"""Redis key names. All keys of one model share the hash tag {m:<model>} (one cluster slot), or
{m:<model>:<k>} on shard k of a sharded model."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from sluice.protocol.ids import request_shard

PREFIX = "sluice"
GROUP = "workers"
MODELS = f"{PREFIX}:models"
WORKERS = f"{PREFIX}:workers"
VTC_TTL_S = 86_400  # tenants' virtual token counters: kept a day past the lane's last admission or dispatch
ACTIVE_S = 10  # a tenant admitted within this is active: the tenant reserve is kept for it (dispatch.lua)
# Prefix affinity (broker/delivery/affinity.py and its scripts)
AFFINITY_GROUPS_MAX = 4096  # distinct groups counted per interval (more are placed by rank alone)
COUNT_DECAY = 0.5 ** (1 / 8)  # the groups' request counts, at each recompute: halved every 8 intervals
# The webhook outbox streams are capped (MAXLEN ~): a sender group drains them within
# milliseconds, so the cap bites only when no sender has run for this many events (then the
# oldest are dropped).
OUTBOX_MAX_LEN = 100_000


class Suffix(enum.StrEnum):
    """What follows a shard's hash tag in each of its keys' names, each named as the ModelKeys
    member (or the function below) that builds its key. The Lua scripts build the keys they are
    not handed from the same names: the prelude (broker/plumbing/scripts.py) gives them the table
    SUFFIX (`tag .. SUFFIX.held`), so a suffix is spelled here only. Only [a-z_:]: a script may
    put one in a pattern."""

    REQUESTS = ":req"  # the lanes: `<tag>:req` (interactive), `<tag>:bulk`
    BULK = ":bulk"
    DEAD_LETTERS = ":dlq"
    LOG = ":log"
    DONE = ":done"
    REPLY = ":reply:"  # a request's keys: then its id
    STATUS = ":status:"
    RESPONSE = ":resp:"
    ADMITTED = ":admitted:"
    CANCEL = ":cancel:"
    CHARGE = ":charge:"
    QUOTA = ":quota:"  # then `<tenant>:<limit>`
    SWEEP_LOCK = ":sweeping"
    CONSUMER_LOCK = ":consumer:"  # then the consumer's name
    OUTBOX = ":outbox"  # a shard's webhook outbox (and a batch's, beside its lock)
    BATCH_LOCK = ":lock"  # a batch's lock `{sluice:batch:<id>}:lock` (broker/jobs/store.py)
    # Fair share: `<tag>:held`, then per lane (`req`, `bulk`) its backlog, counters, staging streams
    HELD = ":held"
    BACKLOG = ":backlog:"  # then the lane
    COUNTERS = ":vtc:"  # then the lane
    STAGED = ":staged:"  # then `<lane>:<tenant>`
    # Prefix affinity (docs/prefix-affinity.md)
    AFFINITY_SLOTS = ":aff:slots"
    AFFINITY_OWNERS = ":aff:owners"
    AFFINITY_GROUPS = ":aff:groups"
    AFFINITY_SIZES = ":aff:sizes"
    AFFINITY_WAKE = ":aff:wake"
    AFFINITY_LOCK = ":aff:lock"


def idempotency(key: str) -> str:
    return f"{PREFIX}:idem:{key}"


# Fair share (docs/delivery.md): beside a lane stream `<tag>:req` or `<tag>:bulk`, in its slot,
# as broker/lua/_lib.lua names them.
def _tag_and_lane(stream: str) -> tuple[str, str]:
    tag, _, lane = stream.rpartition(":")
    return tag, lane


def backlog(stream: str) -> str:
    """Sorted set: the lane's tenants with staged entries, by virtual token counter."""
    tag, lane = _tag_and_lane(stream)
    return f"{tag}{Suffix.BACKLOG}{lane}"


def staged(stream: str, tenant: str) -> str:
    """Stream: a tenant's requests waiting for their turn onto the lane."""
    tag, lane = _tag_and_lane(stream)
    return f"{tag}{Suffix.STAGED}{lane}:{tenant}"


def counters(stream: str) -> str:
    """Hash: each tenant's virtual token counter on the lane (and `:floor`)."""
    tag, lane = _tag_and_lane(stream)
    return f"{tag}{Suffix.COUNTERS}{lane}"


def held(stream: str) -> str:
    """Hash: the entries each tenant holds on the shard, staged or on a lane stream."""
    return f"{_tag_and_lane(stream)[0]}{Suffix.HELD}"


def affinity_wake(stream: str) -> str:
    """Stream: prefix affinity's doorbell beside an interactive lane (docs/prefix-affinity.md):
    admission rings it, and workers placing by prefix block on it instead of the lane."""
    return f"{_tag_and_lane(stream)[0]}{Suffix.AFFINITY_WAKE}"


def tenant_index(tenant: str) -> str:
    """What stands for a tenant where an owner is named (the index of its batches or files, for
    a tenant whose keys share): a key's digest is hex, so the two never meet."""
    return f"tenant:{tenant}"


def tenant_streams(tenant: str) -> str:
    """The SSE streams a tenant holds open on every api process: a ZSET of stream → lease expiry
    (ms), each refreshed while its stream is open (broker/intake/tenant_streams.py)."""
    return f"{PREFIX}:{{t:{tenant}}}:streams"


def tenant_files(tenant: str) -> str:
    """The files a tenant stores: a hash of file id → `<bytes> <expires_at>` (broker/jobs/tenant_files.py)."""
    return f"{PREFIX}:{{t:{tenant}}}:files"


@dataclass(frozen=True)
class ModelKeys:
    """A model's keys on one shard. Shard 0 is the model's tag `{m:<model>}` and holds the
    interactive and bulk streams, the dead letters, the log and the consumer locks; shard k of a
    model with `shards: K` is `{m:<model>:<k>}` and holds an interactive stream of its own. A
    request's keys (status, reply, cancel, response) live in the slot of the shard its id
    names (protocol/ids.py), beside the stream entry its scripts touch."""

    model: str
    shard: int = 0

    def at(self, shard: int) -> ModelKeys:
        return self if shard == self.shard else ModelKeys(self.model, shard)

    def for_request(self, rid: str) -> ModelKeys:
        """The keys of the shard that holds request `rid`."""
        return self.at(request_shard(rid))

    def shards(self, count: int) -> list[ModelKeys]:
        return [self.at(k) for k in range(count)]

    @property
    def tag(self) -> str:
        model = self.model if self.shard == 0 else f"{self.model}:{self.shard}"
        return f"{PREFIX}:{{m:{model}}}"

    @property
    def requests(self) -> str:
        """This shard's interactive stream."""
        return f"{self.tag}{Suffix.REQUESTS}"

    @property
    def bulk(self) -> str:
        """The bulk stream: only shard 0's is written (on another shard: the empty key the
        admission script counts as the other lane, in the same slot)."""
        return f"{self.tag}{Suffix.BULK}"

    @property
    def dead_letters(self) -> str:
        return f"{self.tag}{Suffix.DEAD_LETTERS}"

    @property
    def log(self) -> str:
        return f"{self.at(0).tag}{Suffix.LOG}"

    @property
    def done(self) -> str:
        """Sharded pub/sub channel (SPUBLISH) announcing the shard's requests whose final was
        just written: in a cluster it lives on the node of the shard's slot, not on every node."""
        return f"{self.tag}{Suffix.DONE}"

    def _rtag(self, rid: str) -> str:
        return self.for_request(rid).tag

    def reply(self, rid: str) -> str:
        return f"{self._rtag(rid)}{Suffix.REPLY}{rid}"

    def status(self, rid: str) -> str:
        return f"{self._rtag(rid)}{Suffix.STATUS}{rid}"

    def response(self, rid: str) -> str:
        """What a Responses API response repeats of its request (instructions, metadata ...)."""
        return f"{self._rtag(rid)}{Suffix.RESPONSE}{rid}"

    def admitted(self, rid: str) -> str:
        """The mark that a request named by an Idempotency-Key was admitted (admit.lua): kept as
        long as the key, so that a repeat after its result expired is not run again."""
        return f"{self._rtag(rid)}{Suffix.ADMITTED}{rid}"

    def cancel(self, rid: str) -> str:
        return f"{self._rtag(rid)}{Suffix.CANCEL}{rid}"

    def quota(self, tenant: str, limit: str) -> str:
        """A tenant's bucket of `limit` (requests, tokens) per minute on this shard (quota.lua)."""
        return f"{self.tag}{Suffix.QUOTA}{tenant}:{limit}"

    def charge(self, rid: str) -> str:
        """The tokens a request was charged at admission, until its final settles them (quota.lua)."""
        return f"{self._rtag(rid)}{Suffix.CHARGE}{rid}"

    @property
    def sweep_lock(self) -> str:
        """Held (short TTL) by the api process sweeping this model's overdue entries (api/expiry.py)."""
        return f"{self.tag}{Suffix.SWEEP_LOCK}"

    def consumer_lock(self, consumer: str) -> str:
        """The lock of a consumer name (shard 0's; another shard's is never set, and stands in
        for it in that slot's scripts)."""
        return f"{self.tag}{Suffix.CONSUMER_LOCK}{consumer}"

    @property
    def outbox(self) -> str:
        """The webhook events of the finals of the shard's requests (broker/webhooks/outbox.py)."""
        return f"{self.tag}{Suffix.OUTBOX}"

    @property
    def held(self) -> str:
        """Fair share's count of the entries each tenant holds on the shard (as `held(stream)`)."""
        return f"{self.tag}{Suffix.HELD}"

    # Prefix affinity's keys (docs/protocol.md): only its scripts touch them, but for the doorbell.
    @property
    def affinity_slots(self) -> str:
        return f"{self.tag}{Suffix.AFFINITY_SLOTS}"

    @property
    def affinity_owners(self) -> str:
        return f"{self.tag}{Suffix.AFFINITY_OWNERS}"

    @property
    def affinity_groups(self) -> str:
        return f"{self.tag}{Suffix.AFFINITY_GROUPS}"

    @property
    def affinity_sizes(self) -> str:
        return f"{self.tag}{Suffix.AFFINITY_SIZES}"

    @property
    def affinity_wake(self) -> str:
        return f"{self.tag}{Suffix.AFFINITY_WAKE}"

    @property
    def affinity_lock(self) -> str:
        return f"{self.tag}{Suffix.AFFINITY_LOCK}"
