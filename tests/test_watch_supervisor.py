"""The supervisor's restarts: a scorer that dies at once (a real child process that exits) is restarted after
a backoff that doubles up to its cap, then given up on (gauge, one ERROR line); one that lives long enough
before dying is restarted at the first backoff every time and never given up on."""

from __future__ import annotations

import json
import logging
import sys
import time

from lpf.watch.metrics import WatchMetrics
from lpf.watch.supervisor import Supervisor


def _run_until(sup: Supervisor, done, limit: float = 30.0) -> None:
    sup.start()
    end = time.monotonic() + limit
    while not done() and time.monotonic() < end:
        time.sleep(0.02)
    sup.close()


def test_a_scorer_that_fails_at_once_is_backed_off_then_given_up(tmp_path, caplog):
    (tmp_path / "live").mkdir()
    m = WatchMetrics()
    sup = Supervisor(
        tmp_path,
        [],
        m,
        lambda w: None,
        poll=0.01,
        backoff=0.1,
        backoff_cap=0.4,
        give_up_after=5,
        command=[sys.executable, "-c", "import sys; print('no model fits'); sys.exit(3)"],
    )
    with caplog.at_level(logging.WARNING, logger="lpf.watch"):
        _run_until(sup, lambda: sup.gave_up)
    assert sup.gave_up and sup.restarts == 4 and len(sup.spawned_at) == 5
    waits = [
        float(r.getMessage().rsplit(" in ", 1)[1].split(" s")[0])
        for r in caplog.records
        if r.levelno == logging.WARNING
    ]
    assert waits == [0.1, 0.2, 0.4, 0.4]  # doubling, capped
    gaps = [b - a for a, b in zip(sup.spawned_at, sup.spawned_at[1:])]
    assert all(g >= w for g, w in zip(gaps, waits)), (gaps, waits)  # each restart waited its backoff out
    err = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(err) == 1
    rec = json.loads(err[0].getMessage())
    assert (
        rec["event"] == "lpf_watch_scorer_gave_up" and rec["consecutive_failures"] == 5 and rec["last_exit_code"] == 3
    )
    text = m.render()[0].decode()
    assert "lpf_watch_scorer_gave_up 1.0" in text and "lpf_watch_scorer_up 0.0" in text
    assert "lpf_watch_scorer_restarts 4.0" in text
    assert (tmp_path / "live" / "scorer.log").read_text().count("no model fits") == 5
    time.sleep(0.3)
    assert len(sup.spawned_at) == 5  # given up: nothing more is started


def test_a_scorer_that_lived_long_enough_is_restarted_at_the_first_backoff(tmp_path, caplog):
    (tmp_path / "live").mkdir()
    m = WatchMetrics()
    sup = Supervisor(
        tmp_path,
        [],
        m,
        lambda w: None,
        poll=0.01,
        backoff=0.05,
        backoff_cap=10.0,
        give_up_after=2,
        healthy_after=0.1,
        command=[sys.executable, "-c", "import time; time.sleep(0.2)"],
    )
    with caplog.at_level(logging.WARNING, logger="lpf.watch"):
        _run_until(sup, lambda: sup.restarts >= 3)
    assert sup.restarts >= 3 and not sup.gave_up and sup.quick_failures == 1
    waits = {r.getMessage().rsplit(" in ", 1)[1] for r in caplog.records if r.levelno == logging.WARNING}
    assert waits == {"0.1 s"}  # 0.05 s, printed to one decimal: never doubled
    assert "lpf_watch_scorer_gave_up 0.0" in m.render()[0].decode()
