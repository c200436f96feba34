"""Which config variants of an architecture are worth a matrix row: those that change the reference's output.

Contract: `check_variants(out, arch, kinds, prompts) -> dict` reads the fields the reference's modeling code
reads (`config_reads`), builds the architecture's variants (`variants.variants`), builds each one's tiny
checkpoint (`tiny.build_tiny(model_type, overrides)`: same seed, same recipe, the overrides on top) and
teacher-forces `prompts` through it and through the default config built the same way, float32, one
prompt at a time. Variants are built with every zero-initialised bias drawn at random
(`build_tiny(..., random_biases=True)`: a bias left at zero is one an engine could ignore unseen), so
their baseline is the default config with random biases, itself the first row (`random-biases`, kind
`biases`, kept when the default has any such bias). A variant whose logits are identical to that
baseline's (bit for bit), or a toggle's identical to its enablers' alone, changes nothing the
reference computes on these prompts: `status` `dropped` with that reason; one transformers cannot build is
`reference cannot build` with the error's line; the rest are `kept`, with `max_abs_logit_change` (how
far from the default it moved the logits) and `model` (the checkpoint directory). The document:
`architecture`, `model_type`, `modeling` (the file read), `reads` (how many fields it reads),
`factors` {field: {default, alternatives, enablers}}, `skipped` {field: why}, `variants` [row]. Kept in
`out/variants/<arch>.json` (a rerun reads it back when the kinds match). Prints nothing.
"""

from __future__ import annotations

import json
from pathlib import Path


def _logits(model_dir: Path, prompts: list[list[int]]):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([p]), use_cache=False).logits[0].clone() for p in prompts]


def _same(a: list, b: list) -> bool:
    """Two runs' logits identical, bit for bit, prompt by prompt."""
    import torch

    return all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def check_variants(out: Path, arch: dict, kinds: list[str], prompts: list[list[int]]) -> dict:
    from lpf.experiments.conformance.config_reads import config_reads, modeling_source
    from lpf.experiments.conformance.tiny import build_tiny, tiny_default_config
    from lpf.experiments.conformance.variants import factors, variants

    mt = arch["model_type"]
    kept = Path(out) / "variants" / f"{arch['architecture'].removesuffix('ForCausalLM')}.json"
    if kept.is_file():
        doc = json.loads(kept.read_text())
        if doc.get("kinds") == kinds and doc.get("n_prompts") == len(prompts):
            return doc
    found = modeling_source(mt)
    doc: dict = {"architecture": arch["architecture"], "model_type": mt, "kinds": kinds, "n_prompts": len(prompts)}
    if found is None:
        doc.update(modeling=None, reads=0, factors={}, skipped={}, variants=[])
    else:
        source, path = found
        reads = config_reads(source)
        config = tiny_default_config(mt)
        fs, skipped = factors(config, reads)
        doc.update(
            modeling=f"transformers/models/{mt}/{path.name}",
            reads=len(reads),
            factors={
                f: {"default": x.default, "alternatives": x.alternatives, "enablers": x.enablers} for f, x in fs.items()
            },
            skipped=skipped,
            variants=[],
        )
        # every variant is built with its zero biases drawn at random, so its baseline is the default config
        # built the same way; that baseline is a row of its own (`random-biases`), judged against the default
        base_model = build_tiny(mt, None, random_biases=True)
        base = _logits(base_model, prompts)
        changed = not _same(_logits(build_tiny(mt), prompts), base)
        doc["variants"].append(
            {
                "name": "random-biases",
                "kind": "biases",
                "overrides": {},
                "why": "the default config with every bias the init leaves at zero drawn at random (the variants' "
                "baseline: a zero bias is one an engine could ignore unseen)",
                "source": None,
                **(
                    {"status": "kept", "model": str(base_model)}
                    if changed
                    else {"status": "dropped", "reason": "the default config has no bias the init leaves at zero"}
                ),
            }
        )

        for v in variants(mt, config, reads, kinds):
            row = {"name": v.name, "kind": v.kind, "overrides": v.overrides, "why": v.why, "source": v.source}
            try:
                model = build_tiny(mt, v.overrides, random_biases=True)
                got = _logits(model, prompts)
                # a toggle set with what enables it: compared with the enablers alone too (the field itself
                # must change something, not just the flag it needs)
                enablers = {k: x for k, x in v.overrides.items() if k != v.name.split("=")[0]}
                alone = (
                    _logits(build_tiny(mt, enablers, random_biases=True), prompts)
                    if v.kind == "toggle" and enablers
                    else None
                )
            except Exception as e:  # noqa: BLE001 - a variant transformers cannot build or run is said, not raised
                row.update(status="reference cannot build", reason=" ".join(str(e).split())[:300])
                doc["variants"].append(row)
                continue
            change = max(
                (float((a - b).abs().max()) for a, b in zip(base, got) if a.shape == b.shape), default=float("nan")
            )
            if _same(base, got):
                row.update(
                    status="dropped",
                    reason=f"the reference's logits on {len(prompts)} conformance prompts are identical to the "
                    "default config's: the reference computes nothing different with it",
                )
            elif alone is not None and _same(alone, got):
                row.update(
                    status="dropped",
                    reason=f"the reference's logits on {len(prompts)} conformance prompts are identical to those "
                    f"with only {', '.join(f'{k}={x!r}' for k, x in enablers.items())} set: the field itself "
                    "changes nothing the reference computes",
                )
            else:
                row.update(status="kept", max_abs_logit_change=change, model=str(model))
            doc["variants"].append(row)
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return doc
