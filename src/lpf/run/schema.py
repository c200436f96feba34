"""Explicit Arrow schemas of every table in a run directory, and the schema version.

Bump `SCHEMA_VERSION` when a column changes meaning or a required column is added; readers refuse
run directories written by a newer version instead of guessing. Logprobs that get compared
(engine vs reference) are float64 so storage never adds error of its own; top-k lists are float32.
"""

import pyarrow as pa

SCHEMA_VERSION = 1

_ids = pa.list_(pa.int32())
_lps = pa.list_(pa.float32())

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
    ]
)

# the optional calibration run (`lpf rescore --calibrate`): the same reference model teacher-forced a
# second time at the engine's dtype over the same tokens, in the reference's columns
CALIBRATION = REFERENCE

TABLES = {"requests": REQUESTS, "tokens": TOKENS, "reference": REFERENCE, "calibration": CALIBRATION}
