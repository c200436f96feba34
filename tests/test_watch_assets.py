"""The files `lpf watch` ships for users to import: Prometheus alert rules and a Grafana dashboard.

- The rules pass the real `promtool check rules`, and `promtool test rules` (Prometheus's own rule engine
  over given series) shows the scoring-lag alert firing on a real lag and clearing once nothing waits, the
  departure alert firing on an alarm, the upstream-failing alert on an upstream-failing window.
- Every metric either file reads is one `lpf watch` serves (from its start: `WatchMetrics().render()`), so a
  renamed metric cannot leave a rule or a panel reading nothing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import lpf.watch.metrics

from lpf.watch.metrics import WatchMetrics

ASSETS = Path(lpf.watch.metrics.__file__).parent / "assets"
RULES = ASSETS / "alerts.yml"
DASHBOARD = ASSETS / "grafana-dashboard.json"


def _promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("no promtool (Debian's prometheus package)")
    return exe


def _metric_names(expr: str) -> set[str]:
    return {n for n in re.findall(r"\b(lpf_watch_[a-z_]+)", expr)}


def _served_names() -> set[str]:
    text = WatchMetrics().render()[0].decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_every_metric_the_rules_and_the_dashboard_read_is_served_from_the_start():
    served = _served_names()
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    dash = json.loads(DASHBOARD.read_text())
    exprs = [r["expr"] for r in rules] + [t["expr"] for p in dash["panels"] for t in p["targets"]]
    exprs += [a["expr"] for a in dash["annotations"]["list"]]
    used = set().union(*(_metric_names(e) for e in exprs))
    assert used and used <= served, used - served
    assert len(rules) == 5 and all(p["targets"] for p in dash["panels"])


def test_promtool_checks_the_rules_and_runs_them_over_an_outage(tmp_path):
    exe = _promtool()
    r = subprocess.run([exe, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS: 5 rules found" in r.stdout, r.stdout + r.stderr
    rules = {x["alert"]: x for x in yaml.safe_load(RULES.read_text())["groups"][0]["rules"]}
    inst = {"instance": "watch:8100", "job": "lpf-watch"}

    def fired(name: str) -> list[dict]:
        return [{"exp_labels": {**inst, **rules[name]["labels"]}, "exp_annotations": rules[name]["annotations"]}]

    series = '{instance="watch:8100",job="lpf-watch"}'
    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    # the reference stalls for 9 minutes (the oldest answered sample waits longer and longer),
                    # then catches up: nothing waits, the lag is 0 (failed samples never count)
                    {
                        "series": f"lpf_watch_scoring_lag_seconds{series}",
                        "values": "0 0 60 120 180 240 300 360 420 480 540 0 0 0",
                    },
                    {"series": f"lpf_watch_alarms_total{series}", "values": "0 0 0 0 0 1 1 1 1 1 1 1 1 1"},
                    {
                        "series": f"lpf_watch_upstream_failing_windows_total{series}",
                        "values": "0 0 0 0 0 0 0 0 0 0 0 0 0 0",
                    },
                ],
                "alert_rule_test": [
                    {"eval_time": "7m", "alertname": "LpfWatchScoringBehind", "exp_alerts": []},  # pending (for: 2m)
                    {
                        "eval_time": "9m",
                        "alertname": "LpfWatchScoringBehind",
                        "exp_alerts": fired("LpfWatchScoringBehind"),
                    },
                    {"eval_time": "12m", "alertname": "LpfWatchScoringBehind", "exp_alerts": []},  # cleared
                    {"eval_time": "4m", "alertname": "LpfWatchEngineDeparts", "exp_alerts": []},
                    {
                        "eval_time": "6m",
                        "alertname": "LpfWatchEngineDeparts",
                        "exp_alerts": fired("LpfWatchEngineDeparts"),
                    },
                    {"eval_time": "13m", "alertname": "LpfWatchUpstreamFailing", "exp_alerts": []},
                ],
            },
            {
                "interval": "1m",
                "input_series": [
                    {"series": f"lpf_watch_upstream_failing_windows_total{series}", "values": "0 0 1 2 2 2"},
                ],
                "alert_rule_test": [
                    {"eval_time": "1m", "alertname": "LpfWatchUpstreamFailing", "exp_alerts": []},
                    {
                        "eval_time": "3m",
                        "alertname": "LpfWatchUpstreamFailing",
                        "exp_alerts": fired("LpfWatchUpstreamFailing"),
                    },
                ],
            },
        ],
    }
    spec = tmp_path / "alerts_test.yml"
    spec.write_text(yaml.safe_dump(tests))
    r = subprocess.run([exe, "test", "rules", str(spec)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
