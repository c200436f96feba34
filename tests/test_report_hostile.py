"""The report with hostile model text, in real headless Chromium: nothing in a run's data may execute.

A real run (`lpf run` on the built-in engine, with the swap-outputs drill so requests are flagged and
drilled into) whose request ids and prompts carry `</script>`, U+2028/U+2029, quotes that close
attributes and `on*=` handlers, a `javascript:` URL and HTML tags; one flagged request's output text
is then replaced by 100 KB of such text in one piece (a huge "token" of model text), and a server's
evidence (an inconsistency reason, attempt errors) carries the same. After the real `lpf rescore` and
`lpf analyze`, the page must render every section, show the hostile strings as text, and run nothing:
no global set by the payloads, no element with an `on*` attribute, no `javascript:` link, only lpf's
own three scripts.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import lpf_main, write_prompts
from lpf.run import schema
from test_report import browser, open_page, severe  # noqa: F401  (the real-Chromium fixture and helpers)

pytestmark = pytest.mark.slow

PAYLOADS = [
    '</script><script>window.__pwned="script"</script>',
    '"><img src=x onerror="window.__pwned=\'img\'">',
    "' onmouseover='window.__pwned=1' x='",
    "javascript:window.__pwned='href'",
    "line\u2028sep\u2029para</SCRIPT >",
    "<svg/onload=window.__pwned='svg'>",
]
HUGE = ("</script><script>window.__pwned='huge'</script>\u2028" * 2000)[:100_000]


@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    from lpf.zoo import registry

    base = tmp_path_factory.mktemp("hostile")
    items = [{"id": i["id"], "prompt": i["prompt"]} for i in registry.workload_items("oracle", seed=4, n=60)]
    for k, text in enumerate(PAYLOADS):
        items.insert(5 + 7 * k, {"id": f"{text}#{k}", "prompt": text})
    run = base / "run"
    r = lpf_main(
        "run",
        "--engine",
        "builtin",
        "--model",
        "zoo:hybrid",
        "--workload",
        write_prompts(base / "w.jsonl", items),
        "--max-tokens",
        8,
        "--inject",
        "swap-outputs:3",
        "--out",
        run,
    )
    assert r.returncode == 0, r.stderr
    # the evidence a hostile server would leave, on a request the drill corrupted (so it is drilled into):
    # a 100 KB output text, an inconsistency reason and an attempt error carrying the payloads
    victim = (
        pq.read_table(run / "faults")
        .filter(pa.compute.equal(pq.read_table(run / "faults")["role"], "corrupted"))["request_id"][0]
        .as_py()
    )
    hostile_id = PAYLOADS[0] + "#victim"  # its id becomes hostile too, in its requests and tokens parts
    for part in sorted((run / "requests").glob("part-*.parquet")):
        rows = pq.read_table(part).to_pylist()
        if not any(row["request_id"] == victim for row in rows):
            continue
        for row in rows:
            if row["request_id"] == victim:
                row.update(
                    request_id=hostile_id,
                    output_text=HUGE,
                    inconsistency="text: " + PAYLOADS[0],
                    attempts=[
                        {"attempt": 0, "sent": True, "status": 500, "error": PAYLOADS[1], "t_start": 0.0, "t_end": 0.0}
                    ],
                )
        toks = pq.read_table(run / "tokens" / part.name).to_pylist()
        for t in toks:
            if t["request_id"] == victim:
                t["request_id"] = hostile_id
        pq.write_table(pa.Table.from_pylist(toks, schema=schema.TOKENS), run / "tokens" / part.name)
        pq.write_table(pa.Table.from_pylist(rows, schema=schema.REQUESTS), part)
    r = lpf_main("rescore", run)
    assert r.returncode == 0, r.stderr
    r = lpf_main("analyze", run, "--fail-on", "never", "--json")
    assert r.returncode == 0, r.stderr
    return run, json.loads(r.stdout), hostile_id


def test_hostile_text_renders_as_text_and_runs_nothing(hostile_run, browser):  # noqa: F811
    from selenium.webdriver.common.by import By

    run, findings, victim = hostile_run
    assert victim in {f["request_id"] for f in findings["flagged"]}
    assert findings["evidence"]["inconsistent"]["by_reason"] == {"text": 1}
    page = (run / "report.html").read_text()
    head, _, rest = page.partition('<script type="application/json" id="lpf-data">')
    data, _, tail = rest.partition("</script>")
    for text in PAYLOADS + [HUGE[:200]]:
        assert text not in head and text not in tail  # model text lives only in the data block...
        if any(c in text for c in "<>&\u2028\u2029"):
            assert text not in data  # ...where whatever could end the element or a JS line is \u-escaped
    log = open_page(browser, run / "report.html")
    assert severe(log) == [], log
    for d in browser.find_elements(By.CSS_SELECTOR, "details.req"):  # open every drilled-down request
        browser.execute_script("arguments[0].open = true", d)
    assert browser.execute_script("return typeof window.__pwned") == "undefined"
    assert browser.execute_script("return document.scripts.length") == 3
    assert (
        browser.execute_script(
            "return [...document.querySelectorAll('*')].filter(e => [...e.attributes].some(a => /^on/i.test(a.name)))"
            ".length"
        )
        == 0
    )
    assert (
        browser.execute_script(
            'return document.querySelectorAll(\'a[href^="javascript" i], img, svg image,'
            " iframe, object, embed').length"
        )
        == 0
    )
    text = browser.execute_script("return document.body.textContent")
    flagged_hostile = [f["request_id"] for f in findings["flagged"] if "#" in f["request_id"]]
    assert victim in flagged_hostile and all(rid in text for rid in flagged_hostile)  # ids shown as text
    assert HUGE[-3900:] in text and HUGE not in text  # the 100 KB output: its end (clipped), as text
    evidence = browser.find_element(By.ID, "evidence").text.lower()
    assert "inconsistent answers" in evidence and "text" in evidence
    assert browser.execute_script("return typeof window.__pwned") == "undefined"
