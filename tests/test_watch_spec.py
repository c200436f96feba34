"""`lpf watch`'s settings as one validated value (`lpf.watch.spec.WatchSpec`) and the scorer's as another
(`ScorerSpec`), read by the scoring process as `lpf audit --spec FILE|-` reads an AuditSpec.

- Bounds the old piecemeal checks missed are one line naming the flag, exit 2, nothing written.
- Neither spec takes a setting it does not know; the scorer's spec round-trips through JSON.
- A real `python -m lpf.watch.scorer RUN --spec -` reads its settings from stdin (the reference dtype it
  was given lands in the run's manifest), and a bad spec is one line, exit 2.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from pydantic import ValidationError


@pytest.mark.parametrize(
    "args,says",
    [
        (["--queue", "0"], "--queue must be >= 1, got 0"),
        (["--fail-after", "0"], "--fail-after must be >= 1, got 0"),
        (["--top-k", "-1"], "--top-k must be >= 0, got -1"),
        (["--part-seconds", "0"], "--part-seconds must be > 0"),
    ],
)
def test_bad_watch_bounds_are_one_line_naming_the_flag(lpf_cli, tmp_path, args, says):
    base = ["--reference", "zoo:hybrid", "--out", tmp_path / "run", "--upstream", "http://127.0.0.1:1"]
    r = lpf_cli("watch", *base, "--listen", "127.0.0.1:0", *args)
    assert r.code == 2 and says in r.err and "Traceback" not in r.err, r.err
    assert not (tmp_path / "run").exists()


def test_the_specs_refuse_unknown_settings_and_the_scorers_round_trips(tmp_path):
    from lpf.watch.spec import ScorerSpec, WatchSpec, read_scorer_spec

    with pytest.raises(ValidationError, match="windw"):
        WatchSpec(upstream="http://127.0.0.1:1", reference="zoo:hybrid", out=tmp_path / "run", windw=3)
    w = WatchSpec(upstream="http://h:1", reference="zoo:hybrid", out=tmp_path / "run", window=7, max_lag=9)
    s = w.scorer_spec()
    assert (s.window, s.max_lag, s.reference, s.executor) == (7, 9, "zoo:hybrid", "local")
    assert read_scorer_spec(s.model_dump_json(), "x") == s
    with pytest.raises(ValidationError):
        ScorerSpec(reference="zoo:hybrid", window=0)


def _scorer(run, text: str) -> subprocess.Popen:
    spec = run.parent / "spec-on-stdin.json"
    spec.write_text(text)
    with open(spec) as stdin:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "lpf.watch.scorer", str(run), "--spec", "-"],
            stdin=stdin,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )


def test_a_bad_scorer_spec_is_one_line_and_exit_2(tmp_path):
    from click.testing import CliRunner

    from lpf.watch.scorer import main

    r = CliRunner().invoke(main, [str(tmp_path), "--spec", "-"], input=json.dumps({"reference": "x", "windw": 3}))
    assert r.exit_code == 2 and "not a scorer spec (windw: Extra inputs are not permitted)" in r.output, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)


@pytest.mark.slow  # a scoring process of its own, loading torch and the reference (~15 s alone, ~50 s under load)
def test_the_scorer_process_reads_its_spec_from_stdin(tmp_path):
    from lpf.watch.service import Settings, prepare
    from lpf.watch.spec import ScorerSpec

    run, _, _ = prepare(Settings(upstream="http://127.0.0.1:1", reference="zoo:hybrid", out=tmp_path / "run"))
    proc = _scorer(run.path, ScorerSpec(reference="zoo:hybrid", dtype="bfloat16", poll=0.1).model_dump_json())
    try:
        deadline = time.monotonic() + 120
        reference = None
        while reference is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            reference = json.loads((run.path / "manifest.json").read_text()).get("reference")
        assert proc.poll() is None, proc.stderr.read()
        assert reference is not None and reference["dtype"] == "bfloat16" and reference["executor"] == "local"
    finally:
        proc.terminate()
        proc.wait(30)
