"""`lpf watch` put together: the run directory, the recorder, the scoring process, the proxy under uvicorn.

Contract: `prepare(out, reference, upstream, ...)` validates and creates the run directory (manifest in
the run schema: engine `openai` at the upstream, model and reference `--reference`, the reference's
tokenizer fingerprint; no API key anywhere) and returns it; `serve(settings, sock, on_ready, on_window)`
runs until SIGINT/SIGTERM (or `--fail-after` alarms) and returns a `Outcome` (requests proxied, sampled,
recorded, dropped, windows, alarms, whether --fail-after fired). Beside the proxy: /metrics, the live page at
/lpf/ and the report of the recording so far at /lpf/report.html (`lpf.watch.snapshot`, which the page's flagged
requests link into). In-flight requests get 10 s to finish,
the recorder commits what it holds, the scorer is stopped. It prints nothing: the command line renders.
"""

from __future__ import annotations

import json
import platform
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

from lpf.core.errors import LpfError
from lpf.watch.spec import SCORER_SPEC, WatchSpec


# the settings of one watch: validated on construction (lpf.watch.spec); `Settings` is its old name here
Settings = WatchSpec


@dataclass
class Outcome:
    proxied_sampled: int = 0
    recorded: int = 0
    dropped: int = 0
    windows: list = field(default_factory=list)
    alarms: int = 0
    failed: bool = False
    scorer_restarts: int = 0


def prepare(s: Settings):
    """The run directory, created (or an LpfError: a bad reference, an occupied --out)."""
    import lpf
    from lpf.core.model_specs import load_tokenizer, resolve_model, tokenizer_fingerprint
    from lpf.core.sampling import SamplingParams
    from lpf.pipeline.generate import model_config
    from lpf.run.store import RunDir

    model = resolve_model(s.local_model)
    cfg = model_config(model)
    tokenizer = load_tokenizer(model)
    manifest = {
        "run_id": uuid.uuid4().hex[:12],
        "lpf_version": lpf.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "status": "running",
        "engine": {
            "name": "openai",
            "options": {"base_url": s.upstream, "dtype": s.upstream_dtype},
            "watch": {"sample": s.sample, "seed": s.seed, "keep_text": s.keep_text, "window": s.window},
        },
        "model": {**model.describe(), "architecture": (cfg.get("architectures") or ["?"])[0]},
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
        "workload": {"source": "live traffic (lpf watch)", "n_prompts": None, "n": 1, "n_requests": None},
        "sampling": SamplingParams(logprobs=s.top_k).to_dict(),
        "seed": s.seed,
        "part_size": s.part_rows,
        "host": {
            "hostname": socket.gethostname(),
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
    }
    run = RunDir.create(s.out, manifest)
    (run.path / "live").mkdir(exist_ok=True)  # the scorer's windows, status and log (not parts)
    return run, tokenizer, int(cfg.get("vocab_size", len(tokenizer)))


def serve(
    s: Settings, sock: socket.socket, on_ready: Callable[[int], None], on_window: Callable[[dict], None]
) -> Outcome:
    import uvicorn

    from lpf.serve.server import serve_until_stopped
    from lpf.watch.metrics import WatchMetrics
    from lpf.watch.proxy import create_proxy
    from lpf.watch.record import Recording
    from lpf.watch.recorder import Recorder
    from lpf.watch.retention import parse_retain
    from lpf.watch.sample import Sampler
    from lpf.watch.scorer import STATUS
    from lpf.watch.snapshot import PAGE as REPORT_PAGE
    from lpf.watch.snapshot import Snapshots
    from lpf.watch.supervisor import Supervisor

    sampler = Sampler(s.sample, s.seed)
    retention = parse_retain(s.retain)
    metrics = WatchMetrics()
    run, tokenizer, vocab = prepare(s)
    recorder = Recorder(
        run, Recording(tokenizer, vocab, s.keep_text), s.queue_size, s.part_rows, s.part_seconds, retention
    )
    held: dict = {}

    async def page():
        from fastapi.responses import HTMLResponse

        from lpf.watch.page import render_page

        sup, state = held["sup"], app.state.proxy
        counters = {
            "sampled": state.seq,
            "recorded": recorder.recorded,
            "dropped": recorder.dropped,
            "windows": len(sup.windows),
            "alarms": sup.alarms,
            "upstream-failing windows": sum(1 for w in sup.windows if w.get("upstream_failing")),
            "scorer restarts": sup.restarts,
        }
        config = {
            "upstream": s.upstream,
            "upstream dtype": s.upstream_dtype or "not stated (the most lenient floor)",
            "reference": s.reference,
            "reference dtype": s.reference_dtype,
            "window": s.window,
            "sample": s.sample,
        }
        try:
            status = json.loads((run.path / STATUS).read_text())
        except (OSError, ValueError):
            status = None
        return HTMLResponse(render_page(sup.windows, counters, config, status))

    snapshots = Snapshots(run.path)

    async def report():
        from fastapi.responses import HTMLResponse, PlainTextResponse

        try:
            return HTMLResponse(await snapshots.report(len(held["sup"].windows)))
        except LpfError as e:
            return PlainTextResponse(str(e) + "\n", status_code=503)

    routes = {"/lpf/": page, f"/lpf/{REPORT_PAGE}": report}
    app = create_proxy(s.upstream, sampler, recorder, metrics, s.top_k, s.upstream_timeout, routes)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level=s.log_level, timeout_graceful_shutdown=10, lifespan="on", access_log=False)
    )
    # the scorer reads its settings as `lpf audit --spec FILE` reads an AuditSpec (lpf.watch.spec)
    (run.path / SCORER_SPEC).write_text(s.scorer_spec().model_dump_json(indent=2) + "\n")
    sup = Supervisor(
        run.path,
        ["--spec", str(run.path / SCORER_SPEC)],
        metrics,
        on_window,
        s.alert_webhook,
        s.fail_after,
        stop=lambda: setattr(server, "should_exit", True),
    )

    held["sup"] = sup
    try:
        serve_until_stopped(server, sock, on_ready, before=sup.start if s.scorer else None)
    finally:
        recorder.close()
        if s.scorer:
            sup.tick()  # the last windows the scorer appended
        sup.close()
    if not server.started:
        raise LpfError("the proxy did not start (see the messages above)")
    state = app.state.proxy
    return Outcome(
        proxied_sampled=state.seq,
        recorded=recorder.recorded,
        dropped=recorder.dropped,
        windows=sup.windows,
        alarms=sup.alarms,
        failed=sup.failed,
        scorer_restarts=sup.restarts,
    )
