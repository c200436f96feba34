"""GGUF files for the `llamacpp` engine: llama.cpp's tools found, checkpoints converted, cached by content.

Contract:
- `find_tools()` -> `Tools` (llama-server, llama-quantize, the converter's directory) from
  `$LPF_LLAMACPP_DIR`, else the checkout's `.llamacpp/` (`make llamacpp` builds it from the llama.cpp
  that llama-cpp-python's PyPI sdist vendors). Raises LpfError naming what is missing and how to build it.
- `gguf_for(model, dtype, tools)` -> `Gguf` for a Hugging Face directory at one of `DTYPES`: written
  by the converter (`llamacpp_convert.py`, run with lpf's own interpreter: it has torch and
  transformers, the converter's only heavy needs) at f32/f16/bf16/q8_0, then `llama-quantize` for the
  other quantized types (from the f32 file). Cached under `$LPF_CACHE/gguf/<name>-<key>/` where the key
  hashes the model's config, tokenizer and weight files, the converter's sources (with lpf's tokenizer
  registration) and, for quantized types, the quantizer binary: a changed input makes a new file,
  never a stale one. Files are written under a temporary name and renamed, so a killed or concurrent
  export never leaves half a file. Every converted file's vocabulary is checked against the Hugging
  Face tokenizer id by id (`Gguf.vocab`); one with a changed id is refused (LpfError), not served.
- `user_gguf(path, dtype, model, tools)` -> `Gguf` for a file the user brought: its header says its
  dtype (a declared one must agree), its vocabulary must be the model's. `describe_gguf(path, tools)`:
  the header facts of any GGUF (architecture, file type, tensor types).
Conversion failures (an architecture the converter lacks, a tokenizer it refuses) raise LpfError with
the converter's last line.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from lpf.core.errors import LpfError
from lpf.core.model_specs import ModelRef, cache_root, weights_sha256

REPO_DIR = Path(__file__).resolve().parents[3] / ".llamacpp"
CONVERT = Path(__file__).with_name("llamacpp_convert.py")

# lpf's name (what the run's dtype is) -> (converter --outtype, llama-quantize type or None)
DTYPES = {
    "float32": ("f32", None),
    "float16": ("f16", None),
    "bfloat16": ("bf16", None),
    "q8_0": ("q8_0", None),
    "q6_k": ("f32", "Q6_K"),
    "q5_k_m": ("f32", "Q5_K_M"),
    "q4_k_m": ("f32", "Q4_K_M"),
    "q4_k_s": ("f32", "Q4_K_S"),
    "q4_0": ("f32", "Q4_0"),
}
FLOAT_DTYPES = ("float32", "float16", "bfloat16")
# general.file_type (llama.cpp's LLAMA_FTYPE_*) -> lpf's name, for reading a user's own file
FILE_TYPES = {
    0: "float32",
    1: "float16",
    32: "bfloat16",
    7: "q8_0",
    18: "q6_k",
    17: "q5_k_m",
    15: "q4_k_m",
    14: "q4_k_s",
    2: "q4_0",
}
TIMEOUT_S = 1800


@dataclass(frozen=True)
class Tools:
    root: Path

    @property
    def server(self) -> Path:
        return self.root / "bin" / "llama-server"

    @property
    def quantize(self) -> Path:
        return self.root / "bin" / "llama-quantize"

    @property
    def converter_dir(self) -> Path:
        return self.root / "llama.cpp"

    def source(self) -> str | None:
        """What `make llamacpp` built, from its SOURCE file (None for a tree built another way)."""
        try:
            return (self.root / "SOURCE").read_text().strip() or None
        except OSError:
            return None


@dataclass
class Gguf:
    path: Path
    dtype: str
    key: str | None = None  # the content key (None: a user's own file)
    vocab: dict | None = None  # the converter-side vocabulary check (`llamacpp_convert.check_vocab`)
    header: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {
            "path": str(self.path),
            "dtype": self.dtype,
            "key": self.key,
            "vocab_check": self.vocab,
            "file_type": self.header.get("file_type_name"),
            "tensor_types": self.header.get("tensor_types"),
            "size_bytes": self.path.stat().st_size if self.path.is_file() else None,
        }


def find_tools() -> Tools:
    env = os.environ.get("LPF_LLAMACPP_DIR")
    tools = Tools(Path(env).expanduser().resolve() if env else REPO_DIR)
    where = f"LPF_LLAMACPP_DIR={env}" if env else str(REPO_DIR)
    for what in (tools.server, tools.converter_dir / "convert_hf_to_gguf.py"):
        if not what.is_file():
            raise LpfError(
                f"llama.cpp is not built ({what} is missing under {where}): run `make llamacpp` in "
                f"the lpf checkout (about 15 minutes once), or set LPF_LLAMACPP_DIR to a directory "
                f"with bin/llama-server and llama.cpp/convert_hf_to_gguf.py"
            )
    return tools


def _hash_files(h, files) -> None:
    for f in files:
        h.update(f.name.encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())


def content_key(model: ModelRef, dtype: str, tools: Tools) -> str:
    """What the GGUF depends on: the model's files, the converter's code, the quantizer."""
    h = hashlib.sha256(dtype.encode())
    h.update(str(weights_sha256(model.path)).encode())
    _hash_files(
        h,
        sorted(
            p
            for p in model.path.iterdir()
            if p.is_file() and p.suffix in (".json", ".model", ".txt", ".jinja") and p.name != "lpf_card.json"
        ),
    )
    conv = tools.converter_dir
    _hash_files(
        h,
        [
            conv / "convert_hf_to_gguf.py",
            CONVERT,
            *sorted((conv / "conversion").glob("*.py")),
            *sorted((conv / "gguf-py" / "gguf").rglob("*.py")),
        ],
    )
    if DTYPES[dtype][1] is not None:
        _hash_files(h, [tools.quantize])
    return h.hexdigest()[:16]


def gguf_for(model: ModelRef, dtype: str, tools: Tools) -> Gguf:
    if dtype not in DTYPES:
        raise LpfError(f"the llamacpp engine writes GGUFs at {', '.join(DTYPES)}; got dtype {dtype!r}")
    outtype, quant = DTYPES[dtype]
    key = content_key(model, dtype, tools)
    out_dir = cache_root() / "gguf" / f"{_slug(model.spec)}-{key}"
    path, meta = out_dir / f"model-{dtype}.gguf", out_dir / f"model-{dtype}.json"
    if path.is_file() and meta.is_file():
        info = json.loads(meta.read_text())
        return Gguf(path, dtype, key, info.get("vocab"), info.get("header") or {})
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".tmp-{os.getpid()}-{dtype}"
    tmp.mkdir(exist_ok=True)
    try:
        converted = tmp / f"convert-{outtype}.gguf"
        vocab = _convert(model, outtype, converted, tools)
        if vocab.get("n_mismatches"):
            raise LpfError(
                f"llama.cpp's converter changed {model.spec}'s token ids "
                f"({vocab['n_mismatches']} differences, e.g. {vocab['mismatches'][0]}): not served"
            )
        final = converted
        if quant is not None:
            final = tmp / f"quant-{quant}.gguf"
            _run([str(tools.quantize), str(converted), str(final), quant], f"llama-quantize to {quant}")
        header = describe_gguf(final, tools)
        os.replace(final, path)
        _write_json(meta, {"model": model.spec, "dtype": dtype, "vocab": vocab, "header": header})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return Gguf(path, dtype, key, vocab, header)


def user_gguf(path: str, dtype: str | None, model: ModelRef, tools: Tools) -> Gguf:
    """A GGUF the user brought: its header says what it holds (a declared dtype must agree with it) and
    its vocabulary must be the local model's, id for id (else the run would compare other tokens)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise LpfError(f"-E gguf={path}: no such file")
    header = describe_gguf(file, tools, model.path)
    vocab = header.get("vocab_check") or {}
    if vocab.get("n_mismatches"):
        raise LpfError(
            f"-E gguf={path}: its vocabulary is not {model.spec}'s ({vocab['n_mismatches']} differences, "
            f"e.g. {vocab['mismatches'][0]})"
        )
    actual = header.get("dtype")
    if dtype is not None and actual is not None and dtype != actual:
        raise LpfError(
            f"-E gguf={path} holds {header.get('file_type_name')} ({actual}), not {dtype}: drop --dtype "
            f"or pass the file it names"
        )
    return Gguf(file.resolve(), actual or dtype or "unknown", None, vocab or None, header)


def describe_gguf(path: Path, tools: Tools, model_dir: Path | None = None) -> dict:
    """Header facts read with the gguf-py that ships with the converter (in a child process, so lpf's
    own import path never holds the converter's modules); with `model_dir`, its vocabulary checked too."""
    out = _run(
        [
            sys.executable,
            str(CONVERT),
            str(tools.converter_dir),
            "--describe",
            str(path),
            *([str(model_dir)] if model_dir else []),
        ],
        "reading the GGUF header",
    )
    line = next((ln for ln in out.splitlines() if ln.startswith("lpf-gguf: ")), None)
    if line is None:
        raise LpfError(f"could not read {path}'s GGUF header")
    header = json.loads(line[len("lpf-gguf: ") :])
    header["dtype"] = FILE_TYPES.get(header.get("file_type"))
    return header


def _convert(model: ModelRef, outtype: str, out: Path, tools: Tools) -> dict:
    output = _run(
        [
            sys.executable,
            str(CONVERT),
            str(tools.converter_dir),
            "--",
            str(model.path),
            "--outtype",
            outtype,
            "--outfile",
            str(out),
        ],
        f"llama.cpp's converter on {model.spec}",
    )
    line = next((ln for ln in output.splitlines() if ln.startswith("lpf-vocab: ")), None)
    if line is None or not out.is_file():
        raise LpfError(f"llama.cpp's converter wrote no GGUF for {model.spec}")
    return json.loads(line[len("lpf-vocab: ") :])


def _run(cmd: list[str], what: str) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PYTHONPATH", None)  # the converter imports its own gguf-py, not anything of the caller's
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise LpfError(f"{what} did not finish within {TIMEOUT_S} s") from None
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()]
        raise LpfError(f"{what} failed: {lines[-1] if lines else f'exit code {proc.returncode}'}")
    return proc.stdout


def _slug(spec: str) -> str:
    name = (
        spec.replace("zoo:", "zoo-").replace("tiny:", "tiny-")
        if spec.startswith(("zoo:", "tiny:"))
        else Path(spec).name
    )
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[-48:] or "model"


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)
