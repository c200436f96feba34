"""Token identity for answers that name tokens by string or bytes: which id of the local tokenizer each one is.

Contract: `TokenMap(tokenizer, vocab_size, mode)`; `resolve(token, tid, raw, strict)` returns the id behind one
answered token, in this order: an id the server sent (llama.cpp's `id`), a `token_id:N` string (vLLM and
lpf serve with `return_tokens_as_token_ids`), its bytes (the chat shape's `bytes`: the id whose raw bytes
are exactly these), its string (the id that decodes to exactly it, or whose vocabulary piece it is).
`mode` "server" accepts server ids only. Every mapping is checked: a candidate id must decode (or its
bytes must be) exactly what was sent, and two ids that share a string or bytes cannot be told apart this
way (then the string is tried, then None). `strict`: an unmappable token raises `RequestFailed` (the
request's error: a sampled token must be known) instead of returning None (a top-k alternative is then
left out). `seen` records which ways were used ("server", "bytes", "tokenizer") for the manifest.
`text_ids(text)` re-encodes an answer's text when a server sent no tokens at all (the ids and whether
they decode back to exactly that text). `by_text(ids, tokens, text, eos)` fills the sampled tokens that
mapped to nothing (None in `ids`) from the answer's text re-encoded, where that is unambiguous: the
re-encoding (plus the stop token when the text is one short) has one id per position, agrees with every
id already known, and each filled id decodes to the string sent for it or the server sent none (a
token `''` with `bytes: null`: a special token whose text the server skipped); `seen` gets "text".
"""

from __future__ import annotations

from typing import Any

from lpf.adapters.http import RequestFailed

TOKEN_ID_PREFIX = "token_id:"


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each of the 256 bytes as one printable character (char -> byte)."""
    direct = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in direct:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenMap:
    def __init__(self, tokenizer, vocab_size: int, mode: str = "auto"):
        self.tok, self.vocab_size, self.mode = tokenizer, vocab_size, mode
        self.seen: set[str] = set()
        self._bytes: dict[bytes, list[int]] | None = None
        self._of: dict[int, bytes] | None = None

    def resolve(self, token: Any, tid: Any, raw: Any, pos: int, strict: bool) -> int | None:
        if isinstance(tid, int) and not isinstance(tid, bool):
            self.seen.add("server")
            return tid
        if isinstance(token, str) and token.startswith(TOKEN_ID_PREFIX):
            try:
                out = int(token[len(TOKEN_ID_PREFIX) :])
                self.seen.add("server")
                return out
            except ValueError:
                pass
        if self.mode == "server":
            if strict:
                raise RequestFailed(f"token {token!r} at position {pos} is not in token_id:N form")
            return None
        found = None
        if isinstance(raw, list) and raw and all(isinstance(b, int) and 0 <= b < 256 for b in raw):
            found = self.by_bytes(bytes(raw))
            if found is not None:
                self.seen.add("bytes")
        if found is None and isinstance(token, str):
            found = self.by_string(token)
            if found is not None:
                self.seen.add("tokenizer")
        if found is None and strict:
            raise RequestFailed(
                f"token {token!r} at position {pos} does not map back to one token id of the local tokenizer"
            )
        return found

    def by_string(self, text: str) -> int | None:
        """The one id whose decoding is exactly `text` (raw vocabulary pieces and decoded text both
        accepted), checked by decoding it back; None when there is no such single id."""
        tok = self.tok
        candidates = []
        vocab_id = tok.convert_tokens_to_ids(text)
        if isinstance(vocab_id, int) and vocab_id != tok.unk_token_id:
            candidates.append(vocab_id)
        encoded = tok.encode(text, add_special_tokens=False)
        if len(encoded) == 1:
            candidates.append(encoded[0])
        for tid in candidates:
            if tok.decode([tid]) == text or tok.convert_ids_to_tokens(tid) == text:
                return tid
        return None

    def by_bytes(self, raw: bytes) -> int | None:
        if self._bytes is None:
            self._bytes = self._byte_table()
        ids = self._bytes.get(raw, [])
        return ids[0] if len(ids) == 1 else None

    def bytes_of(self, tid: Any) -> bytes | None:
        """The bytes of one id (`_byte_table`'s inverse), None when it has none of its own."""
        if self._of is None:
            if self._bytes is None:
                self._bytes = self._byte_table()
            self._of = {t: raw for raw, ids in self._bytes.items() for t in ids}
        return self._of.get(tid)

    def _byte_table(self) -> dict[bytes, list[int]]:
        """bytes -> ids: a byte-level tokenizer's pieces through its alphabet (partial UTF-8 included),
        else each id's decoding where it is whole UTF-8 text."""
        tok = self.tok
        alphabet = _byte_alphabet()
        decoder = repr(getattr(getattr(tok, "backend_tokenizer", None), "decoder", None))
        byte_level = "ByteLevel" in decoder
        special = set(getattr(tok, "all_special_ids", []) or [])
        table: dict[bytes, list[int]] = {}
        for tid in range(min(self.vocab_size, len(tok))):
            piece = tok.convert_ids_to_tokens(tid)
            if tid in special or piece is None:
                key = (piece or "").encode()
            elif byte_level and all(c in alphabet for c in piece):
                key = bytes(alphabet[c] for c in piece)
            else:
                text = tok.decode([tid])
                if "\ufffd" in text:
                    continue
                key = text.encode()
            table.setdefault(key, []).append(tid)
        return table

    def by_text(self, ids: list, tokens: list, text: Any, eos: int | None) -> list[int] | None:
        """`ids` with its None entries filled from `text` re-encoded, or None when that is not unambiguous."""
        if self.mode == "server" or not isinstance(text, str):
            return None
        cand, _ = self.text_ids(text)
        if len(cand) + 1 == len(ids) and eos is not None:
            cand.append(eos)  # the stop token: its text is skipped
        if len(cand) != len(ids) or any(a is not None and a != b for a, b in zip(ids, cand)):
            return None
        for tid, token, c in zip(ids, tokens, cand):
            if tid is None and token not in (None, "") and self.tok.decode([c]) != token:
                return None
        self.seen.add("text")
        return cand

    def text_ids(self, text: str) -> tuple[list[int], bool]:
        """(ids, exact): the text re-encoded without special tokens, and whether they decode back to it."""
        ids = self.tok.encode(text, add_special_tokens=False)
        return ids, self.tok.decode(ids) == text
