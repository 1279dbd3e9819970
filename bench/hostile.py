"""`sluice bench hostile`: the attacks of issue 29 replayed against a running stack (Redis, a
null-engine worker, the jobs worker, one api with a key), one at a time. Per attack it prints the
answer, the time to it, the api's peak RSS over its idle RSS, the jobs worker's peak RSS, and the
longest /healthz latency seen meanwhile (each probe on a new connection, from a thread of its
own, every 50 ms; RSS read from /proc every 50 ms by another).

Targets (issue 29): no 5xx; every refusal within 1 s of the request's headers; /healthz never
slower than 200 ms; the api's RSS never more than 200 MB over idle; the jobs worker's under
500 MB for a 1,000,000-line batch input file (bench/hostile_batch.py), refused by the line cap
or run (--max-batch-lines 1000000); no unauthenticated request makes the api read or spool more
than 64 KiB. Slow-client attacks are answered by closing the
connection after the timeouts (SLUICE_API_HEADER_TIMEOUT_S, SLUICE_API_BODY_TIMEOUT_S): their
time is that of the close.
"""

from __future__ import annotations

import asyncio
import json
import resource
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import typer

from sluice.bench.hostile_batch import big_batch
from sluice.bench.hostile_probe import Target, Watch, rss_mib
from sluice.supervisor.stack import LocalStack

MODELS = ("models:\n  - name: echo\n    continuous_batching_config: {max_concurrent_batch_size: 256}\n"
          "  - name: idle\n"  # no worker serves it
          "    continuous_batching_config: {max_concurrent_batch_size: 4}\n")
Attack = Callable[["Target"], Awaitable[tuple[str, float]]]


async def _status(t: Target, method: str, path: str, *, content: str | None = None,
                  headers: dict[str, str] | None = None, json_body: object = None) -> tuple[str, float]:
    async with t.client() as client:
        t0 = time.perf_counter()
        r = await client.request(method, path, content=content, headers=headers, json=json_body)
        return f"{r.status_code} {r.json()['error']['code'] if r.status_code >= 400 else ''}".strip(), \
            time.perf_counter() - t0


def completions(prompts: int, n: int) -> Attack:
    body = json.dumps({"model": "echo", "prompt": [f"p{i}" for i in range(prompts)], "n": n, "max_tokens": 4})

    async def attack(t: Target) -> tuple[str, float]:
        return await _status(t, "POST", "/v1/completions", content=body,
                             headers={"content-type": "application/json"})

    return attack


async def _closed(reader: asyncio.StreamReader, within_s: float = 600) -> bytes:
    """What the server sent until it closed the connection."""
    answer = b""
    try:
        async with asyncio.timeout(within_s):
            while chunk := await reader.read(65536):
                answer += chunk
    except (ConnectionResetError, BrokenPipeError):
        pass
    return answer


def _first_line(answer: bytes) -> str:
    return answer.split(b"\r\n", 1)[0].decode("latin-1").removeprefix("HTTP/1.1 ") or "closed"


def partial_headers(connections: int) -> Attack:
    async def attack(t: Target) -> tuple[str, float]:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, connections + 256)), hard))
        t0 = time.perf_counter()
        opened = []
        for _ in range(connections):
            reader, writer = await asyncio.open_connection(*t.address)
            writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")  # never the blank line
            opened.append((reader, writer))
        answers = await asyncio.gather(*(_closed(r) for r, _ in opened))
        for _, w in opened:
            w.close()
        counts: dict[str, int] = {}
        for a in answers:
            counts[_first_line(a)] = counts.get(_first_line(a), 0) + 1
        return ", ".join(f"{n}x {line}" for line, n in sorted(counts.items())) + " then closed", \
            time.perf_counter() - t0

    return attack


async def _trickled(t: Target, first: bytes, rest: bytes, piece: int) -> tuple[bytes, float]:
    """Send `first`, then `rest` `piece` bytes a second, until the server closes the connection:
    what it answered, and when it closed (seconds after `first`)."""
    reader, writer = await asyncio.open_connection(*t.address)
    writer.write(first)
    t0 = time.perf_counter()

    async def trickle() -> None:
        for i in range(0, len(rest), piece):
            writer.write(rest[i:i + piece])
            await writer.drain()
            await asyncio.sleep(1)

    feeding = asyncio.create_task(trickle())
    answer = await _closed(reader)
    feeding.cancel()
    writer.close()
    return answer, time.perf_counter() - t0


async def drip_headers(t: Target) -> tuple[str, float]:
    head = b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-pad: " + b"a" * 10_000 + b"\r\n\r\n"
    answer, took = await _trickled(t, b"", head, 1)
    return f"{_first_line(answer)}, closed (a header byte a second)", took


async def slow_body(t: Target) -> tuple[str, float]:
    body = json.dumps({"model": "echo", "prompt": "a" * 1_000_000}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + t.key.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(body))
    answer, took = await _trickled(t, head, body, 100)
    return f"{_first_line(answer)}, closed (a body at 100 B/s)", took


async def upload_without_key(t: Target) -> tuple[str, float]:
    size = 150 * 1024 * 1024
    reader, writer = await asyncio.open_connection(*t.address)
    writer.write(b"POST /v1/files HTTP/1.1\r\nhost: x\r\ncontent-type: multipart/form-data; boundary=b\r\n"
                 b"content-length: %d\r\n\r\n" % size)
    t0 = time.perf_counter()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
    took = time.perf_counter() - t0
    sent = 0
    try:
        while sent < size:  # the rest of the body, as fast as the server takes it
            writer.write(b"x" * 1_048_576)
            await asyncio.wait_for(writer.drain(), 10)
            sent += 1_048_576
    except (ConnectionResetError, BrokenPipeError, TimeoutError):
        pass
    writer.close()
    spooled = sum(f.stat().st_size for f in t.spool.rglob("*") if f.is_file())
    return (f"{_first_line(head)} from its headers; {sent // 1_048_576} MiB sent before close; "
            f"{spooled} B spooled"), took


def streams_of_one_key(count: int) -> Attack:
    async def attack(t: Target) -> tuple[str, float]:
        async with t.client() as client:
            rid = (await client.post("/v1/requests", json={"model": "idle", "prompt": "p"})).json()["id"]
        host, port = t.address
        opened: list[asyncio.StreamWriter] = []
        statuses: dict[str, int] = {}
        t0 = time.perf_counter()
        for _ in range(count):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(f"GET /v1/requests/{rid}/events HTTP/1.1\r\nhost: x\r\n"
                         f"authorization: Bearer {t.key}\r\naccept: text/event-stream\r\n\r\n".encode())
            line = _first_line(await reader.readuntil(b"\r\n\r\n"))
            statuses[line] = statuses.get(line, 0) + 1
            opened.append(writer)
        took = time.perf_counter() - t0
        for w in opened:
            w.close()
        return ", ".join(f"{n}x {line}" for line, n in sorted(statuses.items())), took

    return attack


async def redirect(t: Target) -> tuple[str, float]:
    async with t.client() as client:
        t0 = time.perf_counter()
        r = await client.get("/v1/requests/", headers={"host": "evil.example"}, follow_redirects=False)
        return f"{r.status_code} location={r.headers.get('location')}", time.perf_counter() - t0


async def nothing(t: Target) -> tuple[str, float]:
    """No attack: the machine's own /healthz latency and the api's RSS drift, to compare with."""
    await asyncio.sleep(5)
    return "-", 0.0


ATTACKS: dict[str, Attack] = {
    "no attack (baseline, 5 s)": nothing,
    "completions 20,000 prompts x n=16": completions(20_000, 16),
    "completions 100,000 prompts x n=16": completions(100_000, 16),
    "completions 50,000 prompts x n=1": completions(50_000, 1),
    "completions 1,024 x 1 (over the queue bound)": completions(1024, 1),
    "upload 150 MB without a key": upload_without_key,
    "trailing slash, Host: evil.example": redirect,
    "tokenize 7.8 MB": lambda t: _status(t, "POST", "/tokenize",
                                         json_body={"model": "echo", "prompt": "a" * 7_800_000}),
    "top_k 10^30": lambda t: _status(t, "POST", "/v1/completions",
                                     json_body={"model": "echo", "prompt": "p", "top_k": 10**30}),
    "300 SSE streams of one key": streams_of_one_key(300),
    "1,500 partial headers": partial_headers(1500),
    "3,000 partial headers (over the connection cap)": partial_headers(3000),
    "headers a byte a second": drip_headers,
    "body at 100 B/s": slow_body,
}


def _row(name: str, answer: str, took_s: float, watch: Watch, idle_mib: float) -> str:
    return (f"{name:48s} {answer:90s} {took_s:8.2f} s  +{watch.peak_mib - idle_mib:6.1f} MiB "
            f"(peak {watch.peak_mib:6.1f})  jobs {watch.jobs_peak_mib:6.1f} MiB  "
            f"healthz max {watch.worst_s * 1000:7.1f} ms"
            + (f", {watch.failed} probes failed" if watch.failed else ""))


async def _run(target: Target, pid: int, jobs_pid: int, attacks: dict[str, Attack], only: list[str]) -> None:
    await asyncio.sleep(1)
    idle = max(rss_mib(pid) for _ in range(3))
    typer.echo(f"api idle RSS {idle:.1f} MiB (pid {pid}); jobs worker idle RSS {rss_mib(jobs_pid):.1f} MiB "
               f"(pid {jobs_pid}); load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    typer.echo(f"{'attack':48s} {'answer':90s} {'time':>10s}  api RSS over idle        jobs RSS peak    "
               "longest /healthz")
    for name, attack in attacks.items():
        if only and not any(o.lower() in name.lower() for o in only):
            continue
        watch = Watch(target.url, pid, jobs_pid)
        watch.start()
        try:
            answer, took = await attack(target)
        except Exception as err:  # noqa: BLE001 - a bench reports what failed and goes on
            answer, took = f"error: {type(err).__name__}: {err}", float("nan")
        watch.stop()
        typer.echo(_row(name, answer, took, watch, idle))
    typer.echo(f"load average after: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")


def hostile(
    only: list[str] = typer.Option([], "--only",
                                   help="run the attacks whose names contain this (repeatable)"),
    header_timeout_s: float | None = typer.Option(None, help="SLUICE_API_HEADER_TIMEOUT_S for the api"),
    body_timeout_s: float | None = typer.Option(None, help="SLUICE_API_BODY_TIMEOUT_S for the api"),
    batch_lines: int = typer.Option(1_000_000, help="lines of the big batch input file (131 bytes each)"),
    max_batch_lines: int | None = typer.Option(None, help="SLUICE_MAX_BATCH_LINES for the stack: at or above "
                                                          "--batch-lines, the big file is run, not refused"),
    batch_run_s: float = typer.Option(30.0,
                                      help="how long the big batch's rows run before the bench cancels it"),
) -> None:
    """Replay issue 29's attacks against a local stack (Redis, a null worker, the jobs worker, one
    keyed api)."""
    key = secrets.token_urlsafe(24)
    data = Path(tempfile.mkdtemp(prefix="sluice-hostile-"))
    spool = data / "tmp"
    spool.mkdir()
    env = {"SLUICE_API_KEYS": f"admin:{key}", "TMPDIR": str(spool)}
    for name, value in (("SLUICE_API_HEADER_TIMEOUT_S", header_timeout_s),
                        ("SLUICE_API_BODY_TIMEOUT_S", body_timeout_s),
                        ("SLUICE_MAX_BATCH_LINES", max_batch_lines)):
        if value:
            env[name] = str(value)
    attacks = {**ATTACKS,
               f"batch input file of {batch_lines:,} lines": big_batch(batch_lines, data, batch_run_s)}
    with LocalStack(data, models_yaml=MODELS, env=env) as stack:
        stack.start_redis()
        stack.start_worker("echo", engine="null")
        jobs = stack.start_jobs()
        stack.start_api()
        stack.wait_ready(120, probe="healthz")
        pid = next(iter(stack.apis.values())).pid
        asyncio.run(_run(Target(stack.url, key, spool), pid, jobs.pid, attacks, only))
