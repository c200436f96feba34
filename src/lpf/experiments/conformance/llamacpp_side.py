"""The llama.cpp side of conformance discovery: which stateful architectures its converter accepts.

Contract: `converter_architectures(converter_dir) -> set[str]` reads (as text, never imports) the
architecture names llama.cpp's converter registers (`@ModelBase.register("A", "B", ...)` in
`convert_hf_to_gguf.py` and its `conversion/` package): the converter picks a model class by the
checkpoint's `architectures[0]`, so a name it does not register cannot become a GGUF at all.
`classify_llamacpp(ref, registered, version) -> list[dict]` is pure: one discovery entry (the
shape of `discover._entry`) per reference architecture: `audit` when the converter registers it and
a tiny recipe exists, `not supported` ("llama.cpp's converter has no model class for it"),
`no tiny recipe`. Whether the runtime then loads the GGUF is what the cells find out (a GGUF
llama-server refuses is an `engine error` row with llama-server's own line, as vLLM's are).
Architectures only llama.cpp knows (no transformers class) are not listed: which of its
architectures keep state is in llama.cpp's C++ (`llm_arch_is_recurrent` / `_hybrid`), which lpf does
not parse.
"""

from __future__ import annotations

import re
from pathlib import Path

from lpf.experiments.conformance.tiny import SCALE

_REGISTER = re.compile(r"@ModelBase\.register\(([^)]*)\)", re.S)
_NAME = re.compile(r"[\"']([A-Za-z0-9_]+)[\"']")


def converter_architectures(converter_dir: Path) -> set[str]:
    files = [Path(converter_dir) / "convert_hf_to_gguf.py", *sorted((Path(converter_dir) / "conversion").glob("*.py"))]
    names: set[str] = set()
    for f in files:
        if f.is_file():
            for m in _REGISTER.finditer(f.read_text(errors="replace")):
                names.update(_NAME.findall(m.group(1)))
    return names


def classify_llamacpp(ref: dict[str, str], registered: set[str], where: str) -> list[dict]:
    out = []
    for arch in sorted(ref):
        mt = ref[arch]
        entry = {"architecture": arch, "model_type": mt, "converter": where}
        if arch not in registered:
            entry.update(
                status="not supported",
                reason=f"llama.cpp's converter has no model class registered for {arch}: it cannot be written to GGUF",
            )
        elif mt not in SCALE:
            entry.update(status="no tiny recipe", reason=f"lpf has no scaled-down recipe for {mt} yet")
        else:
            entry.update(status="audit", reason="")
        out.append(entry)
    return out
