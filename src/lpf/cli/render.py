"""Every terminal table and summary of the command line, drawn with rich; nothing else prints.

Each function takes the plain data a domain module returned (findings, a sweep document, an
inspected request, a repeat document, RL findings, the zoo listing) and a console. Model text is
escaped before it reaches rich markup (a `[bold]` in a prompt is text).
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

VERDICT_STYLE = {
    "clean": "green",
    "noise": "yellow",
    "divergent": "bold magenta",
    "systematic": "bold dark_orange",
    "corrupt": "bold red",
}


def print_summary(findings: dict, run_path, console: Console) -> None:
    """The audit summary: verdict, counts, error percentiles, thresholds, shape, worst requests, mechanisms."""
    v = findings["verdict"]
    console.print(
        f"[bold]verdict:[/] [{VERDICT_STYLE.get(v, 'white')}]{v}[/]   "
        f"engine {findings.get('engine')} · model {findings.get('model')} · reference {findings.get('reference')}"
    )
    c = findings["counts"]
    line = "  ".join(f"[{VERDICT_STYLE[k]}]{k}[/] {c[k]}" for k in ("clean", "noise", "divergent", "corrupt"))
    extra = ""
    if findings.get("errors"):
        extra += f"  [red]errors[/] {findings['errors']}"
    if findings.get("unscored"):
        extra += f"  unscored {findings['unscored']}"
    console.print(f"requests {findings['n_requests']} · tokens {findings['n_tokens']}   {line}{extra}")
    o = findings.get("oracle") or {}
    if o.get("n"):
        console.print(f"oracle accuracy {o['accuracy']:.1%} ({o['correct']}/{o['n']} exact answers)")
    d = findings["metrics"].get("abs_logprob_diff", {})
    if d.get("max") is not None:
        console.print("|logprob diff|  " + "  ".join(f"{k} {d[k]:.3g}" for k in ("p50", "p90", "p99", "p99_9", "max")))
    _print_thresholds(findings["thresholds"], console)
    _print_trace(findings.get("trace"), console)
    _print_judged(findings.get("judged"), console)
    print_run_test(findings.get("run_test"), console)
    _print_shape(findings.get("shape"), console)
    flagged = findings.get("flagged") or []
    if flagged:
        t = Table(title=f"flagged requests (worst {min(10, len(flagged))} of {len(flagged)})", title_justify="left")
        for col in ("request_id", "verdict", "first_divergence", "max |diff|"):
            t.add_column(col)
        for f in flagged[:10]:
            diff = f["max_abs_logprob_diff"]
            t.add_row(
                escape(f["request_id"]),
                f"[{VERDICT_STYLE[f['verdict']]}]{f['verdict']}[/]",
                str(f["first_divergence"]),
                "inf" if diff is None else f"{diff:.3g}",
            )
        console.print(t)
    _print_hypotheses(findings.get("hypotheses") or [], console)
    _print_prefix_cache(findings.get("prefix_cache"), console)
    _print_evidence(findings.get("evidence"), console)
    _print_prompt(findings.get("prompt"), console)
    console.print(f'results: {run_path}/findings.json  (lpf query {run_path} "SELECT ...")')


def _print_prompt(p: dict | None, console: Console) -> None:
    """The prompt (prefill) positions, judged apart from the outputs."""
    if not p:
        return
    v, c = p["verdict"], p["counts"]
    d = p["metrics"].get("abs_logprob_diff") or {}
    counts = "  ".join(f"[{VERDICT_STYLE[k]}]{k}[/] {c[k]}" for k in ("clean", "noise", "divergent"))
    diff = f"  max |diff| {d['max']:.3g}" if d.get("max") is not None else ""
    console.print(
        f"[bold]prompt positions:[/] [{VERDICT_STYLE.get(v, 'white')}]{v}[/]   "
        f"requests {p['n_requests']} · positions {p['n_scored_tokens']}   {counts}{diff}"
    )
    shape = p.get("shape") or {}
    if shape.get("n_flagged"):
        console.print(f"prompt shape: {escape(shape.get('sentence', ''))}")
    flagged = p.get("flagged") or []
    if flagged:
        t = Table(
            title=f"prompt-divergent requests (worst {min(5, len(flagged))} of {p['counts']['divergent']})",
            title_justify="left",
        )
        for col in ("request_id", "first departure", "first divergence", "max |diff|"):
            t.add_column(col)
        for f in flagged[:5]:
            diff = f["max_abs_logprob_diff"]
            t.add_row(
                escape(f["request_id"]),
                str(f["first_departure"]),
                str(f["first_divergence"]),
                "inf" if diff is None else f"{diff:.3g}",
            )
        console.print(t)


def _print_thresholds(th: dict, console: Console) -> None:
    """The thresholds this run's verdicts used, and where they came from."""
    source = th.get("source", "default")
    floor = (th.get("noise_floor") or {}).get("token_abs_diff") or {}
    origin = (
        f"calibrated to this run's floor: token |diff| median {floor['median']:.2g}, MAD {floor['mad']:.2g}"
        if source == "calibrated" and floor
        else source
    )
    if source == "calibration-run" and floor:
        dtype = (th.get("noise_floor") or {}).get("dtype", "?")
        origin = (
            f"from a calibration run, reference at {dtype}: token |diff| median {floor['median']:.2g}, "
            f"MAD {floor['mad']:.2g}"
        )
    if source == "table":
        origin = f"from the expected floor of {(th.get('noise_floor') or {}).get('pair', '?')} (the shipped table)"
    pinned = f", pinned: {', '.join(th['pinned'])}" if th.get("pinned") else ""
    console.print(
        f"[dim]thresholds ({origin}{pinned}): clean <= {th['clean_abs_diff']:.3g}, "
        f"divergent > {th['divergent_abs_diff']:.3g}, tie margin {th.get('tie_margin', 0):.3g}, "
        f"corrupt: gibberish score >= {th.get('gibberish_min_score', 0):.2g} "
        f"with >= {th['gibberish_min_tokens']} lie tokens[/]"
    )


_TRACE_SOURCE = {
    "engine": "from the engine",
    "vllm-plugin": "from inside vLLM (lpf-vllm-trace)",
    "joined": "joined from the server's lpf-vllm-trace directory",
}


def _print_trace(trace: dict | None, console: Console) -> None:
    """One line: whether the step trace the hypotheses read was recorded, and why not."""
    if not trace:
        return
    if trace["recorded"]:
        why = f" [yellow]({escape(trace['why'])})[/]" if trace.get("why") else ""
        console.print(
            f"[dim]trace: {trace['rows']} rows {_TRACE_SOURCE.get(trace['source'], '')}[/]{why}", highlight=False
        )
    else:
        console.print(f"[dim]trace: none ({escape(trace.get('why') or 'no reason given')})[/]", highlight=False)


def _print_judged(judged: dict | None, console: Console) -> None:
    """What came back, when it limits what was judged (no logprobs, some missing), and the adapter's notes."""
    if not judged:
        return
    if judged.get("logprobs") != "all":
        console.print(f"[bold]judged:[/] {escape(judged['steps']['per_request'])}", highlight=False)
    for note in judged.get("notes") or []:
        console.print(f"[yellow]note:[/] {escape(note)}", highlight=False)


def print_run_test(rt: dict | None, console: Console) -> None:
    """The run-level test in one sentence with its numbers (and the floor finding when there is one)."""
    if not rt:
        return
    style = {"same": "green", "different": VERDICT_STYLE["systematic"]}.get(rt.get("result"), "dim")
    console.print(f"[bold]run test:[/] [{style}]{escape(rt['sentence'])}[/]", highlight=False)
    if rt.get("floor_sentence"):
        console.print(f"  [{style}]{escape(rt['floor_sentence'])}[/]", highlight=False)


def _print_shape(shape: dict | None, console: Console) -> None:
    if not shape or not shape.get("n_flagged"):
        return
    onset = shape.get("onset") or {}
    fd = shape.get("first_divergence") or {}
    per = shape.get("periodicity") or {}
    parts = [
        f"rate {shape['rate']:.2%} ({shape['n_flagged']} flagged)",
        f"onset request #{onset.get('seq')}" + (f", step {onset['step']}" if onset.get("step") is not None else ""),
    ]
    if fd.get("median") is not None:
        parts.append(f"first divergence median position {fd['median']:g} ({fd.get('at_zero_fraction', 0):.0%} at 0)")
    if per.get("period") is not None:
        parts.append(f"period {per['period']:g} {per.get('over', 'step')}s (confidence {per.get('confidence', 0):.2f})")
    console.print("shape: " + " · ".join(parts))


def _print_hypotheses(hyps: list, console: Console) -> None:
    if not hyps:
        return
    console.print("[bold]likely mechanisms[/] (Fisher exact test, best first):")
    for h in hyps[:3]:
        console.print(f"  {h['rank']}. {h['sentence']} [dim](p={h['p_value']:.2g})[/]", highlight=False)


def _print_prefix_cache(pcache: dict | None, console: Console) -> None:
    """The prefix cache's line: what it supplied, or the prefix-cache-inert finding."""
    if not pcache:
        return
    if pcache.get("inert"):
        console.print(f"[bold yellow]finding: prefix-cache-inert[/] {escape(pcache['sentence'])}", highlight=False)
    else:
        console.print(f"[dim]{escape(pcache['sentence'])}[/]", highlight=False)


def _print_evidence(ev: dict | None, console: Console) -> None:
    """What the server said beyond its tokens: inconsistent answers, failed attempts, a death."""
    if not ev:
        return
    inc, failed = ev.get("inconsistent") or {}, ev.get("failed") or {}
    if inc.get("n"):
        reasons = ", ".join(f"{k} {v}" for k, v in (inc.get("by_reason") or {}).items())
        console.print(
            f"[yellow]inconsistent answers[/] {inc['n']} kept as returned ({escape(reasons)}); "
            f"{inc.get('scored', 0)} scored, {inc.get('flagged', 0)} flagged",
            highlight=False,
        )
    if failed.get("sent") or failed.get("never_sent"):
        console.print(
            f"[red]failed requests[/] {failed['n']}: {failed.get('sent', 0)} sent and failed, "
            f"{failed.get('never_sent', 0)} never sent",
            highlight=False,
        )
    died = ev.get("server_died")
    if died:
        console.print(f"[bold red]the server died:[/] {escape(died.get('sentence') or '')}", highlight=False)


def print_calibration(cal: dict, run_path, console: Console) -> None:
    """One line on what the calibration run's floor comes from."""
    if cal.get("same_as_reference"):
        console.print(
            f"calibration: the engine computed in {cal['dtype']} like the reference, so the reference "
            f"against itself is the calibration run: floor 0, default thresholds",
            highlight=False,
        )
    else:
        console.print(
            f"calibration: reference at the engine's {cal['dtype']} in {run_path}/calibration "
            f"(noise floor from it, not from the engine)",
            highlight=False,
        )


def print_engines(engines: list[tuple[str, dict]], console: Console) -> None:
    """`lpf engines`: each adapter with its knobs and their defaults."""
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False)
    t.add_column("engine")
    t.add_column("knobs (-E NAME=VALUE; default)", overflow="fold")
    for name, knobs in engines:
        t.add_row(name, ", ".join(f"{k}={v}" for k, v in knobs.items()) or "-")
    console.print(t)


def print_zoo(models: list[dict], workloads: list[dict], console: Console) -> None:
    """`lpf zoo list`: bundled models (architecture, parameters, size, task accuracy) and workloads."""
    t = Table(
        title="models",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        padding=(0, 1),
        pad_edge=False,
        show_edge=False,
        collapse_padding=True,
    )
    for c in ("name", "architecture", "params", "size", "accuracy", "p(answer)", "ready"):
        t.add_column(c, min_width=16 if c == "architecture" else None)
    for m in models:
        t.add_row(
            f"zoo:{m['name']}",
            m["architecture"].removesuffix("ForCausalLM"),
            f"{m['parameters']:,}" if m["parameters"] else "-",
            f"{m['size_bytes'] / 1e6:.1f} MB" if m["size_bytes"] else "-",
            f"{m['accuracy']:.1%}" if m["accuracy"] is not None else "-",
            f"{m['median_answer_prob']:.3f}" if m["median_answer_prob"] is not None else "-",
            "yes" if m["available"] else "no",
        )
    console.print(t)
    w = Table(title="workloads", title_justify="left", box=box.SIMPLE_HEAD)
    for c in ("name", "requests", "description"):
        w.add_column(c)
    for wl in workloads:
        w.add_row(f"zoo:{wl['name']}", str(wl["default_n"]), wl["description"])
    console.print(w)


def print_rows(columns: list[str], rows: list, console: Console, fmt: str = "table") -> None:
    if fmt == "csv":
        import csv
        import sys

        w = csv.writer(sys.stdout)
        w.writerow(columns)
        w.writerows(rows)
        return
    if fmt == "json":
        import json

        console.print_json(json.dumps([dict(zip(columns, r)) for r in rows], default=str))
        return
    t = Table()
    for c in columns:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*("NULL" if v is None else str(v) for v in r))
    console.print(t)


def print_sweep(doc: dict, console: Console) -> None:
    """The sweep table and the moves."""
    from lpf.experiments.sweep import fmt_rate

    knobs = [k["name"] for k in doc["knobs"]]
    t = Table(title=f"sweep: {len(doc['cells'])}/{doc['n_cells']} cells", title_justify="left")
    for c in [
        *knobs,
        "verdict",
        "requests",
        "rate",
        "onset seq",
        "onset step",
        "first div (median)",
        "period",
        "max |diff|",
    ]:
        t.add_column(c)
    fmt = lambda v, f="{:g}": "-" if v is None else f.format(v)  # noqa: E731
    for r in doc["cells"]:
        t.add_row(
            *(escape(str(r["values"][k])) for k in knobs),
            f"[{VERDICT_STYLE.get(r['verdict'], 'white')}]{r['verdict']}[/]",
            str(r["n_requests"]),
            fmt_rate(r),
            fmt(r["onset_seq"]),
            fmt(r["onset_step"]),
            fmt(r["first_divergence_median"]),
            fmt(r["period"]),
            fmt(r["max_abs_logprob_diff"], "{:.3g}"),
        )
    console.print(t)
    for m in doc["moves"]:
        console.print(("[bold]" if m["moves"] else "[dim]") + escape(m["sentence"]) + "[/]")


def print_request(info: dict, console: Console, top: int = 3) -> None:
    """`lpf inspect`: the request, its tokens and its trace as tables."""
    from lpf.views.inspect import TRACE_COLUMNS

    r = info["request"]
    s = r.get("summary") or {}
    verdict = s.get("verdict")
    head = f"[bold]{escape(r['request_id'])}[/]  seq {r.get('seq')}  prompt {escape(str(r.get('prompt_id')))}  rollout {r.get('rollout')}"
    head += f"  finish {r.get('finish_reason')}"
    if verdict:
        head += f"  verdict [{VERDICT_STYLE.get(verdict, 'white')}]{verdict}[/]"
        if s.get("first_divergence") is not None:
            head += f"  first divergence at position {s['first_divergence']}"
    console.print(head)
    if r.get("error"):
        console.print(f"[red]error:[/] {escape(str(r['error']))}")
    if r.get("inconsistency"):
        console.print(f"[yellow]inconsistent answer (kept as returned):[/] {escape(str(r['inconsistency']))}")
    for a in r.get("attempts") or []:
        status = a.get("status") if a.get("status") is not None else ("no answer" if a.get("sent") else "not sent")
        took = (a["t_end"] - a["t_start"]) if a.get("t_end") is not None and a.get("t_start") is not None else None
        console.print(
            f"[dim]attempt {a.get('attempt')}: {status}"
            + (f" after {took:.3g} s" if took is not None else "")
            + (f" · {escape(str(a['error']))}" if a.get("error") else "")
            + "[/]",
            highlight=False,
        )
    if info.get("tokenizer"):
        console.print(f"[dim]{escape(info['tokenizer'])}[/]")
    if r.get("prompt_text") is not None:
        console.print(
            f"[dim]prompt ({len(r.get('prompt_token_ids') or [])} tokens):[/] {escape(repr(r['prompt_text']))}"
        )
    first = s.get("first_divergence")

    def topk(items):
        return "  ".join(f"{escape(repr(x['token']))} {x['logprob']:.3f}" for x in items[:top])

    t = Table(title=f"tokens ({len(info['tokens'])})", title_justify="left")
    for c in ("pos", "token", "engine lp", "ref lp", "|d|", "ref rank", f"engine top-{top}", f"ref top-{top}"):
        t.add_column(c, overflow="fold")
    for row in info["tokens"]:
        d = row["abs_diff"]
        style = (
            "bold red"
            if first is not None and row["position"] == first
            else ("yellow" if d is not None and d > 1e-3 else None)
        )
        fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
        t.add_row(
            str(row["position"]),
            escape(repr(row["token"])),
            fmt(row["engine_logprob"]),
            fmt(row["ref_logprob"]),
            "-" if d is None else f"{d:.3g}",
            "-" if row["ref_rank"] is None else str(row["ref_rank"]),
            topk(row["engine_topk"]),
            topk(row["ref_topk"]),
            style=style,
        )
    console.print(t)
    if not info["rescored"]:
        console.print("[dim]not rescored yet: run lpf rescore DIR for the reference side[/]")
    if info["trace"] is None:
        console.print("[dim]no trace: this engine does not record per-step scheduling[/]")
        return
    tr = Table(title=f"trace ({len(info['trace'])} rows)", title_justify="left")
    for c in TRACE_COLUMNS:
        tr.add_column(c)
    for row in info["trace"]:
        tr.add_row(
            *("-" if row[c] is None else str(row[c]) for c in TRACE_COLUMNS),
            style="bold red" if row["preempted"] else None,
        )
    console.print(tr)


def print_repeat(doc: dict, console: Console) -> None:
    knob = doc.get("varied_knob") or "concurrency"
    t = Table(title=f"{doc['times']} copies, temperature 0, engine {doc['engine']}", title_justify="left")
    for c in (
        "copy",
        knob,
        "fillers",
        "arrival",
        "batch sizes seen",
        "tokens",
        "logprobs (bitwise)",
        f"logprobs (<= {doc['tolerance']:g})",
        "max |d| vs copy 0",
    ):
        t.add_column(c)
    letter = lambda i: chr(ord("A") + i) if i < 26 else str(i)  # noqa: E731
    for c in doc["copies"]:
        bs = c.get("batch_sizes")
        t.add_row(
            str(c["copy"]),
            "-" if c["concurrency"] is None else str(c["concurrency"]),
            str(c["n_fillers"]),
            str(c["arrival"]),
            "-" if not bs else f"{min(bs)}..{max(bs)} over {len(bs)} steps",
            letter(c["tokens_group"]),
            letter(c["logprobs_group"]),
            letter(c["tolerance_group"]),
            f"{c['max_abs_diff_vs_copy0']:.3g}",
        )
    console.print(t)
    console.print(
        f"unique completions: token sequences {doc['unique_token_sequences']}, logprob vectors "
        f"{doc['unique_logprob_vectors']} bitwise, {doc['unique_logprob_vectors_at_tolerance']} within "
        f"{doc['tolerance']:g}; max logprob spread {doc['max_logprob_spread']:.3g}"
    )
    fd = doc["first_divergence"]
    if fd["logprobs"] is None:
        console.print("[green]all copies identical[/]: same tokens, bit-identical logprobs")
    else:
        lp = fd["logprobs"]
        console.print(
            f"first logprob divergence at position {lp['position']}: logprob {lp['min_logprob']:.6g} .. "
            f"{lp['max_logprob']:.6g} across copies" + ("" if lp["tokens_agree"] else " (tokens differ)")
        )
    if fd["tokens"] is not None:
        console.print(
            f"[bold red]first token divergence at position {fd['tokens']['position']}[/]: tokens "
            f"{escape(str(fd['tokens']['distinct_tokens']))}"
        )


def print_shrink_event(event: dict, console: Console) -> None:
    """`lpf shrink` progress, one line per candidate (and per try of it): what was tried, its size, what
    the target did, the runs used and the best configuration so far."""
    if event["type"] == "begin":
        console.print(
            f"shrink directory: {escape(event['out'])}{' (resumed)' if event['resumed'] else ''}  "
            f"(target {escape(event['target'])}: {escape(event['signature'])}; budget {event['budget']} "
            f"runs, k-of-n {event['need']}-of-{event['tries']})",
            highlight=False,
        )
        return
    if event["type"] == "try":
        t = event["try"]
        console.print(
            f"  {escape(t['dir'])}: {escape(t['seen'])}" + ("  [bold red]the lie[/]" if t["lie"] else ""),
            highlight=False,
        )
        return
    c = event["candidate"]
    if event["type"] == "start":
        console.print(
            f"[bold]{c['id']}[/] [dim]{c['phase']}[/] {escape(c['step'])}: {escape(c['description'])}", highlight=False
        )
        return
    ok = c["status"] == "reproduces"
    outcome = "[bold red]reproduces[/]" if ok else "[dim]gone[/]"
    best = event.get("best")
    tail = f" · best so far {escape(best['description'])} ({best['id']})" if best else ""
    if event.get("replayed"):
        console.print(
            f"[bold]{c['id']}[/] [dim]{c['phase']} (recorded)[/] {escape(c['step'])}: "
            f"{escape(c['description'])} → {outcome}",
            highlight=False,
        )
        return
    console.print(f"  → {outcome} · runs {event['runs_used']}/{event['budget']}{tail}", highlight=False)


def print_shrink(doc: dict, console: Console) -> None:
    """The shrink's end: original vs minimal, the signature, the outcome."""
    o, m = doc["original"], doc.get("minimal")
    console.print(
        f"[bold]shrink of[/] {escape(doc['target'])}: {escape(doc['signature_description'])}", highlight=False
    )
    if doc.get("signature_note"):
        console.print(f"[dim]{escape(doc['signature_note'])}[/]")
    console.print(f"original: {escape(o['description'])}", highlight=False)
    if m:
        console.print(
            f"[bold]minimal:[/]  {escape(m['description'])}  ({m['candidate']}, "
            f"knobs: {escape(', '.join(f'{k}={v}' for k, v in m['config']['knobs'].items()) or 'defaults')})",
            highlight=False,
        )
    conf = doc.get("confirmation") or {}
    if conf.get("note"):
        console.print(f"[dim]{escape(conf['note'])}[/]")
    status = {
        "done": "[green]done[/]",
        "budget-spent": "[yellow]budget spent[/] (the best configuration found so far)",
        "not-reproduced": "[bold yellow]not reproduced[/]",
    }.get(doc["status"], doc["status"])
    console.print(
        f"status: {status} · {doc['runs_used']} runs of {doc['budget_runs']} · "
        f"deterministic: {doc.get('deterministic')}",
        highlight=False,
    )
    if doc.get("locate"):
        console.print(f"where the lie is born: [bold]{escape(doc['locate']['command'])}[/]", highlight=False)
