"""The reference rescorer against a plain full-logits computation, and its batching contract."""

import pytest
import torch

from lpf.core.model_specs import resolve_model
from lpf.pipeline.reference import Rescorer, ScoreItem


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
    from lpf.core.errors import LpfError

    with pytest.raises(LpfError, match="outside the reference vocabulary"):
        rescorer.validate(ScoreItem("x", [1, 2], [10**6]))
    with pytest.raises(LpfError, match="exceed the reference context"):
        rescorer.validate(ScoreItem("x", [1] * 4096, [1]))


def _float64_rows(z, tok, k):
    lp = torch.log_softmax(z.double(), -1)
    chosen = lp.gather(1, tok.view(-1, 1)).squeeze(1)
    p = lp.exp()
    entropy = -torch.where(p > 0, p * lp, torch.zeros_like(lp)).sum(1)
    return chosen, lp.topk(k), (lp > chosen.unsqueeze(1)).sum(1) + 1, entropy


@pytest.mark.parametrize("vocab,k", [(32000, 5), (50257, 20), (100, 3), (40, 0)])
def test_logprob_rows_matches_float64(vocab, k, monkeypatch):
    """The fused passes (column-max top-k, one work buffer, exps over the logits) against float64
    log_softmax: tokens inside and outside the top-k, -inf logits (a top-k-masked row), k = 0; and the
    GPU's `fused` form (S, sum(e * y) and the rank's count as one set of reductions, compiled there), here
    its ops run eagerly: the arithmetic a compiler must reproduce."""
    from lpf.core import torch_utils
    from lpf.core.torch_utils import logprob_rows

    monkeypatch.setattr(torch_utils, "_ROW_SUMS", {"failed": "the test runs the eager form"})

    g = torch.Generator().manual_seed(vocab)
    z = torch.randn(37, vocab, generator=g) * 4
    z[3, ::2] = float("-inf")
    z[30:] += 100  # rows past exp's float32 range: the shifted path
    tok = torch.randint(0, vocab, (37,), generator=g)
    tok[:10] = z[:10].argmax(1)
    tok[3] = 1  # finite in the masked row
    scratch = torch.empty(64 * vocab)
    runs = (
        logprob_rows(z, tok, k),
        logprob_rows(z.clone(), tok, k, scratch, overwrite=True),
        logprob_rows(z.clone(), tok, k, scratch, overwrite=True, fused=True),
    )
    for out in runs:
        chosen, top_ids, top_lp, rank, entropy = out
        want, (want_top, want_ids), want_rank, want_entropy = _float64_rows(z, tok, max(k, 1))
        assert (chosen.double() - want).abs().max() < 2e-5
        assert torch.equal(top_ids, want_ids) and (top_lp.double() - want_top).abs().max() < 2e-5
        assert torch.equal(rank, want_rank)
        assert (entropy.double() - want_entropy).abs().max() < 1e-4 and entropy.isfinite().all()


def test_batches_sorted_by_length_then_id_under_the_budget_and_the_padding_slack():
    from lpf.pipeline.batch_plan import PAD_SLACK, plan_batches

    lengths, ids = [5, 3, 5, 9, 3, 20], ["e", "b", "a", "c", "z", "x"]
    assert plan_batches(lengths, ids, 10) == [[1, 4], [2, 0], [3], [5]]  # 2 x 5 fits 10; 20 goes alone
    # a budget of 100 would take [3, 3, 5] (15 padded for 11 real), but that is over the padding slack
    assert PAD_SLACK < 15 / 11 - 1
    assert plan_batches(lengths, ids, 100) == [[1, 4], [2, 0], [3], [5]]
    assert plan_batches([10] * 5 + [11] * 5, [f"r{i}" for i in range(10)], 1000) == [list(range(10))]


@pytest.mark.parametrize("float32_head", [True, False])
def test_bfloat16_reference_head_in_float32(float32_head):
    """Weights in bfloat16; the head and log-softmax in float32 (or, for a calibration run, the head
    at the model's dtype as an engine computes it) against the plain computation of each."""
    rs = Rescorer(resolve_model("tiny:llama"), dtype="bfloat16", topk=3, float32_head=float32_head)
    w = rs.model.get_output_embeddings().weight
    for batch in rs.batches(_items()):
        rows = {(r["request_id"], r["position"]): r for r in rs.score_batch(batch).to_pylist()}
        # the same padded batch (bfloat16 hidden states depend on the batch's shape)
        width = max(len(it.prompt_token_ids) + len(it.output_token_ids) for it in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        for row, it in enumerate(batch):
            seq = it.prompt_token_ids + it.output_token_ids
            ids[row, : len(seq)] = torch.tensor(seq)
        with torch.no_grad():
            hidden = rs.model.base_model(input_ids=ids).last_hidden_state
            logits = hidden.float() @ w.float().T if float32_head else hidden @ w.T
        lp = torch.log_softmax(logits.double(), -1)
        for row, it in enumerate(batch):
            p = len(it.prompt_token_ids)
            for j, tok in enumerate(it.output_token_ids):
                assert rows[(it.request_id, j)]["ref_logprob"] == pytest.approx(
                    lp[row, p - 1 + j, tok].item(), abs=1e-4
                )


def test_reference_device_errors():
    from lpf.core.devices import resolve_device
    from lpf.core.errors import LpfError

    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(LpfError, match="unknown reference device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(LpfError, match="sees no GPU"):
            resolve_device("cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_reference_matches_cpu(rescorer):
    gpu = Rescorer(resolve_model("tiny:hybrid"), device="cuda", token_budget=64, chunk_rows=7, topk=4)
    items = _items()
    cpu_rows = [r for b in rescorer.batches(items) for r in rescorer.score_batch(b).to_pylist()]
    gpu_rows = [r for b in gpu.batches(items) for r in gpu.score_batch(b).to_pylist()]
    assert [(r["request_id"], r["position"]) for r in cpu_rows] == [(r["request_id"], r["position"]) for r in gpu_rows]
    for a, b in zip(cpu_rows, gpu_rows):
        assert a["ref_logprob"] == pytest.approx(b["ref_logprob"], abs=1e-4)


def test_the_float32_output_gemm_is_used_only_where_the_device_has_it():
    """bfloat16 weights: the float32-output GEMM on CUDA, the float32 copy of the weight on a CPU (torch has
    no CPU kernel for `out_dtype`: if one appears, this says so and the rule is revisited)."""
    from lpf.pipeline.reference_head import mixed_mm_supported

    a = torch.ones((2, 3), dtype=torch.bfloat16)
    try:
        torch.mm(a, a.t(), out_dtype=torch.float32)
        cpu_has_it = True
    except (RuntimeError, NotImplementedError, TypeError):
        cpu_has_it = False
    assert not cpu_has_it and not mixed_mm_supported("cpu", torch.bfloat16)
    assert not mixed_mm_supported("cuda", torch.float32)
    rs = Rescorer(resolve_model("tiny:llama"), dtype="bfloat16", topk=3)
    assert not rs.mixed_head and rs.head.weights[0].dtype == torch.float32 and rs.head_dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_mixed_head_equals_the_float32_copy():
    """bfloat16 weights on CUDA: the head from the bf16 operands with float32 accumulation and output
    scores what the float32 copy of the weight scores, within 1e-4."""
    items = _items()
    fast = Rescorer(resolve_model("tiny:llama"), dtype="bfloat16", device="cuda", topk=3)
    copy = Rescorer(resolve_model("tiny:llama"), dtype="bfloat16", device="cuda", topk=3, mixed_head=False)
    assert fast.mixed_head and not copy.mixed_head
    a = [r for t in fast.score(items) for r in t.to_pylist()]
    b = [r for t in copy.score(items) for r in t.to_pylist()]
    assert [(r["request_id"], r["position"]) for r in a] == [(r["request_id"], r["position"]) for r in b]
    assert max(abs(x["ref_logprob"] - y["ref_logprob"]) for x, y in zip(a, b)) <= 1e-4


@pytest.mark.slow  # an end-to-end run or a browser: kept out of `make test-fast` (issue 27)
def test_the_rescorer_imports_only_what_a_bare_gpu_machine_has():
    """scripts/gpu_check.sh runs where Python has torch, transformers, pyarrow and numpy only."""
    import json
    import subprocess
    import sys

    probe = (
        "import sys, lpf.pipeline.reference, lpf.core.devices, lpf.pipeline.rescore, lpf.run.store, lpf.core.model_specs\n"
        "import lpf.zoo.registry\n"
        "import json; print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('duckdb', 'plotly', 'rich', 'click', 'pydantic', 'httpx', 'fastapi', 'uvicorn', 'ray', 'vllm'))))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_one_batch_ahead_scores_what_one_batch_at_a_time_does(rescorer):
    """score_planned queues batch i + 1 before it waits for batch i: the same tables, in the same order,
    as score_batch_all one batch at a time, the prompt rows included; a batch that fails validation
    still lets the batch before it out first."""
    from lpf.core.errors import LpfError

    items = _items()
    items = [
        ScoreItem(it.request_id, it.prompt_token_ids, it.output_token_ids, score_prompt=i % 2 == 0)
        for i, it in enumerate(items)
    ]
    batches = rescorer.batches(items)
    assert len(batches) >= 3
    ahead = list(rescorer.score_planned(batches))
    assert len(ahead) == len(batches)
    for b, got in zip(batches, ahead):
        want = rescorer.score_batch_all(b)
        assert got.reference.equals(want.reference)
        assert (got.prompt_reference is None) == (want.prompt_reference is None)
        if want.prompt_reference is not None:
            assert got.prompt_reference.equals(want.prompt_reference)
    bad = [ScoreItem("bad", [1, 2], [10**6])]
    seen = []
    with pytest.raises(LpfError, match="outside the reference vocabulary"):
        for scored in rescorer.score_planned([batches[0], bad, batches[1]]):
            seen.append(scored.reference)
    assert len(seen) == 1 and seen[0].equals(ahead[0].reference)
