"""`lpf watch` drills with real parts (slow: each starts `lpf serve` and `lpf watch` processes).

- The model swapped under its name: `lpf serve` (zoo:hybrid, float32) stopped in the middle of a clean stream of
  requests (a window of them sent while it is down) and restarted on the same port with
  `--inject quantize-weights:4`: no window before the swap alarms, the outage's window is `upstream-failing`
  (on the live page too) and the lag is back to 0 after it, the first window after the swap alarms, its change
  point names the swap's first request and the next alarmed window the same incident; the live page links the
  flagged requests into the drill-down of the report of the recording so far; a real Prometheus server
  (Debian's `prometheus`, when installed) scraping /metrics sees `lpf_watch_alarms_total` at 0 before the swap
  and rising after it (PromQL over its HTTP API), and the shipped rules fire (the swap's and the outage's).
- Concurrent clients (64 at once) with disconnects and malformed bodies, the scorer SIGKILLed mid-run: every
  client that stayed got the upstream's own answer, the clients that left (after 2 s, on long answers) had
  their upstream requests cancelled (`lpf serve` counts them), every sample is recorded or counted as
  dropped, the scorer comes back, and a SIGKILL of `lpf watch` itself leaves every committed sample readable.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

import lpf.watch.metrics
from lpf.serve.process import free_port, served
from lpf.watch.process import watched

MODEL = "zoo:hybrid"
RULES = Path(lpf.watch.metrics.__file__).parent / "assets" / "alerts.yml"
pytestmark = pytest.mark.slow
ENV = {"OMP_NUM_THREADS": "1"}


def wait_for(pred, timeout: float = 180.0, what: str = "condition", show=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}" + (f": {show()}" if show else ""))


def windows(out) -> list[dict]:
    p = out / "live" / "windows.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.is_file() else []


def _prompts(n: int, seed: int) -> list[str]:
    from lpf.zoo import registry

    return [it["prompt"] for it in registry.workload_items("oracle", seed=seed, n=n)]


def _prometheus() -> str | None:
    """Debian's `prometheus` (apt-get install prometheus, or its .deb unpacked: LPF_PROMETHEUS=path/to/prometheus)."""
    return os.environ.get("LPF_PROMETHEUS") or shutil.which("prometheus")


@contextmanager
def _scraping(target: str, tmp: Path):
    """A real Prometheus server scraping `target` (HOST:PORT) every second; yields its base URL, or None without one."""
    exe = _prometheus()
    if exe is None:
        yield None
        return
    port = free_port()
    cfg = tmp / "prometheus.yml"
    cfg.write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{RULES}']\n"  # the alert rules lpf ships (docs/watch.md)
        f"scrape_configs:\n  - job_name: lpf-watch\n    static_configs:\n      - targets: ['{target}']\n"
    )
    log = open(tmp / "prometheus.log", "wb")
    proc = subprocess.Popen(
        [exe, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: _ready(url), timeout=60, what="Prometheus ready")
        yield url
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _promql(url: str, query: str, at: float | None = None) -> float | None:
    params = {"query": query, **({"time": at} if at is not None else {})}
    got = httpx.get(f"{url}/api/v1/query", params=params, timeout=10).json()["data"]["result"]
    return float(got[0]["value"][1]) if got else None


@pytest.fixture(scope="module")
def swap(tmp_path_factory):
    """`lpf serve` clean for two windows of requests, then stopped (a window of requests sent meanwhile: 502s), then
    restarted on its port with quantize-weights:4 for two more, behind `lpf watch` (every request sampled, windows of
    8), scraped by Prometheus when there is one."""
    tmp = tmp_path_factory.mktemp("swap")
    port, out, w = free_port(), tmp / "run", 8
    prompts = _prompts(5 * w, seed=21)
    # the server computes in float32 (said: an unknown dtype is judged against the most lenient floor, bfloat16's,
    # and the swap's first request can fall inside it: the change point then lands one request late)
    args = [
        "--reference",
        MODEL,
        "--sample",
        "1",
        "--window",
        w,
        "--part-seconds",
        "0.3",
        "--upstream-dtype",
        "float32",
    ]

    def send(base, ps, status=200):
        for p in ps:  # one at a time: arrival order is the order sent
            r = httpx.post(
                f"{base}/v1/completions",
                json={"model": MODEL, "prompt": p, "max_tokens": 16, "temperature": 0, "ignore_eos": True},
                timeout=120,
            )
            assert r.status_code == status, r.text

    result = {"w": w, "out": out}
    with served("--model", MODEL, "--cache-mb", 12, "--port", port, env=ENV) as clean:
        with watched(clean.base_url, out, *args, env=ENV) as proxy:
            with _scraping(f"127.0.0.1:{proxy.port}", tmp) as prom:
                send(proxy.base_url, prompts[: 2 * w])
                wait_for(lambda: len(windows(out)) >= 2, what="the clean windows judged")
                time.sleep(2.5)  # two scrapes of the clean state
                result["t_clean"] = time.time()
                clean.stop()
                send(proxy.base_url, prompts[2 * w : 3 * w], status=502)  # the upstream is down: a window of them
                with served(
                    "--model", MODEL, "--cache-mb", 12, "--port", port, "--inject", "quantize-weights:4", env=ENV
                ):
                    send(proxy.base_url, prompts[3 * w :])
                    result["windows"] = wait_for(lambda: len(windows(out)) >= 5 and windows(out), what="5 windows")
                    # the outage over and every answered sample scored: no lag left in the metrics
                    result["metrics"] = wait_for(
                        lambda: "lpf_watch_scoring_lag_requests 0.0"
                        in (m := httpx.get(f"{proxy.base_url}/metrics").text)
                        and "lpf_watch_alarms_total 2.0" in m
                        and m,
                        timeout=30,
                        what="the lag back to 0",
                    )
                # the live page once it shows the alarm's flagged requests, and the report its links lead to
                result["page"] = wait_for(
                    lambda: "report.html#request-" in (page := httpx.get(f"{proxy.base_url}/lpf/").text) and page,
                    timeout=30,
                    what="the flagged requests on the live page",
                )
                result["report"] = httpx.get(f"{proxy.base_url}/lpf/report.html", timeout=300)
                if prom is not None:
                    q = "lpf_watch_alarms_total"
                    result["alarms_after"] = wait_for(lambda: (_promql(prom, q) or 0) >= 1 and _promql(prom, q))
                    result["alarms_before"] = _promql(prom, q, result["t_clean"])
                    result["rise"] = _promql(prom, f"increase({q}[10m])")
                    firing = 'ALERTS{alertname="LpfWatchEngineDeparts",alertstate="firing"}'
                    result["firing"] = wait_for(lambda: _promql(prom, firing), timeout=30, what="the alert firing")
                    failing = 'ALERTS{alertname="LpfWatchUpstreamFailing",alertstate="firing"}'
                    result["failing"] = wait_for(lambda: _promql(prom, failing), timeout=30, what="the outage alert")
                result["prometheus"] = prom
    return result


def test_a_model_swapped_under_its_name_alarms_in_the_first_window_after_the_swap(swap):
    got, w = swap["windows"], swap["w"]
    assert [x["alarm"] for x in got[:5]] == [False, False, False, True, True], [
        (x["verdicts"], x["run_test"]) for x in got
    ]
    # the upstream stopped: its window failed whole, said so, and was no alarm
    assert got[2]["upstream_failing"] and got[2]["n_failed"] == w and got[2]["result"] == "upstream-failing"
    assert f"{w} of {w} failed upstream" in swap["page"]
    assert got[3]["change"]["seq"] == 3 * w and got[3]["change"]["request_id"] == f"w{3 * w:09d}"
    assert got[3]["run_test"]["result"] == "different"
    # one swap, one incident: the next alarmed window names the incident's change point, not one of its own
    assert got[4]["incident"]["id"] == got[3]["window"] and got[4]["incident"]["windows"] == 2
    assert got[4]["change"]["request_id"] == f"w{3 * w:09d}" or got[4]["change"]["refined"]
    # after the outage the lag is back to 0: the failed samples never counted as waiting
    assert "lpf_watch_scoring_lag_seconds 0.0" in swap["metrics"]
    assert 'lpf_watch_windows_total{result="upstream-failing"} 1.0' in swap["metrics"]
    # --fail-after 1 over this swap's own windows (as the scorer wrote them): it stops at the first alarmed one
    from lpf.watch.metrics import WatchMetrics
    from lpf.watch.supervisor import Supervisor

    replay = swap["out"].parent / "replay"
    (replay / "live").mkdir(parents=True)
    (replay / "live" / "windows.jsonl").write_text((swap["out"] / "live" / "windows.jsonl").read_text())
    seen, stopped = [], []
    sup = Supervisor(replay, [], WatchMetrics(), seen.append, fail_after=1, stop=lambda: stopped.append(1))
    try:
        sup.tick()
        sup.tick()
    finally:
        sup.close()
    assert [x["window"] for x in seen] == [x["window"] for x in got[:4]] and stopped == [1] and sup.failed


def test_the_live_page_links_the_flagged_requests_into_the_reports_drill_down(swap):
    flagged = [r for x in swap["windows"] for r in x.get("flagged") or ()]
    linked = re.findall(r"<a href='report\.html#request-([^']+)'>", swap["page"])
    assert linked and set(linked) <= set(flagged) and flagged[0] in linked
    report = swap["report"]
    assert report.status_code == 200 and report.headers["content-type"].startswith("text/html")
    # the report of the recording so far (analysed as a snapshot beside it, never in place): its findings flag the
    # linked requests and its drill-down data holds them (report.js anchors each as request-<id>: test_report.py)
    snap = swap["out"] / "live" / "report"
    assert report.text == (snap / "report.html").read_text() and not (swap["out"] / "findings.json").exists()
    offline = {f["request_id"] for f in json.loads((snap / "findings.json").read_text())["flagged"]}
    assert set(linked) <= offline
    data = report.text.split('<script type="application/json" id="lpf-data">', 1)[1].split("</script>", 1)[0]
    assert set(linked) <= {r["request_id"] for r in json.loads(data)["drill"]["requests"]}


def test_a_real_prometheus_sees_the_alarm_counter_rise_after_the_swap(swap):
    if swap["prometheus"] is None:
        pytest.skip("no prometheus binary (apt-get install prometheus, or LPF_PROMETHEUS=path)")
    assert swap["alarms_before"] == 0.0  # scraped while the upstream was clean
    assert swap["alarms_after"] >= 1.0 and swap["rise"] > 0
    assert swap["firing"] == 1.0  # the shipped rule, evaluated by the real server over the real scrape
    assert swap["failing"] == 1.0  # and the outage's (it clears 10 min after: tests/test_watch_assets.py runs that)


def test_concurrent_clients_disconnects_malformed_bodies_and_a_killed_scorer(tmp_path):
    out = tmp_path / "run"
    prompts = _prompts(64, seed=33)
    args = ["--reference", MODEL, "--sample", "0.5", "--window", "16", "--part-seconds", "0.3"]
    with served("--model", MODEL, "--cache-mb", 16, env=ENV) as up:
        with watched(up.base_url, out, *args, env=ENV) as proxy:
            bodies = []
            for i, p in enumerate(prompts):
                if i % 12 == 5:
                    bodies.append(b'{"model": "zoo:hybrid", "prompt": [1, 2,')  # malformed
                else:
                    body = {"model": MODEL, "prompt": p, "max_tokens": 8 + i % 8, "temperature": 0, "seed": i}
                    if i % 10 == 7:  # a long answer its client will not wait for (~5 s alone on a quiet machine)
                        body.update(max_tokens=1000, ignore_eos=True)
                    bodies.append(json.dumps(body).encode())
            # clients that give up after 2 s: by then their request runs upstream (after 1 s, in a loaded suite, the
            # proxy had once not yet sent it: nothing to cancel)
            leave = {i for i in range(len(bodies)) if i % 10 == 7}

            async def one(client, base, i, raw, short):
                try:
                    return await client.post(
                        f"{base}/v1/completions",
                        content=raw,
                        headers={"content-type": "application/json"},
                        timeout=2.0 if short else 300,
                    )
                except httpx.TimeoutException:
                    return None

            async def burst(base, with_leavers, skip=frozenset()):
                """Every body (None for those in `skip`, not sent), the leavers giving up after 2 s if asked."""
                limits = httpx.Limits(max_connections=128)
                async with httpx.AsyncClient(limits=limits) as client:
                    return await asyncio.gather(
                        *(
                            asyncio.sleep(0) if i in skip else one(client, base, i, raw, with_leavers and i in leave)
                            for i, raw in enumerate(bodies)
                        )
                    )

            cancelled0 = _value(httpx.get(f"{up.base_url}/metrics").text, "lpf_requests_cancelled_total")
            via = asyncio.run(burst(proxy.base_url, True))
            gone = sum(1 for i in leave if via[i] is None)
            # a client that leaves cancels its upstream request (lpf serve counts the requests it took back)
            cancelled = wait_for(
                lambda: _value(httpx.get(f"{up.base_url}/metrics").text, "lpf_requests_cancelled_total") - cancelled0
                or None,
                timeout=30,
                what="the leavers' upstream requests cancelled",
            )
            assert gone >= 1 and 1 <= cancelled <= gone
            # the scorer is SIGKILLed once it has started; proxying goes on through a second burst
            status = out / "live" / "scorer.json"
            wait_for(status.is_file, what="the scorer's first cycle")
            os.kill(json.loads(status.read_text())["pid"], signal.SIGKILL)
            # (the long answers are not asked again: 1000 tokens each, they prove nothing more here)
            again = asyncio.run(burst(proxy.base_url, False, skip=leave))
            assert all(r is not None for i, r in enumerate(again) if i not in leave)
            direct = asyncio.run(burst(up.base_url, False, skip={i for i in leave if via[i] is None}))
            for i, (a, b) in enumerate(zip(via, direct)):
                if i in leave and a is None:
                    continue
                assert a is not None and a.status_code == b.status_code, (i, a and a.text, b.text)
                ja, jb = a.json(), b.json()
                for k in ("id", "created"):
                    ja.pop(k, None), jb.pop(k, None)
                assert ja == jb, i
            metrics = wait_for(
                lambda: (m := httpx.get(f"{proxy.base_url}/metrics").text)
                and _value(m, "lpf_watch_scorer_restarts") >= 1
                and _value(m, "lpf_watch_samples_recorded") + _value(m, "lpf_watch_samples_dropped_total")
                == _value(m, 'lpf_watch_requests_total{route="/v1/completions",sampled="True"}')
                and m,
                what="every sample recorded or dropped, the scorer restarted",
                show=lambda: [
                    x
                    for x in httpx.get(f"{proxy.base_url}/metrics").text.splitlines()
                    if "_created" not in x and not x.startswith("#")
                ],
                timeout=60,
            )
            sampled = _value(metrics, 'lpf_watch_requests_total{route="/v1/completions",sampled="True"}')
            recorded = len(pq.read_table(out / "requests"))
            assert recorded == _value(metrics, "lpf_watch_samples_recorded")
            assert recorded + _value(metrics, "lpf_watch_samples_dropped_total") == sampled > 0
            wait_for(lambda: windows(out), what="a window judged after the restart")
            # a SIGKILL of lpf watch loses no sample already written, and its orphaned scorer stops itself
            scorer_pid = json.loads(status.read_text())["pid"]
            proxy.stop(signal.SIGKILL)
            wait_for(lambda: not _running(scorer_pid), timeout=120, what="the orphaned scorer stopping by itself")
            from lpf.run.store import RunDir

            run = RunDir.open(out)
            assert run.read("requests").num_rows == recorded
            assert set(run.read("tokens", ["request_id"]).column("request_id").to_pylist()) <= set(
                run.read("requests", ["request_id"]).column("request_id").to_pylist()
            )


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its new parent to reap it does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.rsplit(" ", 1)[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_stale_state_under_concurrent_clients_the_imposters_are_flagged_as_they_happen(tmp_path):
    """`lpf serve --inject stale-state` with test_serve_audit's pressure (tiny:jamba, an 8-token step budget, 8
    sequences, a 1 MB cache): 64 concurrent clients through the proxy, every request sampled. The requests the
    windows flag are among the server's own ground truth (its --trace-dir faults) and each window holding one
    alarms (alone: an imposter's token errors are 1e4x the float32 floor, far beyond an honest near tie). Not asserted: the load hypothesis (with ~5 flagged of 64 requests neither the windows nor `lpf
    analyze` on the whole recording rank any hypothesis as significant; it needs a longer run)."""
    knobs = ["--cache-mb", 1, "--max-num-batched-tokens", 8, "--max-num-seqs", 8]
    trace, out = tmp_path / "trace", tmp_path / "run"
    prompts = _prompts(64, seed=11)
    # the server computes in float32 (lpf serve's default): said, so the floor is float32's. Left unknown, the
    # most lenient floor (bfloat16's, 4-8x wider on the tiny random models) holds these imposters' errors
    args = ["--reference", "tiny:jamba", "--sample", "1", "--window", "16", "--part-seconds", "0.3"]
    args += ["--upstream-dtype", "float32"]
    with served("--model", "tiny:jamba", *knobs, "--inject", "stale-state", "--trace-dir", trace, env=ENV) as up:
        with watched(up.base_url, out, *args, env=ENV) as proxy:

            async def burst():
                async with httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=300) as client:
                    return await asyncio.gather(
                        *(
                            client.post(
                                f"{proxy.base_url}/v1/completions",
                                json={"model": "tiny:jamba", "prompt": p, "max_tokens": 16, "temperature": 0},
                                headers={"X-Request-Id": f"c{i}"},
                            )
                            for i, p in enumerate(prompts)
                        )
                    )

            assert all(r.status_code == 200 for r in asyncio.run(burst()))
            got = wait_for(lambda: len(windows(out)) >= 4 and windows(out), what="4 windows judged")
    truth = {
        r.removeprefix("cmpl-").removesuffix("-0")
        for r in pq.read_table(trace / "faults").column("request_id").to_pylist()
    }
    upstream = {
        r["request_id"]: r["upstream_request_id"].removeprefix("cmpl-")
        for r in pq.read_table(out / "watch").to_pylist()
    }
    flagged = {upstream[r] for w in got for r in w["flagged"]}
    assert truth and flagged and flagged <= truth, (flagged - truth, truth)
    assert all(w["alarm"] for w in got if w["flagged"])
