"""A real daemon's start-up report: READY comes with one log line of the whole start-up time and
its phases (the coordinator's, then the slowest rank's as it measured them), and /health and
/metrics carry the same figures; the phases are non-negative and sum to at most the total.
"""

from __future__ import annotations

import re
import urllib.request

PHASES = ["coordinator", "workers up", "adapters", "weights", "KV pool", "graphs", "warm-up"]


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("lorad_startup")}


def test_ready_reports_the_start_in_the_log_health_and_metrics(start_lorad):
    daemon = start_lorad("--parallel", "2")
    health = daemon.health()
    total, phases = health["startup_s"], health["startup_phases_s"]
    assert list(phases) == PHASES
    assert all(seconds >= 0 for seconds in phases.values()), phases
    assert sum(phases.values()) <= total + 0.005, (phases, total)  # each rounded to 1 ms
    assert phases["workers up"] > 0 and phases["weights"] > 0, phases

    found = re.findall(r"lorad: ready in (\d+\.\d) s \((.*)\)", daemon.log())
    assert len(found) == 1, daemon.log()[-3000:]
    assert abs(float(found[0][0]) - total) <= 0.051  # 0.1 s in the log, 1 ms on /health
    assert [part.rsplit(" ", 2)[0] for part in found[0][1].split(", ")] == PHASES

    metrics = _metrics(daemon.url)
    assert round(metrics["lorad_startup_seconds"], 3) == total
    for name, seconds in phases.items():
        assert round(metrics[f'lorad_startup_phase_seconds{{phase="{name}"}}'], 3) == seconds
    assert daemon.stop() == 0
