"""Which requests are sampled: a pure function of the request body's bytes, the seed and the rate.

Contract: `Sampler(rate, seed).take(body)` is True for a fraction `rate` (0..1) of distinct bodies,
the same answer for the same (body, seed) in every process and every replay (blake2b, not Python's
salted `hash`), so replaying recorded traffic samples the same requests. A body that asks for logprobs
itself is no cheaper to sample than another: the rate alone decides (the caller may force it).
"""

from __future__ import annotations

import hashlib

from lpf.core.errors import LpfError


class Sampler:
    def __init__(self, rate: float, seed: int = 0):
        if not 0.0 <= rate <= 1.0:
            raise LpfError(f"--sample must be in 0..1 (a fraction of requests), got {rate}")
        self.rate, self.seed = rate, int(seed)
        self._below = int(rate * 2**64)  # compared with the hash's first 8 bytes as an unsigned integer

    def take(self, body: bytes) -> bool:
        if self.rate >= 1.0:
            return True
        if self.rate <= 0.0:
            return False
        h = hashlib.blake2b(body, digest_size=8, key=self.seed.to_bytes(8, "little", signed=True)).digest()
        return int.from_bytes(h, "little") < self._below
