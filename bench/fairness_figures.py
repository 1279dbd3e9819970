"""The figures of `sluice bench fairness` (bench/fairness.py): per tenant, from the final results
of what it sent, the tokens served inside a time span (each request's prompt at its first token,
its output spread evenly up to its final), its share of the service overall and in every 30 s
window, and its TTFT and queueing quantiles."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

WINDOW_S = 30.0


class SentRequest(Protocol):
    tenant: str
    at: float
    rid: str | None
    refused: int


@dataclass
class TenantFigures:
    tokens_per_s: float = 0.0
    share: float = 0.0
    window_shares: list[float] = field(default_factory=list)
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    queued_p99: float | None = None  # admission to start: the scheduler's part of the TTFT
    sent: int = 0
    done: int = 0
    refused: int = 0


def quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _service(result: dict, start: float, end: float) -> tuple[float, float]:
    """Tokens of a request served within [start, end): (prompt + output, prompt + 2 x output),
    the prompt at its first token, the output spread evenly up to its final."""
    t = result.get("timings") or {}
    usage = result.get("usage") or {}
    first, finished = t.get("first_token"), t.get("finished")
    if first is None or finished is None:
        return 0.0, 0.0
    prompt, output = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    inside = prompt if start <= first < end else 0
    span = max(finished - first, 1e-9)
    part = max(0.0, min(end, finished) - max(start, first)) / span
    return inside + output * part, inside + 2 * output * part


def figures_of(sent: Sequence[SentRequest], results: dict[str, dict], start: float,
               end: float) -> dict[str, TenantFigures]:
    tenants = sorted({s.tenant for s in sent})
    out = {t: TenantFigures() for t in tenants}
    windows = [(w, min(w + WINDOW_S, end)) for w in _frange(start, end, WINDOW_S)
               if min(w + WINDOW_S, end) - w >= WINDOW_S / 2]  # a last window under half of one is left out
    served: dict[str, float] = dict.fromkeys(tenants, 0.0)
    weighted: dict[str, float] = dict.fromkeys(tenants, 0.0)
    per_window = [dict.fromkeys(tenants, 0.0) for _ in windows]
    for s in sent:
        f = out[s.tenant]
        f.sent += 1
        f.refused += s.refused != 0
        result = results.get(s.rid or "")
        if result is None or result.get("status") != "done":
            continue
        f.done += 1
        plain, vtc = _service(result, start, end)
        served[s.tenant] += plain
        weighted[s.tenant] += vtc
        for i, (w0, w1) in enumerate(windows):
            per_window[i][s.tenant] += _service(result, w0, w1)[1]
    ttfts: dict[str, list[float]] = {t: [] for t in tenants}
    queued: dict[str, list[float]] = {t: [] for t in tenants}
    for s in sent:
        result = results.get(s.rid or "")
        timings = (result or {}).get("timings") or {}
        if s.at >= start and timings.get("first_token") and timings.get("enqueued"):
            ttfts[s.tenant].append(timings["first_token"] - timings["enqueued"])
            queued[s.tenant].append(timings["started"] - timings["enqueued"])
    total = sum(weighted.values()) or 1.0
    for t, f in out.items():
        f.tokens_per_s = served[t] / (end - start)
        f.share = weighted[t] / total
        f.window_shares = [w[t] / (sum(w.values()) or 1.0) for w in per_window]
        f.ttft_p50, f.ttft_p99 = quantile(ttfts[t], 0.5), quantile(ttfts[t], 0.99)
        f.queued_p99 = quantile(queued[t], 0.99)
    return out


def _frange(start: float, end: float, step: float) -> list[float]:
    out, x = [], start
    while x < end:
        out.append(x)
        x += step
    return out
