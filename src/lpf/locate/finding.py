"""From two sides' activations to the finding: where the lie is born, and who is wrong (numpy only).

Contract: `judge(engine, ref, prompt_len, engine_dtype, engine_steps=None, slot_stride=None) -> dict` with
- `located`: the first op and position where the engine departs from the reference's teacher-forced
  pass beyond that op's floor (`align.first_departure`), with both sides' norms there and, for the
  built-in engine, the engine step that computed it; None when nothing departs;
- `mamba`: for a departure inside a Mamba layer, whether that layer's input state at the step that
  computed the position already differed (`input_state: "differed"`: the state is not this
  request's; with the engine's step: what it read and who last wrote it) or agreed (`"agreed"`: the
  layer computed wrong from the right input);
- `input`: for any other op, whether the op just before it in execution order agreed there;
- `trials`: the reference on trial: float32 against the float64 gold (`agrees` when every op is
  within `align.GOLD_TOLERANCE` float32 epsilons), its decode path against its teacher-forced pass,
  its attention implementations against each other, and the engine against the decode path, each
  with its first departure;
- `verdict`: `suspect` engine | reference | both | nobody, and the sentence saying so with numbers;
- `modules`: `align.summary` rows (engine vs reference) with the trials' errors at each op beside
  them, in execution order: the chart's data; `grid`: log10(error / floor) per op and position;
- `sentence`: the finding in one sentence; `details`: the numbers and the verdict behind it.
"""

from __future__ import annotations

from lpf.locate import align
from lpf.locate.ops import NAMES, SHORT, STEP_OPS, base_name, is_step_op, merged_order, split_op

# ops of a Mamba layer that its input state reaches (in_proj and dt do not read it)
MAMBA_OPS = ("conv", "conv_state_in", "state_in", "ssm_out", "conv_state_out", "state_out", "gate_norm", "out_proj")
LINEAR_OPS = ("in_proj", "out_proj", "o_proj", "router")
PAIRS = {"q": "k", "k": "q", "conv_state_in": "state_in", "state_in": "conv_state_in"}


def token_label(position: int, prompt_len: int) -> str:
    return f"prompt token {position}" if position < prompt_len else f"output token {position - prompt_len}"


def _describe(op: str, names: dict = NAMES) -> str:
    layer, rest = split_op(op)
    what = names.get(base_name(op), base_name(op))
    shared = " (its shared block)" if rest.startswith("shared.") else ""
    return what if layer is None else f"{what} of layer {layer}{shared}"


def _short(op: str) -> str:
    """`L1.dt (the SSM step size dt of layer 1)`: for sentences."""
    return f"{op} ({_describe(op, SHORT)})"


def _g(x) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _compare(a, b, dtype, growth, order):
    errs, mismatched = align.rel_errors(a, b)
    floor_of = align.floors(growth, dtype, errs)
    return errs, floor_of, align.first_departure(errs, floor_of, order), mismatched


def judge(
    engine,
    ref,
    prompt_len: int,
    engine_dtype: str,
    engine_steps: list[dict] | None = None,
    slot_stride: int | None = None,
) -> dict:
    order = merged_order(engine.order, ref.tf.order)
    gold_errs, _ = align.rel_errors(ref.tf, ref.gold)
    growth = align.growth(gold_errs)
    errs, floor_of, located, mismatched = _compare(engine, ref.tf, engine_dtype, growth, order)
    out = {"order": order, "growth": growth, "mismatched": mismatched}
    trials = {"gold": _gold_trial(gold_errs)}
    side_errs = {"gold": gold_errs}
    for name, acts, a, b, dtype in (
        ("decode_path", ref.decode, ref.decode, ref.tf, "float32"),
        ("attention", ref.eager, ref.eager, ref.tf, "float32"),
        ("engine_vs_decode_path", ref.decode, engine, ref.decode, engine_dtype),
    ):
        if acts is None:
            continue
        e, f, first, _ = _compare(a, b, dtype, growth, order)
        side_errs[name] = e
        trials[name] = {"compared_ops": len(e), "first_departure": _point(first, a, b, prompt_len)}
    dp = (trials.get("decode_path") or {}).get("first_departure")
    if dp is not None and "engine_vs_decode_path" in side_errs:
        e = side_errs["engine_vs_decode_path"].get(dp["op"], {}).get(dp["position"])
        f = align.floors(growth, engine_dtype, [dp["op"]])[dp["op"]]
        trials["decode_path"]["engine_there"] = None if e is None else {"rel_error": e, "floor": f, "agrees": e <= f}
    out["trials"] = trials
    out["located"] = _point(located, engine, ref.tf, prompt_len)
    if out["located"] is not None:  # its sibling computed from the same input (q and k, the two states)
        op, p = out["located"]["op"], out["located"]["position"]
        sibling = op.rpartition(".")[0] + "." + PAIRS[base_name(op)] if base_name(op) in PAIRS else None
        out["located"]["also"] = (
            [sibling] if sibling and errs.get(sibling, {}).get(p, 0) > floor_of.get(sibling, 1e300) else []
        )
    if out["located"] is not None and engine_steps:
        out["located"]["step"] = _step_at(engine_steps, out["located"]["position"])
    out["mamba"] = _mamba(out["located"], errs, floor_of, engine, ref.tf, prompt_len, engine_steps)
    if out["mamba"] is not None:
        out["mamba"]["slot_stride"] = slot_stride
    out["input"] = _input(out["located"], errs, floor_of, order)
    out["modules"] = _modules(errs, floor_of, order, side_errs)
    out["grid"] = _grid(errs, floor_of, order)
    out["verdict"] = _verdict(out, trials)
    out["sentence"], out["details"] = _sentence(out, prompt_len)
    return out


def _point(first, a, b, prompt_len):
    if first is None:
        return None
    op, p = first["op"], first["position"]
    layer, _ = split_op(op)
    return {
        **first,
        "layer": layer,
        "name": base_name(op),
        "description": _describe(op),
        "short": _short(op),
        "token": token_label(p, prompt_len),
        f"{a.side}_norm": align.norms(a, op, p),
        f"{b.side}_norm": align.norms(b, op, p),
    }


def _step_at(steps: list[dict], position: int) -> dict | None:
    return next((s for s in steps if s["first_position"] <= position <= s["last_position"]), None)


def _gold_trial(gold_errs) -> dict:
    worst = max(((op, max(e.values())) for op, e in gold_errs.items() if e), key=lambda x: x[1], default=None)
    if worst is None:
        return {"agrees": None}
    eps = worst[1] / align.EPS["float32"]
    return {
        "agrees": eps <= align.GOLD_TOLERANCE,
        "worst_op": worst[0],
        "worst_rel_error": worst[1],
        "worst_epsilons": eps,
        "tolerance_epsilons": align.GOLD_TOLERANCE,
        "compared_ops": len(gold_errs),
    }


def _mamba(located, errs, floor_of, engine, ref, prompt_len, steps):
    """The Mamba layer's input state (its SSM and conv state) at the start of the step that computed
    the located position: did either already differ?"""
    if located is None or located["name"] not in MAMBA_OPS:
        return None
    layer, p = located["layer"], located["position"]
    ins = [q for q in engine.positions(f"L{layer}.state_in") + engine.positions(f"L{layer}.conv_state_in") if q <= p]
    if not ins:
        return None
    start = max(ins)
    parts = {}
    for part, op in (("ssm", f"L{layer}.state_in"), ("conv", f"L{layer}.conv_state_in")):
        e, f = errs.get(op, {}).get(start), floor_of.get(op)
        if e is not None and f is not None:
            parts[part] = {
                "rel_error": e,
                "floor": f,
                "differed": e > f,
                "engine_norm": align.norms(engine, op, start),
                "reference_norm": align.norms(ref, op, start),
            }
    if not parts:
        return None
    differed = [k for k, v in parts.items() if v["differed"]]
    shown = parts.get(differed[0] if differed else "ssm") or next(iter(parts.values()))
    info = {
        "layer": layer,
        # only a Gated DeltaNet layer has the gates g and beta (either side's capture)
        "kind": "Gated DeltaNet" if f"L{layer}.g" in engine or f"L{layer}.g" in ref else "Mamba",
        "step_start": start,
        "start_token": token_label(start, prompt_len),
        "input_state": "differed" if differed else "agreed",
        "differed_parts": differed,
        "parts": parts,
        "state_in_rel_error": shown["rel_error"],
        "floor": shown["floor"],
        "engine_state_norm": shown["engine_norm"],
        "reference_state_norm": shown["reference_norm"],
    }
    if steps:
        step = _step_at(steps, start)
        info["step"] = step
        prev = [s for s in steps if s["last_position"] == start - 1]
        if prev:
            info["previous_step"] = prev[-1]
            pe = errs.get(f"L{layer}.state_out", {}).get(start - 1)
            info["previous_state_out_rel_error"] = pe
            fo = floor_of.get(f"L{layer}.state_out")
            info["previous_state_out_agreed"] = None if pe is None or fo is None else pe <= fo
    return info


def _input(located, errs, floor_of, order):
    if located is None:
        return None
    op, p = located["op"], located["position"]
    i = order.index(op) if op in order else 0
    for prev in reversed(order[:i]):
        if is_step_op(prev) or p not in errs.get(prev, {}):
            continue
        e, f = errs[prev][p], floor_of.get(prev)
        return {
            "op": prev,
            "description": _describe(prev),
            "rel_error": e,
            "floor": f,
            "agreed": f is not None and e <= f,
        }
    return None


def _modules(errs, floor_of, order, side_errs) -> list[dict]:
    rows = align.summary(errs, floor_of, order)
    for r in rows:
        r["description"] = _describe(r["op"])
        r["step_level"] = base_name(r["op"]) in STEP_OPS
        for name, e in side_errs.items():
            vals = e.get(r["op"])
            r[f"{name}_max_rel_error"] = max(vals.values()) if vals else None
    return rows


def _grid(errs, floor_of, order, max_positions: int = 512) -> dict:
    """log10(error / floor) per op (rows, execution order) and position (columns; past `max_positions`,
    each column the largest of a bin of positions), None where an op has no row: the report's heat map."""
    import math

    ops = [op for op in order if errs.get(op) and floor_of.get(op)]
    positions = sorted({p for op in ops for p in errs[op]})
    step = max(1, -(-len(positions) // max_positions))
    cols = [positions[i : i + step] for i in range(0, len(positions), step)]
    rows = []
    for op in ops:
        e, f = errs[op], floor_of[op]
        row = []
        for col in cols:
            vals = [e[p] for p in col if p in e]
            row.append(None if not vals else round(math.log10(max(max(vals), 1e-30) / f), 2))
        rows.append(row)
    return {"ops": ops, "positions": [c[0] for c in cols], "bin": step, "log_ratio": rows}


def _verdict(out, trials) -> dict:
    located = out["located"]
    dp = (trials.get("decode_path") or {}).get("first_departure")
    at = (trials.get("attention") or {}).get("first_departure")
    gold = trials["gold"]
    # the gold sets the floors; float32 far off it is ill-conditioning (reported), not the reference contradicting itself
    ref_wrong = [t for t in (dp, at) if t is not None]
    if gold.get("agrees") is False:
        note = (
            f"; note: the float32 reference is {gold['worst_epsilons']:.3g} float32 epsilons off its float64 gold "
            f"at {gold['worst_op']} (beyond {gold['tolerance_epsilons']}: ill-conditioned here, the floors widen with it)"
        )
    else:
        note = ""
    verdict = _suspect(located, dp, at, ref_wrong, trials)
    verdict["sentence"] += note
    return verdict


def _suspect(located, dp, at, ref_wrong, trials) -> dict:
    gold = trials["gold"]
    if located is None and not ref_wrong:
        return {
            "suspect": "nobody",
            "sentence": "no op departs from the reference beyond its floor, and the reference agrees with itself",
        }
    if located is None:
        return {
            "suspect": "reference",
            "sentence": "the engine agrees with the reference's teacher-forced pass; "
            "the reference disagrees with itself (" + _ref_words(dp, at, gold) + ")",
        }
    if not ref_wrong:
        return {
            "suspect": "engine",
            "sentence": f"the engine departs ({located['short']}, {located['token']}); "
            "the reference agrees with itself: its float64 gold, its decode path "
            "and its attention implementations",
        }
    there = (trials.get("decode_path") or {}).get("engine_there")
    tail = ""
    if dp is not None and there is not None:
        tail = (
            f"; where the decode path departs, the engine {'agrees' if there['agrees'] else 'disagrees'} with it "
            f"(rel error {_g(there['rel_error'])})"
        )
    return {
        "suspect": "both",
        "sentence": f"the engine departs ({located['short']}, {located['token']}) and "
        f"the reference disagrees with itself ({_ref_words(dp, at, gold)}){tail}",
    }


def _ref_words(dp, at, gold) -> str:
    parts = []
    if dp is not None:
        parts.append(
            f"its decode path departs from its teacher-forced pass at {dp['short']}, {dp['token']}: "
            f"rel error {_g(dp['rel_error'])}, {_g(dp['ratio'])}x the floor"
        )
    if at is not None:
        parts.append(f"its attention implementations depart at {at['short']}, {at['token']}")
    return "; ".join(parts)


def _state_words(mamba: dict) -> str:
    """What the step that computed the position read as its state, and who wrote it (built-in engine)."""
    step = mamba.get("step") or {}
    if "state_read_offset" not in step:  # an engine that does not say where it read its state (vLLM)
        return ": the state is not this request's" + (
            f" (step {step['step']}, {step['phase']} on slot {step['state_slot']})" if step else ""
        )
    if step.get("state_read_offset") is None:
        return (
            f": step {step['step']} ({step['phase']}, tokens {step['first_position']}..{step['last_position']}) "
            f"read no state and started from zeros, where the reference carries the state of the tokens before it"
        )
    writers = [w for w in step.get("state_last_written_by") or [] if w]
    prev = mamba.get("previous_step")
    if (
        prev
        and mamba.get("previous_state_out_agreed")
        and prev.get("state_write_offset") == step.get("state_read_offset")
        and {w["step"] for w in writers} == {prev["step"]}
    ):  # its own last write, right where it read, was right: the state changed between the write and the read
        e, r = mamba["engine_state_norm"], mamba["reference_state_norm"]
        same_norm = r > 0 and abs(e - r) <= 1e-4 * r
        return (
            f": step {step['step']} ({step['phase']} on slot {step['state_slot']}) read back the state its own "
            f"previous step ({prev['phase']}, step {prev['step']}) wrote at the same offset, which agreed with the "
            f"reference (rel error {_g(mamba['previous_state_out_rel_error'])}): the state changed between the "
            f"write and the read" + (" (its norm unchanged: the same numbers in another layout)" if same_norm else "")
        )
    who = ", ".join(f"{w['request_id']} at step {w['step']}" for w in writers) or "nobody (never written: zeros)"
    words = (
        f": the state is not this request's: step {step['step']} ({step['phase']} on slot {step['state_slot']}) "
        f"read it at element offset {step['state_read_offset']}, last written by {who}"
    )
    if (
        prev
        and prev.get("state_write_offset") != step.get("state_read_offset")
        and prev.get("state_write_offset") is not None
    ):
        stride = mamba.get("slot_stride")
        inside = f" (inside slot {prev['state_write_offset'] // stride})" if stride else ""
        words += (
            f"; its previous step ({prev['phase']}, step {prev['step']}) wrote its final state at offset "
            f"{prev['state_write_offset']}{inside} instead"
        )
    return words


def _sentence(out, prompt_len: int) -> tuple[str, str]:
    """(the finding in one sentence, the numbers and the verdict behind it)."""
    loc, mamba, inp, verdict = out["located"], out["mamba"], out["input"], out["verdict"]
    suspect = verdict["suspect"]
    if loc is None:
        return f"Nothing departs beyond its floor; suspect: {suspect} ({verdict['sentence']}).", verdict["sentence"]
    head = (
        f"the first departure is {loc['short']} at {loc['token']}: rel error {_g(loc['rel_error'])}, "
        f"{_g(loc['ratio'])}x its floor"
        + (f" (at the same token also {', '.join(loc['also'])})" if loc.get("also") else "")
    )
    details = f"{head[0].upper()}{head[1:]}; {verdict['sentence']}."
    if mamba is not None and mamba["input_state"] == "differed":
        which = (
            "input state"
            if len(mamba["differed_parts"]) == 2
            else (
                "input SSM state" if mamba["differed_parts"] == ["ssm"] else "input conv state (its SSM state agreed)"
            )
        )
        return (
            f"{mamba.get('kind', 'Mamba')} layer {mamba['layer']}'s {which} at {mamba['start_token']} already differed (engine state "
            f"norm {_g(mamba['engine_state_norm'])}, reference {_g(mamba['reference_state_norm'])})"
            f"{_state_words(mamba)}; suspect: {suspect}."
        ), details
    if mamba is not None:
        return (
            f"In {mamba.get('kind', 'Mamba')} layer {mamba['layer']} {head}, while its input state at {mamba['start_token']} agreed "
            f"(rel error {_g(mamba['state_in_rel_error'])}): the layer computed wrong from the right input; "
            f"suspect: {suspect}."
        ), details
    extra = ""
    if inp is not None:
        extra = (
            f", its input ({_short(inp['op'])}) {'agreeing' if inp['agreed'] else 'already differing'} there "
            f"(rel error {_g(inp['rel_error'])})"
        )
        if inp["agreed"] and loc["name"] in LINEAR_OPS:
            extra += ": a linear op computes another function of the same input (its weights or its matmul differ)"
    return f"{head[0].upper()}{head[1:]}{extra}; suspect: {suspect}.", details
