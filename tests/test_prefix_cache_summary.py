"""The run's prefix-cache finding (`analysis.prefix_cache`), pure: when is caching called inert.

Hand-built requests and traces: prompts sharing 40-token prefixes, 60 tokens long. With a 16-token
block they share whole blocks, so zero hits is inert as before. With vLLM #48401's configuration (the
hybrid's block raised to 128, past every prompt) no prompt shares a whole block by construction; zero
hits is still inert, stated in 16-token blocks; one hit, caching off, or prompts sharing nothing is not.
"""

import pyarrow as pa

from lpf.analysis.prefix_cache import prefix_cache_summary

SHARED = list(range(1000, 1040))


def tables(hit_tokens: list[int], prompts: list[list[int]]):
    ids = [f"r{i}" for i in range(len(prompts))]
    requests = pa.table({"request_id": ids, "seq": list(range(len(ids))), "prompt_token_ids": prompts})
    trace = pa.table(
        {"request_id": ids, "prefix_cache_hit_tokens": pa.array(hit_tokens, pa.int32())},
    )
    return requests, trace


def info(block: int, enabled: bool = True) -> dict:
    return {
        "options": {"enable_prefix_caching": enabled, "max_model_len": 120},
        "cache": {"prefix_cache": {"block_size": block}},
    }


def prompts(shared: bool = True) -> list[list[int]]:
    return [(SHARED if shared else list(range(i * 100, i * 100 + 40))) + [i] * 20 for i in range(6)]


def test_zero_hits_on_shared_blocks_is_inert():
    pc = prefix_cache_summary(*tables([0] * 6, prompts()), info(16))
    assert pc["inert"] and pc["finding"] == "prefix-cache-inert" and pc["requests_sharing"] == 5
    assert "requests_sharing_below_block" not in pc


def test_a_block_past_every_prompt_is_inert_in_small_blocks():
    pc = prefix_cache_summary(*tables([0] * 6, prompts()), info(128))
    assert pc["requests_sharing"] == 0  # no prompt can fill a 128-token block
    assert pc["inert"] and pc["finding"] == "prefix-cache-inert"
    assert pc["requests_sharing_below_block"] == 5 and pc["shareable_tokens_below_block"] == 5 * 32
    assert "longer than every prompt (longest 60; max_model_len 120)" in pc["sentence"]


def test_not_inert_with_a_hit_caching_off_or_nothing_shared():
    assert not prefix_cache_summary(*tables([0, 32, 0, 0, 0, 0], prompts()), info(128))["inert"]
    assert not prefix_cache_summary(*tables([0] * 6, prompts()), info(128, enabled=False))["inert"]
    pc = prefix_cache_summary(*tables([0] * 6, prompts(shared=False)), info(128))
    assert not pc["inert"] and pc["requests_sharing_below_block"] == 0 and "finding" not in pc
