"""llama-server: `completion_probabilities` skips every token that ends inside a UTF-8 character.

Run: PYTHONPATH=src .venv/bin/python scripts/repro/llamacpp_probs_utf8.py [tiny:hybrid] (needs `make llamacpp`).
Greedy requests with `n_probs` and `return_tokens` on a random tiny model (its ByteLevel vocabulary
has single-byte tokens, so it emits cut-off multi-byte characters). Expected: one probabilities entry
per generated token. Observed (llama.cpp vendored by llama-cpp-python 0.3.36): fewer entries than
`tokens`, and the missing ones are exactly the tokens after which the generated text ends in a
cut-off UTF-8 lead byte (llama.cpp's own `validate_utf8`, replayed here on the tokens' bytes).
Cause: tools/server/server-context.cpp `process_token` (lines 1825-1860) calls `slot.add_token(result)`,
which appends the token's probabilities, only `if (!incomplete)`, while `generated_tokens` (the
`tokens` field) takes every token; `send_final_response` then sends `generated_token_probs` as
`completion_probabilities` (the OpenAI route's `logprobs.content` too). A client that pairs the i-th
entry with the i-th token (or counts on one entry per token) pairs logprobs with the wrong tokens
from the first such token on; the `llamacpp` adapter aligns the entries by id and stores no logprob
where none came (`logprobs_missing`).
"""

import json
import sys

import httpx

from lpf.adapters.llamacpp_gguf import find_tools, gguf_for
from lpf.adapters.llamacpp_server import LlamaServer
from lpf.core.model_specs import load_tokenizer, resolve_model


def byte_pieces(tok) -> dict[int, bytes]:
    """Each id's bytes (GPT-2 ByteLevel mapping; special tokens as llama.cpp renders them: empty)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for x in range(256):
        if x not in bs:
            bs.append(x)
            cs.append(256 + n)
            n += 1
    dec = {chr(c): b for b, c in zip(bs, cs)}
    special = set(tok.all_special_ids)
    return {i: b"" if i in special else bytes(dec[c] for c in tok.convert_ids_to_tokens(i)) for i in range(len(tok))}


def cut_off(text: bytes) -> bool:
    """llama.cpp's validate_utf8 (tools/server/server-common.cpp): a multi-byte lead byte at the end
    without all its continuation bytes."""
    for i in range(1, min(4, len(text)) + 1):
        c = text[-i]
        if ((c & 0xE0) == 0xC0 and i < 2) or ((c & 0xF0) == 0xE0 and i < 3) or ((c & 0xF8) == 0xF0 and i < 4):
            return True
    return False


if __name__ == "__main__":
    spec = sys.argv[1] if len(sys.argv) > 1 else "tiny:hybrid"
    model = resolve_model(spec)
    tok = load_tokenizer(model)
    pieces = byte_pieces(tok)
    tools = find_tools()
    server = LlamaServer(
        tools.server, gguf_for(model, "float32", tools).path, ["-np", "1", "-c", "512", "-t", "1", "-fa", "off"]
    ).start()
    rows = []
    try:
        for seed in range(8):
            prompt = [1] + [3 + (seed * 37 + 11 * i) % (len(tok) - 3) for i in range(12)]
            body = httpx.post(
                server.base_url + "/completion",
                timeout=60,
                json={
                    "prompt": prompt,
                    "n_predict": 16,
                    "n_probs": 1,
                    "return_tokens": True,
                    "samplers": ["temperature"],
                    "temperature": 0,
                    "cache_prompt": False,
                },
            ).json()
            tokens, probs = body["tokens"], [e["id"] for e in body["completion_probabilities"]]
            expected_missing = [i for i in range(len(tokens)) if cut_off(b"".join(pieces[t] for t in tokens[: i + 1]))]
            kept = [t for i, t in enumerate(tokens) if i not in expected_missing]
            rows.append(
                {
                    "tokens": len(tokens),
                    "entries": len(probs),
                    "cut_off_positions": expected_missing,
                    "entries_are_the_other_tokens": probs == kept,
                }
            )
    finally:
        server.cleanup()
    print(
        json.dumps(
            {
                "model": spec,
                "requests": rows,
                "requests_with_missing_entries": sum(r["entries"] < r["tokens"] for r in rows),
                "all_explained_by_cut_off_utf8": all(r["entries_are_the_other_tokens"] for r in rows),
            },
            indent=1,
        )
    )
