"""The parts' columns: lpf's `trace` and `faults` schemas, copied (this plugin never imports lpf).

`TRACE` starts with exactly lpf's `lpf.run.schema.TRACE` columns (lpf's tests check the copy; the
prefix-cache ones, prefix_cache_hit_tokens included, are nullable: a row that lacks one writes null),
then lpf's speculative-decoding columns (`lpf.run.schema.SPEC_TRACE`, the built-in engine's, same meaning;
all null when the engine does not speculate):
  num_draft_tokens         drafts scheduled for verification in this row (`scheduled_spec_decode_tokens`;
                           0: none)
  num_accepted_tokens      how many of them the rejection sampler accepted (null: no drafts)
  spec_sampled             its drafts were verified at temperature > 0 (null: no drafts)
  draft_token_ids          the drafts verified in this row, in order (null: none; a preemption row); vLLM's
                           `scheduled_spec_decode_tokens` (a -1 is a padded draft, always rejected), under
                           async scheduling the runner's own proposal (null if it holds none)
  draft_token_probs        the proposer's probability of each draft (null: one-hot drafts, q = 1, as
                           vLLM's rejection sampler reads them when it is given no draft probabilities,
                           rejection_sampler.py:871-872). vllm 0.32.0 gives it none for n-gram
                           speculation: gpu_model_runner.py:3459 passes `_get_spec_decode_draft_probs`,
                           None while `_draft_probs` is None (:4722), which `propose_draft_token_ids`
                           clears (:4764) and only a drafter with `take_last_draft_probs` (EAGLE, draft
                           model: :5019-5023), never the n-gram branch (:4766), sets. Those drafters'
                           q_i(d_i) are read from the same tensor (step_rows.StepReader._draft_probs)
  verify_state_slot, state_tokens_before_rollback, state_tokens_after_rollback
                           always null here: which column of its state table vLLM's Mamba kernels read
                           and wrote is decided inside the kernel (`num_accepted_tokens`), out of sight
then columns only vLLM has:
  vllm_request_id          vLLM's id for the request in the runner (request_id holds the same until
                           lpf maps it to its own id)
  batch_index              the row's position in the runner's batch this step, after the reorder
  reordered                the batch reorder moved this row this step
  num_prompt_tokens        the request's prompt length
  state_slots              the state slot in every Mamba KV-cache group (state_slot is the first)
Rows: one per scheduled request per step, plus one per preemption (preempted = true, phase null) at
the step whose scheduling preempted it.
"""

TRACE_COLUMNS = [
    ("step", "int64"),
    ("request_id", "string"),
    ("phase", "string"),
    ("num_computed_tokens", "int32"),
    ("num_scheduled_tokens", "int32"),
    ("state_slot", "int32"),
    ("batch_size", "int32"),
    ("batch_tokens", "int32"),
    ("preempted", "bool"),
    # lpf's prefix-cache columns (nullable; a row that lacks one writes null)
    ("prefix_cache_hit_tokens", "int32"),
    ("resume_block", "int32"),
    ("resume_writer", "string"),
    ("resume_write_step", "int64"),
    ("resume_covers_tokens", "int32"),
    ("resume_publisher", "string"),
    ("resume_publish_step", "int64"),
    ("chunk_end_aligned", "bool"),
    ("aborted", "bool"),
]
# lpf's speculative-decoding columns (`lpf.run.schema.SPEC_TRACE`), nullable
SPEC_COLUMNS = [
    ("num_draft_tokens", "int32"),
    ("num_accepted_tokens", "int32"),
    ("verify_state_slot", "int32"),
    ("state_tokens_before_rollback", "int32"),
    ("state_tokens_after_rollback", "int32"),
    ("spec_sampled", "bool"),
    ("draft_token_ids", "list<int32>"),
    ("draft_token_probs", "list<float32>"),
]
VLLM_COLUMNS = [
    ("vllm_request_id", "string"),
    ("batch_index", "int32"),
    ("reordered", "bool"),
    ("num_prompt_tokens", "int32"),
    ("state_slots", "list<int32>"),
]
FAULT_COLUMNS = [
    ("request_id", "string"),
    ("step", "int64"),
    ("fault", "string"),
    ("role", "string"),
    ("detail", "string"),
]


def arrow_schema(columns):
    import pyarrow as pa

    types = {
        "int64": pa.int64(),
        "int32": pa.int32(),
        "string": pa.string(),
        "bool": pa.bool_(),
        "list<int32>": pa.list_(pa.int32()),
        "list<float32>": pa.list_(pa.float32()),
    }
    return pa.schema([(name, types[kind]) for name, kind in columns])


def trace_schema():
    return arrow_schema(TRACE_COLUMNS + SPEC_COLUMNS + VLLM_COLUMNS)


def faults_schema():
    return arrow_schema(FAULT_COLUMNS)
