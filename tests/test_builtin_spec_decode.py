"""Speculative decoding in the built-in engine (n-gram drafts, one verify pass, the rejection sampler,
the Mamba state rolled back to the last accepted position), engine level, no reference, no CLI:

- clean and greedy, a speculative run equals the plain run on a trained zoo hybrid (tokens identical,
  logprobs within 1e-4), with prefix caching off and on, while drafts are really accepted and rejected;
- the rejection sampler keeps the output distribution exactly (chi-square goodness of fit against p for
  the first emitted token and for the token after an accepted draft, with a one-hot and a spread draft
  distribution; the same statistic rejects a sampler that keeps every draft, so the test has power);
- sampled at temperature 1, the speculative engine's per-position token frequencies match the plain
  engine's (two-sample chi-square, independent seeds), with drafts accepted and rejected in the run;
- the draft-model proposer (-E speculative=draft:zoo:llama:K) gives the plain run's greedy tokens and keeps
  the sampled distribution the same way;
- spec-draft-probs-permuted (slow) fires only for sampled requests in batches of more than 2 sequences;
- the knob is refused in one line when malformed, and a drill without speculation is refused too.
"""

import json
import math
import tempfile
from collections import Counter

import numpy as np
import pyarrow as pa
import pytest
import torch

from lpf.adapters.builtin import BuiltinEngine, BuiltinOptions
from lpf.analysis.speculative_features import spec_features
from lpf.builtin.drill_truth import EXPECTED
from lpf.builtin.sched_output import ScheduledRequest
from lpf.builtin.speculative_propose import ngram_drafts
from lpf.builtin.speculative_sampler import verify_tokens
from lpf.core.model_specs import load_tokenizer, resolve_model
from lpf.core.sampling import SamplingParams
from lpf.core.workload import expand, load_prompts
from lpf.zoo import registry

MODEL = "zoo:hybrid"


def run(items, n=1, temperature=0.0, seed=0, max_tokens=24, model=MODEL, faults=False, **options):
    """(completions by id, trace[, faults]) of `items` on the built-in engine, as `lpf run` drives it."""
    ref = resolve_model(model)
    tok = load_tokenizer(ref)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("".join(json.dumps(i) + "\n" for i in items))
    prompts, _ = load_prompts(f.name, tok, len(tok), None)
    engine = BuiltinEngine(ref, sampling, BuiltinOptions.parse(options))
    done = {c.request_id: c for c in engine.generate(expand(prompts, n, sampling))}
    sides = engine.side_tables()
    return (done, sides["trace"], sides["faults"]) if faults else (done, sides["trace"])


def chi2_sf(x: float, dof: int) -> float:
    """Upper tail of the chi-square distribution (Wilson-Hilferty; ample for a 1e-3 threshold)."""
    if dof <= 0:
        return 1.0
    z = ((x / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def gof(counts: Counter, p: torch.Tensor) -> float:
    """p-value of counts against probabilities p (categories with expected < 5 pooled)."""
    total = sum(counts.values())
    exp = (p * total).tolist()
    big = [i for i, e in enumerate(exp) if e >= 5]
    obs = [counts.get(i, 0) for i in big] + [total - sum(counts.get(i, 0) for i in big)]
    ex = [exp[i] for i in big] + [total - sum(exp[i] for i in big)]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, ex) if e > 1e-9)
    return chi2_sf(stat, len([e for e in ex if e > 1e-9]) - 1)


def two_sample(a: Counter, b: Counter) -> float:
    """p-value of a two-sample chi-square test of equal distributions (categories with < 10 in both pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    rest = (na - sum(a[k] for k in keys), nb - sum(b[k] for k in keys))
    rows = [(a[k], b[k]) for k in keys] + ([rest] if sum(rest) else [])
    stat = 0.0
    for x, y in rows:
        tot = x + y
        ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
    return chi2_sf(stat, len(rows) - 1)


def test_ngram_proposer_looks_up_the_longest_recurring_suffix():
    assert ngram_drafts([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]
    assert ngram_drafts([5, 1, 7, 4, 1], 2) == [7, 4]  # only a 1-gram recurs
    assert ngram_drafts([1, 2, 3], 4) == []


@pytest.fixture(scope="module")
def oracle():
    return registry.workload_items("oracle", n=24)


@pytest.mark.parametrize("caching", [False, True])
def test_greedy_speculation_equals_the_plain_run(oracle, caching):
    knobs = {"enable_prefix_caching": caching, "max_num_batched_tokens": 64}
    plain, _ = run(oracle, **knobs)
    spec, trace = run(oracle, speculative="ngram:4", **knobs)
    assert [spec[r].output_token_ids for r in plain] == [plain[r].output_token_ids for r in plain]
    worst = max(np.max(np.abs(np.subtract(spec[r].logprobs, plain[r].logprobs)), initial=0) for r in plain)
    assert worst <= 1e-4
    rows = [r for r in trace.to_pylist() if r["num_draft_tokens"]]
    drafted = sum(r["num_draft_tokens"] for r in rows)
    accepted = sum(r["num_accepted_tokens"] for r in rows)
    assert 0 < accepted < drafted  # drafts really kept, and some really rolled back
    rolled = [r for r in rows if r["num_accepted_tokens"] < r["num_draft_tokens"]]
    assert rolled and all(
        r["state_tokens_after_rollback"]
        == r["num_computed_tokens"] + 1 + r["num_accepted_tokens"]
        < r["state_tokens_before_rollback"]
        for r in rolled
    )
    assert {r["phase"] for r in rows} == {"verify"}
    assert sum(len(c.output_token_ids) for c in plain.values()) > len(rows)  # fewer steps than tokens


def _request(drafts, seed, temperature=1.0):
    return ScheduledRequest(
        request_id="r",
        token_ids=[0, *drafts],
        num_computed_tokens=5,
        state_slot=0,
        block_table=[0],
        slot_is_new=False,
        slot_reused=False,
        will_sample=True,
        output_position=3,
        sampling=SamplingParams(temperature=temperature),
        seed=seed,
        draft_token_ids=tuple(drafts),
    )


@pytest.mark.parametrize("spread", [False, True])
def test_rejection_sampler_keeps_the_target_distribution(spread):
    z = torch.tensor([[1.5, 0.2, -0.3, 0.9, 0.0, -1.0], [0.1, 1.2, 0.4, -0.5, 0.8, 0.3], [0.0] * 6])
    p0, p1 = z[0].softmax(-1), z[1].softmax(-1)
    q = None
    if spread:  # a draft model's distribution: the sampler must correct for it
        q = torch.tensor([[0.05, 0.05, 0.1, 0.6, 0.1, 0.1], [0.1, 0.1, 0.1, 0.1, 0.5, 0.1]])
    first, second, kept = Counter(), Counter(), 0
    g = torch.Generator().manual_seed(0)
    for seed in range(3000):
        # a draft model draws its drafts from q (the theorem's premise); n-gram drafts are fixed (q one-hot)
        drafts = [3, 4] if q is None else [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        tokens, a = verify_tokens(z, _request(drafts, seed), q)
        first[tokens[0]] += 1
        if a >= 1 and drafts[0] == 3:  # the token after an accepted draft 3: drawn from row 1
            second[tokens[1]] += 1
        kept += a
    assert 0 < kept < 2 * 3000
    assert gof(first, p0) > 1e-3 and gof(second, p1) > 1e-3
    keep_all = Counter({3: 3000})  # what a sampler that never rejects would emit first
    assert gof(keep_all, p0) < 1e-6


def test_greedy_rejection_sampler_keeps_the_argmax_prefix():
    z = torch.tensor([[0.0, 3.0, 0.0], [0.0, 0.0, 3.0], [3.0, 0.0, 0.0]])
    assert verify_tokens(z, _request([1, 2], 0, temperature=0.0)) == ([1, 2, 0], 2)
    assert verify_tokens(z, _request([1, 0], 0, temperature=0.0)) == ([1, 2], 1)
    assert verify_tokens(z, _request([2, 2], 0, temperature=0.0)) == ([1], 0)


@pytest.mark.slow  # a few seconds: out of make test-fast's 90 s (it runs in make test)
def test_sampled_speculation_keeps_the_plain_engines_distribution():
    # one copy prompt (drafts from the prompt are accepted often, not always) sampled 240 times each way
    items = [{"id": "copy", "prompt": "C:AB3AB3AB3AB=", "expected": "AB3AB3AB3AB"}]
    plain, _ = run(items, n=240, temperature=1.0, seed=11, max_tokens=6, max_num_seqs=128, max_num_batched_tokens=512)
    spec, trace = run(
        items,
        n=240,
        temperature=1.0,
        seed=12,
        max_tokens=6,
        max_num_seqs=128,
        max_num_batched_tokens=512,
        speculative="ngram:3",
    )
    rows = [r for r in trace.to_pylist() if r["num_draft_tokens"]]
    accepted = sum(r["num_accepted_tokens"] for r in rows)
    assert 0 < accepted < sum(r["num_draft_tokens"] for r in rows)
    for pos in range(1, 6):
        a = Counter(c.output_token_ids[pos] for c in plain.values() if len(c.output_token_ids) > pos)
        b = Counter(c.output_token_ids[pos] for c in spec.values() if len(c.output_token_ids) > pos)
        assert two_sample(a, b) > 1e-3, pos


def test_greedy_draft_model_speculation_equals_the_plain_run(oracle):
    # zoo:llama (attention-only, the zoo's tokenizer) drafts for the zoo hybrid: its KV cache is cut back
    # to what each verify step kept
    plain, _ = run(oracle[:12], max_num_batched_tokens=64)
    spec, trace = run(oracle[:12], speculative="draft:zoo:llama:4", max_num_batched_tokens=64)
    assert [spec[r].output_token_ids for r in plain] == [plain[r].output_token_ids for r in plain]
    worst = max(np.max(np.abs(np.subtract(spec[r].logprobs, plain[r].logprobs)), initial=0) for r in plain)
    assert worst <= 1e-4
    rows = [r for r in trace.to_pylist() if r["num_draft_tokens"]]
    drafted, accepted = sum(r["num_draft_tokens"] for r in rows), sum(r["num_accepted_tokens"] for r in rows)
    # a trained draft of the same data agrees with the target most of the time (85% here; n-gram lookup ~60%)
    assert 0.5 < accepted / drafted < 1


@pytest.mark.slow  # 160 sampled requests drafted by a model (~10-30 s); the sampler's exactness with a spread q
# is test_rejection_sampler_keeps_the_target_distribution's (fast)
def test_sampled_draft_model_speculation_keeps_the_plain_engines_distribution():
    # the draft model's own distributions q (not one-hot): kept with min(1, p/q), else the residual
    # a recall prompt: the draft's and the target's distributions differ enough that drafts are rejected too
    items = [{"id": "recall", "prompt": "R:V78,Q59,C52,W88,O26,A52,S31,"}]
    knobs = {"n": 160, "temperature": 1.0, "max_tokens": 5, "max_num_seqs": 256, "max_num_batched_tokens": 2048}
    plain, _ = run(items, seed=21, **knobs)
    spec, trace = run(items, seed=22, speculative="draft:zoo:llama:3", **knobs)
    rows = [r for r in trace.to_pylist() if r["num_draft_tokens"]]
    accepted = sum(r["num_accepted_tokens"] for r in rows)
    assert 0 < accepted < sum(r["num_draft_tokens"] for r in rows)
    tested = 0
    for pos in range(1, 5):
        a = Counter(c.output_token_ids[pos] for c in plain.values() if len(c.output_token_ids) > pos)
        b = Counter(c.output_token_ids[pos] for c in spec.values() if len(c.output_token_ids) > pos)
        if min(sum(a.values()), sum(b.values())) >= 80:  # requests that stopped early leave a position thin
            assert two_sample(a, b) > 1e-3, pos
            tested += 1
    assert tested >= 2


def test_bad_speculative_knob_and_a_drill_without_it_are_refused_in_one_line():
    with pytest.raises(Exception, match="ngram:K"):
        BuiltinOptions.parse({"speculative": "eagle:3"})
    for bad in ("draft:4", "ngram:zoo:llama:4", "draft:zoo:llama:0"):
        with pytest.raises(Exception, match="draft:MODEL:K"):
            BuiltinOptions.parse({"speculative": bad})
    assert BuiltinOptions.parse({"speculative": "draft:zoo:llama:4"}).speculative == "draft:zoo:llama:4"
    with pytest.raises(Exception, match="speculative=ngram:K"):
        BuiltinOptions.parse({"inject": "spec-no-rollback"})
    with pytest.raises(Exception, match="needs a draft model's probabilities"):
        BuiltinOptions.parse({"inject": "spec-draft-probs-permuted", "speculative": "ngram:4"})


# each drill in the configuration that makes it fire (tiny:jamba-longmem: an untrained Jamba whose SSM
# state remembers far, so a state left at the wrong position shows in every later token)
DRILL_KNOBS = {
    # the zoo's addition prompts are 9 tokens with BOS: K = 8 makes them exactly 1 + K
    "spec-prefill-verify": {"speculative": "ngram:8"},
    # 8 sequences at a time: finished requests' rows are refilled, so the persistent batch is permuted
    "spec-accepted-permuted": {"speculative": "ngram:4", "max_num_seqs": 8},
    "spec-no-rollback": {"speculative": "ngram:4"},
}


@pytest.fixture(scope="module")
def longmem():
    items = registry.workload_items("oracle", n=48)
    return items, run(items, model="tiny:jamba-longmem", max_num_seqs=8)[0]


@pytest.mark.slow  # the drills end to end (~15-30 s together): out of `make test-fast`, as test_engine_drills
@pytest.mark.parametrize("drill", DRILL_KNOBS)
def test_each_spec_drill_corrupts_exactly_the_requests_its_ground_truth_names(longmem, drill):
    items, plain = longmem
    knobs = {"max_num_seqs": 8, **DRILL_KNOBS[drill], "inject": drill}
    got, trace, faults = run(items, model="tiny:jamba-longmem", faults=True, **knobs)
    assert faults is not None, f"{drill} never fired"
    rows = faults.to_pylist()
    assert {r["fault"] for r in rows} == {drill} and {r["role"] for r in rows} == {"corrupted"}
    truth = {r["request_id"] for r in rows}
    departed = {
        r
        for r, c in plain.items()
        if got[r].output_token_ids != c.output_token_ids
        or np.max(np.abs(np.subtract(got[r].logprobs, c.logprobs)), initial=0) > 1e-3
    }
    assert departed == truth
    # the trace names it: the drill's feature holds for exactly the requests its ground truth names
    # (spec-prefill-verify: every request whose prompt took the verify path, a superset: one that ends
    # on its first token never reads its slot)
    ids = list(got)
    requests = pa.table({"request_id": ids, "seq": list(range(len(ids)))})
    feats = {f.name: {ids[i] for i in np.flatnonzero(f.values)} for f in spec_features(requests, trace)}
    named = {"spec-prefill-verify": "prompt_on_verify_path"}.get(drill) or (
        "state_rolled_back_wrong" if drill == "spec-accepted-permuted" else "state_kept_rejected_drafts"
    )
    assert truth <= feats[named] if drill == "spec-prefill-verify" else truth == feats[named]
    assert EXPECTED[drill]["corrupted"] == {named}


def two_turns(model, inject="", n=36, task=None):
    """Turn 1 decodes past Mamba boundaries with speculation and prefix caching on; turn 2 resends each
    prompt + 20 of its outputs on the same engine, so it resumes from checkpoints turn 1's verify steps
    saved. (turn 1's trace, turn 2's completions, trace and faults, a plain engine's turn 2)."""
    ref = resolve_model(model)
    tok = load_tokenizer(ref)
    sampling = SamplingParams(max_tokens=24, ignore_eos=True)

    def prompts_of(items):
        with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
            f.write("".join(json.dumps(i) + "\n" for i in items))
        return load_prompts(f.name, tok, len(tok), None)[0]

    first = [i for i in registry.workload_items("oracle", n=n) if task is None or i["task"] == task]
    knobs = {"enable_prefix_caching": True, "mamba_block_size": 16, "max_num_batched_tokens": 64}
    spec = BuiltinEngine(ref, sampling, BuiltinOptions.parse({**knobs, "speculative": "ngram:4", "inject": inject}))
    turn1 = {c.request_id: c for c in spec.generate(expand(prompts_of(first), 1, sampling))}
    second = [
        {
            "id": f"{p.prompt_id}-t2",
            "prompt_token_ids": [*p.prompt_token_ids, *turn1[f"{p.prompt_id}-r0"].output_token_ids[:20]],
        }
        for p in prompts_of(first)
    ]
    t1 = spec.side_tables()
    assert t1["faults"] is None  # turn 1 itself never reads a checkpoint it saved
    turn2 = {c.request_id: c for c in spec.generate(expand(prompts_of(second), 1, sampling))}
    t2 = spec.side_tables()
    plain = BuiltinEngine(ref, sampling, BuiltinOptions.parse({"max_num_batched_tokens": 64}))
    want = {c.request_id: c for c in plain.generate(expand(prompts_of(second), 1, sampling))}
    return t1["trace"].to_pylist(), turn2, t2["trace"].to_pylist(), t2["faults"], want


def test_checkpoints_saved_by_verify_steps_are_the_state_a_resume_needs():
    t1, turn2, trace, faults, want = two_turns(MODEL, task="copy")
    saved_by_verify = {
        r["request_id"]
        for r in t1
        if r["phase"] == "verify" and r["num_computed_tokens"] < 32 <= r["state_tokens_after_rollback"]
    }
    resumed = [r for r in trace if r["prefix_cache_hit_tokens"] and r["resume_covers_tokens"] == 32]
    assert faults is None and len(resumed) >= len(want) // 2  # most resumed from a boundary in turn 1's outputs
    assert sum(r["resume_writer"] in saved_by_verify for r in resumed) >= len(resumed) // 2
    assert [turn2[r].output_token_ids for r in want] == [want[r].output_token_ids for r in want]
    worst = max(np.max(np.abs(np.subtract(turn2[r].logprobs, want[r].logprobs)), initial=0) for r in want)
    assert worst <= 1e-4


@pytest.mark.slow  # two turns with prefix caching under the drill (~5-17 s): out of `make test-fast`
def test_spec_checkpoint_rejected_corrupts_exactly_the_resumes_its_ground_truth_names():
    _, turn2, trace, faults, want = two_turns("tiny:jamba-longmem", inject="spec-checkpoint-rejected", n=48)
    assert faults is not None, "no turn-2 request resumed from a checkpoint the drill saved wrong"
    rows = faults.to_pylist()
    assert {(r["fault"], r["role"]) for r in rows} == {("spec-checkpoint-rejected", "corrupted")}
    truth = {r["request_id"] for r in rows}
    departed = {
        r
        for r in want
        if turn2[r].output_token_ids != want[r].output_token_ids
        or np.max(np.abs(np.subtract(turn2[r].logprobs, want[r].logprobs)), initial=0) > 1e-3
    }
    assert departed == truth
    # the trace shows it: each resumed from a state covering more tokens than its hit, by its publisher
    overshot = {
        r["request_id"]
        for r in trace
        if r["prefix_cache_hit_tokens"] and r["resume_covers_tokens"] > r["prefix_cache_hit_tokens"]
    }
    assert truth <= overshot


def test_a_tight_step_budget_verifies_fewer_drafts(oracle):
    # (without chunked prefill a request needing more than one step's budget is refused at admission,
    # and drafts never exceed max_tokens: a verify step then always fits)
    items = oracle[:8]
    knobs = {"max_num_batched_tokens": 16, "max_num_seqs": 8}
    plain, _ = run(items, **knobs)
    spec, trace = run(items, speculative="ngram:8", **knobs)
    assert [spec[r].output_token_ids for r in plain] == [plain[r].output_token_ids for r in plain]
    rows = trace.to_pylist()
    steps = {}
    for r in rows:
        steps[r["step"]] = steps.get(r["step"], 0) + r["num_scheduled_tokens"]
    assert max(steps.values()) <= 16 and any(r["num_draft_tokens"] for r in rows)
    assert any(0 < r["num_draft_tokens"] < 8 and steps[r["step"]] == 16 for r in rows)  # cut to fit


@pytest.mark.slow  # a draft model beside an untrained Jamba, 6 runs (~2-4 min on 2 loaded cores): out of test-fast
def test_spec_draft_probs_permuted_corrupts_only_sampled_requests_verified_in_batches_over_two():
    # tiny:jamba-longmem's spread distributions let another request's draft probabilities show in the tokens
    items = registry.workload_items("oracle", n=30)
    knobs = {"model": "tiny:jamba-longmem", "max_num_batched_tokens": 256, "seed": 5}
    spec = {**knobs, "speculative": "draft:zoo:llama:4"}
    drill = {**spec, "inject": "spec-draft-probs-permuted"}
    few = {"n": 1, "max_tokens": 8}
    # greedy verification never reads the draft probabilities: the drill changes nothing
    plain, _ = run(items[:12], max_num_seqs=8, **knobs, **few)
    got, _, faults = run(items[:12], max_num_seqs=8, faults=True, **drill, **few)
    assert faults is None and all(got[r].output_token_ids == c.output_token_ids for r, c in plain.items())
    # two sequences at a time: a leaver's row is refilled by the other one, the order never changes
    honest2, _ = run(items[:12], max_num_seqs=2, temperature=1.0, **spec, **few)
    got2, _, faults2 = run(items[:12], max_num_seqs=2, temperature=1.0, faults=True, **drill, **few)
    assert faults2 is None and all(got2[r].output_token_ids == c.output_token_ids for r, c in honest2.items())
    many = {"n": 4, "max_tokens": 12}
    # sampled, 8 at a time: the requests the ground truth names are the sampled ones verified in a step
    # beside 2 or more other speculating requests (the feature holds for each), and their tokens follow
    # another distribution than the target's: less probable under it than the honest run's
    honest, _ = run(items, max_num_seqs=8, temperature=1.0, **spec, **many)
    bad, trace, faults8 = run(items, max_num_seqs=8, temperature=1.0, faults=True, **drill, **many)
    assert faults8 is not None
    events = faults8.to_pylist()
    truth = {r["request_id"] for r in events if r["role"] == "corrupted"}  # tokens other than its own q gives
    exposed = {r["request_id"] for r in events}
    assert truth and exposed - truth, "some exposed steps drew exactly what the request's own q draws"
    assert all("its own give" in r["detail"] for r in events if r["role"] == "corrupted")
    ids = list(bad)
    requests = pa.table({"request_id": ids, "seq": list(range(len(ids)))})
    feats = {f.name: {ids[i] for i in np.flatnonzero(f.values)} for f in spec_features(requests, trace)}
    assert exposed <= feats["sampled_spec_batch_over_2"]
    assert EXPECTED["spec-draft-probs-permuted"]["corrupted"] == {
        "spec_decision_against_odds",
        "sampled_spec_batch_over_2",
    }
    # the trace carries what the decision test reads: every sampled verify row's drafts and their q
    verify = [r for r in trace.to_pylist() if r["num_draft_tokens"] and r["spec_sampled"]]
    assert verify and all(
        len(r["draft_token_ids"]) == len(r["draft_token_probs"]) == r["num_draft_tokens"] for r in verify
    )
    assert all(0 < q <= 1 for r in verify for q in r["draft_token_probs"])

    def mean_lp(done):
        lp = np.array([x for r in truth for x in done[r].logprobs])
        return lp.mean(), lp.std() / math.sqrt(len(lp))

    (m_bad, se_bad), (m_ok, se_ok) = mean_lp(bad), mean_lp(honest)
    assert (m_ok - m_bad) / math.hypot(se_bad, se_ok) > 3
