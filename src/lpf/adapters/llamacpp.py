"""`llamacpp` engine: llama.cpp's `llama-server`, started by lpf on a GGUF of the model or reached at --base-url.

Without `--base-url`, lpf exports the model (a directory, zoo: or tiny: name) to GGUF with llama.cpp's
own converter at `--dtype` (default float32; f16, bf16, q8_0 and llama-quantize's q4_k_m ... types:
`llamacpp_gguf.DTYPES`), cached by content, or takes `-E gguf=FILE` (its header gives the dtype), and
starts one `llama-server` on 127.0.0.1 at a free port with the knobs below (`llamacpp_server`);
`close()` stops it. With `--base-url` it talks to a server the user started: `--dtype` then is what
the user says the server holds (unknown when not given: the analysis takes the most lenient floor
measured and says so), and the knobs that configure a server are refused. Either way each request is
one `POST /completion` with token ids (`llamacpp_wire`: every sampler set explicitly, raw logprobs
with top-k ids), sent `concurrency` at a time (default twice the parallel slots).

Knobs are llama-server's own, as typed fields (`lpf engines llamacpp`): parallel slots (-np), total
context (-c; each slot gets ctx_size / parallel, rounded to 256), cache_prompt, batch and ubatch
sizes, threads, the KV cache's types (default: the dtype's float type, so a float32 run keeps its KV in
f32; quantized GGUFs keep llama.cpp's f16), flash attention (default off for float32: llama.cpp runs
it on f16 copies of an f32 KV cache; on when the V cache is quantized, which llama.cpp computes only
with flash attention, and `-E flash_attn=off` with one is refused in one line; llama.cpp's auto
otherwise; `flash_attention()` says which and why), the unified KV buffer, the
host-memory prompt cache (cache_ram), context checkpoints, continuous batching, slot prompt similarity, and
`extra_args` passed as given. `--ignore-eos` is refused unless `-E ban_eos=true`: llama-server's
ignore_eos bans end-of-generation tokens (a -inf logit bias, tools/server/server-schema.cpp) where
lpf's other engines generate past them, so a greedy run would flag every banned EOS as a flip.

The trace (`side_tables()["trace"]`): one row per answered request, lpf's trace columns where they fit
(`step`: the order the server answered in, which within one slot is the order the slot served
requests; `phase` prefill, or extend when part of the prompt came from the slot's cache;
`num_computed_tokens` = timings.cache_n; `num_scheduled_tokens` = timings.prompt_n; `state_slot` =
id_slot; `preempted` false; batch columns null: the server does not say) and llama.cpp's own after
them (`LLAMACPP_COLUMNS`); of lpf's prefix-cache columns it fills `prefix_cache_hit_tokens` = cache_n
(which the prefix-cache feature reads), the rest null (the server does not say).
`describe()` records the GGUF (path, dtype, content key, the vocabulary check, tensor types), the
server's command line and build, its /props, and the dtype the run is judged at.
"""

from __future__ import annotations

import json
import shlex
import threading
from typing import Any, Literal

import pyarrow as pa
from pydantic import Field, model_validator

from lpf.adapters import llamacpp_gguf as gguf_files
from lpf.adapters import llamacpp_wire as wire
from lpf.adapters.remote import RemoteEngine, RemoteOptions
from lpf.adapters.token_map import TokenMap
from lpf.core.errors import LpfError
from lpf.core.knobs import knob
from lpf.core.workload import EngineRequest
from lpf.run.schema import PREFIX_TRACE, TRACE

DTYPE = Literal["float32", "float16", "bfloat16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_k_s", "q4_0"]
KV_TYPE = Literal["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"]
LLAMACPP_COLUMNS = [
    ("num_prompt_tokens", pa.int32()),
    ("predicted_n", pa.int32()),
    ("tokens_cached", pa.int32()),
    ("prompt_ms", pa.float64()),
    ("predicted_ms", pa.float64()),
]
TRACE_SCHEMA = pa.schema(list(TRACE) + [pa.field(n, t) for n, t in LLAMACPP_COLUMNS])
# knobs that configure a server lpf starts; refused with --base-url (the user's server has its own)
SERVER_KNOBS = (
    "gguf",
    "parallel",
    "ctx_size",
    "batch_size",
    "ubatch_size",
    "threads",
    "threads_batch",
    "cache_type_k",
    "cache_type_v",
    "kv_unified",
    "cache_ram",
    "ctx_checkpoints",
    "cont_batching",
    "flash_attn",
    "slot_prompt_similarity",
    "extra_args",
)
QUANTIZED_KV = frozenset({"q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"})
SLOT_CTX_CAP = 4096  # default context per slot: the model's own, at most this (KV for 2^20 positions is GiBs)


class LlamaCppOptions(RemoteOptions):
    base_url: str = Field("", description="a llama-server the user started (http://HOST:PORT); empty: lpf starts one")
    dtype: DTYPE | None = knob(
        None,
        help="GGUF type: what lpf converts to (default float32), what -E gguf= holds, or "
        "what a --base-url server serves (unknown if not given)",
        shrink_order=130,
    )
    gguf: str = Field(
        "", description="serve this GGUF file instead of converting the model (its header gives the dtype)"
    )
    parallel: int = knob(
        1,
        ge=1,
        le=256,
        help="llama-server -np: parallel slots (each with its own state)",
        roles=("concurrency",),
        shrink_order=50,
    )
    ctx_size: int | None = knob(
        None,
        ge=256,
        help="llama-server -c: context over all slots (default: parallel x min(model's, 4096))",
        roles=("cache_size",),
        shrink_order=10,
    )
    cache_prompt: bool = Field(True, description="reuse a slot's cached prompt prefix (cache_prompt per request)")
    batch_size: int | None = knob(
        None,
        ge=1,
        help="llama-server -b: logical batch (tokens per decode call)",
        roles=("step_budget",),
        shrink_order=60,
    )
    ubatch_size: int | None = knob(
        None,
        ge=1,
        help="llama-server -ub: physical batch (tokens per compute pass)",
        roles=("step_budget",),
        shrink_order=65,
    )
    threads: int | None = Field(None, ge=1, description="llama-server -t: generation threads (default: llama.cpp's)")
    threads_batch: int | None = Field(None, ge=1, description="llama-server -tb: prompt-processing threads")
    cache_type_k: KV_TYPE | None = Field(
        None, description="llama-server -ctk: K cache type (default: the dtype's float type, f16 for quantized GGUFs)"
    )
    cache_type_v: KV_TYPE | None = Field(None, description="llama-server -ctv: V cache type (default as cache_type_k)")
    kv_unified: bool | None = Field(None, description="llama-server -kvu/-no-kvu: one KV buffer shared by all slots")
    cache_ram: int | None = knob(
        None,
        ge=-1,
        help="llama-server -cram MiB: host-memory prompt cache (0 off, -1 no limit; default llama.cpp's 8192)",
        roles=("cache_size",),
        shrink_order=15,
    )
    ctx_checkpoints: int | None = Field(
        None,
        ge=0,
        description="llama-server -ctxcp: context checkpoints per slot "
        "(recurrent/SWA state snapshots for prompt reuse)",
    )
    cont_batching: bool = Field(True, description="llama-server -cb/-nocb: continuous batching")
    flash_attn: Literal["on", "off", "auto"] | None = Field(None, description="llama-server -fa")
    slot_prompt_similarity: float | None = Field(
        None, ge=0, le=1, description="llama-server -sps: how alike a prompt must be to pick a slot by it"
    )
    extra_args: str = Field("", description="more llama-server arguments, passed as given (shell-split)")
    start_timeout_s: float = Field(120.0, gt=0, description="seconds llama-server may take to load the model")
    ban_eos: bool = Field(
        False,
        description="accept --ignore-eos in llama-server's meaning: end-of-generation tokens "
        "banned (fixed-length throughput runs; a greedy audit flags each ban)",
    )
    # the client's requests in flight (as RemoteOptions'): no role, `parallel` is the server's concurrency
    concurrency: int | None = knob(None, ge=1, help="requests in flight (default: 2 x parallel)", shrink_order=110)

    @model_validator(mode="after")
    def _usable(self):
        v = self.cache_type_v or self.cache_type_k
        if self.flash_attn == "off" and v in QUANTIZED_KV:
            raise LpfError(
                f'a quantized V cache ({v}) runs only with flash attention in llama.cpp ("failed to create '
                f'context" otherwise): drop -E flash_attn=off or keep the V cache in a float type'
            )
        if self.base_url:
            given = [k for k in SERVER_KNOBS if getattr(self, k) != type(self).model_fields[k].default]
            if given:
                raise LpfError(
                    f"--base-url talks to a server you started: {', '.join(given)} configure a server "
                    f"lpf starts (set them on your llama-server instead)"
                )
            RemoteOptions._usable(self)
        return self


class LlamaCppEngine(RemoteEngine):
    name = "llamacpp"
    trace_source = "own"  # one row per answered request, from the server's timings and id_slot
    state_slots = True
    discovers_architectures = True
    Options = LlamaCppOptions

    @classmethod
    def check_capacity(cls, model, options: LlamaCppOptions, requests: list[EngineRequest]) -> None:
        if options.base_url or not requests:
            return
        slot = slot_context(options, _model_context(model))
        if all(len(r.prompt_token_ids) + r.max_tokens > slot for r in requests):
            shortest = min(len(r.prompt_token_ids) + r.max_tokens for r in requests)
            raise LpfError(
                f"each llama.cpp slot holds {slot} tokens (ctx_size / parallel), but the shortest request "
                f"needs {shortest} (prompt + max_tokens): raise -E ctx_size"
            )

    def __init__(self, model, sampling, options: LlamaCppOptions):
        if sampling.ignore_eos and not options.ban_eos:
            raise LpfError(
                "--ignore-eos: llama-server's ignore_eos bans end-of-generation tokens (a -inf logit bias) "
                "where lpf's other engines generate past them, so a greedy audit would flag each ban as a "
                "flip; -E ban_eos=true accepts that (fixed-length throughput runs)"
            )
        self.server = None
        self.gguf = self.tools = None
        self._rows: list[dict] = []
        self._lock = threading.Lock()
        self._answered = 0
        self.props: dict | None = None
        if not options.base_url:
            self._start(model, options)
        try:
            super().__init__(model, sampling, options)
            self.map = TokenMap(self.tokenizer, self.vocab_size)  # its byte table is built on first use
            self.props = self._props()
        except BaseException:
            self.close()
            raise

    # -- the server ---------------------------------------------------------------------------------
    def _start(self, model, o: LlamaCppOptions) -> None:
        from lpf.adapters.llamacpp_server import LlamaServer

        tools = self.tools = gguf_files.find_tools()
        self.gguf = (
            gguf_files.user_gguf(o.gguf, o.dtype, model, tools)
            if o.gguf
            else gguf_files.gguf_for(model, o.dtype or "float32", tools)
        )
        self.server = LlamaServer(
            tools.server, self.gguf.path, self.server_args(model, o), start_timeout_s=o.start_timeout_s
        ).start()

    def server_args(self, model, o: LlamaCppOptions) -> list[str]:
        kv = o.cache_type_k or _kv_default(self.gguf.dtype)
        args = [
            "-np",
            str(o.parallel),
            "-c",
            str(o.ctx_size or o.parallel * slot_context(o, _model_context(model))),
            "-ctk",
            kv,
            "-ctv",
            o.cache_type_v or kv,
            "--fit",
            "off",
            "--no-webui",
            "--cache-prompt" if o.cache_prompt else "--no-cache-prompt",
            "-cb" if o.cont_batching else "-nocb",
        ]
        for flag, value in (
            ("-b", o.batch_size),
            ("-ub", o.ubatch_size),
            ("-t", o.threads),
            ("-tb", o.threads_batch),
            ("-cram", o.cache_ram),
            ("-ctxcp", o.ctx_checkpoints),
            ("-fa", flash_attention(o, self.gguf.dtype)[0]),
            ("-sps", o.slot_prompt_similarity),
        ):
            if value is not None:
                args += [flag, str(value)]
        if o.kv_unified is not None:
            args.append("-kvu" if o.kv_unified else "-no-kvu")
        return args + shlex.split(o.extra_args)

    def base(self) -> str:
        return (
            self.server.base_url if self.server is not None else self.options.base_url.rstrip("/").removesuffix("/v1")
        )

    def url(self, path: str) -> str:
        return self.base() + path

    def _server_version(self) -> str | None:
        props = self._props()
        return None if props is None else str(props.get("build_info") or "") or None

    def _props(self) -> dict | None:
        import httpx

        try:
            answer = httpx.get(self.base() + "/props", timeout=5.0).json()
        except (httpx.HTTPError, ValueError):
            return None
        return answer if isinstance(answer, dict) else None

    def in_flight(self) -> int:
        return self.options.concurrency or 2 * self.options.parallel

    # -- requests -----------------------------------------------------------------------------------
    def endpoint(self) -> str:
        return "/completion"

    def payload(self, req: EngineRequest) -> dict:
        return wire.payload(req, self.sampling, self.options.cache_prompt, ban_eos=self.options.ban_eos)

    def parse(self, req: EngineRequest, body: Any):
        c = wire.parse(req, body, self.sampling, self.vocab_size, self.map.bytes_of, self.check_answer)
        row = wire.slot_row(req, body)
        with self._lock:
            row["step"] = self._answered
            self._answered += 1
            self._rows.append(row)
        return c

    def side_tables(self) -> dict:
        with self._lock:
            rows, self._rows = self._rows, []
        return {"trace": trace_table(rows) if rows else None}

    def describe(self) -> dict:
        d = super().describe()
        o = self.options
        dtype = self.gguf.dtype if self.gguf is not None else o.dtype
        # the dtype the run is judged at goes into the options (the manifest's), so a resumed run keeps it
        d["options"] = {**o.to_dict(), "dtype": dtype if dtype in gguf_files.DTYPES else None}
        d["dtype"] = dtype
        d["server"] = (
            {
                "started_by": "lpf",
                "command": self.server.command(self.server.port)[1:],
                "binary": str(self.server.binary),
                "source": self.tools.source(),
            }
            if self.server is not None
            else {"started_by": "user", "base_url": o.base_url}
        )
        if self.server is not None and not self.server.alive():  # it died: what it said last is evidence
            d["server"]["died"] = self.server.log_tail(8).removeprefix("; llama-server log: ") or True
        d["gguf"] = self.gguf.describe() if self.gguf is not None else None
        props = self.props or {}
        d["props"] = {k: props.get(k) for k in ("build_info", "total_slots", "model_path") if k in props} or None
        d["samplers"] = wire.samplers(self.sampling)
        d["trace"] = {"source": "engine", "why": None}
        return d

    def configuration(self) -> dict:
        """/props (the GGUF's file type, the server's sampling defaults) and, on a server lpf started, its
        command line (KV cache types, flash attention and why): llama-server's /props says neither."""
        from lpf.adapters.engine_config import from_llama_props

        out = from_llama_props(self.props)
        if self.server is None:
            return out
        o = self.options
        kv_k = o.cache_type_k or _kv_default(self.gguf.dtype)
        kv_v = o.cache_type_v or kv_k
        kv = kv_k if kv_k == kv_v else f"k={kv_k},v={kv_v}"
        out["kv_cache_dtype"] = (kv, f"llama-server -ctk {kv_k} -ctv {kv_v} (lpf started it)")
        fa, why = flash_attention(o, self.gguf.dtype)
        if fa in ("on", "off"):
            out["flash_attention"] = (fa, f"llama-server -fa {fa} (lpf started it): {why}")
        out.setdefault("dtype", (self.gguf.dtype, "the GGUF lpf serves"))
        return out

    def close(self) -> None:
        if getattr(self, "server", None) is not None:
            self.server.cleanup()
            self.server = None


def _model_context(model) -> int | None:
    try:
        cfg = json.loads((model.path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return cfg.get("text_config", cfg).get("max_position_embeddings")


def slot_context(o: LlamaCppOptions, model_context: int | None) -> int:
    """Tokens one slot holds: ctx_size / parallel rounded up to 256 (llama_context's padding,
    src/llama-context.cpp), or the default per slot."""
    if o.ctx_size is None:
        return _pad(min(model_context or SLOT_CTX_CAP, SLOT_CTX_CAP))
    if o.kv_unified:
        return _pad(o.ctx_size)
    return _pad(_pad(o.ctx_size) // o.parallel)


def _pad(n: int) -> int:
    return max(256, -(-n // 256) * 256)


def flash_attention(o: LlamaCppOptions, dtype: str) -> tuple[str | None, str]:
    """The -fa value lpf starts llama-server with (None: llama.cpp's `auto`) and why.
    Off for float32 runs: with it, llama.cpp casts an f32 KV cache's K and V to f16 before
    `ggml_flash_attn_ext` (src/llama-graph.cpp, build_attn_mha), so attention would run at f16 (measured:
    max |logprob diff| 6.4e-3 on zoo:jamba). On when the V cache is quantized: llama.cpp refuses a
    quantized V cache without flash attention (src/llama-context.cpp: "failed to create context")."""
    if o.flash_attn:
        return o.flash_attn, "set (-E flash_attn)"
    v = o.cache_type_v or o.cache_type_k or _kv_default(dtype)
    if v in QUANTIZED_KV:
        return "on", f"a quantized V cache ({v}) needs flash attention in llama.cpp"
    if dtype == "float32":
        return "off", "float32: llama.cpp's flash attention computes on an f16 copy of the f32 KV cache"
    return None, "llama.cpp's default (auto)"


def _kv_default(dtype: str) -> str:
    return {"float32": "f32", "bfloat16": "bf16"}.get(dtype, "f16")


def trace_table(rows: list[dict]) -> pa.Table:
    cols = {
        "step": [r["step"] for r in rows],
        "request_id": [r["request_id"] for r in rows],
        "phase": [None if r["cache_n"] is None else ("extend" if r["cache_n"] > 0 else "prefill") for r in rows],
        "num_computed_tokens": [r["cache_n"] for r in rows],
        "num_scheduled_tokens": [r["prompt_n"] for r in rows],
        "state_slot": [r["state_slot"] for r in rows],
        "batch_size": [None] * len(rows),
        "batch_tokens": [None] * len(rows),
        "preempted": [False] * len(rows),
        **{name: [None] * len(rows) for name, _ in PREFIX_TRACE},
        "prefix_cache_hit_tokens": [r["cache_n"] for r in rows],
        "num_prompt_tokens": [r["n_prompt_tokens"] for r in rows],
        "predicted_n": [r["predicted_n"] for r in rows],
        "tokens_cached": [r["tokens_cached"] for r in rows],
        "prompt_ms": [r["prompt_ms"] for r in rows],
        "predicted_ms": [r["predicted_ms"] for r in rows],
    }
    return pa.table(cols, schema=TRACE_SCHEMA)
