"""The zoo: task generators, tokenizer, registry, and the bundled checkpoints (never retrained here)."""

from __future__ import annotations

import random
import re
import subprocess
import sys

import pytest

from lpf.core.errors import LpfError
from lpf.zoo import registry, tasks


def _answer(prompt: str) -> str:
    """Recompute the expected answer from the task text alone (the last line of the prompt)."""
    task = prompt.split("\n")[-1]
    if m := re.fullmatch(r"A:(\d\d)\+(\d\d)=", task):
        return str(int(m[1]) + int(m[2]))
    if m := re.fullmatch(r"C:([A-Z1-9]+)=", task):
        return m[1]
    if m := re.fullmatch(r"R:((?:[A-Z][1-9]{2},)*[A-Z][1-9]{2})\|([A-Z])", task):
        table = {kv[0]: kv[1:] for kv in m[1].split(",")}
        assert len(table) == len(m[1].split(",")), "keys must be distinct"
        return table[m[2]]
    raise AssertionError(f"unrecognised task text {task!r}")


# --- generators -------------------------------------------------------------------------------------


def test_oracle_items_are_deterministic_and_seeded():
    a, b = tasks.oracle_items(60, seed=3), tasks.oracle_items(60, seed=3)
    assert a == b
    assert a != tasks.oracle_items(60, seed=4)
    assert len({it["id"] for it in a}) == 60
    assert {it["task"] for it in a} == set(tasks.TASKS)


def test_oracle_expected_answers_are_correct():
    for it in tasks.oracle_items(300, seed=0):
        assert it["expected"] == _answer(it["prompt"]), it


def test_addition_pairs_in_oracle_are_held_out_from_training():
    for it in tasks.oracle_items(300, seed=0):
        if it["task"] == "add":
            a, b = map(int, re.findall(r"\d\d", it["prompt"]))
            assert tasks.add_held_out(a, b)
    rng = random.Random(0)
    for _ in range(3000):
        tr = tasks.training_item(rng, 1.0)
        if tr["task"] == "add":
            a, b = map(int, re.findall(r"\d\d", tr["text"].split("\n")[-1])[:2])
            assert not tasks.add_held_out(a, b)


def test_training_items_mark_answer_spans():
    rng = random.Random(1)
    for _ in range(500):
        tr = tasks.training_item(rng, rng.random())
        for a, b in tr["spans"]:
            assert 0 < a < b <= len(tr["text"])
            assert re.fullmatch(r"[A-Z0-9]+", tr["text"][a:b])
        if tr["task"] == "recall":  # every queried value matches the table
            body, _, queries = tr["text"].split("\n")[-1][2:].partition("|")
            table = {kv[0]: kv[1:] for kv in body.split(",")}
            for q in queries.split("|"):
                assert table[q[0]] == q[1:]


def test_stress_items_vary_prompt_and_output_lengths():
    items = tasks.stress_items(400, seed=0)
    assert items == tasks.stress_items(400, seed=0)
    assert len({it["id"] for it in items}) == 400
    mt = [it["max_tokens"] for it in items]
    assert min(mt) <= 8 and max(mt) >= 100 and all(4 <= m <= 128 for m in mt)
    lens = [len(it["prompt"]) for it in items]
    assert min(lens) < 150 and max(lens) > 1000
    for it in items:
        assert it["expected"] == _answer(it["prompt"])
        assert it["max_tokens"] > len(it["expected"])  # room for the answer and </s>


def test_filler_text_reads_like_prose():
    text = tasks.filler_text(random.Random(0), 60)
    assert len(text.split()) >= 60
    assert text[0].isupper() and text[-1] in ".!?"
    assert text == tasks.filler_text(random.Random(0), 60)


# --- tokenizer --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(registry.tokenizer_dir()), local_files_only=True)


def test_tokenizer_special_tokens(tok):
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<s>", "</s>")
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert 512 <= len(tok) <= 1024


def test_task_strings_are_one_token_per_character(tok):
    for ch in tasks.TASK_CHARS:
        assert len(tok(ch, add_special_tokens=False)["input_ids"]) == 1, ch
    for it in tasks.oracle_items(90, seed=5) + tasks.stress_items(30, seed=5):
        task = it["prompt"].split("\n")[-1] + it["expected"]
        assert len(tok(task, add_special_tokens=False)["input_ids"]) == len(task), task


def test_tokenizer_round_trips_prompts(tok):
    for it in tasks.stress_items(60, seed=9):
        ids = tok(it["prompt"])["input_ids"]
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids, skip_special_tokens=True) == it["prompt"]


# --- registry ---------------------------------------------------------------------------------------


def test_registry_import_is_cheap():
    code = "import sys, lpf.zoo.registry; print('torch' in sys.modules or 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_unknown_names_suggest_the_close_one():
    with pytest.raises(LpfError, match="did you mean 'hybrid'"):
        registry.model_dir("hybird")
    with pytest.raises(LpfError, match="did you mean 'oracle'"):
        registry.workload_items("oracel")


def test_workloads():
    assert {w["name"] for w in registry.list_workloads()} == {"oracle", "stress", "shared-prefix"}
    assert len(registry.workload_items("oracle")) == 500
    assert registry.workload_items("oracle", seed=2, n=10) == tasks.oracle_items(10, seed=2)
    assert len(registry.workload_items("stress", n=25)) == 25


def test_list_models_and_dirs():
    rows = registry.list_models()
    assert [r["name"] for r in rows] == list(registry.MODELS)
    for r in rows:
        assert r["path"] == str(registry.model_dir(r["name"]))
        if r["available"]:
            assert r["parameters"] and r["size_bytes"] and r["accuracy"] is not None
    assert (registry.tokenizer_dir() / "tokenizer.json").is_file()


# --- checkpoints ------------------------------------------------------------------------------------


def _greedy_exact(model, tok, items) -> float:
    """HF greedy generate, grouped by prompt length so that no padding is involved."""
    import torch

    groups: dict[int, list] = {}
    for it in items:
        ids = tok(it["prompt"])["input_ids"]
        groups.setdefault(len(ids), []).append((ids, it))
    ok = 0
    with torch.no_grad():
        for group in groups.values():
            x = torch.tensor([ids for ids, _ in group])
            budget = max(len(it["expected"]) for _, it in group) + 3
            y = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                do_sample=False,
                max_new_tokens=budget,
                pad_token_id=tok.pad_token_id,
            )
            for row, (_, it) in zip(y[:, x.shape[1] :].tolist(), group):
                if tok.eos_token_id in row:
                    ok += tok.decode(row[: row.index(tok.eos_token_id)]) == it["expected"]
    return ok / len(items)


@pytest.mark.parametrize("name", list(registry.MODELS))
def test_bundled_model_loads_offline_and_answers(name, monkeypatch):
    if not registry.model_available(name):
        pytest.skip(f"zoo model {name!r} not trained yet (run scripts/train_zoo.py --model {name})")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    d = registry.model_dir(name)
    assert sum(p.stat().st_size for p in d.iterdir() if p.is_file()) <= 10 * 2**20
    model = transformers.AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True)
    tok = transformers.AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    model.eval()
    assert type(model).__name__ == registry.MODELS[name]["architecture"]
    acc = _greedy_exact(model, tok, tasks.oracle_items(42, seed=0))
    assert acc >= 0.85, f"{name}: {acc:.0%} exact on 42 oracle items"
