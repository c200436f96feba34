"""The reference rescorer against a plain full-logits computation, and its batching contract."""

import pytest
import torch

from lpf.model_specs import resolve_model
from lpf.reference import Rescorer, ScoreItem


@pytest.fixture(scope="module")
def rescorer():
    return Rescorer(resolve_model("tiny:hybrid"), token_budget=64, chunk_rows=7, topk=4)


def _items():
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (p, o) in enumerate([(3, 5), (10, 1), (1, 9), (17, 12), (6, 6), (2, 0)]):
        ids = torch.randint(3, 500, (p + o,), generator=g).tolist()
        out.append(ScoreItem(f"r{i}", ids[:p], ids[p:]))
    return out


def test_matches_full_logits_one_sequence_at_a_time(rescorer):
    items = _items()
    batches = rescorer.batches(items)
    assert all(len(b) * max(len(i.prompt_token_ids) + len(i.output_token_ids) for i in b) <= 64 for b in batches)
    assert sum(len(b) for b in batches) == 5  # the empty output is not scored
    rows = {}
    for b in batches:
        for r in rescorer.score_batch(b).to_pylist():
            rows[(r["request_id"], r["position"])] = r
    model = rescorer.model
    for it in items:
        if not it.output_token_ids:
            continue
        ids = torch.tensor([it.prompt_token_ids + it.output_token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        p = len(it.prompt_token_ids)
        for j, tok in enumerate(it.output_token_ids):
            row = rows[(it.request_id, j)]
            lp = logp[p - 1 + j]
            assert row["ref_logprob"] == pytest.approx(lp[tok].item(), abs=1e-4)
            assert row["ref_rank"] == int((lp > lp[tok]).sum()) + 1
            assert row["ref_top1_id"] == int(lp.argmax())
            assert row["ref_topk_ids"] == lp.topk(4).indices.tolist()
            assert row["ref_entropy"] == pytest.approx(float(-(lp.exp() * lp).sum()), abs=1e-3)


def test_context_and_vocab_checked(rescorer):
    from lpf.errors import LpfError

    with pytest.raises(LpfError, match="outside the reference vocabulary"):
        rescorer.validate(ScoreItem("x", [1, 2], [10**6]))
    with pytest.raises(LpfError, match="exceed the reference context"):
        rescorer.validate(ScoreItem("x", [1] * 4096, [1]))
