"""Terminal tables of the views: `lpf engines`, `lpf zoo list`, `lpf query`'s rows and `lpf inspect`'s
request (drawn with rich; model text escaped before it reaches rich markup)."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lpf.cli.render import VERDICT_STYLE


def print_engines(engines: list[tuple[str, dict, list[str]]], console: Console) -> None:
    """`lpf engines`: each adapter with what it can do (its capabilities) and its knobs with their defaults."""
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False)
    t.add_column("engine")
    t.add_column("can", overflow="fold")
    t.add_column("knobs (-E NAME=VALUE; default)", overflow="fold")
    for name, knobs, can in engines:
        t.add_row(name, ", ".join(can) or "-", ", ".join(f"{k}={v}" for k, v in knobs.items()) or "-")
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


def print_request(info: dict, console: Console, top: int = 3) -> None:
    """`lpf inspect`: the request, its tokens and its trace as tables."""
    from lpf.run.schema import TRACE_STEP_COLUMNS

    r = info["request"]
    s = r.get("summary") or {}
    verdict = s.get("verdict")
    head = f"[bold]{escape(r['request_id'])}[/]  seq {r.get('seq')}  prompt {escape(str(r.get('prompt_id')))}  rollout {r.get('rollout')}"
    head += f"  finish {r.get('finish_reason')}"
    if verdict:
        head += f"  verdict [{VERDICT_STYLE.get(verdict, 'white')}]{verdict}[/]"
        if s.get("first_divergence") is not None:
            head += f"  first divergence at position {s['first_divergence']}"
        elif verdict in ("divergent", "corrupt"):
            head += "  flagged on its answer as a whole (no single position)"
    console.print(head)
    m = info.get("mechanism")
    if m:
        by = f" (written over by {escape(m['writer'])})" if m.get("writer") else ""
        rank = f" [dim](hypothesis {m['rank']})[/]" if m.get("rank") else ""
        if m.get("feature"):
            console.print(f"mechanism: [bold]{escape(m['feature'])}[/]{by}{rank}: {escape(m['sentence'])}")
        else:  # the sentence names it ("unexplained: ..."): said once
            console.print(f"mechanism: [bold]{escape(m['sentence'])}[/]{by}{rank}")
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
            + (f" · sent as {escape(str(a['sent_id']))}" if a.get("sent_id") else "")  # the server's name for it
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
    strays = any("stray_writes" in row for row in info["trace"])
    for c in (*TRACE_STEP_COLUMNS, *(["stray write"] if strays else [])):
        tr.add_column(c)
    for row in info["trace"]:
        landed = ", ".join(
            f"{'KV block' if e.get('memory') == 'kv' else 'slot'} {e['slot']} "
            f"({escape(e['owner']) if e['owner'] else 'free'})"
            for e in row.get("stray_writes") or []
        )
        tr.add_row(
            *("-" if row[c] is None else str(row[c]) for c in TRACE_STEP_COLUMNS),
            *([landed or "-"] if strays else []),
            style="bold red" if row["preempted"] else None,
        )
    console.print(tr)
    for w in info.get("overwritten_by") or []:
        what = "K/V write landed in its KV block" if w.get("memory") == "kv" else "state write landed in its slot"
        console.print(f"[red]step {w['step']}:[/] {escape(w['writer'])}'s {what} {w['slot']}")
