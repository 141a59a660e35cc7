"""The service's /metrics in Prometheus's text format (version 0.0.4): what a scraper needs to see a
fleet's load and its verdicts."""

from __future__ import annotations

from launch.serve.dispatch import LATENCY_BOUNDS


def render(snap: dict, live_verifiers: int) -> str:
    lines = [
        "# HELP kiln_serve_queue_depth Jobs waiting for a verifier.",
        "# TYPE kiln_serve_queue_depth gauge",
        f"kiln_serve_queue_depth {snap['queued']}",
        "# HELP kiln_serve_running Jobs a verifier is working on.",
        "# TYPE kiln_serve_running gauge",
        f"kiln_serve_running {snap['running']}",
        "# HELP kiln_serve_busy_workers Service workers in a verification, of kiln_serve_workers.",
        "# TYPE kiln_serve_busy_workers gauge",
        f"kiln_serve_busy_workers {snap['busy_workers']}",
        "# TYPE kiln_serve_workers gauge",
        f"kiln_serve_workers {snap['workers']}",
        "# HELP kiln_serve_verifiers Verifiers serving.",
        "# TYPE kiln_serve_verifiers gauge",
        f"kiln_serve_verifiers {live_verifiers}",
        "# HELP kiln_serve_retried_total Jobs retried once after their verifier died.",
        "# TYPE kiln_serve_retried_total counter",
        f"kiln_serve_retried_total {snap['retried']}",
        "# HELP kiln_serve_cancelled_total Running jobs whose work was cancelled when their deadline passed.",
        "# TYPE kiln_serve_cancelled_total counter",
        f"kiln_serve_cancelled_total {snap['cancelled']}",
        "# HELP kiln_serve_verdicts_total Answered jobs by verdict: pass, an error class, or timeout.",
        "# TYPE kiln_serve_verdicts_total counter",
    ]
    for verdict, count in sorted(snap["verdicts"].items()):
        lines.append(f'kiln_serve_verdicts_total{{verdict="{verdict}"}} {count}')
    lines += [
        "# HELP kiln_serve_latency_seconds Time from a job's arrival to its answer.",
        "# TYPE kiln_serve_latency_seconds histogram",
    ]
    total = 0
    for bound, count in zip(LATENCY_BOUNDS, snap["latency"], strict=False):
        total += count
        lines.append(f'kiln_serve_latency_seconds_bucket{{le="{bound:g}"}} {total}')
    total += snap["latency"][-1]
    lines += [
        f'kiln_serve_latency_seconds_bucket{{le="+Inf"}} {total}',
        f"kiln_serve_latency_seconds_sum {snap['latency_sum']:.6f}",
        f"kiln_serve_latency_seconds_count {total}",
    ]
    return "\n".join(lines) + "\n"
