"""The same model gets the same expected floor and tie margin however it is named (issue 39: zoo:jamba
given as its directory got a tie margin of 4.33, as `zoo:jamba` 0.531): the floor table is looked up
by the zoo model whose weights the reference holds (`pipeline.analyze.floor_model`), by sha256, so a
copy elsewhere counts too; a model the table never measured keeps the unmeasured envelope."""

from __future__ import annotations

import shutil

from lpf.analysis.floors import expected_floor
from lpf.core.model_specs import resolve_model
from lpf.pipeline.analyze import floor_model, floor_table


def _floor(ref: dict) -> dict:
    # a server of unknown dtype (the case): the most lenient pair measured, bfloat16/float32
    return expected_floor(floor_table(), None, "float32", floor_model(ref))


def test_a_zoo_model_given_as_a_path_gets_its_own_floor_row(tmp_path):
    named = resolve_model("zoo:jamba").describe()
    as_path = resolve_model(named["path"]).describe()  # what `--reference /path/to/it` records
    assert as_path["spec"] != "zoo:jamba" and floor_model(as_path) == "zoo:jamba"
    copy = tmp_path / "my-jamba"
    shutil.copytree(named["path"], copy)  # the same weights elsewhere: the same model
    copied = resolve_model(str(copy)).describe()
    assert floor_model(copied) == "zoo:jamba"
    want = _floor(named)
    assert "measured on zoo:jamba" in want["detail"] and want["tie_margin"] < 1  # 0.531 on the 2026-12-01 table
    for ref in (as_path, copied):
        got = _floor(ref)
        assert got["tie_margin"] == want["tie_margin"] and got["token"] == want["token"], (got, want)

    # other weights (one file changed): not the zoo model, the unmeasured envelope (a larger tie margin)
    other = tmp_path / "other"
    shutil.copytree(named["path"], other)
    with open(other / "model.safetensors", "ab") as f:
        f.write(b"\0")
    ref = resolve_model(str(other)).describe()
    assert floor_model(ref) == str(other)
    unmeasured = _floor(ref)
    assert "not measured" in unmeasured["detail"] and unmeasured["tie_margin"] > 2 * want["tie_margin"]  # 4.33
