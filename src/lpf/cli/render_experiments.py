"""Terminal tables of the experiments: the sweep table and its moves, `lpf repeat`'s copies, and the
shrink's progress lines and summary (drawn with rich; the documents come from lpf.experiments)."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lpf.cli.render import VERDICT_STYLE


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
        bs = [b for b in c.get("batch_sizes") or () if b is not None]  # servers that do not say: null
        t.add_row(
            str(c["copy"]),
            "-" if c["concurrency"] is None else str(c["concurrency"]),
            str(c["n_fillers"]),
            str(c["arrival"]),
            "-" if not bs else f"{min(bs)}..{max(bs)} over {len(bs)} steps",
            letter(c["tokens_group"]),
            letter(c["logprobs_group"]),
            letter(c["tolerance_group"]),
            "-" if c["max_abs_diff_vs_copy0"] is None else f"{c['max_abs_diff_vs_copy0']:.3g}",
        )
    console.print(t)
    if doc.get("varied"):
        console.print(f"[dim]varied: {escape(doc['varied']['sentence'])}[/]")
    fd = doc["first_divergence"]
    if doc.get("unique_logprob_vectors") is None:  # the server returned no logprobs
        console.print(
            f"unique completions: token sequences {doc['unique_token_sequences']} (tokens only: the server "
            f"returned no logprobs)"
        )
    else:
        console.print(
            f"unique completions: token sequences {doc['unique_token_sequences']}, logprob vectors "
            f"{doc['unique_logprob_vectors']} bitwise, {doc['unique_logprob_vectors_at_tolerance']} within "
            f"{doc['tolerance']:g}; max logprob spread {doc['max_logprob_spread']:.3g}"
        )
    if fd["logprobs"] is None and fd["tokens"] is None:
        bits = ", bit-identical logprobs" if doc.get("unique_logprob_vectors") is not None else ""
        console.print(f"[green]all copies identical[/]: same tokens{bits}")
    elif fd["logprobs"] is not None:
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
    bs = doc.get("batch_shape")
    if bs:
        console.print(("[bold yellow]" if bs["dependent"] else "[green]") + escape(bs["sentence"]) + "[/]")


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
