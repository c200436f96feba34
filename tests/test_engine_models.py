"""The engine's own model implementations against the HF models they re-implement.

Each case drives `lpf.builtin.models` as the model runner does (packed batches, one ForwardContext per
step, paged KV blocks, state slots) and compares the log-probabilities at every position with HF's
teacher-forced forward of the whole sequence:
(a) one-step prefill; (b) chunked prefill (prefill + odd-sized extends) then 1-token decodes;
(c) prefill, extend and decodes of four requests packed into the same steps, non-contiguous blocks;
(d) a reused slot and reused KV blocks, never zeroed: the new prefill must ignore the old state.

Float32 against HF float32: max |logprob diff| <= 1e-4. The exceptions are tiny:hybrid (initializer
range 0.25, attention_multiplier 1.0: attention scores ~150) and tiny:qwen35 (Gated DeltaNet; HF's own
float32 forward is up to ~3.4e-4 from its float64 one, and HF computes the GDN rule in float32 even
for a float64 model), so ill-conditioned that HF's
own float32 forward is up to ~2e-4 away from exact arithmetic on these sequences; there the bound is
5e-4 and exactness is shown in float64 instead: every engine path (chunks, extends, batched decodes,
reused slots) equals the engine's own one-step prefill to 1e-9, and a one-step prefill equals HF.
"""

from __future__ import annotations

import pytest
import torch

from lpf.builtin.forward_context import ForwardContext, SeqMeta, get_forward_context, set_forward_context
from lpf.builtin.kv_cache import KVCache
from lpf.builtin.state_cache import StateCache
from lpf.core.errors import LpfError

BLOCK = 4
TOL = 1e-4
TOL_F32 = {"hybrid": 5e-4, "qwen35": 5e-4}  # see the module docstring
TOL_F64_PATHS = 1e-9


def _spread_mamba_constants(model):
    """HF initialises D and dt bias to constants; spread them so every parameter is exercised."""
    with torch.no_grad():
        for layer in model.model.layers:
            mixer = getattr(layer, "mamba", None)
            if mixer is not None:
                mixer.D.uniform_(0.5, 1.5)
                bias = mixer.dt_bias if hasattr(mixer, "dt_bias") else mixer.dt_proj.bias
                bias.uniform_(-2.0, 0.5)


def _jamba_dir(root):
    from transformers import JambaConfig, JambaForCausalLM

    cfg = JambaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        num_experts=2,
        num_experts_per_tok=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        use_mamba_kernels=False,
        initializer_range=0.25,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(1)
    model = JambaForCausalLM(cfg)
    _spread_mamba_constants(model)
    model.save_pretrained(root / "jamba")
    return root / "jamba"


def _granite_moe_dir(root):
    """GraniteMoeHybrid with what the zoo model lacks: experts, RoPE, GQA, 2 SSM groups, multipliers."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(
        vocab_size=512,
        hidden_size=64,
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        shared_intermediate_size=96,
        num_local_experts=3,
        num_experts_per_tok=2,
        position_embedding_type="rope",
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_n_groups=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_chunk_size=8,
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.15,
        logits_scaling=1.5,
        initializer_range=0.25,
        tie_word_embeddings=True,
    )
    torch.manual_seed(2)
    model = GraniteMoeHybridForCausalLM(cfg)
    _spread_mamba_constants(model)
    model.save_pretrained(root / "granite-moe")
    return root / "granite-moe"


# --- a minimal model runner ---------------------------------------------------------------------


class Req:
    def __init__(self, tokens, slot, blocks):
        self.tokens, self.slot, self.blocks = tokens, slot, blocks
        self.computed = 0
        self.logprobs = {}  # position -> logprob row predicting the next token

    def rows(self) -> torch.Tensor:
        return torch.stack([self.logprobs[p] for p in range(self.computed)])


class Driver:
    """Packs the scheduled requests of a step and runs one forward, as the model runner does."""

    def __init__(self, model, dtype=torch.float32, num_slots=8, num_blocks=128):
        n_attn, n_kv, head_dim = model.kv_spec()
        self.model = model
        self.kv = KVCache(n_attn, num_blocks, BLOCK, n_kv, head_dim, dtype=dtype)
        self.state = StateCache(model.state_specs(), num_slots=num_slots, dtype=dtype)
        self.step_no = 0

    def step(self, items):
        """items: (req, n_tokens, phase) scheduled together in this step."""
        ids, pos, seqs, start = [], [], [], 0
        for req, n, phase in items:
            ids += req.tokens[req.computed : req.computed + n]
            pos += range(req.computed, req.computed + n)
            seqs.append(SeqMeta(f"r{id(req)}", start, n, req.computed, phase, req.slot, req.blocks))
            start += n
        ctx = ForwardContext(self.step_no, seqs, self.kv, self.state)
        with torch.inference_mode(), set_forward_context(ctx):
            hidden = self.model(torch.tensor(ids), torch.tensor(pos))
            logprobs = self.model.compute_logits(hidden).log_softmax(-1)
        for (req, n, _), s in zip(items, seqs):
            for i in range(n):
                req.logprobs[req.computed + i] = logprobs[s.start + i]
            req.computed += n
        self.step_no += 1


def _tokens(seed, n, vocab=512):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# --- the cases (each returns the requests whose every position is compared) -------------------


def case_prefill(drv):
    req = Req(_tokens(0, 37), slot=3, blocks=list(range(20, 30)))
    drv.step([(req, 37, "prefill")])
    return [req]


def case_chunked(drv):
    req = Req(_tokens(1, 33), slot=5, blocks=[7, 2, 11, 30, 4, 9, 40, 41, 42])
    for n, phase in [(12, "prefill"), (5, "extend"), (7, "extend"), (3, "extend")] + [(1, "decode")] * 6:
        drv.step([(req, n, phase)])
    return [req]


def case_mixed(drv):
    a = Req(_tokens(2, 30), slot=6, blocks=[13, 5, 27, 8, 19, 33, 34, 35])
    b = Req(_tokens(3, 24), slot=1, blocks=[3, 21, 12, 44, 45, 46, 47])
    c = Req(_tokens(4, 18), slot=4, blocks=[50, 0, 16, 17, 60])
    d = Req(_tokens(5, 12), slot=7, blocks=[61, 62, 63, 59])
    drv.step([(a, 9, "prefill"), (b, 15, "prefill"), (d, 7, "prefill")])
    # prefill + extend + two decodes of different lengths in one step, decodes packed in between
    drv.step([(c, 11, "prefill"), (b, 1, "decode"), (a, 6, "extend"), (d, 1, "decode")])
    for _ in range(4):
        drv.step([(b, 1, "decode"), (c, 1, "decode"), (a, 1, "decode"), (d, 1, "decode")])
    drv.step([(c, 3, "extend"), (a, 1, "decode")])
    return [a, b, c, d]


def case_reused_slot(drv):
    old = Req(_tokens(6, 20), slot=2, blocks=[10, 11, 12, 13, 14, 15])
    drv.step([(old, 17, "prefill")])
    for _ in range(3):
        drv.step([(old, 1, "decode")])
    assert drv.state.buffer.abs().sum() > 0
    new = Req(_tokens(7, 26), slot=2, blocks=[15, 14, 13, 12, 11, 10, 9])  # same slot and blocks, not zeroed
    drv.step([(new, 9, "prefill")])
    drv.step([(new, 10, "extend")])
    for _ in range(7):
        drv.step([(new, 1, "decode")])
    return [new]


CASES = {"prefill": case_prefill, "chunked": case_chunked, "mixed": case_mixed, "reused-slot": case_reused_slot}
MODELS = ["hybrid", "jamba", "granite-moe", "qwen35"]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP barriers
    made single small ops take tens of milliseconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Per model: the engine models (float32/64), the HF model, and every case's requests in both dtypes."""
    from transformers import AutoModelForCausalLM

    from lpf.builtin.models import load_model
    from lpf.core.model_specs import resolve_model

    root = tmp_path_factory.mktemp("engine-models")
    out = {}
    for name in MODELS:
        path = {
            "hybrid": lambda: resolve_model("tiny:hybrid").path,
            "jamba": lambda: _jamba_dir(root),
            "granite-moe": lambda: _granite_moe_dir(root),
            "qwen35": lambda: resolve_model("tiny:qwen35").path,
        }[name]()
        m32, m64 = load_model(path), load_model(path, dtype=torch.float64)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        runs = {c: (fn(Driver(m32)), fn(Driver(m64, torch.float64))) for c, fn in CASES.items()}
        out[name] = dict(m32=m32, m64=m64, hf=hf, runs=runs)
    return out


def _hf_logprobs(hf, req):
    with torch.no_grad():
        return hf(torch.tensor([req.tokens[: req.computed]])).logits[0].float().log_softmax(-1)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", MODELS)
def test_float32_matches_hf(results, name, case):
    r = results[name]
    diffs = [(req.rows() - _hf_logprobs(r["hf"], req)).abs().max().item() for req in r["runs"][case][0]]
    assert max(diffs) <= TOL_F32.get(name, TOL), diffs


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", MODELS)
def test_float64_every_path_equals_a_one_step_prefill(results, name, case):
    """Chunking, extends, batched decodes and slot reuse change nothing but rounding."""
    r = results[name]
    for req in r["runs"][case][1]:
        one = Req(req.tokens[: req.computed], slot=0, blocks=list(range(100, 128)))
        Driver(r["m64"], torch.float64).step([(one, req.computed, "prefill")])
        assert (req.rows() - one.rows()).abs().max().item() <= TOL_F64_PATHS


@pytest.mark.parametrize("name", MODELS)
def test_one_step_prefill_matches_hf_float64(results, name):
    """The float64 anchor for the test above. HF keeps some float32 islands (norms, the SSD scan) even
    in float64, so this agrees only to about float32 precision times the model's conditioning."""
    from transformers import AutoModelForCausalLM

    r = results[name]
    hf64 = AutoModelForCausalLM.from_pretrained(
        r["hf"].name_or_path, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    req = r["runs"]["prefill"][1][0]
    with torch.no_grad():
        ref = hf64(torch.tensor([req.tokens])).logits[0].log_softmax(-1)
    assert (req.rows() - ref).abs().max().item() <= TOL_F32.get(name, TOL)


def test_decode_reads_whatever_the_slot_holds(results):
    """A brand-new request run as decode (the stale-state drill) must see the slot's old state."""
    model = results["hybrid"]["m32"]
    drv = Driver(model)
    old = Req(_tokens(8, 15), slot=0, blocks=[1, 2, 3, 4])
    drv.step([(old, 15, "prefill")])
    fresh_on_used = Req(_tokens(9, 5), slot=0, blocks=[5, 6])
    drv.step([(fresh_on_used, 1, "decode")])
    fresh_on_clean = Req(_tokens(9, 5), slot=0, blocks=[5, 6])
    Driver(model).step([(fresh_on_clean, 1, "decode")])
    assert (fresh_on_used.logprobs[0] - fresh_on_clean.logprobs[0]).abs().max() > 1e-3
    prefill_on_used = Req(_tokens(9, 5), slot=0, blocks=[5, 6])
    drv.step([(prefill_on_used, 1, "prefill")])
    torch.testing.assert_close(prefill_on_used.logprobs[0], fresh_on_clean.logprobs[0])  # zero initial state


@pytest.mark.parametrize("name", MODELS)
def test_chunks_of_one_step_run_together_as_they_would_one_at_a_time(results, name):
    """Several prefill/extend chunks in one step run as one padded batch (mamba_base `_together`):
    the same logprobs and the same states left in every slot as the chunks one step each, in float64
    up to rounding. A chunk that reads the slot an earlier chunk of its step wrote (a slot handed out
    twice) runs one at a time: it reads what that chunk wrote, as it would in a step of its own."""
    model = results[name]["m64"]

    def run(schedule):
        drv = Driver(model, torch.float64)
        reqs = {
            "a": Req(_tokens(20, 30), slot=1, blocks=list(range(0, 10))),
            "b": Req(_tokens(21, 24), slot=2, blocks=list(range(10, 20))),
            "c": Req(_tokens(22, 8), slot=5, blocks=list(range(20, 30))),
            "d": Req(_tokens(23, 19), slot=1, blocks=list(range(30, 40))),  # a's slot, handed out again
        }
        for step in schedule:
            drv.step([(reqs[k], n, phase) for k, n, phase in step])
        return reqs, drv.state.buffer.clone()

    first = [("a", 9, "prefill"), ("b", 15, "prefill"), ("c", 3, "prefill")]
    second = [("c", 5, "extend"), ("a", 12, "extend"), ("b", 1, "decode")]
    together, state = run([first, second])
    alone, state_alone = run([[x] for x in first] + [[x] for x in second])
    for k in "abc":
        assert (together[k].rows() - alone[k].rows()).abs().max().item() <= TOL_F64_PATHS
    assert (state - state_alone).abs().max().item() <= TOL_F64_PATHS

    # d prefills into a's slot, then a extends from it in the same step: a reads d's state
    shared, _ = run([[("a", 9, "prefill")], [("d", 7, "prefill"), ("a", 6, "extend")]])
    ordered, _ = run([[("a", 9, "prefill")], [("d", 7, "prefill")], [("a", 6, "extend")]])
    rows = slice(9, 15)
    assert (shared["a"].rows()[rows] - ordered["a"].rows()[rows]).abs().max().item() <= TOL_F64_PATHS
    clean, _ = run([[("a", 9, "prefill")], [("a", 6, "extend")]])
    assert (shared["a"].rows()[rows] - clean["a"].rows()[rows]).abs().max().item() > 1e-6


@pytest.mark.parametrize("name", MODELS)
def test_specs(results, name):
    model, cfg = results[name]["m32"], results[name]["hf"].config
    specs, (n_attn, n_kv, head_dim) = model.state_specs(), model.kv_spec()
    kinds = list(cfg.layer_types)
    assert len(specs) == kinds.count("linear_attention") and n_attn == kinds.count("full_attention")
    assert n_kv == cfg.num_key_value_heads
    assert head_dim == (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    assert [part for part, _ in specs[0]] == ["conv", "ssm"]
    d_conv = getattr(cfg, "linear_conv_kernel_dim", None) or cfg.mamba_d_conv
    assert specs[0][0][1][1] == d_conv - 1
    if name == "qwen35":  # the delta-rule memory: a [d_k, d_v] matrix per value head
        assert specs[0][1][1] == (cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim)
    assert model.vocab_size == cfg.vocab_size and model.eos_token_id == cfg.eos_token_id
    assert model.config.architectures == cfg.architectures


def test_forward_outside_a_context_raises(results):
    model = results["hybrid"]["m32"]
    with pytest.raises(RuntimeError, match="no forward context"):
        get_forward_context()
    with pytest.raises(RuntimeError, match="no forward context"), torch.inference_mode():
        model(torch.tensor([5, 6]), torch.tensor([0, 1]))


def test_unsupported_architecture():
    from lpf.builtin.models import load_model
    from lpf.core.model_specs import resolve_model

    with pytest.raises(
        LpfError,
        match="runs GraniteMoeHybrid, Jamba, Qwen3.5 and Kimi Linear \\(KDA\\) models; LlamaForCausalLM is not supported",
    ):
        load_model(resolve_model("tiny:llama").path)
