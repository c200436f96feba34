"""The quantized KV cache's drills: bugs that live inside an fp8 (or fp4) KV cache, each a scale that reaches the
wrong rows. The arithmetic is `kv_quant`'s; `KVCache` calls the hooks installed here (`read_fault`,
`decode_scale`), which are None on an honest engine.

  kv-scale-from-position:P  vllm#54035 / sglang#25790 (fp8 KV on Hopper FA3: decode's 96-token tile against
                            prefill's): a decode reads the rows from position P - 1 on with another scale
                            (1.0, the scale buffer's default) than prefill or its own write stored them with, so
                            every logprob from absolute position P on is wrong (the token at P is the first
                            whose context holds row P - 1); prefill reads them right.
  kv-offload-scales-lost    sglang#29913 (host offload of a quantized KV cache loses the block scales): the
                            blocks a prefix-cache hit reuses come back from the host tier with their codes and
                            without their scales, read with the default 1.0 (the built-in prefix cache has no
                            host tier: every hit's reused blocks are treated as having been there).
  kv-requant-on-hit         K/V quantized twice on a prefix-cache hit: the reused blocks' codes go through the
                            quantizing write again (their scale applied twice), saturating at the type's range.
  kv-fp4-collapse           vllm PR #49818 (NVFP4 KV: 5/5 prompts collapse to token id 0): the cache holds fp4
                            (e2m1) codes with 16-element block scales; a decode's write divides its block
                            scales by a global scale the decode path never set (0): inf scales, NaN K/V, NaN
                            logits, and greedy argmax returns token id 0 from the first decode on.
Ground truth: each request once, at the step it first sampled from a wrong read (`GroundTruth.record_once`).
"""

from __future__ import annotations

import torch

from lpf.builtin.kv_quant import KVQuant


class KVDrills:
    def __init__(self, faults, truth, kv_cache_dtype: str | None, scales: str, head_dim: int):
        self.faults, self.truth = faults, truth
        self.from_position = faults.kv_scale_from_position
        self.lost = faults.kv_offload_scales_lost
        self.twice = faults.kv_requant_on_hit
        self.fp4 = faults.kv_fp4_collapse
        if self.fp4:
            self.quant = KVQuant("fp4_e2m1", "block", head_dim)
        else:
            self.quant = KVQuant(kv_cache_dtype, scales, head_dim) if kv_cache_dtype else None
        self._hits: dict[str, int] = {}  # request -> prefix tokens its hit reused (their blocks' rows)

    def install(self, cache) -> None:
        if self.from_position is not None or self.lost or self.twice:
            cache.read_fault = self.read_fault
        if self.fp4:
            cache.decode_scale = float("inf")  # divided by the global scale the decode path left at 0

    def preempted(self, request_ids) -> None:
        for rid in request_ids:
            self._hits.pop(rid, None)  # recompute looks the prefix up again

    def scheduled(self, so, s, phase: str) -> None:
        if s.resume_tokens:
            self._hits[s.request_id] = s.resume_tokens
        t, step, rid = self.truth, so.step, s.request_id
        P = self.from_position
        if P is not None and phase == "decode" and s.num_computed_tokens >= P - 1:
            t.record_once(
                rid,
                step,
                "kv-scale-from-position",
                f"decode at position {s.num_computed_tokens} read K/V rows from {P - 1} on with scale 1.0, not the "
                f"scale they were written with: logprobs from absolute position {P} on",
            )
        hit = self._hits.get(rid, 0)
        if hit and s.will_sample:
            if self.lost:
                t.record_once(
                    rid,
                    step,
                    "kv-offload-scales-lost",
                    f"its prefix-cache hit's {hit} tokens of K/V came back from the host tier without their scales "
                    "(read with 1.0)",
                )
            if self.twice:
                t.record_once(
                    rid,
                    step,
                    "kv-requant-on-hit",
                    f"its prefix-cache hit's {hit} tokens of K/V quantized a second time",
                )
        if self.fp4 and phase == "decode" and s.will_sample:
            t.record_once(
                rid,
                step,
                "kv-fp4-collapse",
                f"decode at position {s.num_computed_tokens} wrote fp4 K/V whose block scales were divided by an "
                "unset global scale: NaN K/V from there on",
            )

    def read_fault(self, seqs, pos: torch.Tensor, decode: bool) -> dict:
        """Per read row ([n, width] positions of the requests `seqs`): which read with the default scale
        (`unscaled`), which quantized twice (`requantized`)."""
        out = {}
        if self.from_position is not None and decode:
            out["unscaled"] = pos >= self.from_position - 1
        if self.lost or self.twice:
            hits = torch.tensor([self._hits.get(m.request_id, 0) for m in seqs], device=pos.device)[:, None]
            reused = pos < hits
            if self.lost:
                out["unscaled"] = reused | out["unscaled"] if "unscaled" in out else reused
            if self.twice:
                out["requantized"] = reused
        return out
