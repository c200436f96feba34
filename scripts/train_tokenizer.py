"""Train the zoo's byte-level BPE tokenizer and save it where `lpf.zoo.registry.tokenizer_dir()` points.

    python scripts/train_tokenizer.py [--vocab 512] [--out DIR]

Deterministic: the corpus comes from `lpf.zoo.tasks.tokenizer_corpus(seed=0)`. Every task character
(capitals, digits, task punctuation) is isolated by the pre-tokenizer, so task strings are one token per
character whatever merges BPE learns from the prose. The result loads with
`transformers.AutoTokenizer.from_pretrained(DIR)` offline and prepends `<s>` to every encoded text.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lpf.zoo import tasks  # noqa: E402

SPECIALS = ["<pad>", "<s>", "</s>"]


def build(vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    isolate = "[" + re.escape(tasks.TASK_CHARS) + "\n]"
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(isolate), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tasks.tokenizer_corpus(seed=0), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


def save(tok, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).unlink(missing_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    fast.save_pretrained(str(out))
    # Written explicitly too: some loaders (older transformers, vLLM) read these files directly.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "clean_up_tokenization_spaces": False,
            "padding_side": "left",
        }
    )
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, indent=2) + "\n"
    )


def check(out: Path) -> None:
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(str(out))
    assert (t.pad_token_id, t.bos_token_id, t.eos_token_id) == (0, 1, 2), (
        t.pad_token_id,
        t.bos_token_id,
        t.eos_token_id,
    )
    for ch in tasks.TASK_CHARS + "\n":
        ids = t(ch, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, (ch, ids)
    rng = random.Random("tokenizer-check")
    samples = tasks.oracle_items(300, seed=123) + tasks.stress_items(200, seed=123)
    for it in samples:
        ids = t(it["prompt"])["input_ids"]
        assert ids[0] == 1, ids[:3]
        assert t.decode(ids[1:]) == it["prompt"], it["prompt"]
        task_part = it["prompt"].split("\n")[-1] + it["expected"]
        ids = t(task_part, add_special_tokens=False)["input_ids"]
        assert len(ids) == len(task_part), (task_part, t.convert_ids_to_tokens(ids))
    for _ in range(300):
        tr = tasks.training_item(rng, 1.0)
        task_part = tr["text"].split("\n")[-1]
        assert len(t(task_part, add_special_tokens=False)["input_ids"]) == len(task_part)
    full = t.decode(t("Hi!\nR:A37|A37")["input_ids"] + [2])
    assert full == "<s>Hi!\nR:A37|A37</s>", full
    lens = [len(t(it["prompt"])["input_ids"]) for it in tasks.stress_items(500, seed=0)]
    print(f"ok: vocab {len(t)}; stress prompt tokens min {min(lens)} max {max(lens)}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--out", type=Path, default=ROOT / "src/lpf/zoo/data/tokenizer")
    args = ap.parse_args(argv)
    if not 512 <= args.vocab <= 1024:
        ap.error("--vocab must be in 512..1024")
    save(build(args.vocab), args.out)
    check(args.out)
    print(f"saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
