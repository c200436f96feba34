"""One row per model family when the two sides name it differently (BailingHybrid / BailingMoeV2_5, BailingMoeV3).

Contract: `pairing_evidence(source_dir, engine_only, ref_only) -> {ref_arch: [(engine_arch, "path:line")]}`
reads the engine's Python source as text (never imports it): an engine-only architecture name
(`engine_only`, with or without its ForCausalLM suffix) and a reference-only architecture's
transformers `model_type` (`ref_only`: {arch: model_type}), quoted, within `WINDOW` lines of each
other in one file are that file's statement that the engine serves that model type under that name
(vLLM's `config/speculative.py` maps a `bailing_hybrid` config onto `BailingMoeV2_5ForCausalLM` /
`BailingMoeV3ForCausalLM` that way). The evidence is the file and line of the model type's mention.
`fold(entries, pairs, engine_name)` is pure: each paired reference entry becomes the family's row
(`family`, `engine_architectures`, `paired_by` added; its reason says it is one family with the
engine's names) and the engine-only entries it absorbed are dropped, so the matrix lists one row
per family instead of two gaps. A paired `no engine implementation` becomes `no tiny recipe` (or `paired, not audited` where a
recipe exists: the cells run the reference's own architecture name only); other statuses stay.
"""

from __future__ import annotations

import re
from pathlib import Path

WINDOW = 6  # lines: an `if model_type == ... or "Arch" in architectures` statement and its neighbours


def pairing_evidence(source_dir: Path, engine_only: list[str], ref_only: dict[str, str]) -> dict[str, list[tuple]]:
    if not engine_only or not ref_only:
        return {}
    names = {n: n for n in engine_only} | {n.removesuffix("ForCausalLM"): n for n in engine_only}
    name_re = re.compile(r"[\"'](" + "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)) + r")[\"']")
    types = {f'"{mt}"': arch for arch, mt in ref_only.items() if mt} | {
        f"'{mt}'": arch for arch, mt in ref_only.items() if mt
    }
    out: dict[str, list[tuple]] = {}
    root = Path(source_dir)
    for f in sorted(root.rglob("*.py")):
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        if not any(t in text for t in types):
            continue
        lines = text.splitlines()
        for i, line in enumerate(lines):
            for quoted, arch in types.items():
                if quoted not in line:
                    continue
                near = "\n".join(lines[max(0, i - WINDOW) : i + WINDOW + 1])
                for m in name_re.finditer(near):
                    engine_arch = names[m.group(1)]
                    where = f"{root.name}/{f.relative_to(root)}:{i + 1}"
                    if engine_arch not in [p[0] for p in out.get(arch, [])]:
                        out.setdefault(arch, []).append((engine_arch, where))
    return out


def fold(entries: list[dict], pairs: dict[str, list[tuple]], engine_name: str) -> list[dict]:
    absorbed = {e for found in pairs.values() for e, _ in found}
    out = []
    for entry in entries:
        if entry["architecture"] in absorbed and entry["architecture"] not in pairs:
            continue
        found = pairs.get(entry["architecture"])
        if found:
            names = [e for e, _ in found]
            entry = {
                **entry,
                "family": entry["architecture"].removesuffix("ForCausalLM"),
                "engine_architectures": names,
                "paired_by": [w for _, w in found],
            }
            said = (
                f"one family: {engine_name} serves model type {entry.get('model_type')!r} as "
                f"{', '.join(n.removesuffix('ForCausalLM') for n in names)} ({'; '.join(dict.fromkeys(entry['paired_by']))})"
            )
            if entry["status"] == "no engine implementation":  # it has one, under another name
                from lpf.experiments.conformance.tiny import SCALE

                entry["status"] = "no tiny recipe" if entry.get("model_type") not in SCALE else "paired, not audited"
                entry["reason"] = said + (
                    "; lpf has no scaled-down recipe for it yet"
                    if entry["status"] == "no tiny recipe"
                    else "; the cells run the reference's own name only"
                )
            else:
                entry["reason"] = f"{said}; {entry['reason']}" if entry["reason"] else said
        out.append(entry)
    return out
