"""The audit of `sluice bench chaos`: every accepted request's status hash and reply stream read
straight from Redis, and every reader's text compared with the final, row by row."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import redis as redis_sync
from rich.table import Table

from sluice.bench.chaos_tenants import per_tenant, tenant_row
from sluice.broker.keys import ModelKeys, idempotency
from sluice.broker.plumbing.decoded import hash_of, maybe_text, stream_entries
from sluice.broker.plumbing.urls import sync_connect

FINAL_STATES = ("done", "failed", "expired", "cancelled")


def final_texts(view: dict) -> dict[int, str]:
    """Per row, the text of a final (a RequestView or the reply stream's final event)."""
    if view.get("rows"):
        return {i: r.get("text") or "" for i, r in enumerate(view["rows"])}
    return {0: view["output"].get("text") or ""} if view.get("output") else {}


@dataclass
class Reader:
    """One /events reader of a request: what it received, in order."""

    # "first" (from the submit on), "late" (joins mid-stream) or "responses" (late, a Responses stream)
    name: str
    deltas: list[tuple[int, int, str]] = field(default_factory=list)  # (row, index, text)
    final: dict | None = None  # the done/error event's data
    reconnects: int = 0
    dropped: bool = False  # hung up on purpose once, then resumed with Last-Event-ID

    def texts(self) -> dict[int, str]:
        out: dict[int, str] = {}
        for row, _, text in self.deltas:
            out[row] = out.get(row, "") + text
        return out

    def index_gap(self) -> str | None:
        """A row whose indices do not rise (a delta shown twice, or out of order)."""
        last: dict[int, int] = {}
        for row, index, _ in self.deltas:
            if index <= last.get(row, -1):
                return f"row {row}: index {index} after {last[row]}"
            last[row] = index
        return None

    def describe(self) -> str:
        return (f"{self.name}: {len(self.deltas)} deltas, {self.reconnects} reconnects"
                f"{', hung up once' if self.dropped else ''}{', no final' if self.final is None else ''}")


@dataclass
class Tracked:
    """One accepted request, as its clients saw it."""

    rid: str
    model: str
    kind: str  # "stream" | "poll" | "structured" | "rows"
    idem_key: str | None
    submit_tries: int
    rows: int = 1
    readers: list[Reader] = field(default_factory=list)
    answer: dict[int, str] | None = None  # per row, the text a poll or the infer call answered
    every_reader: bool = False  # a client's first request: a late reader and a hang-up, whatever the draw
    tenant: str = "default"  # the tenant its client sent it as (bench/chaos_tenants.py)
    owner: str = ""  # its client's key digest ('' without keys)


def replay(deltas: list[dict]) -> dict[int, str]:
    """Per row, the text a reader following the reply stream from its start receives (the api's
    rule: a delta starting below the next undelivered index of its row is skipped whole)."""
    seen: dict[int, int] = {}
    out: dict[int, list[str]] = {}
    for d in deltas:
        row = d.get("row", 0)
        if d["i"] < seen.get(row, 0):
            continue
        seen[row] = d["i"] + len(d["token_ids"])
        out.setdefault(row, []).append(d["text"])
    return {row: "".join(texts) for row, texts in out.items()}


def overlaps(deltas: list[dict]) -> list[str]:
    """Token indices covered twice by deltas of one attempt (one row), with the two entry ids."""
    covered: dict[tuple[int, int], dict[int, str]] = {}
    twice = []
    for d in deltas:
        cells = covered.setdefault((d.get("attempt", 1), d.get("row", 0)), {})
        for i in range(d["i"], d["i"] + len(d["token_ids"])):
            if i in cells:
                twice.append(f"attempt {d.get('attempt', 1)} row {d.get('row', 0)} index {i} "
                             f"(entries {cells[i]} and {d.get('_id')})")
            cells[i] = d.get("_id", "")
    return twice


def gaps(deltas: list[dict]) -> list[str]:
    """Token indices skipped inside one attempt's deltas (a write of deltas that was lost);
    an attempt may start past 0 (it resumes), but then goes on without holes."""
    end: dict[tuple[int, int], int] = {}
    holes = []
    for d in deltas:
        key = (d.get("attempt", 1), d.get("row", 0))
        if key in end and d["i"] > end[key]:
            holes.append(f"attempt {key[0]} row {key[1]} indices {end[key]}-{d['i'] - 1} "
                         f"(before entry {d.get('_id')})")
        end[key] = max(end.get(key, 0), d["i"] + len(d["token_ids"]))
    return holes


def runs(deltas: list[dict]) -> list[str]:
    """The reply stream's deltas in order, contiguous ones of one attempt and row joined:
    "a1 r0 i0-41" is attempt 1, row 0, token indices 0 to 41."""
    out: list[list] = []  # [attempt, row, first, end]
    for d in deltas:
        a, r, i, end = d.get("attempt", 1), d.get("row", 0), d["i"], d["i"] + len(d["token_ids"])
        if out and out[-1][:2] == [a, r] and out[-1][3] == i:
            out[-1][3] = end
        else:
            out.append([a, r, i, end])
    return [f"a{a} r{r} i{i}-{end - 1}" for a, r, i, end in out]


def _differs(got: dict[int, str], want: dict[int, str]) -> str | None:
    """The first row whose text differs, as 'row r: <got tail> vs <want tail>'; None if all agree."""
    for row in sorted(set(got) | set(want)):
        a, b = got.get(row, ""), want.get(row, "")
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return (f"row {row}: from character {at} of {len(a)} vs {len(b)}: "
                    f"{a[max(0, at - 20):at + 40]!r} vs {b[max(0, at - 20):at + 40]!r}")
    return None


DIVERGED = "diverged from the tokens already streamed"  # a failed final's error (see audit_one)


def _regenerated_otherwise(deltas: list[dict], final: str) -> bool:
    """Whether a retried structured row's final differs from its stream inside the part an
    earlier attempt streamed: the row was generated again from token 0 (a grammar cannot start
    mid-way) and the engine gave other tokens there than the first time."""
    last = max((d.get("attempt", 1) for d in deltas), default=1)
    earlier = "".join(d["text"] for d in deltas if d.get("attempt", 1) < last and d.get("row", 0) == 0)
    return bool(earlier) and not final.startswith(earlier)


def audit_one(r: redis_sync.Redis, t: Tracked) -> dict:
    """What Redis holds for one accepted request, and which invariants it breaks."""
    keys = ModelKeys(t.model)
    status = hash_of(r.hgetall(keys.status(t.rid)))
    entries = stream_entries(r.xrange(keys.reply(t.rid)))
    deltas = [{**json.loads(f["data"]), "_id": eid} for eid, f in entries if f.get("kind") == "delta"]
    finals = [json.loads(f["data"]) for _, f in entries if f.get("kind") == "final"]
    broken: list[str] = []
    row: dict[str, object] = {
        "rid": t.rid, "model": t.model, "kind": t.kind, "rows": t.rows, "state": status.get("state"),
        "finals": [f"{f['status']}@attempt{f.get('attempt')}: {f.get('error') or ''}" for f in finals],
        "deltas": runs(deltas), "status_attempt": status.get("attempt"), "worker": status.get("worker"),
        "submit_tries": t.submit_tries, "readers": [rd.describe() for rd in t.readers], "broken": broken,
        "tenant": t.tenant, "status_tenant": status.get("tenant")}
    if status and status.get("tenant") != t.tenant:  # admitted as another tenant than its key's
        broken.append(f"tenant: stored as {status.get('tenant')!r}, sent as {t.tenant!r}")
    if not finals:
        entry = status.get("entry")
        queued = bool(entry and r.xrange(status.get("stream", keys.requests), entry, entry))
        row["stream_entry_present"] = queued
        # Still on its stream when the drain ended (workers too slow to come back): late, not lost.
        broken.append("unfinished: no final yet, its entry is on the stream" if queued
                      else "lost: no final event")
        idempotency_key = idempotency(f"{t.owner or 'anonymous'}:{t.idem_key}")
        row["idempotency_bound"] = t.idem_key and maybe_text(r.get(idempotency_key))
        dead_letters = stream_entries(r.xrange(keys.dead_letters))
        row["in_dead_letters"] = any(f.get("id") == t.rid for _, f in dead_letters)
    if len(finals) > 1:
        broken.append(f"duplicated: {len(finals)} final events")
    if finals and status.get("state") != finals[0]["status"]:
        broken.append(f"status {status.get('state')} != final event {finals[0]['status']}")
    if twice := overlaps(deltas):
        broken.append(f"duplicated: {len(twice)} token indices delivered twice, e.g. {twice[0]}")
    if holes := gaps(deltas):
        row["gaps"] = holes  # not broken by itself: a retry may have resumed from the hole
    final = final_texts(finals[0]) if finals else None
    streamed = replay(deltas)
    # A retried structured row the engine regenerated with other tokens than it streamed fails
    # the request, saying so, with no text (workers/generation.py): what was streamed stands.
    diverged = bool(finals) and not final and DIVERGED in (finals[0].get("error") or "")
    row["diverged"] = diverged
    if final is not None and not diverged and (why := _differs(streamed, final)):
        broken.append(f"stream != final: the reply stream replayed {why}")
        row["regenerated_otherwise"] = (t.kind == "structured"
                                        and _regenerated_otherwise(deltas, final.get(0, "")))
    for rd in t.readers:
        if rd.final is None:
            continue
        if why := _differs(rd.texts(), streamed):
            row["reader_vs_stream"] = True  # a reader defect whatever the final says
            if diverged:  # the stream is all the text there is: it is this reader's final
                broken.append(f"reader != final: {rd.name} ({rd.describe()}) != its reply stream {why}")
        if finals and (rd.final.get("status") == "done") != (finals[0]["status"] == "done"):
            broken.append(f"reader != final: {rd.name} was told {rd.final.get('status')}, "
                          f"the final is {finals[0]['status']}")
        if final is not None and final_texts(rd.final) != final:
            broken.append(f"reader != final: {rd.name}'s final view differs from the stream's final")
        why = None if diverged else _differs(rd.texts(), final_texts(rd.final))
        if why or (why := rd.index_gap()):
            broken.append(f"reader != final: {rd.name} ({rd.describe()}) {why}")
    if finals and t.answer is not None and (why := _differs(t.answer, final or {})):
        broken.append(f"answer != final: the call's own answer {why}")
    if finals and any(rd.final is None for rd in t.readers):
        row["reader_unfinished"] = True  # the client gave up: not a lost request
    return row


def audit(redis_url: str, tracked: list[Tracked]) -> dict:
    r = sync_connect(redis_url)
    rows = [audit_one(r, t) for t in tracked]
    readers = [rd for t in tracked for rd in t.readers]
    figures: dict[str, int] = {
        "accepted": len(tracked), "done": 0, "failed": 0, "expired": 0, "cancelled": 0,
        "lost": 0, "unfinished": 0, "duplicated": 0, "stream_mismatch": 0, "reader_mismatch": 0,
        "answer_mismatch": 0, "retried": 0, "readers": len(readers), "readers_mismatched": 0,
        "readers_unfinished": 0, "readers_dropped": sum(rd.dropped for rd in readers),
        "readers_late": sum(rd.name != "first" for rd in readers),
        "done_once": 0, "regenerated_otherwise": 0, "diverged": 0, "tenant_mismatch": 0}
    for row in rows:
        state = row["finals"][0].split("@")[0] if row["finals"] else None
        if state in FINAL_STATES:
            figures[state] += 1
        broken = row["broken"]
        figures["done_once"] += state == "done" and len(row["finals"]) == 1
        figures["lost"] += any(b.startswith("lost") for b in broken)
        figures["unfinished"] += any(b.startswith("unfinished") for b in broken)
        figures["duplicated"] += any(b.startswith("duplicated") for b in broken)
        figures["stream_mismatch"] += any(b.startswith("stream") for b in broken)
        figures["reader_mismatch"] += any(b.startswith("reader") for b in broken)
        figures["readers_mismatched"] += len({b.split(" ")[3] for b in broken if b.startswith("reader")})
        figures["answer_mismatch"] += any(b.startswith("answer") for b in broken)
        figures["tenant_mismatch"] += any(b.startswith("tenant") for b in broken)
        figures["regenerated_otherwise"] += bool(row.get("regenerated_otherwise"))
        figures["diverged"] += row["diverged"]
        figures["retried"] += int(row["status_attempt"] or 1) > 1
        figures["readers_unfinished"] += bool(row.get("reader_unfinished"))
    figures["dead_letters"] = sum(r.xlen(ModelKeys(m).dead_letters) for m in {t.model for t in tracked})
    figures["token_gaps"] = sum(bool(row.get("gaps")) for row in rows)
    kinds = {k: sum(t.kind == k for t in tracked) for k in ("stream", "poll", "structured", "rows")}
    return {"figures": {**figures, "kinds": kinds, "by_tenant": per_tenant(rows)},
            "broken": [row for row in rows if row["broken"]],
            "gaps": [row for row in rows if row.get("gaps") and not row["broken"]],
            "not_done": [row for row in rows if not row["broken"] and row["state"] != "done"]}


def table(f: dict, models: list[str]) -> Table:
    durability = "strict" if f["strict_durability"] else "default"
    tenants = f" as {len(f['tenants'])} tenants" if f.get("tenants") else ""
    table = Table(title=f"chaos run: {f['seconds']:.0f}s, {f['clients']} clients{tenants}, "
                        f"models {', '.join(models)}, {f['redis']} Redis, {durability} durability")
    table.add_column("figure")
    table.add_column("value", justify="right")
    k, kinds = f["kills"], f["kinds"]
    rows = [("accepted (stream/poll/structured/multi-row)",
             f"{f['accepted']} ({kinds['stream']}/{kinds['poll']}/{kinds['structured']}/{kinds['rows']})"),
            tenant_row(f["by_tenant"]), ("done exactly once", f["done_once"])]
    rows += [(c, f[c]) for c in ("failed", "expired", "cancelled", "lost", "duplicated")]
    rows += [("unfinished at the drain's end (entry still queued)", f["unfinished"])]
    rows += [("failed as diverged (a retried structured row regenerated other tokens)", f["diverged"])]
    rows += [("streamed != final (reply stream, per row)", f["stream_mismatch"]),
             ("  of which a retried structured row regenerated other tokens", f["regenerated_otherwise"]),
             ("reader != final (requests)", f["reader_mismatch"]),
             ("readers (late joiners, hung up and resumed)",
              f"{f['readers']} ({f['readers_late']}, {f['readers_dropped']})"),
             ("readers != final", f["readers_mismatched"]),
             ("answer != final (poll, infer)", f["answer_mismatch"]),
             ("token gaps (resumed holes)", f["token_gaps"]),
             ("stored under another tenant than its key's", f["tenant_mismatch"]),
             ("kills (workers/apis/redis)", f"{k['workers']}/{k['apis']}/{k['redis']}"),
             ("Redis kills with an AOF fsync running (default durability's window)",
              f["aof_window"]["kills_in_fsync"]),
             ("AOF writes postponed past 2 s (INFO before kills / Redis log)",
              f"{f['aof_window']['delayed_fsync']}/{f['aof_window']['postponed_logged']}"),
             ("reclaims (worker logs)", f["reclaims"]), ("retried (final attempt > 1)", f["retried"]),
             ("dead letters", f["dead_letters"]), ("refused: 503 queue full / 429 tenant",
              f"{f['queue_full']} / {f['tenant_refused']}"),
             ("submit retries", f["submit_retries"]), ("readers unfinished", f["readers_unfinished"]),
             ("requests/s (done)", f"{f['requests_per_s']:.1f}")]
    for name, value in rows:
        table.add_row(name, str(value))
    return table


def broken(f: dict) -> bool:
    """Whether the run broke the promise: a request lost, duplicated or not done (but a retried
    structured row that failed as diverged, as designed), or a text (the reply stream, a reader,
    an answer) other than the final, or one stored under another tenant than its client's."""
    return bool(f["lost"] or f["duplicated"] or f["done"] + f["diverged"] < f["accepted"]
                or f["stream_mismatch"] or f["reader_mismatch"] or f["answer_mismatch"]
                or f["tenant_mismatch"])
