"""The drill catalog (`lpf.builtin.drill_catalog`) is the one place a drill is declared: the engine's
FaultSet, the adapter's preconditions, the drill scoring, the engine facts analysis reads and the docs'
table all come from it, and analysis never reads a drill's name."""

import re
from pathlib import Path

import pytest

from lpf.adapters.builtin import BuiltinOptions
from lpf.builtin.drill_catalog import BEGIN, CATALOG, END, engine_facts, markdown_table
from lpf.builtin.drill_truth import EXPECTED
from lpf.builtin.faults import FaultSet
from lpf.core.errors import LpfError
from lpf.pipeline.trace import engine_info

ROOT = Path(__file__).resolve().parents[1]


def test_faultset_has_one_field_per_drill_and_round_trips_every_spelling():
    assert [f.replace("_", "-") for f in FaultSet.__dataclass_fields__] == [
        d.field.replace("_", "-") for d in CATALOG.values()
    ]
    for d in CATALOG.values():
        f = FaultSet.parse(d.name)
        assert f.in_force() == [d]
        spelled = f.names()[0]
        assert FaultSet.parse(spelled) == f
        if d.arg:
            assert getattr(f, d.field) == d.arg.default
            with pytest.raises(LpfError, match="must be in"):
                FaultSet.parse(f"{d.name}:{d.arg.hi * 2 + 1:g}")
        else:
            with pytest.raises(LpfError, match="takes no argument"):
                FaultSet.parse(f"{d.name}:3")
    with pytest.raises(LpfError, match="did you mean"):
        FaultSet.parse("stale-sate")


@pytest.mark.parametrize(
    "inject, knobs, refused",
    [
        ("conv-into-shared-block", {}, "conv-into-shared-block needs --enable-prefix-caching"),
        ("conv-into-shared-block", {"enable_prefix_caching": True}, None),
        ("incomplete-block-cached", {"enable_prefix_caching": True}, "add -E mamba_cache_mode=all"),
        ("spec-no-rollback", {}, "spec-no-rollback needs -E speculative=ngram:K"),
        ("spec-draft-probs-permuted", {"speculative": "ngram:4"}, "needs a draft model's probabilities"),
        ("kv-double-free", {"enable_prefix_caching": True}, "kv-double-free runs without prefix caching"),
        ("resume-wrong-units", {"enable_prefix_caching": True, "block_size": 16}, "mamba_block_size=32"),
        ("resume-wrong-units", {"enable_prefix_caching": True, "mamba_block_size": 32, "block_size": 16}, None),
    ],
)
def test_preconditions_come_from_the_catalog(inject, knobs, refused):
    if refused is None:
        assert BuiltinOptions.parse({"inject": inject, **knobs}).inject == inject
    else:
        with pytest.raises(Exception, match=re.escape(refused)):
            BuiltinOptions.parse({"inject": inject, **knobs})


def test_scoring_reads_each_drills_declared_features():
    assert EXPECTED["offset-wrap"]["overwritten"] == {"state_overwritten"}
    assert EXPECTED["spec-no-rollback"] == {"corrupted": {"state_kept_rejected_drafts"}}
    # a drill that names nothing per request (substitutions, prefix-cache-inert) has no entry
    assert "quantize-weights" not in EXPECTED and "prefix-cache-inert" not in EXPECTED
    for name, roles in EXPECTED.items():
        assert set(CATALOG[name].named_by) <= set().union(*roles.values()), name


class _Run:
    def __init__(self, manifest):
        self.manifest = manifest


@pytest.mark.parametrize(
    "engine, joined, bits",
    [
        ({"name": "builtin", "cache": {"faults": ["offset-wrap:18"]}}, {}, 18),
        ({"name": "builtin", "options": {"inject": "stale-state,offset-wrap"}}, {}, 20),  # a run without cache info
        ({"name": "openai"}, {"faults": ["stale-state", "offset-wrap:21"]}, 21),  # the vLLM plugin's, joined
        ({"name": "builtin", "cache": {"faults": ["stale-state"]}}, {}, None),
    ],
)
def test_analysis_learns_the_offset_wrap_as_an_engine_fact(engine, joined, bits):
    info = engine_info(_Run({"engine": engine, "trace": joined}))
    assert info.get("state_offset_wrap_bits") == bits
    assert engine_facts(["another-engines-drill:3"]) == {}


def test_analysis_never_reads_a_drill_name():
    # prefix-cache-inert is also the name of a finding analysis makes (findings.prefix_cache)
    names = [n for n in CATALOG if n != "prefix-cache-inert"]
    pattern = re.compile("[\"']({})".format("|".join(re.escape(n) for n in names)))  # a string literal
    hits = [
        f"{p.name}:{i}"
        for p in sorted((ROOT / "src/lpf/analysis").glob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith("#")
    ]
    assert not hits, f"analysis reads drill names: {hits}"


def test_the_docs_table_is_the_catalogs():
    text = (ROOT / "docs/builtin-engine.md").read_text()
    table = text.partition(BEGIN)[2].partition(END)[0]
    assert table.strip() == markdown_table().strip(), "run: python -m lpf.builtin.drill_catalog --write"
