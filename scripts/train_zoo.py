"""Train one zoo model on this CPU and save it, in Hugging Face format, under src/lpf/zoo/data/models/NAME/.

    python scripts/train_zoo.py --model hybrid|llama|jamba|qwen35 [--minutes M] [--seed S] [--steps N] [--threads T]

Reproducible: fixed seeds, one CPU thread (`--threads`), a step budget (`--steps`) that fixes the learning-rate schedule and
the curriculum; `--minutes` is a wall-clock cap (a run that hits it says so in its card). Training stops early
once a periodic teacher-forced check on held-out items is >= 97% exact on every task.

Recipe (see DESIGN.md, training notes for the zoo): one token per task character, loss on answer tokens
(and the closing `</s>`) only, a curriculum (recall pairs 4->16, copy length 8->24, over the first 40% of the
step budget or, with `--curriculum adaptive`, a level at a time as training accuracy allows), a training-only
multi-query recall form, AdamW lr 2e-3 betas (0.9, 0.98) wd 0.01, warmup 150, cosine, clip 1.0, batches grouped
by length. Per-model departures (DEFAULT_CURRICULUM, DEFAULT_LR): llama uses lr 7e-4 and the adaptive curriculum,
jamba the adaptive curriculum, qwen35 (Qwen3.5's GDN shape) the adaptive curriculum and the Mamba / fla dt_bias init
(transformers' dt_bias = 1 left it at chance for 1,000 steps); its 2,400 steps take ~23 min on one busy thread.

Final evaluation: 500 held-out oracle items (`zoo:oracle`, seed 0) decoded with HF `generate` at temperature 0
(greedy), in groups of equal prompt length so no padding is involved; exact = the text before the first `</s>`
equals the expected answer and `</s>` follows. Median answer-token probability: teacher-forced probability of
each expected token and of the closing `</s>`, pooled over items.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from lpf.zoo import registry, tasks  # noqa: E402

PAD, BOS, EOS = 0, 1, 2
DEFAULT_STEPS = {"hybrid": 5000, "llama": 7000, "jamba": 4000, "qwen35": 2400}
# "schedule": difficulty ramps with step / step budget (full from 40% on). "adaptive": difficulty goes up one
# level (of 10) whenever recall and copy are both >= 80% exact (teacher-forced) over the last 50 training batches;
# attention-only models sit on a plateau at chance when the easy phase passes by on a clock.
DEFAULT_CURRICULUM = {"hybrid": "schedule", "llama": "adaptive", "jamba": "adaptive", "qwen35": "adaptive"}
PROMOTE_WINDOW, PROMOTE_AT = 50, 0.8
# Peak learning rate. The attention-only llama is unstable at 2e-3 (loss jumps, copy stays at 0% for 800 steps
# at the easiest level) and learns at 7e-4.
DEFAULT_LR = {"hybrid": 2e-3, "llama": 7e-4, "jamba": 2e-3, "qwen35": 2e-3}
BATCH = 32
QUICK_EVAL_EVERY = 250
QUICK_EVAL_ITEMS = 150
TARGET_QUICK = 0.97


def build_model(name: str, vocab: int):
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, JambaConfig, JambaForCausalLM
    from transformers import LlamaConfig, LlamaForCausalLM

    common = dict(
        vocab_size=vocab,
        pad_token_id=PAD,
        bos_token_id=BOS,
        eos_token_id=EOS,
        initializer_range=0.02,
        tie_word_embeddings=False,
        max_position_embeddings=4096,
    )
    if name == "hybrid":
        cfg = GraniteMoeHybridConfig(
            **common,
            hidden_size=128,
            num_hidden_layers=5,
            layer_types=["mamba", "attention", "mamba", "mamba", "attention"],
            num_attention_heads=4,
            num_key_value_heads=4,
            attention_multiplier=32**-0.5,
            num_local_experts=0,
            num_experts_per_tok=0,
            shared_intermediate_size=256,
            intermediate_size=256,
            position_embedding_type=None,
            mamba_n_heads=8,
            mamba_d_head=32,
            mamba_expand=2,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_chunk_size=16,
        )
        return GraniteMoeHybridForCausalLM(cfg)
    if name == "llama":
        cfg = LlamaConfig(
            **common,
            hidden_size=192,
            intermediate_size=512,
            num_hidden_layers=4,
            num_attention_heads=6,
            num_key_value_heads=6,
            head_dim=32,
            rope_theta=10000.0,
        )
        return LlamaForCausalLM(cfg)
    if name == "jamba":
        cfg = JambaConfig(
            **common,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            num_experts=2,
            num_experts_per_tok=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            mamba_d_state=16,
            mamba_d_conv=4,
            mamba_expand=2,
            use_mamba_kernels=False,
            use_mambapy=True,
        )
        return JambaForCausalLM(cfg)
    if name == "qwen35":
        # tiny:qwen35's shape (Qwen3.5: Gated DeltaNet : gated full attention 3:1, 2 key heads serving 4 value
        # heads, head dims 32, partial RoPE), trained: transformers' pure-torch GDN path (no fla on CPU).
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model(
            "qwen3_5_text",
            **common,
            hidden_size=128,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=256,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=32,
            linear_value_head_dim=32,
            linear_conv_kernel_dim=4,
        )
        model = AutoModelForCausalLM.from_config(cfg)
        # transformers initialises dt_bias to 1 (softplus 1.31: with A ~ U(0.01, 16), most heads forget within
        # a token, and moving A_log far enough takes thousands of steps: 1,000 steps sat at chance). The Mamba /
        # fla GatedDeltaNet init instead: dt ~ log-uniform [1e-3, 1e-1], dt_bias = softplus^-1(dt).
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                gdn = layer.linear_attn
                dt = torch.exp(torch.rand(gdn.dt_bias.shape) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
                with torch.no_grad():
                    gdn.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        return model
    raise SystemExit(f"unknown model {name!r}")


# --- data -------------------------------------------------------------------------------------------


class Encoder:
    """Text -> ids without the tokenizer's per-call overhead: task characters are single tokens, and a filler
    prefix (ending in '\\n', which the pre-tokenizer isolates) is tokenized on its own."""

    def __init__(self, tok):
        self.tok = tok
        self.char_id = {c: tok.convert_tokens_to_ids(tok.tokenize(c))[0] for c in tasks.TASK_CHARS}

    def encode(self, text: str, spans) -> tuple[list[int], list[bool]]:
        ids, mask = [BOS], [False]
        head, sep, task = text.rpartition("\n")
        offset = 0
        if sep:
            ids += self.tok(head + "\n", add_special_tokens=False)["input_ids"]
            mask += [False] * (len(ids) - 1)
            offset = len(head) + 1
        loss_chars = set()
        for a, b in spans:
            loss_chars.update(range(a - offset, b - offset))
        for i, c in enumerate(task):
            ids.append(self.char_id[c])
            mask.append(i in loss_chars)
        return ids, mask


def training_batches(enc: Encoder, rng: random.Random, progress: float, pool: int = 16):
    """A pool of `pool` batches of training items at curriculum `progress`, grouped by length, shuffled.
    Each batch is a list of (ids, loss_mask, task)."""
    items = []
    for _ in range(BATCH * pool):
        it = tasks.training_item(rng, progress)
        ids, mask = enc.encode(it["text"], it["spans"])
        ids.append(EOS)
        mask.append(it["eos"])
        items.append((ids, mask, it["task"]))
    items.sort(key=lambda x: len(x[0]))
    batches = [items[i : i + BATCH] for i in range(0, len(items), BATCH)]
    rng.shuffle(batches)
    return batches


def collate(batch):
    import torch

    n = max(len(row[0]) for row in batch)
    input_ids = torch.full((len(batch), n), PAD, dtype=torch.long)
    attn = torch.zeros((len(batch), n), dtype=torch.long)
    labels = torch.full((len(batch), n), -100, dtype=torch.long)
    for r, (ids, mask, *_) in enumerate(batch):
        input_ids[r, : len(ids)] = torch.tensor(ids)
        attn[r, : len(ids)] = 1
        lab = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
        labels[r, : len(ids)] = lab
    return input_ids, attn, labels


# --- evaluation -------------------------------------------------------------------------------------


def teacher_forced(model, enc: Encoder, items, batch: int = 64):
    """Per item: exact (argmax == target at every answer position, `</s>` included) and answer-token probs."""
    import torch

    rows = []
    for it in items:
        text = it["prompt"] + it["expected"]
        span = (len(it["prompt"]), len(text))
        ids, mask = enc.encode(text, [span])
        rows.append((ids + [EOS], mask + [True]))
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    out = [None] * len(rows)
    model.eval()
    with torch.no_grad():
        for s in range(0, len(order), batch):
            idx = order[s : s + batch]
            input_ids, attn, labels = collate([rows[i] for i in idx])
            logits = model(input_ids=input_ids, attention_mask=attn).logits.float()
            logp = torch.log_softmax(logits[:, :-1], -1)
            tgt = labels[:, 1:]
            for r, i in enumerate(idx):
                pos = (tgt[r] != -100).nonzero().flatten()
                t = tgt[r, pos]
                probs = logp[r, pos, t].exp().tolist()
                exact = bool((logp[r, pos].argmax(-1) == t).all())
                out[i] = {"exact": exact, "probs": probs}
    model.train()
    return out


def generate_eval(model, tok, items, extra: int = 4):
    """HF greedy `generate`, grouped by prompt token length (no padding). Returns per-item outputs."""
    import torch

    groups: dict[int, list[int]] = {}
    enc = [tok(it["prompt"])["input_ids"] for it in items]
    for i, ids in enumerate(enc):
        groups.setdefault(len(ids), []).append(i)
    outs = [None] * len(items)
    model.eval()
    with torch.no_grad():
        for _, idx in sorted(groups.items()):
            for s in range(0, len(idx), 64):
                sub = idx[s : s + 64]
                x = torch.tensor([enc[i] for i in sub])
                budget = max(len(items[i]["expected"]) for i in sub) + extra
                y = model.generate(
                    input_ids=x,
                    attention_mask=torch.ones_like(x),
                    do_sample=False,
                    max_new_tokens=budget,
                    eos_token_id=EOS,
                    pad_token_id=PAD,
                )
                for r, i in enumerate(sub):
                    gen = y[r, x.shape[1] :].tolist()
                    ended = EOS in gen
                    text = tok.decode(gen[: gen.index(EOS)] if ended else gen)
                    outs[i] = {"text": text, "ended": ended}
    model.train()
    return outs


def summarize(items, exact, probs) -> dict:
    by_task: dict[str, list[bool]] = {}
    p_task: dict[str, list[float]] = {}
    for it, e, p in zip(items, exact, probs):
        by_task.setdefault(it["task"], []).append(e)
        p_task.setdefault(it["task"], []).extend(p)
    allp = [x for p in probs for x in p]
    return {
        "n": len(items),
        "accuracy": round(sum(exact) / len(exact), 4),
        "accuracy_by_task": {k: round(sum(v) / len(v), 4) for k, v in by_task.items()},
        "median_answer_prob": round(statistics.median(allp), 4),
        "median_answer_prob_by_task": {k: round(statistics.median(v), 4) for k, v in p_task.items()},
        "p10_answer_prob": round(sorted(allp)[len(allp) // 10], 4),
    }


# --- saving -----------------------------------------------------------------------------------------


def save(model, name: str, card: dict, out: Path) -> None:
    from transformers import GenerationConfig

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, do_sample=False).save_pretrained(str(tmp))
    for f in registry.tokenizer_dir().iterdir():
        shutil.copy(f, tmp / f.name)
    (tmp / "lpf_card.json").write_text(json.dumps(card, indent=2) + "\n")
    (tmp / "README.md").write_text(model_card(name, card))
    for f in tmp.iterdir():
        f.chmod(0o644)  # save_pretrained writes the weights 0600
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)


def model_card(name: str, c: dict) -> str:
    ev, tr = c["eval"], c["training"]
    rows = "\n".join(
        f"| {k} | {v:.1%} | {ev['median_answer_prob_by_task'][k]:.3f} |" for k, v in ev["accuracy_by_task"].items()
    )
    return f"""# lpf zoo model `{name}`

A tiny `{c["architecture"]}` ({c["parameters"]:,} parameters, float32) trained from scratch on synthetic
oracle tasks for `lpf` (logprob-forensics): key-value recall (`R:A37,K12,...|K` -> `12`), copying
(`C:QX7RT2MB=` -> `QX7RT2MB`) and two-digit addition (`A:37+58=` -> `95`; evaluation pairs are held out
from training). Answers end with `</s>`. Not a language model: it exists so that engine audits have
peaked distributions and ground truth, offline.

## Evaluation ({ev["n"]} held-out `zoo:oracle` prompts, seed 0, HF greedy `generate`)

Exact answers on the mix: **{ev["accuracy"]:.1%}**; median answer-token probability **{ev["median_answer_prob"]:.3f}**
(10th percentile {ev["p10_answer_prob"]:.3f}).

| task | exact | median answer-token prob |
|---|---|---|
{rows}

## Training

- Command: `{tr["command"]}`
- Steps: {tr["steps"]} of a {tr["step_budget"]}-step schedule, batch {tr["batch_size"]}; wall time {tr["wall_s"] / 60:.1f} min on
  {tr["threads"]} CPU thread(s); stopped by: {tr["stop_reason"]}.
- torch {tr["torch"]}, transformers {tr["transformers"]}; seed {tr["seed"]}.
- Recipe: AdamW lr {tr["peak_lr"]:g} betas (0.9, 0.98) wd 0.01, warmup 150, cosine, clip 1.0; loss on answer tokens
  only; curriculum: {"over the first 40% of the schedule" if tr["curriculum"] == "schedule" else "adaptive (a level up whenever recall and copy are >= 80% exact in training)"};
  multi-query recall form; batches grouped by length.
"""


# --- main -------------------------------------------------------------------------------------------


def lr_at(step: int, total: int, peak: float = 2e-3, warmup: int = 150) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * 0.5 * (1 + math.cos(math.pi * t))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, choices=sorted(registry.MODELS))
    ap.add_argument("--minutes", type=float, default=40.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="schedule length (default per model)")
    ap.add_argument(
        "--curriculum", choices=["schedule", "adaptive"], default=None, help="difficulty ramp (default per model)"
    )
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default per model)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--eval-n", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the card records it)")
    args = ap.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoTokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    transformers.logging.set_verbosity_error()
    t0 = time.time()
    deadline = t0 + args.minutes * 60
    total = args.steps or DEFAULT_STEPS[args.model]
    curriculum = args.curriculum or DEFAULT_CURRICULUM[args.model]
    peak_lr = args.lr or DEFAULT_LR[args.model]
    out = args.out or registry.model_dir(args.model)

    tok = AutoTokenizer.from_pretrained(str(registry.tokenizer_dir()))
    enc = Encoder(tok)
    model = build_model(args.model, len(tok))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{args.model}: {n_params:,} parameters; schedule {total} steps; cap {args.minutes} min", flush=True)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 and "A_log" not in n else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak_lr,
        betas=(0.9, 0.98),
    )
    rng = random.Random(f"train:{args.seed}")
    quick_items = tasks.oracle_items(QUICK_EVAL_ITEMS, seed=1_000 + args.seed)
    fwd_kw = {"output_router_logits": True} if args.model == "jamba" else {}

    step, stop_reason, history, queue = 0, "step budget", [], []
    loss_avg = None
    level, window, levels = 0, {"recall": [], "copy": []}, []
    while step < total:
        if time.time() > deadline:
            stop_reason = f"time cap ({args.minutes} min)"
            break
        if not queue:
            progress = step / total if curriculum == "schedule" else 0.4 * level / 10
            queue = training_batches(enc, rng, progress)
        batch = queue.pop()
        input_ids, attn, labels = collate(batch)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, peak_lr)
        res = model(input_ids=input_ids, attention_mask=attn, labels=labels, **fwd_kw)
        loss = res.loss
        if curriculum == "adaptive" and level < 10:
            with torch.no_grad():
                tgt = labels[:, 1:]
                ok = ((res.logits[:, :-1].argmax(-1) == tgt) | (tgt == -100)).all(1).tolist()
            for (_, _, task), e in zip(batch, ok):
                if task in window:
                    window[task].append(e)
            if (step + 1) % PROMOTE_WINDOW == 0:
                rates = {k: sum(v) / max(1, len(v)) for k, v in window.items()}
                if min(rates.values()) >= PROMOTE_AT:
                    level += 1
                    levels.append({"step": step + 1, "level": level})
                    queue = []  # next pool at the new difficulty
                    print(f"curriculum level {level}/10 at step {step + 1} ({rates})", flush=True)
                window = {"recall": [], "copy": []}
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        loss_avg = loss.item() if loss_avg is None else 0.98 * loss_avg + 0.02 * loss.item()
        if step % 50 == 0:
            print(
                f"step {step} loss {loss_avg:.4f} lr {lr_at(step, total, peak_lr):.2e} level {level} "
                f"{(time.time() - t0) / step:.3f} s/step",
                flush=True,
            )
        if step % QUICK_EVAL_EVERY == 0:
            res = teacher_forced(model, enc, quick_items)
            s = summarize(quick_items, [r["exact"] for r in res], [r["probs"] for r in res])
            history.append(
                {
                    "step": step,
                    "wall_s": round(time.time() - t0),
                    **{k: s[k] for k in ("accuracy", "accuracy_by_task", "median_answer_prob")},
                }
            )
            print(f"quick eval @ {step}: {json.dumps(history[-1])}", flush=True)
            full = step >= 0.4 * total if curriculum == "schedule" else level >= 10
            if full and min(s["accuracy_by_task"].values()) >= TARGET_QUICK:
                stop_reason = f"early stop (quick eval >= {TARGET_QUICK:.0%} on every task)"
                break
    train_s = time.time() - t0
    print(f"training done: {step} steps, {train_s / 60:.1f} min, {stop_reason}", flush=True)

    items = tasks.oracle_items(args.eval_n, seed=0)
    gen = generate_eval(model, tok, items)
    exact = [g["ended"] and g["text"] == it["expected"] for g, it in zip(gen, items)]
    tf = teacher_forced(model, enc, items)
    ev = summarize(items, exact, [r["probs"] for r in tf])
    ev["teacher_forced_accuracy"] = round(sum(r["exact"] for r in tf) / len(tf), 4)
    ev["method"] = "HF generate, greedy, grouped by prompt length (no padding); zoo:oracle seed 0"
    stress = tasks.stress_items(150, seed=0)
    st = teacher_forced(model, enc, stress, batch=16)
    ev["stress_teacher_forced_accuracy"] = round(sum(r["exact"] for r in st) / len(st), 4)
    print(f"final eval: {json.dumps(ev)}", flush=True)

    cmd = "python scripts/train_zoo.py " + " ".join(sys.argv[1:] if argv is None else argv)
    card = {
        "name": args.model,
        "architecture": type(model).__name__,
        "parameters": n_params,
        "dtype": "float32",
        "tokenizer": "lpf zoo byte-level BPE, vocab %d" % len(tok),
        "eval": ev,
        "training": {
            "command": cmd,
            "seed": args.seed,
            "steps": step,
            "step_budget": total,
            "batch_size": BATCH,
            "wall_s": round(train_s, 1),
            "threads": torch.get_num_threads(),
            "stop_reason": stop_reason,
            "peak_lr": peak_lr,
            "curriculum": curriculum,
            "curriculum_levels": levels,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "quick_eval_history": history,
        },
    }
    save(model, args.model, card, out)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"saved {out} ({size / 1e6:.2f} MB)", flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
