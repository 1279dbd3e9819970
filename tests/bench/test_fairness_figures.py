"""sluice bench fairness's figures: service inside a span, shares per 30 s window, quantiles."""

from __future__ import annotations

from sluice.bench.fairness import Sent
from sluice.bench.fairness_figures import figures_of


def result(first: float, finished: float, output: int, prompt: int = 10) -> dict:
    return {"status": "done", "usage": {"prompt_tokens": prompt, "completion_tokens": output},
            "timings": {"enqueued": first - 0.25, "started": first - 0.2, "first_token": first, "finished": finished}}


def test_shares_follow_the_tokens_served_in_each_window() -> None:
    sent, results = [], {}
    for i in range(60):  # a: one request a second, 30 output tokens over 1 s; b: one every 3 s
        sent.append(Sent("a", float(i), f"a{i}"))
        results[f"a{i}"] = result(i + 0.5, i + 1.5, 30)
        if i % 3 == 0:
            sent.append(Sent("b", float(i), f"b{i}"))
            results[f"b{i}"] = result(i + 0.5, i + 1.5, 30)
    sent.append(Sent("b", 5.0, None, refused=429))
    figures = figures_of(sent, results, 0.0, 60.0)
    a, b = figures["a"], figures["b"]
    assert len(a.window_shares) == 2 and all(abs(s - 0.75) < 0.02 for s in a.window_shares)
    assert abs(a.share - 0.75) < 0.01 and abs(a.tokens_per_s - 40) < 1  # (10 + 30) a second
    assert (b.sent, b.done, b.refused) == (21, 20, 1)
    assert abs(a.ttft_p50 - 0.25) < 1e-9 and abs(a.queued_p99 - 0.05) < 1e-9
