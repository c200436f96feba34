"""What the conformance matrix's terminal table shows, as plain data, from a conformance document
(`matrix_view`; pure: the cli's render_compare draws it)."""

from __future__ import annotations

SHORT_DTYPE = {"bfloat16": "bf16", "float16": "fp16"}


def matrix_view(doc: dict) -> dict:
    """What the terminal table shows, as plain data: `cells` (names), `grid` [(architecture, [entry per
    cell])] with entry {status, verdict, label ("verdict" or "verdict/prompt verdict"), max (largest |d|
    on output or prompt positions)}, `not_clean` [(name, what the attribution says, its sentence)],
    `failed` [(name, status, reason)], `named` [(name, cause, evidence, clean)]: the known departures a
    per-token judgement names (llama.cpp), `reference` [(name, status, departing paths or why)]: the
    reference column, `not_audited` [(status, reason, architectures)], and `variants` [(row name, kind,
    the fields that differ)] / `dropped` [(architecture, variant, reason)]: the config-variant axis."""
    cells = [c["name"] for c in doc.get("cell_catalogue") or []]
    rows = doc.get("cells") or []
    by = {(r["architecture"], r["cell"]): r for r in rows}
    order = [a["architecture"] for a in doc.get("architectures") or []]
    archs = [a for a in order if any(r["architecture"] == a for r in rows)]
    short = {a: a.removesuffix("ForCausalLM") for a in archs}
    grid = []
    for a in archs:
        entries = []
        for c in cells:
            r = by.get((a, c)) or {"status": "–"}
            v, pv = r.get("verdict"), r.get("prompt_verdict")
            label = f"{v}/{pv}" if pv and pv != v else str(v)
            if r.get("conformance") == "clean" and v != "clean" and r.get("engine_judgement"):
                label = "clean*"  # per token, its named departures beside it (`named`)
            elif r.get("conformance") == "clean" and v != "clean":  # within the bf16 expectation
                label = f"{SHORT_DTYPE.get(r['dtype'], r['dtype'])} ok"
            entries.append(
                {
                    "status": r["status"],
                    "verdict": r.get("conformance", v),
                    "label": label,
                    "max": max(
                        [x for x in (r.get("max_abs_output"), r.get("max_abs_prompt")) if x is not None] or [0.0]
                    ),
                }
            )
        grid.append((short[a], entries))
    not_clean, failed, located, named = [], [], [], []
    for r in rows:
        name = f"{r['architecture'].removesuffix('ForCausalLM')} · {r['cell']}"
        for cause in (r.get("engine_judgement") or {}).get("causes") or []:
            # clean* only where the judgement made the cell clean; a cell that departs past its known
            # departures shows them beside its verdict
            named.append((name, cause["name"], cause["evidence"], r.get("conformance") == "clean"))
        if r.get("status") != "ok":
            failed.append((name, r.get("status"), str(r.get("error") or "")))
        elif r.get("conformance") not in ("clean", None):
            at = r.get("attribution") or {}
            says = at.get("says") or (f"not attributed: {at['error']}" if at.get("error") else "not attributed")
            not_clean.append((name, says, at.get("sentence")))
            lc = r.get("locate") or {}
            if lc:
                located.append((name, lc.get("sentence") or f"not located: {lc.get('error')}"))
    groups: dict[tuple, list[str]] = {}
    for a in doc.get("architectures") or []:
        if a.get("status") != "audit":
            groups.setdefault((a["status"], a.get("reason") or ""), []).append(
                a["architecture"].removesuffix("ForCausalLM")
            )
    reference = [
        (
            r["architecture"].removesuffix("ForCausalLM"),
            r.get("status"),
            ", ".join(
                f"{n} {(r.get('paths') or {}).get(n, {}).get('max_abs', 0):.2g}" for n in r.get("departing") or []
            )
            or r.get("error")
            or r.get("reason")
            or "",
        )
        for r in doc.get("reference_column") or []
    ]
    variants = [
        (
            a["architecture"],
            a["variant"].get("kind"),
            ", ".join(f"{k}={v}" for k, v in (a["variant"].get("overrides") or {}).items()) or a["variant"].get("why"),
        )
        for a in doc.get("architectures") or []
        if a.get("variant")
    ]
    dropped = [
        (c["architecture"].removesuffix("ForCausalLM"), v["name"], v.get("reason") or v.get("status"))
        for c in doc.get("variants") or []
        for v in c.get("variants") or []
        if v.get("status") != "kept"
    ]
    dropped += [  # a check that could not run at all (its variants are then not built)
        (c["architecture"].removesuffix("ForCausalLM"), "(every variant)", c["error"])
        for c in doc.get("variants") or []
        if c.get("error")
    ]
    return {
        "variants": variants,
        "dropped": dropped,
        "cells": cells,
        "archs": archs,
        "grid": grid,
        "not_clean": not_clean,
        "failed": failed,
        "located": located,
        "named": named,
        "reference": reference,
        "not_audited": [(s, r, names) for (s, r), names in groups.items()],
    }
