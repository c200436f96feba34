"""The process `llamacpp_gguf` runs to write a GGUF with llama.cpp's own converter (never imported by lpf).

Usage: PYTHON llamacpp_convert.py LLAMA_CPP_DIR --describe FILE [MODEL_DIR] prints one JSON line
`lpf-gguf: {architecture, file_type, file_type_name, tensor_types, vocab_check}` (the vocabulary
checked only when MODEL_DIR is given). PYTHON llamacpp_convert.py LLAMA_CPP_DIR -- CONVERTER_ARGS...
(with --outfile FILE) runs
`convert_hf_to_gguf.main()` from LLAMA_CPP_DIR (its `conversion` package and `gguf-py` put first on
the path) with the converter's own arguments, then checks the written vocabulary against the Hugging
Face tokenizer id by id (`check_vocab`) and prints the outcome as one JSON line starting `lpf-vocab: `
on stdout. Before converting it registers the tokenizers lpf ships (`REGISTERED`), the only change
made to the converter's behaviour:
- The converter identifies a BPE tokenizer by the sha256 of the ids it gives a fixed test text
  (`TextModel.get_vocab_base_pre`) and refuses a hash it does not list. lpf's zoo tokenizer (ByteLevel
  BPE whose pre-tokenizer first isolates capitals, digits and `:,|+=\\n`) is listed here under its hash,
  written as llama.cpp's `gpt-2` pre-tokenizer (the ByteLevel regex, the second stage of the zoo's).
  That name only matters when llama.cpp tokenizes text itself; lpf sends token ids. The ids, the
  token strings and the merges are copied from the Hugging Face tokenizer as for any BPE model.
- Jamba's converter path reads a Llama (SentencePiece-style) tokenizer when there is no
  `tokenizer.model`; for a registered ByteLevel tokenizer it takes the BPE path every other BPE model
  takes (`_set_vocab_gpt2`), so the written vocabulary is the Hugging Face one, id for id.
A tokenizer that is not registered meets the converter's own checks unchanged. One more shim, for
configs saved by transformers 5 (which lpf's venv runs; the converter pins 4.57): GraniteMoeHybrid's
`layer_types` there says "full_attention" / "linear_attention" where the converter's
`GraniteHybridModel.get_attn_layers` (conversion/granite.py) only counts "attention", so it would
write a GGUF whose metadata calls every layer Mamba2 beside attention tensors (llama.cpp then refuses
to load it: "tensor 'blk.1.ssm_in.weight' not found"); the shim counts "full_attention" layers. Needs only what the
converter needs (torch, transformers, numpy, safetensors, pyyaml): lpf's own venv has them.
"""

import os
import sys

# the zoo tokenizer (src/lpf/zoo/data/tokenizer, shared by every zoo and tiny model), by the hash
# the converter computes for it; tests/test_llamacpp.py recomputes it, so a changed tokenizer fails there
REGISTERED = {"9b6ecb0387104826c4d1287138278dc1654bb1f231621b35ebc266e8fc1fdfd3": "gpt-2"}


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] not in ("--", "--describe"):
        print(
            "usage: llamacpp_convert.py LLAMA_CPP_DIR (-- CONVERTER_ARGS... | --describe FILE [MODEL_DIR])",
            file=sys.stderr,
        )
        return 2
    root, args = os.path.abspath(argv[0]), argv[2:]
    here = os.path.dirname(os.path.abspath(__file__))
    # this file sits beside lpf's adapters: that directory must not shadow the converter's modules
    sys.path[:] = [root, os.path.join(root, "gguf-py")] + [p for p in sys.path if os.path.abspath(p or ".") != here]
    import json

    if argv[1] == "--describe":
        print("lpf-gguf: " + json.dumps(describe(args[0], args[1] if len(args) > 1 else None)), flush=True)
        return 0
    import convert_hf_to_gguf
    from conversion import base

    register(base)
    sys.argv = ["convert_hf_to_gguf.py", *args]
    convert_hf_to_gguf.main()
    model = next(a for a in args if not a.startswith("-") and os.path.isdir(a))
    outfile = args[args.index("--outfile") + 1]
    print("lpf-vocab: " + json.dumps(check_vocab(outfile, model)), flush=True)
    return 0


def describe(path: str, model_dir: str | None) -> dict:
    import gguf

    reader = gguf.GGUFReader(path)
    fields = reader.fields
    ftype = fields["general.file_type"].contents() if "general.file_type" in fields else None
    try:
        ftype_name = gguf.LlamaFileType(ftype).name if ftype is not None else None
    except ValueError:
        ftype_name = None
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    arch = fields["general.architecture"].contents() if "general.architecture" in fields else None
    return {
        "architecture": arch,
        "file_type": ftype,
        "file_type_name": ftype_name,
        "tensor_types": types,
        "vocab_check": check_vocab(path, model_dir) if model_dir else None,
    }


def check_vocab(gguf_path: str, model_dir: str) -> dict:
    """The GGUF's vocabulary against the Hugging Face tokenizer's: every id's token string (ids past
    the tokenizer's vocabulary must be padding), and the BOS/EOS/PAD ids. {"n_tokens", "pre",
    "mismatches": [first few "id: gguf != hf"], "n_mismatches"}."""
    import gguf
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    fields = gguf.GGUFReader(gguf_path).fields

    def value(name):
        return fields[name].contents() if name in fields else None

    tokens = value("tokenizer.ggml.tokens") or []
    n_hf = len(tok)
    bad = []
    for i, piece in enumerate(tokens):
        want = tok.convert_ids_to_tokens(i) if i < n_hf else None
        if (want is None and not piece.startswith("[PAD")) or (want is not None and piece != want):
            bad.append(f"{i}: {piece!r} != {want!r}")
    if len(tokens) < n_hf:
        bad.append(f"the GGUF has {len(tokens)} tokens, the tokenizer {n_hf}")
    for name, want in (("bos", tok.bos_token_id), ("eos", tok.eos_token_id), ("padding", tok.pad_token_id)):
        got = value(f"tokenizer.ggml.{name}_token_id")
        if want is not None and got != want:
            bad.append(f"{name} id: {got} != {want}")
    return {
        "n_tokens": len(tokens),
        "pre": value("tokenizer.ggml.pre"),
        "model": value("tokenizer.ggml.model"),
        "n_mismatches": len(bad),
        "mismatches": bad[:5],
    }


def registered_pre(chktxt: str | None, tokenizer) -> str | None:
    """The pre-tokenizer name lpf registered for this tokenizer, else None."""
    from hashlib import sha256

    return REGISTERED.get(sha256(str(tokenizer.encode(chktxt)).encode()).hexdigest()) if chktxt else None


def converter_chktxt(source: str) -> str | None:
    """The converter's test text, read from the source of its get_vocab_base_pre (where it is a local)."""
    import ast
    import textwrap

    for node in ast.walk(ast.parse(textwrap.dedent(source))):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "chktxt" for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def register(base) -> None:
    original_pre = base.TextModel.get_vocab_base_pre
    import inspect

    chktxt = converter_chktxt(inspect.getsource(original_pre))
    if chktxt is None:  # the converter changed shape: nothing is registered, its own checks speak
        print("lpf: the converter's tokenizer test text was not found; zoo tokenizer not registered", file=sys.stderr)
        return

    def get_vocab_base_pre(self, tokenizer):
        name = registered_pre(chktxt, tokenizer)
        return name if name is not None else original_pre(self, tokenizer)

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre

    from conversion import jamba

    original_vocab = jamba.JambaModel.set_vocab

    def set_vocab(self):
        if not (self.dir_model / "tokenizer.model").is_file() and _registered_dir(chktxt, self.dir_model):
            self._set_vocab_gpt2()
        else:
            original_vocab(self)

    jamba.JambaModel.set_vocab = set_vocab

    from conversion import granite

    original_attn = granite.GraniteHybridModel.get_attn_layers

    def get_attn_layers(self):
        types = self.hparams.get("layer_types") or []
        if any(t in ("full_attention", "linear_attention") for t in types):  # transformers 5's names
            return [i for i, t in enumerate(types) if t == "full_attention"]
        return original_attn(self)

    granite.GraniteHybridModel.get_attn_layers = get_attn_layers


def _registered_dir(chktxt: str, path) -> bool:
    from transformers import AutoTokenizer

    return registered_pre(chktxt, AutoTokenizer.from_pretrained(path)) is not None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
