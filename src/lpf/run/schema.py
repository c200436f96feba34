"""Explicit Arrow schemas of every table in a run directory, and the schema version.

Bump `SCHEMA_VERSION` when a column changes meaning or a required column is added; readers refuse
run directories written by a newer version instead of guessing, and read older ones with the columns
they lack as nulls (`RunDir.read`). Logprobs that get compared (engine vs reference) are float64 so
storage never adds error of its own; top-k lists are float32.

v2 (over v1): `requests.inconsistency` and `requests.attempts` (what a server returned, kept as
evidence), and the prompt-position tables `prompt_tokens` / `prompt_reference` (the prefill path).
`attempts.sent_id` came later (an older part reads it as null, no bump: nothing required changed).
The optional `attribution` and `seeded` tables are derived (re-computable from the others), so it needs no bump.

`table(target, columns)` builds a table of one of these schemas from the columns a writer has, every
other column null (what `RunDir.read` gives a part of an older version): code that builds tables
outside the adapters (benchmarks, synthetic runs) names only its own columns, so a column added here
cannot break it.
"""

import pyarrow as pa

SCHEMA_VERSION = 2

_ids = pa.list_(pa.int32())
_lps = pa.list_(pa.float32())

ATTEMPT = pa.struct(
    [
        ("attempt", pa.int32()),  # 0 first, then retries
        ("sent", pa.bool_()),  # false: it never left (connection refused, circuit open, deadline)
        ("status", pa.int32()),  # the HTTP status, null when there was no answer
        ("error", pa.string()),  # the server's own error message, or what went wrong; null on success
        ("t_start", pa.float64()),  # unix seconds
        ("t_end", pa.float64()),
        # the request id the server was told for this attempt (X-Request-Id, SGLang's rid): a UUID, or
        # lpf's own id; null when none was sent. A server's trace names attempts by it (pipeline.trace)
        ("sent_id", pa.string()),
    ]
)

# A request's own sampling settings as its client sent them (`lpf watch`: real traffic mixes them per request);
# a field left null was not sent (the server's default applies: never assumed greedy). The whole struct
# null: the run's settings (the manifest's workload sampling), as every request of an audit lpf drives has.
SAMPLING = pa.struct(
    [
        ("temperature", pa.float64()),
        ("top_p", pa.float64()),
        ("top_k", pa.int32()),
        ("min_p", pa.float64()),
        ("repetition_penalty", pa.float64()),
        ("presence_penalty", pa.float64()),
        ("frequency_penalty", pa.float64()),
        ("seed", pa.int64()),
        ("logprobs", pa.int32()),  # the top-k the client asked for (null: none asked; lpf may add them)
    ]
)

REQUESTS = pa.schema(
    [
        ("request_id", pa.string()),
        ("seq", pa.int64()),  # arrival index: the order requests were handed to the engine
        ("prompt_id", pa.string()),
        ("rollout", pa.int32()),
        ("prompt_token_ids", _ids),
        ("output_token_ids", _ids),
        ("output_text", pa.string()),
        ("finish_reason", pa.string()),  # stop | length | error
        ("error", pa.string()),  # null unless the engine could not complete the request
        ("t_submit", pa.float64()),  # unix seconds
        ("t_first_token", pa.float64()),
        ("t_finish", pa.float64()),
        ("oracle_expected", pa.string()),
        ("oracle_ok", pa.bool_()),
        # v2: why an answer that failed a consistency check was kept as returned (null when consistent)
        ("inconsistency", pa.string()),
        # v2: every attempt to get the answer (HTTP engines; empty for in-process engines)
        ("attempts", pa.list_(ATTEMPT)),
        # v2: the request's own sampling settings (`SAMPLING`); null: the run's
        ("sampling", SAMPLING),
    ]
)

TOKENS = pa.schema(
    [
        ("request_id", pa.string()),
        ("position", pa.int32()),  # index into output_token_ids
        ("token_id", pa.int32()),
        ("engine_logprob", pa.float64()),  # raw (pre-temperature) logprob of the sampled token
        ("engine_topk_ids", _ids),
        ("engine_topk_logprobs", _lps),
    ]
)

REFERENCE = pa.schema(
    [
        ("request_id", pa.string()),
        ("position", pa.int32()),
        ("ref_logprob", pa.float64()),
        ("ref_rank", pa.int32()),  # 1 = the reference's argmax (vLLM's convention)
        ("ref_entropy", pa.float32()),
        ("ref_top1_id", pa.int32()),
        ("ref_top1_logprob", pa.float64()),
        ("ref_topk_ids", _ids),
        ("ref_topk_logprobs", _lps),
        # log-sum-exp of the raw logits at the position (logit = logprob + it); null in runs scored before it
        ("ref_logsumexp", pa.float32()),
    ]
)

# v2, engines that return prompt logprobs (`--prompt-logprobs`): one row per prompt position p >= 1, the
# engine's logprob of prompt token p given tokens < p (TOKENS' columns; position indexes prompt_token_ids),
# and the reference's score of the same positions (REFERENCE's columns), from the same teacher-forced pass
PROMPT_TOKENS = TOKENS
PROMPT_REFERENCE = REFERENCE

# the optional seeded replay (`lpf.pipeline.replay`, engines whose sampler lpf knows, sampled runs): per output position
# the token the reference drew with the engine's sampler and the request's seed, how far the engine's token was
# from being drawn (nats of log p - log q; 0 when it was) and how far the closest other token was from winning
SEEDED = pa.schema(
    [
        ("request_id", pa.string()),
        ("position", pa.int32()),
        ("seeded_token", pa.int32()),
        ("seeded_margin", pa.float64()),
        ("seeded_runner_up", pa.float64()),
    ]
)

# the optional calibration run (`lpf rescore --calibrate`): the same reference model teacher-forced a
# second time at the engine's dtype over the same tokens, in the reference's columns
CALIBRATION = REFERENCE

# engines that can (the built-in engine, vLLM through the lpf-vllm-trace plugin): one row per request
# per engine step, plus one row per preemption (preempted = true, phase null)
# The prefix-cache columns after `preempted` are nullable (null: the engine did not record them; old runs
# and traces lack them): see docs/run-directory.md. With prefix caching, per row: tokens the cache
# supplied at this (re)admission (0 on other rows); on the first step after a hit, the Mamba block
# (in Mamba block units) whose state was restored, the last write into it (request, step, tokens it
# really covers) and who published the hash the hit matched (request, step); whether the step ends on
# a Mamba block boundary; whether the step was cancelled while in flight (its chunk never ran).
PREFIX_TRACE = [
    ("prefix_cache_hit_tokens", pa.int32()),
    ("resume_block", pa.int32()),
    ("resume_writer", pa.string()),
    ("resume_write_step", pa.int64()),
    ("resume_covers_tokens", pa.int32()),
    ("resume_publisher", pa.string()),
    ("resume_publish_step", pa.int64()),
    ("chunk_end_aligned", pa.bool_()),
    ("aborted", pa.bool_()),
]
TRACE = pa.schema(
    [
        ("step", pa.int64()),
        ("request_id", pa.string()),
        ("phase", pa.string()),  # prefill | extend | decode
        ("num_computed_tokens", pa.int32()),
        ("num_scheduled_tokens", pa.int32()),
        ("state_slot", pa.int32()),
        ("batch_size", pa.int32()),
        ("batch_tokens", pa.int32()),
        ("preempted", pa.bool_()),
        *PREFIX_TRACE,
    ]
)
# one request's trace rows as the drill-downs show them (`lpf inspect`, report.html): TRACE's core columns
# but the request id, in their order
TRACE_STEP_COLUMNS = (
    "step",
    "phase",
    "num_computed_tokens",
    "num_scheduled_tokens",
    "state_slot",
    "batch_size",
    "batch_tokens",
    "preempted",
)

# the write log (engines that can: the built-in engine), columns the engine's trace adds after TRACE's:
# per row, this request's writes at this step that landed in memory it does not hold alone: a state
# write outside its own slot (a wrapped or misplaced offset; memory "state", slot = the state slot hit)
# or a K/V write into a block another running request holds too (a double free; memory "kv", slot = the
# KV block), one entry per slot or block and other holder, with the element (state buffer) or row (KV
# pool) range [start, end) written and the request holding that memory then (owner null: a free slot).
# Empty: none strayed; null (or the column absent): the engine keeps no write log.
STRAY_WRITE = pa.struct(
    [
        ("memory", pa.string()),
        ("owner", pa.string()),
        ("slot", pa.int32()),
        ("start", pa.int64()),
        ("end", pa.int64()),
    ]
)
WRITE_LOG = [("stray_writes", pa.list_(STRAY_WRITE))]

# speculative decoding (engines that can: the built-in engine with -E speculative=...), columns its trace
# adds when speculation is on: drafts verified this step (0: none), how many were accepted (null: no
# drafts), and for a row on the verify path the state slot that path read and wrote (the null slot for a
# request without a state table), the tokens the slot's state covered after the verify pass and after the
# rollback to the last accepted position (null off the verify path), and whether its drafts went through the
# sampled rejection path (which reads the draft probabilities; null without drafts)
SPEC_TRACE = [
    ("num_draft_tokens", pa.int32()),
    ("num_accepted_tokens", pa.int32()),
    ("verify_state_slot", pa.int32()),
    ("state_tokens_before_rollback", pa.int32()),
    ("state_tokens_after_rollback", pa.int32()),
    ("spec_sampled", pa.bool_()),  # its drafts were verified by the sampled rejection path (it reads q)
    # the drafts verified this row, in order (null: none)
    ("draft_token_ids", pa.list_(pa.int32())),
    # the proposer's probability of each draft as it drew it, q_i(d_i) (null: one-hot drafts, q = 1: an
    # n-gram proposer's, or an engine whose rejection sampler gets no draft probabilities)
    ("draft_token_probs", pa.list_(pa.float32())),
]

# "whose answer is this?" (`lpf.pipeline.attribute`): a flagged request's output re-scored by the reference
# under another request's prompt (candidate_id): the summed logprob of its n_tokens output tokens
ATTRIBUTION = pa.schema(
    [
        ("request_id", pa.string()),
        ("candidate_id", pa.string()),
        ("n_tokens", pa.int32()),
        ("logprob_sum", pa.float64()),
    ]
)

# fault drills' ground truth (which request, which step, what happened); analysis never reads it
FAULTS = pa.schema(
    [
        ("request_id", pa.string()),
        ("step", pa.int64()),
        ("fault", pa.string()),
        ("role", pa.string()),
        ("detail", pa.string()),
    ]
)

# columns a part written by an older schema version may lack (read as nulls); any other missing column
# means the part is damaged, not old
ADDED_LATER = {
    "requests": {"inconsistency", "attempts", "sampling"},
    "reference": {"ref_logsumexp"},
    "calibration": {"ref_logsumexp"},
    "prompt_reference": {"ref_logsumexp"},
}

TABLES = {
    "requests": REQUESTS,
    "tokens": TOKENS,
    "reference": REFERENCE,
    "calibration": CALIBRATION,
    "prompt_tokens": PROMPT_TOKENS,
    "prompt_reference": PROMPT_REFERENCE,
    "attribution": ATTRIBUTION,
    "seeded": SEEDED,
}


def table(target: pa.Schema, columns: dict) -> pa.Table:
    """A table of schema `target` from `columns` (name -> equal-length array-likes), every column of
    `target` it does not name all nulls. A name `target` lacks is a ValueError, never dropped."""
    unknown = sorted(set(columns) - set(target.names))
    if unknown:
        raise ValueError(f"no column {', '.join(unknown)} in the schema (columns: {', '.join(target.names)})")
    if not columns:
        return target.empty_table()
    n = len(next(iter(columns.values())))
    return pa.table(
        {f.name: columns[f.name] if f.name in columns else pa.nulls(n, f.type) for f in target}, schema=target
    )
