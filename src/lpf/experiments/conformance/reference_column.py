"""The matrix's reference column: `reference_check` on every stateful architecture transformers ships.

Contract: `reference_column(out, architectures, workload, max_tokens, n_prompts, tick) -> list[dict]`
runs `reference_check.check_reference` on each discovery entry's tiny checkpoint, whatever the
engine's status for it (the architectures the engine cannot run get this check too), over the first
`n_prompts` prompts of the matrix's workload, and returns one row per architecture: `architecture`,
`model_type`, `status` (`reference consistent`, `reference inconsistent` with `departing` naming the
path, `reference cannot run`, or `no tiny recipe` with the reason) and the check's numbers. A config
variant's row (an entry with `variant`, `<Arch>~<name>`) checks the variant's own checkpoint, built as
`variant_check` builds it (its overrides, zero biases drawn at random): a field can make the reference
disagree with itself where its default does not. Each row is kept in `out/reference/<arch>.json`, so a
rerun reads it back instead of checking again.
"""

from __future__ import annotations

import json
from pathlib import Path

from lpf.core.errors import LpfError


def reference_column(
    out: Path, architectures: list[dict], workload: Path, max_tokens: int, n_prompts: int = 4, tick=lambda n: None
) -> list[dict]:
    from lpf.experiments.conformance.reference_check import check_reference
    from lpf.experiments.conformance.tiny import SCALE, build_tiny

    prompts = [
        json.loads(line)["prompt_token_ids"] for line in Path(workload).read_text().splitlines() if line.strip()
    ][:n_prompts]
    folder = Path(out) / "reference"
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for a in architectures:
        mt = a.get("model_type")
        if not mt:
            continue  # the engine's name only: no reference to check
        row = {"architecture": a["architecture"], "model_type": mt}
        kept = folder / f"{a['architecture'].removesuffix('ForCausalLM')}.json"
        if kept.is_file():
            rows.append(json.loads(kept.read_text()))
            tick(1)
            continue
        if mt not in SCALE:
            row.update(status="no tiny recipe", reason=f"lpf has no scaled-down recipe for {mt} yet")
        else:
            v = a.get("variant")
            try:
                model = build_tiny(mt, v["overrides"], random_biases=True) if v else build_tiny(mt)
                row.update(check_reference(model, prompts, max_tokens))
            except LpfError as e:
                row.update(status="reference cannot run", error=str(e))
            kept.write_text(json.dumps(row, indent=2, default=str) + "\n")
        rows.append(row)
        tick(1)
    return rows
