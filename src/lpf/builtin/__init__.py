"""The built-in engine: a small continuous-batching engine for hybrid attention + Mamba models.

In the spirit of vLLM v1 / nano-vllm, one job per file: `request` (request state), `scheduler`
(token budget, chunked prefill, preemption; imports no torch), `sched_output` (the only message from
scheduler to runner), `kv_cache` (paged KV blocks), `state_cache` (conv/SSM state slots in one flat
buffer with explicit strides), `forward_context` (per-step metadata every layer can reach),
`model_runner`, `sampler`, `faults` (opt-in drills that re-create real mechanisms, behind one `Drills`
handle), `models/` (our implementations of the architectures, checked against HF).
"""
