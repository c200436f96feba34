"""Terminal rendering of `lpf rl`: analyze's summary, rescore's line, simulate's line, explain's causes.

The RL half of `render` (same rules: plain data and a console in, nothing else printed).
"""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table


def print_rl_summary(f: dict, out: Path, console: Console) -> None:
    """`lpf rl analyze`: spike verdict, counts, bad rows, the best hypotheses, where the files are."""
    console.print(f"[bold]{'SPIKES' if f['n_spikes'] else 'clean'}[/]  {f['summary']}", highlight=False)
    console.print(
        f"steps {f['n_steps']} · responses {f['n_responses']} · tokens {f['n_tokens']} · "
        f"bad rows {len(f['bad_rows'])}" + (f" · empty steps {len(f['empty_steps'])}" if f["empty_steps"] else ""),
        highlight=False,
    )
    for b in f["bad_rows"][:5]:
        console.print(f"  bad row {(b['file'] + ' ') if 'file' in b else ''}{b['row']}: {b['reason']}", highlight=False)
    skipped = f.get("skipped_rows") or []
    if skipped:
        console.print(
            f"  {len(skipped)} rows left out by the framework itself (first: {skipped[0]['reason']})", highlight=False
        )
    ignored = f.get("ignored_files") or []
    if ignored:
        console.print(
            f"  {len(ignored)} files of no dump layout ignored ({', '.join(ignored[:3])}"
            f"{', ...' if len(ignored) > 3 else ''})",
            highlight=False,
        )
    ref = f.get("reference")
    if ref:
        for s in f["spikes"][:8]:
            console.print(
                f"  step {s['step']}: {s['side']} ({', '.join(f'{k} {v}' for k, v in s['sides'].items() if v)})",
                highlight=False,
            )
    for h in f["hypotheses"][:3]:
        console.print(f"  #{h['rank']} {h['sentence']} (p={h['p_value']:.2g})", highlight=False)
    causes = f.get("causes")
    if causes:
        console.print(
            f"  causes ({causes['verdict']}): {escape(causes['summary'])}  (lpf rl explain: tests and fixes)",
            highlight=False,
        )
    console.print(f"results: {out}/rl_findings.json, {out}/rl_steps.parquet", highlight=False)


def print_rl_rescore(path: Path, n_tokens: int, n_responses: int, model: str, dtype: str, console: Console) -> None:
    """`lpf rl rescore`: what was scored, by which reference, where it went."""
    console.print(
        f"reference scores: {path}  ({n_tokens} tokens of {n_responses} responses; {model}, {dtype})", highlight=False
    )


def print_rl_simulate(info: dict, steps: int, console: Console) -> None:
    """`lpf rl simulate`: where the dump went, the engine's cache, the drills in force."""
    cache = info["cache"]
    extra = ""
    if cache["faults"]:
        extra += f", faults {', '.join(cache['faults'])}"
    if info.get("rl_drills"):
        extra += f", RL drills {', '.join(info['rl_drills'])}"
    if info.get("policy"):
        extra += f", policy drift {info['policy']['drift']:g}/step (checkpoints {info['policy']['checkpoints']})"
    console.print(
        f"dump: {info['dump']}  ({info['n_responses']} responses over {steps} steps; engine "
        f"{cache['num_state_slots']} state slots, stride {cache['state_slot_stride']}{extra})",
        highlight=False,
    )


_STATUS_STYLE = {
    "named": "bold red",
    "negligible": "yellow",
    "not found": "green",
    "untested": "dim",
    "not applicable": "dim",
    "inside": "green",
    "exceeded": "bold red",
    "small": "green",
    "cannot judge": "bold yellow",
}


def print_rl_explain(block: dict, out: Path, console: Console) -> None:
    """`lpf rl explain`: the verdict, one row per cause (status, shares, evidence), the fixes of the named
    causes and the corrections they waste, hints for the untested ones, the worst responses."""
    style = {
        "causes": "bold red",
        "unexplained": "bold yellow",
        "inside-floor": "green",
        "cannot-judge": "bold yellow",
    }[block["verdict"]]
    console.print(f"[{style}]{block['verdict']}[/]  {escape(block['summary'])}", highlight=False)
    metric = block["framework_metric"]["name"]
    t = Table(box=box.SIMPLE_HEAD, title_justify="left")
    for col in ("cause", "status", "share of sum |d|", f"share of {metric}"):
        t.add_column(col)
    for c in block["causes"]:
        st = c["status"]
        t.add_row(
            c["label"],
            f"[{_STATUS_STYLE.get(st, 'white')}]{st}[/]",
            f"{100 * c['share']:.1f}%",
            f"{100 * c['share_metric']:.1f}%",
        )
    console.print(t)
    for c in block["causes"]:
        if c["status"] not in ("untested", "not applicable"):
            console.print(f"  {c['label']}: {escape(c['evidence'])}", highlight=False)
    for c in block["causes"]:
        if c["status"] != "named" or c["cause"] == "unexplained":
            continue
        fx = c["fix"]
        console.print(f"[bold]{c['label']}[/]: {escape(fx['why'])}", highlight=False)
        for line in fx["fix"]:
            console.print(f"  fix: {escape(line)}", highlight=False)
        for line in fx["correction"]:
            console.print(f"  correction: {escape(line)}", highlight=False)
    if block["wasted"]:
        console.print("wasted on these causes: " + escape("; ".join(block["wasted"])), highlight=False)
    for h in block["hints"]:
        console.print(f"  hint: {escape(h)}", highlight=False)
    worst = [w for w in block["worst_responses"][:5] if w["mass"]]
    if worst:
        console.print(
            "largest responses: "
            + ", ".join(f"{escape(str(w['request_id']))} (step {w['step']}, {w['dominant']})" for w in worst),
            highlight=False,
        )
    console.print(
        f"results: {out}/rl_causes.json, {out}/rl_causes.parquet, {out}/rl_cause_steps.parquet", highlight=False
    )
