"""Names of the bundled models and workloads, and where their files are.

Contract: `model_dir(name)` and `tokenizer_dir()` return paths inside the installed package (they may not
exist yet for a model that was never trained: see `list_models()[i]["available"]`). `workload_items(name,
seed, n)` returns item dicts as described in `lpf.zoo.tasks`. Unknown names raise `LpfError` with a
suggestion. No torch at import; `list_models()` reads only JSON and file sizes.
"""

from __future__ import annotations

import json
from pathlib import Path

from lpf.core.errors import LpfError, did_you_mean
from lpf.zoo import shared_prefix, tasks

DATA_DIR = Path(__file__).resolve().parent / "data"

MODELS = {
    "hybrid": {
        "architecture": "GraniteMoeHybridForCausalLM",
        "description": "Mamba2 + attention hybrid, dense shared MLP (no experts)",
    },
    "jamba": {"architecture": "JambaForCausalLM", "description": "Mamba1 + attention + MoE (2 experts)"},
    "llama": {"architecture": "LlamaForCausalLM", "description": "attention-only baseline"},
    "qwen35": {
        "architecture": "Qwen3_5ForCausalLM",
        "description": "Gated DeltaNet + gated attention 3:1 (Qwen3.5's shape)",
    },
}

WORKLOADS = {
    "oracle": {
        "description": "held-out recall / copy / addition prompts with exact expected answers",
        "default_n": 500,
    },
    "stress": {
        "description": "filler prose (8..~450 tokens) + a task, max_tokens 4..128: cache pressure",
        "default_n": 2000,
    },
    "shared-prefix": {
        "description": "recall groups sharing prefixes (fan-outs, sub-block prefixes, multi-turn "
        "conversations, exact resends, a cancel-and-resend): prefix caching",
        "default_n": 400,
    },
}


def _check(name: str, table: dict, kind: str) -> str:
    if name not in table:
        raise LpfError(f"unknown zoo {kind} {name!r}{did_you_mean(name, table)}; known: {', '.join(table)}")
    return name


def model_dir(name: str) -> Path:
    """The bundled Hugging Face directory of zoo model `name` (`zoo:NAME` on the command line)."""
    return DATA_DIR / "models" / _check(name, MODELS, "model")


def tokenizer_dir() -> Path:
    """The zoo's shared tokenizer directory (loads with `AutoTokenizer.from_pretrained`)."""
    return DATA_DIR / "tokenizer"


def model_available(name: str) -> bool:
    d = model_dir(name)
    return (d / "config.json").is_file() and (d / "model.safetensors").is_file()


def list_models() -> list[dict]:
    """One dict per model: name, architecture, description, available, and (when trained) parameters,
    size_bytes, accuracy (mix), accuracy_by_task, median_answer_prob, from `lpf_card.json`."""
    rows = []
    for name, meta in MODELS.items():
        d = model_dir(name)
        row = {
            "name": name,
            "architecture": meta["architecture"],
            "description": meta["description"],
            "path": str(d),
            "available": model_available(name),
            "parameters": None,
            "size_bytes": None,
            "accuracy": None,
            "accuracy_by_task": None,
            "median_answer_prob": None,
        }
        card = d / "lpf_card.json"
        if card.is_file():
            c = json.loads(card.read_text())
            ev = c.get("eval", {})
            row.update(
                parameters=c.get("parameters"),
                accuracy=ev.get("accuracy"),
                accuracy_by_task=ev.get("accuracy_by_task"),
                median_answer_prob=ev.get("median_answer_prob"),
            )
        if row["available"]:
            row["size_bytes"] = sum(p.stat().st_size for p in d.iterdir() if p.is_file())
        rows.append(row)
    return rows


def workload_items(name: str, seed: int = 0, n: int | None = None) -> list[dict]:
    """Items of zoo workload `name` (`zoo:NAME`); `n` defaults to the workload's size."""
    _check(name, WORKLOADS, "workload")
    n = WORKLOADS[name]["default_n"] if n is None else n
    if n < 0:
        raise LpfError(f"workload size must be >= 0, got {n}")
    if name == "oracle":
        return tasks.oracle_items(n, seed)
    if name == "shared-prefix":
        return shared_prefix.shared_prefix_items(n, seed)
    return tasks.stress_items(n, seed)


def list_workloads() -> list[dict]:
    return [{"name": k, "description": v["description"], "default_n": v["default_n"]} for k, v in WORKLOADS.items()]
