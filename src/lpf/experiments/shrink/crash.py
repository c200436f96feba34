"""A crash as a shrink signature: the exception an engine raised and the innermost frame it came from.

Contract (pure: error strings and Arrow tables in, plain data out):
- `parse_crash(error) -> Crash | None` reads one request's recorded error (the requests table's
  `error` column: "vLLM failed mid-run: TYPE: message; raised at FILE:LINE in FUNC; vLLM log: ..."
  from lpf's vLLM worker, or any text holding a Python traceback) into the exception's type and
  the innermost frame (file, function, line). The file is made relative to its package
  (`.../site-packages/vllm/x.py` -> `vllm/x.py`) so two installs of one build compare equal. None
  when the text names no exception type (a refusal, a timeout, an HTTP error: not a crash).
- Two crashes are the same (`Crash.same`) when their exception types match and their innermost
  frames are the same file and function (the line is reported, not compared: a patch elsewhere in
  the file moves it); without a frame on either side the type alone decides.
- `run_crash(requests) -> (Crash, n_failed, request_id) | None`: the crash most of a run's failed
  requests share (the shrink's signature when nothing is flagged), with how many requests it
  failed and the first one (arrival order); None when no request failed with an exception.
- `shows_crash(crash, requests) -> (bool, words)`: whether any request of a candidate run failed
  with the same crash (an engine that crashes fails the whole batch in flight, so which request
  carried the error says nothing about which one triggered it), with what was seen in a few words.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass

# "raised at FILE:LINE in FUNC": what lpf's vLLM worker appends to a fatal error (vllm_worker.py)
_RAISED_AT = re.compile(r"raised at (?P<file>[^\s:]+):(?P<line>\d+) in (?P<func>[\w<>.]+)")
_TB_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[\w<>.]+)')
# an exception type as Python prints it: a dotted name ending in Error/Exception/..., then ':' or the end
_EXC = re.compile(
    r"(?<![\w.])(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Warning|Fault))(?=:|\s*$|;)"
)
_PACKAGE_ROOTS = ("site-packages/", "dist-packages/", "/src/")


@dataclass(frozen=True)
class Crash:
    exception: str  # the type as raised, e.g. IndexError or torch.OutOfMemoryError
    file: str | None = None  # innermost frame, relative to its package root
    function: str | None = None
    line: int | None = None
    message: str | None = None  # the exception's message, first 200 characters (reported only)

    def same(self, other: "Crash | None") -> bool:
        if other is None or other.exception.rsplit(".", 1)[-1] != self.exception.rsplit(".", 1)[-1]:
            return False
        if self.file is None or other.file is None:
            return True
        return (self.file, self.function) == (other.file, other.function)

    def frame(self) -> str | None:
        if self.file is None:
            return None
        return f"{self.file}:{self.line} in {self.function}" if self.line else f"{self.file} in {self.function}"

    def describe(self) -> str:
        where = self.frame()
        return f"crash: {self.exception}" + (f" raised at {where}" if where else "")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Crash":
        return cls(**{k: d.get(k) for k in ("exception", "file", "function", "line", "message")})


def package_relative(path: str) -> str:
    """`/x/lib/python3.11/site-packages/vllm/a.py` -> `vllm/a.py` (the last package root wins)."""
    for root in _PACKAGE_ROOTS:
        if root in path:
            path = path.rsplit(root, 1)[1]
    return path.lstrip("/")


def parse_crash(error: str | None) -> Crash | None:
    if not error:
        return None
    text = str(error)
    head = text.split("mid-run:", 1)[1] if "mid-run:" in text else text
    exc = message = None
    tb_lines = text.splitlines()
    if any(_TB_FRAME.search(x) for x in tb_lines):
        # a printed traceback: the exception is the first line after the last frame's source line
        last = max(i for i, x in enumerate(tb_lines) if _TB_FRAME.search(x))
        for x in tb_lines[last + 1 :]:
            m = _EXC.match(x.strip())
            if m:
                exc, message = m.group("type"), x.strip()[len(m.group("type")) :].lstrip(": ")
                break
    if exc is None:
        m = _EXC.search(head)
        if m is None:
            return None
        exc = m.group("type")
        message = head[m.end() :].lstrip(": ").split("; raised at ", 1)[0].split("; vLLM log:", 1)[0]
    frames = list(_RAISED_AT.finditer(text)) or list(_TB_FRAME.finditer(text))
    if not frames:
        return Crash(exc, message=(message or "").strip()[:200] or None)
    f = frames[0] if frames[0].re is _RAISED_AT else frames[-1]  # a traceback's innermost frame is its last
    return Crash(
        exc,
        package_relative(f.group("file")),
        f.group("func"),
        int(f.group("line")),
        (message or "").strip()[:200] or None,
    )


def run_crash(requests) -> tuple[Crash, int, str] | None:
    """The crash most failed requests of a run share: (crash, how many it failed, the first one's id)."""
    rows = requests.select(["seq", "request_id", "error"]).sort_by("seq").to_pylist()
    crashes = [(r["request_id"], parse_crash(r["error"])) for r in rows if r["error"]]
    crashes = [(rid, c) for rid, c in crashes if c is not None]
    if not crashes:
        return None
    key = Counter((c.exception, c.file, c.function) for _, c in crashes).most_common(1)[0][0]
    hits = [(rid, c) for rid, c in crashes if (c.exception, c.file, c.function) == key]
    return hits[0][1], len(hits), hits[0][0]


def shows_crash(crash: Crash, requests) -> tuple[bool, str]:
    errors = [e for e in requests.column("error").to_pylist() if e]
    if not errors:
        return False, f"no request failed ({requests.num_rows} ran)"
    seen = [parse_crash(e) for e in errors]
    same = sum(crash.same(c) for c in seen)
    if same:
        return True, f"{same}/{requests.num_rows} requests failed with {crash.describe()}"
    other = next((c for c in seen if c is not None), None)
    words = other.describe() if other else " ".join(errors[0].split())[:120]
    return False, f"{len(errors)}/{requests.num_rows} requests failed, with another error ({words})"
