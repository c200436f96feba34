"""Terminal rendering of the comparisons: `lpf diff`'s suspect and requests, `lpf conformance`'s matrix.

The comparison half of `render` (same rules: plain data and a console in, nothing else printed, model
and path text escaped), kept apart so each rendering module stays small.
"""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from lpf.cli.render import VERDICT_STYLE


def print_diff(doc: dict, console: Console) -> None:
    """`lpf diff`: the suspect in one sentence, the counts, and the requests that have a suspect."""
    a, b = doc["run_a"], doc["run_b"]
    console.print(
        f"[bold]A[/] {escape(a['run_dir'])}  ({a['engine']} {a.get('version') or ''}, verdict {a['verdict']})"
    )
    console.print(
        f"[bold]B[/] {escape(b['run_dir'])}  ({b['engine']} {b.get('version') or ''}, verdict {b['verdict']})"
    )
    ref = doc["reference"]
    console.print(
        f"reference {escape(str(ref.get('spec')))} ({ref.get('dtype')}) · {doc['n_requests']} requests in "
        f"common · departs = at or above {doc['level']}"
    )
    style = "green" if doc["suspect"] == "none" else "bold red"
    console.print(f"[{style}]suspect: {doc['suspect_name'] or 'none'}[/]  {escape(doc['sentence'])}")
    c = doc["counts"]
    console.print(
        "per request: "
        + "  ".join(f"{k} {c[k]}" for k in ("none", "A", "B", "reference", "both"))
        + f"   (A and B agree on {doc['n_agree']})"
    )
    rows = doc.get("requests") or []
    if rows:
        t = Table(title=f"requests with a suspect (first {min(10, len(rows))} of {len(rows)})", title_justify="left")
        for col in (
            "request_id",
            "suspect",
            "A (output/prompt)",
            "B (output/prompt)",
            "|A-ref|",
            "|B-ref|",
            "|A-B|",
            "same tokens",
        ):
            t.add_column(col, overflow="fold")

        def verdicts(out, prompt):
            return out if prompt is None else f"{out}/{prompt}"

        for r in rows[:10]:
            t.add_row(
                escape(r["request_id"]),
                r["suspect"],
                verdicts(r["verdict_a"], r["prompt_verdict_a"]),
                verdicts(r["verdict_b"], r["prompt_verdict_b"]),
                f"{r['max_abs_diff_a']:.2g}",
                f"{r['max_abs_diff_b']:.2g}",
                f"{r['max_abs_diff_ab']:.2g}",
                "yes" if r["same_tokens"] else f"no (from {r['first_token_difference']})",
            )
        console.print(t)


def print_conformance(doc: dict, console: Console) -> None:
    """`lpf conformance`: the architecture x cell matrix, the attributed cells, what did not run or was not audited."""
    from lpf.experiments.conformance.view import matrix_view

    v = matrix_view(doc)
    console.print(
        f"[bold]conformance:[/] {doc['engine']} {doc.get('engine_version') or ''} against {doc['reference']}  "
        f"({len(v['archs'])} architectures x {len(v['cells'])} cells, {doc.get('elapsed_s') or 0:.0f} s)"
    )
    t = Table(
        title="verdict per cell (output/prompt; max |logprob diff|; bf16 ok: within the bfloat16 expectation)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
    )
    for col in ["architecture", *v["cells"]]:
        t.add_column(col, overflow="fold")
    for arch, entries in v["grid"]:
        t.add_row(
            arch,
            *[
                f"[dim]{e['status']}[/]"
                if e["status"] != "ok"
                else f"[{VERDICT_STYLE.get(e['verdict'], 'white')}]{e['label']}[/] {e['max']:.1g}"
                for e in entries
            ],
        )
    console.print(t)
    for name, says, sentence in v["not_clean"]:
        console.print(f"  {name}: [bold]{escape(says)}[/]" + (f" — {escape(sentence)}" if sentence else ""))
    for name, cause, evidence, clean in v.get("named") or []:
        how = "clean* per token, known departure" if clean else "not clean past its known departure"
        console.print(f"  [dim]{name}: {how} {cause}: {escape(evidence)}[/]")
    for name, sentence in v["located"]:
        console.print(f"  {name}: [bold]locate:[/] {escape(sentence)}")
    for name, status, error in v["failed"]:
        console.print(f"  [dim]{name}: {status}: {escape(error)[:300]}[/]")
    if v.get("variants"):
        console.print("config variants (rows named <architecture>~<variant>):")
    for name, kind, fields in v.get("variants") or []:
        console.print(f"  [dim]{name}: {kind}: {escape(str(fields))[:200]}[/]")
    for arch, name, reason in v.get("dropped") or []:
        console.print(f"  [dim]{arch}~{name}: not run: {escape(str(reason))[:200]}[/]")
    if v.get("reference"):
        console.print("reference column (transformers against itself, float64 gold):")
    for name, status, what in v.get("reference") or []:
        style = "bold" if status == "reference inconsistent" else "dim"
        console.print(f"  [{style}]{name}: {status}[/]" + (f" — {escape(what)[:200]}" if what else ""))
    if v["not_audited"]:
        console.print("not audited:")
    for status, reason, names in v["not_audited"]:
        console.print(f"  [dim]{', '.join(names)}: {status}: {escape(reason)}[/]")
