"""The built-in engine's fp8 KV cache (`kv_quant`, `KVCache`) and the analysis signatures of the bugs inside a
quantized KV cache (`onset_features`), as units: the arithmetic against float32, and the signatures on small
tables whose answer is known."""

import numpy as np
import pyarrow as pa
import pytest
import torch

from lpf.analysis.onset_features import onset_features
from lpf.builtin.kv_cache import KVCache
from lpf.builtin.kv_quant import KVQuant, fp4_e2m1


@pytest.mark.parametrize("name, rel", [("fp8_e4m3", 2.0**-4), ("fp8_e5m2", 2.0**-3)])
@pytest.mark.parametrize("scales", ["tensor", "block"])
def test_fp8_rows_come_back_within_half_an_ulp_of_the_type(name, rel, scales):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 2, 32, generator=g) * torch.logspace(-2, 1, 32)  # a head's elements span 3 decades
    q = KVQuant(name, scales, 32)
    sc = q.scales_for(x, "k", 0)
    assert sc.shape == (40, 2, 1 if scales == "tensor" else 2)
    codes = q.quantize(x, sc)
    assert codes.dtype == {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[name]
    back = q.dequantize(codes, sc)
    normal = x.abs() >= torch.finfo(codes.dtype).smallest_normal * sc.repeat_interleave(32 // sc.shape[-1], -1)
    err = ((back - x).abs() / x.abs())[normal]
    assert err.max() <= rel + 1e-6 and err.max() > 0  # round to nearest: half a spacing (2^-m relative), not exact
    if scales == "tensor":  # fixed at the first write (vLLM's calculate_kv_scales): amax / 200 for K
        assert sc.unique().item() == pytest.approx(x.abs().max().item() / 200)
        assert q.scales_for(x * 10, "k", 0).unique().item() == sc.unique().item()
    else:  # each 16 elements of a head's row: its amax maps to the type's largest value
        assert torch.allclose(sc[0, 0, 0], x[0, 0, :16].abs().max() / torch.finfo(codes.dtype).max)


def test_the_cache_stores_codes_and_the_read_hook_replaces_scales():
    q = KVQuant("fp8_e4m3", "block", 16)
    cache = KVCache(1, 4, 4, 1, 16, quant=q)
    k = torch.randn(6, 1, 16)
    cache.write(0, [2, 0], 0, k, -k)
    assert cache.k[0].dtype == torch.float8_e4m3fn and cache.ks[0].shape == (16, 1, 1)
    K, V = cache.read(0, [2, 0], 6)
    assert torch.allclose(K, k, rtol=2**-4) and torch.allclose(V, -k, rtol=2**-4)
    rows = cache.rows([2, 0], 0, 6)
    cache.read_fault = lambda seqs, pos, decode: {"unscaled": pos >= 4}
    K2, _ = cache.read(0, [2, 0], 6, seq=object())
    assert torch.equal(K2[:4], K[:4])
    assert torch.equal(K2[4:], cache.k[0][rows[4:]].float())  # codes read with 1.0
    assert fp4_e2m1(torch.tensor([0.2, 0.3, -2.4, 2.6, 9.0])).tolist() == [0.0, 0.5, -2.0, 3.0, 6.0]


def _tables(prompts: list[int], outs: list[list[int]], first: list[int | None], verdicts: list[str]):
    n = len(prompts)
    requests = pa.table(
        {
            "request_id": [f"r{i}" for i in range(n)],
            "seq": list(range(n)),
            "prompt_token_ids": [[1] * p for p in prompts],
            "output_token_ids": outs,
        }
    )
    summary = pa.table(
        {
            "request_id": [f"r{i}" for i in range(n)],
            "verdict": verdicts,
            "n_output_tokens": pa.array([len(o) for o in outs], pa.int32()),
            "first_divergence": pa.array(first, pa.int32()),
        }
    )
    return summary, requests


def test_a_positional_onset_is_named_with_its_block_and_a_random_one_is_not():
    # flagged requests of 4 prompt lengths depart at absolute position 97 (their first wrong token); one long
    # prompt was past it already and departs at its first decode; two short answers never reached it
    prompts = [20, 35, 50, 61, 120, 10, 12]
    outs = [list(range(n)) for n in (100, 90, 80, 60, 20, 30, 40)]  # no collapse
    first = [77, 62, 47, 36, 1, None, None]
    verdicts = ["divergent"] * 5 + ["clean"] * 2
    summary, requests = _tables(prompts, outs, first, verdicts)
    flagged = np.array([v != "clean" for v in verdicts])
    feats, onset = onset_features(summary, requests, flagged, {"options": {"block_size": 16}})
    assert onset == {
        "position": 97,
        "n": 4,
        "exact": 4,
        "of": 4,
        "prompt_lengths": 4,
        "blocks": "row 96 = 6 x 16 starts a block (KV block size 16)",
    }
    (f,) = feats
    assert f.name == "positional_onset" and f.values.tolist() == [True] * 5 + [False] * 2
    assert "absolute position 97" in f.phrase
    # onsets spread over positions (the drift of a long answer): no signature
    summary, requests = _tables(prompts, outs, [3, 40, 12, 30, 1, None, None], verdicts)
    assert onset_features(summary, requests, flagged, {}) == ([], None)


def test_outputs_that_collapse_to_one_id_are_named_and_the_flagged_alone_are_read():
    outs = [[7, 3, 0, 0, 0, 0, 0], [9, 0, 0, 0, 0, 0], [4, 4, 4, 8, 2, 6], [0, 0, 0, 0, 0]]
    summary, requests = _tables([5, 6, 7, 8], outs, [2, 1, 1, None], ["corrupt", "divergent", "divergent", "clean"])
    feats, onset = onset_features(summary, requests, np.array([True, True, True, False]))
    (f,) = feats
    assert onset is None and f.name == "collapsed_to_one_token"
    assert f.values.tolist() == [True, True, False, False]  # the clean repetition is never read
    assert "one token id, 0, for all of them" in f.phrase
