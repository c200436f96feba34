"""Bad input: a one-line error, exit 2, no traceback, and nothing already written is lost."""

import json
import shutil

import pytest

from conftest import write_prompts


def _assert_clean_error(r, *needles):
    assert r.code == 2, (r.code, r.err)
    assert "Traceback" not in r.err
    msg = r.err.strip()
    assert msg.startswith("error:"), msg
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, msg


def test_missing_prompts_file(lpf_cli, tmp_path):
    _assert_clean_error(
        lpf_cli("audit", "--workload", tmp_path / "nope.jsonl", "--out", tmp_path / "o"), "does not exist"
    )
    assert not (tmp_path / "o").exists()


def test_malformed_line_names_the_line(lpf_cli, tmp_path):
    p = tmp_path / "p.jsonl"
    p.write_text('{"prompt": "ok"}\n\n{"prompt": "also ok"}\n{"prompt": broken\n')
    _assert_clean_error(lpf_cli("run", "--workload", p, "--out", tmp_path / "o"), "p.jsonl:4", "not valid JSON")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "item, needle",
    [
        ({"prompt": ""}, "empty prompt"),
        ({"prompt_token_ids": []}, "empty prompt"),
        ({"prompt_token_ids": [1, 2, 99999]}, "outside the vocabulary"),
        ({"prompt_token_ids": [1, -3]}, "outside the vocabulary"),
        ({"prompt_token_ids": "1 2 3"}, "list of integers"),
        ({"text": "hi"}, "give 'prompt' instead"),  # 'text' alone: a prompt file's, not a run's workload
        ({"prompt": "a", "prompt_token_ids": [1]}, "exactly one"),
        (["a list"], "JSON object"),
    ],
)
def test_bad_items(lpf_cli, tmp_path, item, needle):
    p = write_prompts(tmp_path / "p.jsonl", [{"prompt": "fine"}, item])
    _assert_clean_error(
        lpf_cli("run", "--engine", "hf", "--model", "tiny:llama", "--workload", p, "--out", tmp_path / "o"),
        ":2:",
        needle,
    )


def test_prompt_longer_than_context(lpf_cli, tmp_path):
    p = write_prompts(tmp_path / "p.jsonl", [{"prompt_token_ids": [5] * 5000}])
    _assert_clean_error(
        lpf_cli("run", "--engine", "hf", "--model", "tiny:llama", "--workload", p, "--out", tmp_path / "o"),
        "model context is 4096",
    )


def test_unknown_engine_suggests(lpf_cli, tmp_path):
    _assert_clean_error(
        lpf_cli("audit", "--engine", "hff", "--out", tmp_path / "o"), "unknown engine 'hff'", "did you mean 'hf'"
    )


def test_unknown_model_path(lpf_cli, tmp_path):
    _assert_clean_error(lpf_cli("audit", "--model", tmp_path / "missing", "--out", tmp_path / "o"), "config.json")
    _assert_clean_error(lpf_cli("audit", "--model", "zoo:hybird", "--out", tmp_path / "o"), "did you mean 'hybrid'")


def test_builtin_refuses_an_architecture_it_does_not_run(lpf_cli, tmp_path):
    _assert_clean_error(
        lpf_cli("run", "--model", "tiny:llama", "--out", tmp_path / "o"), "LlamaForCausalLM", "--engine hf"
    )
    assert not (tmp_path / "o").exists()


def test_unknown_engine_option(lpf_cli, tmp_path):
    _assert_clean_error(
        lpf_cli("run", "--engine", "hf", "-E", "batchsize=4", "--out", tmp_path / "o"), "did you mean 'batch_size'"
    )
    _assert_clean_error(
        lpf_cli("run", "--engine", "hf", "--cache-mb", "4", "--out", tmp_path / "o"), "unknown engine option 'cache_mb'"
    )


def test_existing_run_dir_is_not_overwritten(lpf_cli, tmp_path):
    out = tmp_path / "o"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    _assert_clean_error(lpf_cli("run", "--out", out), "already exists", "--resume")
    assert (out / "precious.txt").read_text() == "keep me"


def test_newer_schema_refused(lpf_cli, hybrid_audit, tmp_path):
    run = tmp_path / "future"
    shutil.copytree(hybrid_audit[0], run)
    m = json.loads((run / "manifest.json").read_text())
    m["schema_version"] = 99
    (run / "manifest.json").write_text(json.dumps(m))
    before = sorted(p.name for p in run.rglob("*"))
    for args in (("analyze", run), ("rescore", run), ("run", "--resume", run), ("query", run, "select 1")):
        _assert_clean_error(lpf_cli(*args), "schema v99")
    assert sorted(p.name for p in run.rglob("*")) == before


def test_reference_with_other_tokenizer_refused(lpf_cli, hybrid_audit, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(hybrid_audit[0], run)
    # a reference whose tokenizer maps ids to other strings: same files, one vocab entry renamed
    ref = tmp_path / "other-tok"
    shutil.copytree(json.loads((run / "manifest.json").read_text())["model"]["path"], ref)
    tok = json.loads((ref / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (ref / "tokenizer.json").write_text(json.dumps(tok))
    before = (run / "findings.json").read_bytes()
    _assert_clean_error(lpf_cli("rescore", run, "--reference", ref, "--redo"), "different tokenizer")
    assert (run / "findings.json").read_bytes() == before
    assert list((run / "reference").glob("part-*.parquet")), "existing scores must survive a refused rescore"


def test_different_reference_model_same_tokenizer_is_allowed_and_recorded(lpf_cli, hybrid_audit, tmp_path):
    run = tmp_path / "r"
    shutil.copytree(hybrid_audit[0], run)
    r = lpf_cli("rescore", run, "--reference", "tiny:llama")
    _assert_clean_error(r, "--redo")  # scores from another reference are never mixed silently
    r = lpf_cli("rescore", run, "--reference", "tiny:llama", "--redo")
    assert r.code == 0, r.err
    assert json.loads((run / "manifest.json").read_text())["reference"]["spec"] == "tiny:llama"
    r = lpf_cli("analyze", run, "--json")
    assert json.loads(r.out)["reference"] == "tiny:llama"
    assert json.loads(r.out)["verdict"] in ("divergent", "corrupt")  # a different random model disagrees


def test_bad_sampling_and_threshold(lpf_cli, tmp_path, hybrid_audit):
    _assert_clean_error(lpf_cli("run", "--top-p", "0", "--out", tmp_path / "o"), "top_p")
    _assert_clean_error(lpf_cli("run", "--max-tokens", "0", "--out", tmp_path / "o"), "max_tokens")
    _assert_clean_error(lpf_cli("analyze", hybrid_audit[0], "--threshold", "clean=1"), "unknown threshold")
    _assert_clean_error(lpf_cli("analyze", tmp_path), "not a run directory")


def test_bad_sql(lpf_cli, hybrid_audit):
    _assert_clean_error(lpf_cli("query", hybrid_audit[0], "SELEC nonsense"), "query failed")
