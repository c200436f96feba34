"""The run's terminal summary (`lpf audit` / `analyze`: verdicts, thresholds, prompt, trace, run-level
test, hypotheses, what explains each flagged request, evidence, calibration) and `VERDICT_STYLE`, drawn with rich; nothing else prints.

Each function takes the plain data a domain module returned (findings) and a console. Model text is
escaped before it reaches rich markup (a `[bold]` in a prompt is text). The other commands' tables
live beside it: render_views, render_experiments, render_compare, render_rl, render_locate.
"""

from __future__ import annotations

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
    _print_reference_cost(findings, console)
    _print_trace(findings.get("trace"), console)
    _print_judged(findings.get("judged"), console)
    print_run_test(findings.get("run_test"), console)
    _print_shape(findings.get("shape"), console)
    flagged = findings.get("flagged") or []
    if flagged:
        t = Table(title=f"flagged requests (worst {min(10, len(flagged))} of {len(flagged)})", title_justify="left")
        for col in ("request_id", "verdict", "first_divergence", "max |diff|", "mechanism"):
            t.add_column(col)
        for f in flagged[:10]:
            diff = f["max_abs_logprob_diff"]
            t.add_row(
                escape(f["request_id"]),
                f"[{VERDICT_STYLE[f['verdict']]}]{f['verdict']}[/]",
                _position(f["first_divergence"]),
                "inf" if diff is None else f"{diff:.3g}",
                _mechanism_cell(f.get("mechanism")),
            )
        console.print(t)
        if any(f["first_divergence"] is None for f in flagged[:10]):
            console.print(f"[dim]{WHOLE_ANSWER}: {WHOLE_ANSWER_WHY}[/]")
    for found in (findings.get("server_processing") or {}).values():
        console.print(f"[bold]server-side processing:[/] {escape(found['sentence'])}.")
    _print_hypotheses(findings.get("hypotheses") or [], console)
    _print_mechanisms(findings.get("mechanisms"), console)
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


def _print_reference_cost(findings: dict, console: Console) -> None:
    """What a server reference's second pass cost the server it ran on (a self-reference: the audited one)."""
    cost = findings.get("reference_cost")
    if not cost:
        return
    on = "the audited engine" if findings.get("reference_kind") == "self" else "the reference server"
    console.print(
        f"[dim]reference cost: {cost['requests']} requests, {cost['tokens']:,} tokens (prompts included) "
        f"prefilled again by {on} in {cost['seconds']:.1f} s[/]",
        highlight=False,
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


FLOOR_UNIT = (
    "floors are in nats of logit error: the 99th percentile of |logprob diff| / sensitivity over "
    "the tokens, not the |logprob diff| above"
)


def print_run_test(rt: dict | None, console: Console) -> None:
    """The run-level test in one sentence with its numbers (and the floor finding when there is one)."""
    if not rt:
        return
    style = {"same": "green", "different": VERDICT_STYLE["systematic"]}.get(rt.get("result"), "dim")
    console.print(f"[bold]run test:[/] [{style}]{escape(rt['sentence'])}[/]", highlight=False)
    if "floor" in (rt.get("sentence") or ""):
        # not the |logprob diff| percentiles printed above: each token's error is divided by how far
        # one nat of logit error moves its logprob (`floors.floor_stats`)
        console.print(f"  [dim]{FLOOR_UNIT}[/]", highlight=False)
    if rt.get("floor_sentence"):
        console.print(f"  [{style}]{escape(rt['floor_sentence'])}[/]", highlight=False)
    if rt.get("arithmetic_sentence"):
        console.print(f"  [dim]{escape(rt['arithmetic_sentence'])}[/]", highlight=False)
    if rt.get("configured_sentence"):
        console.print(f"  [dim]{escape(rt['configured_sentence'])}[/]", highlight=False)


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


# a flagged request with no first divergence was judged on its whole answer, not at one position
WHOLE_ANSWER = "whole answer"
WHOLE_ANSWER_WHY = (
    "flagged on its answer as a whole (its tokens together past the floor, or an answer that contradicts "
    "itself), not at one position"
)


def _position(p: int | None) -> str:
    return WHOLE_ANSWER if p is None else str(p)


def _mechanism_cell(m: dict | None) -> str:
    if not m:
        return "-"
    if not m.get("feature"):
        return "unexplained"
    return escape(m["feature"])  # the writer of a victim's state: `lpf inspect`


def _print_mechanisms(block: dict | None, console: Console) -> None:
    """How many flagged requests each mechanism explains (`lpf.analysis.mechanisms`), and how many none does."""
    if not block or not block.get("n_flagged"):
        return
    console.print(f"[bold]what explains each flagged request[/] ({block['n_flagged']}):")
    for i, c in enumerate(block["covered"]):
        # the first keeps the run's sentence (printed above when it ranks in the top 3); later ones count
        # the requests still unexplained
        where = f"hypothesis {c['rank']}" if i == 0 and c.get("rank") and c["rank"] <= 3 else c["sentence"]
        console.print(f"  {c['n']:>6}  {escape(c['feature'])}: {escape(where)}", highlight=False)
    if block.get("unexplained"):
        console.print(f"  {block['unexplained']:>6}  [yellow]unexplained[/] (no significant hypothesis holds for them)")


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


def print_failures(line: str | None, console: Console) -> None:
    """The failed requests' line (`pipeline.failed_requests`: errors grouped by shape, what to try)."""
    if line:
        console.print(f"[red]{escape(line)}[/]", highlight=False, soft_wrap=True)


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
