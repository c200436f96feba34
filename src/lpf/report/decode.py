"""Token ids to text for the report, with the run's own tokenizer.

`decoder(manifest)` returns (decode each id, decode a sequence, note). It uses the tokenizer of the
run's model, and only when its fingerprint (lpf.core.model_specs.tokenizer_fingerprint: the token -> id map)
equals the one the run recorded, so a model directory changed since the run cannot mislabel tokens.
The model directory's tokenizer.json is read with `tokenizers` directly when it has one (the
same backend HF's fast tokenizers decode with; no torch or transformers import, which would cost a
standalone `lpf report` seconds); otherwise `load_tokenizer(resolve_model(spec))`. When neither
works the ids are shown as #N, with a note saying why.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path


def _fingerprint(vocab: dict[str, int]) -> str:
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def _fast(path: Path, expected: str | None):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    if expected and _fingerprint(tok.get_vocab(with_added_tokens=True)) != expected:
        return None
    return (
        lambda ids: tok.decode_batch([[i] for i in ids], skip_special_tokens=False),
        lambda ids: tok.decode(list(ids), skip_special_tokens=False),
    )


def _hf(spec: str, expected: str | None):
    from lpf.core.model_specs import load_tokenizer, resolve_model, tokenizer_fingerprint

    tok = load_tokenizer(resolve_model(spec))
    if expected and tokenizer_fingerprint(tok) != expected:
        return None
    return (
        lambda ids: tok.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False),
        lambda ids: tok.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False),
    )


def decoder(manifest: dict):
    model = manifest.get("model") or {}
    expected = manifest.get("tokenizer_sha256")
    path = Path(model.get("path") or "")
    why = "the run's model and its tokenizer are not found"
    attempts = []
    if model.get("path") and (path / "tokenizer.json").is_file():
        attempts.append(lambda: _fast(path, expected))
    if model.get("spec"):
        attempts.append(lambda: _hf(model["spec"], expected))
    for attempt in attempts:
        try:
            found = attempt()
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception; any failure means "not usable"
            why = f"no usable tokenizer ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
            continue
        if found is not None:
            return (*found, None)
        why = "the model's tokenizer no longer matches the one this run used"
    return (
        (lambda ids: [f"#{i}" for i in ids]),
        (lambda ids: " ".join(f"#{i}" for i in ids)),
        f"token ids shown instead of text: {why}",
    )
