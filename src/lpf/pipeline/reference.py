"""Reference rescorer: one teacher-forced pass of a plain HF model over prompt + output ids.

For each output position it reports the logprob of the engine's token, its rank (1 = argmax),
the entropy, the top-1 and the top-k, the log-sum-exp of the raw logits (logit = logprob + it: what a
penalty acting on raw logits, `lpf.analysis.penalties`, is fitted against), as a `reference` Arrow table; for items that ask
(`ScoreItem.score_prompt`), the prompt positions 1..P-1 too (the logprob of prompt token p given the
tokens before it), as a `prompt_reference` table from the same pass (`score_all` yields both). Memory contract: it never holds
float32 logits of shape [batch, seq, vocab]. Sequences are sorted by (length, request id) and packed
under a token budget (padding counted, `plan_batches`: the Ray executor packs with the same rule);
the base model returns hidden states; only the rows that predict scored tokens are projected to the
vocabulary, `chunk_rows` rows at a time into one reused buffer, with the head's logits and the
log-softmax in float32 (weights stay in the reference dtype; `float32_head=False` keeps the head in it
too, as an engine computing at that dtype would).

The float32 head of bfloat16/float16 weights: the products of two such numbers are exact in float32, so
"the head in float32" is the model's own operands multiplied with float32 accumulation and output.
Where torch has that GEMM (`torch.mm(..., out_dtype=torch.float32)`: CUDA) it runs on the operands as
they are, at the tensor cores' pace and without a float32 copy of the weight (issue 42: 441 against 49
TFLOP/s for a float32 GEMM with TF32 off, on an H200); elsewhere (a CPU has no such kernel) the weight is
copied to float32 once and the hidden rows upcast: the same products, the same float32 sums up to
their order. Float32 weights stay float32.

Devices (`lpf.core.devices`): cpu, cuda or auto; a model larger than one GPU is spread with
`device_map="auto"`. Inputs go up through one pinned host buffer per batch and the results come
back as one float32 block per batch, copied into pinned memory without blocking: the only host
synchronisation a batch makes, and it is made one batch late (`score_planned` queues batch i + 1
before it waits for batch i), so the device is not left idle while the host builds tables.

The head (hidden -> logits) is rebuilt from the model's output embeddings plus the known post-ops
(Granite's `logits_scaling`, Gemma's final soft-capping), and checked once against the model's own
forward on a probe, so a head this module does not understand fails loudly instead of scoring wrong.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import pyarrow as pa
import torch

from lpf.core.devices import load_model, resolve_device
from lpf.core.errors import LpfError
from lpf.core.model_specs import ModelRef, tokenizer_fingerprint
from lpf.run import schema
from lpf.core.torch_utils import (
    logprob_rows,
    max_context,
    quiet_transformers,
    row_block,
    shape_stable_attention,
    torch_dtype,
)

# The head's [chunk_rows, V] float32 logits buffer is about this size: on a CPU the matmul gains up to
# ~500 rows (~15% from 128 to 512 at V = 32000) while logprob_rows reads the buffer in L2-sized blocks.
_CPU_CHUNK_BYTES = 64 << 20
_GPU_CHUNK_BYTES = 512 << 20
PAD_SLACK = 0.10


def list_column(matrix: np.ndarray, value_type: pa.DataType) -> pa.ListArray:
    """An [N, k] matrix as an Arrow list column (k may be 0)."""
    n, k = matrix.shape
    offsets = pa.array(np.arange(n + 1, dtype=np.int32) * k)
    return pa.ListArray.from_arrays(offsets, pa.array(matrix.ravel(), type=value_type))


@dataclass(frozen=True)
class ScoreItem:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    score_prompt: bool = False  # also score prompt positions 1..P-1
    seed: int | None = None  # the request's seed, for a seeded replay (`lpf.pipeline.replay`)


@dataclass(frozen=True)
class Scored:
    """One batch's scores: output positions, and prompt positions of the items that asked (else None)."""

    reference: pa.Table
    prompt_reference: pa.Table | None
    seeded: pa.Table | None = None  # the replay's draws (`replay` given), schema.SEEDED


@dataclass
class _InFlight:
    """A batch queued on the device (`Rescorer._launch`), its result block on its way to the host."""

    batch: list[ScoreItem]
    asked: list[tuple[int, ScoreItem]]
    n_out: int
    result: torch.Tensor  # [rows, 3 + 2k + 1] float32: pinned host memory on a GPU (valid once `done`)
    done: object  # a torch.cuda.Event recorded after the copy, or None (already on the host)
    draws: list


def plan_batches(lengths: Sequence[int], request_ids: Sequence[str], token_budget: int) -> list[list[int]]:
    """Indices of the items, sorted by (length, request id) and cut into batches where
    batch size * longest length <= token_budget (padding counted; a longer item goes alone) and the
    padding is at most PAD_SLACK of the batch's real tokens (the forward pass is paid per padded
    token; the head gathers rows across a batch, so small batches cost it nothing)."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], request_ids[i]))
    out, cur, real = [], [], 0
    for i in order:
        padded = (len(cur) + 1) * lengths[i]
        if cur and (padded > token_budget or padded > (1 + PAD_SLACK) * (real + lengths[i])):
            out.append(cur)
            cur, real = [], 0
        cur.append(i)
        real += lengths[i]
    if cur:
        out.append(cur)
    return out


def describe_reference(model: ModelRef, dtype: str, tokenizer) -> dict:
    """The manifest's `reference` entry (what scored the run), without loading the weights."""
    import transformers

    return {
        **model.describe(),
        "dtype": dtype,
        "implementation": f"transformers {transformers.__version__}",
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
    }


def mixed_mm_supported(device: str, dtype: torch.dtype) -> bool:
    """Whether `device` multiplies `dtype` matrices into float32 output (`torch.mm(..., out_dtype=)`):
    CUDA with bfloat16/float16, not a CPU (torch 2.13 has no CPU kernel). Probed on two tiny matrices,
    once per (device type, dtype): into a given buffer, else into a new one (a torch without the `out=`
    form of the overload)."""
    key = (torch.device(device).type, dtype)
    if key not in _MIXED_MM:
        _MIXED_MM[key] = None
        if dtype in (torch.bfloat16, torch.float16) and key[0] == "cuda":
            a = torch.ones((2, 3), device=device, dtype=dtype)
            for mode in ("out", "new"):
                try:
                    out = torch.empty((2, 2), device=device, dtype=torch.float32) if mode == "out" else None
                    z = _mm_float32_out(a, a.t(), out)
                except (RuntimeError, NotImplementedError, TypeError):
                    continue
                if z.dtype == torch.float32 and bool(z.eq(3).all()):
                    _MIXED_MM[key] = mode
                    break
    return _MIXED_MM[key] is not None


_MIXED_MM: dict = {}  # (device type, dtype) -> "out" | "new" | None (no float32-output GEMM)


def _mm_float32_out(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a, b, out_dtype=torch.float32, out=out)


def mixed_mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """a @ b of bfloat16/float16 operands, accumulated in float32 and returned in float32 (into `out`
    where this torch has that form; `mixed_mm_supported` must have said yes for the device and dtype)."""
    use_out = out is not None and _MIXED_MM.get((a.device.type, a.dtype)) == "out"
    return _mm_float32_out(a, b, out if use_out else None)


def _chunk_rows(vocab: int, device: str) -> int:
    budget = _GPU_CHUNK_BYTES if device.startswith("cuda") else _CPU_CHUNK_BYTES
    return int(min(4096, max(32, budget // (4 * vocab))))


class Rescorer:
    def __init__(
        self,
        model: ModelRef,
        dtype: str = "float32",
        device: str = "cpu",
        token_budget: int = 16384,
        chunk_rows: int | None = None,
        topk: int = 5,
        float32_head: bool = True,
        mixed_head: bool | None = None,
        fused_rows: bool | None = None,
        compile_trunk: bool = False,
        replay=None,
        on_rows: Callable | None = None,
    ):
        from transformers import AutoConfig, AutoTokenizer

        quiet_transformers()
        self.model_ref = model
        self.dtype = dtype
        self.device = resolve_device(device)
        self.token_budget = token_budget
        self.topk = topk
        self.replay = replay  # an `lpf.pipeline.replay.Replay`: the engine's sampler redrawn on the reference's logits
        # on_rows(logits [n, V] float32, targets [n]): sees every scored row's logits before they are
        # overwritten, in table order (what a caller needs beyond the table: `lpf.rl.row_stats`)
        self.on_rows = on_rows
        self.tokenizer = AutoTokenizer.from_pretrained(model.path)
        cfg = AutoConfig.from_pretrained(model.path)
        cfg = getattr(cfg, "text_config", None) or cfg
        # the float32 head of lower-precision weights: a float32-output GEMM where the device has one,
        # else a float32 copy of the weight beside them
        # (mixed_head=False: the float32 copy even where the GEMM exists, the way before issue 42)
        self.mixed_head = (
            float32_head
            and dtype != "float32"
            and mixed_head is not False
            and mixed_mm_supported(self.device, torch_dtype(dtype))
        )
        copies_head = float32_head and dtype != "float32" and not self.mixed_head
        head_copy = 4 * getattr(cfg, "vocab_size", 0) * getattr(cfg, "hidden_size", 0) if copies_head else 0
        self.model, self.placement = load_model(model.path, torch_dtype(dtype), self.device, head_copy)
        self.input_device = self.model.get_input_embeddings().weight.device
        head = self.model.get_output_embeddings()
        self.head_device = head.weight.device
        self.vocab_size = head.weight.shape[0]
        if self.vocab_size >= 1 << 24:  # ids and ranks travel back as exact float32 integers
            raise LpfError(f"reference vocabulary of {self.vocab_size} tokens: more than this rescorer handles (2^24)")
        self.max_context = max_context(self.model.config)
        self.chunk_rows = chunk_rows or _chunk_rows(self.vocab_size, self.device)
        self._native_head = (head.weight.detach(), None if head.bias is None else head.bias.detach())
        if self.mixed_head:  # the model's own weight; float32 logits from the GEMM; the bias added in float32
            bias = self._native_head[1]
            self._head = (self._native_head[0], None if bias is None else bias.float())
        elif float32_head:
            self._head = tuple(None if t is None else t.float() for t in self._native_head)
        else:
            self._head = self._native_head
        self.head_dtype = torch.float32 if float32_head else self._native_head[0].dtype
        # fused_rows: the row statistics' three full-vocabulary reductions in one compiled kernel (logprob_rows'
        # `fused`). Default (None): on a GPU, where an H200 measured 1.14-1.17x the whole rescoring for a compile
        # of ~5 s on the first batch and scores within 2e-6 of the eager passes (bench/results/gpu_check.json);
        # a CPU keeps its L2-blocked eager passes (compiling there costs minutes).
        self.fused_rows = self.input_device.type == "cuda" if fused_rows is None else bool(fused_rows)
        # compile_trunk=True: the trunk (embeddings to the last norm) through torch.compile, dynamic in batch
        # and length, so the norms, rotary and gated MLP's elementwise work fuse (on an H200 ~30% of the
        # device time went to them unfused). Off by default: compiling takes tens of seconds per new shape
        # family, and its gain is measured by scripts/gpu_check.py's throughput step, not assumed.
        self.compile_trunk = bool(compile_trunk)
        self._trunk = None
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pin = self.input_device.type == "cuda"
        self._check_head()

    def _trunk_fn(self):
        """The trunk's forward: the model's own, or (compile_trunk) compiled once on first use."""
        if not self.compile_trunk:
            return self.model.base_model
        if self._trunk is None:
            self._trunk = torch.compile(self.model.base_model, dynamic=True)
        return self._trunk

    def describe(self) -> dict:
        return {**describe_reference(self.model_ref, self.dtype, self.tokenizer), "device": self.placement}

    # -- the head ----------------------------------------------------------------------------------
    def _logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None, native: bool = False) -> torch.Tensor:
        """[N, H] hidden states -> [N, V] logits (into `out` when given, in the head's dtype)."""
        weight, bias = self._native_head if native else self._head
        h = hidden.to(device=weight.device, dtype=weight.dtype)
        if self.mixed_head and not native:
            logits = mixed_mm(h, weight.t(), out)
        else:
            logits = torch.mm(h, weight.t(), out=out) if out is not None else h @ weight.t()
        if bias is not None:
            logits.add_(bias)
        cfg = self.model.config
        scaling = getattr(cfg, "logits_scaling", None)
        if scaling not in (None, 1, 1.0):
            logits.div_(scaling)
        multiplier = getattr(cfg, "lm_head_multiplier", None)  # FalconH1's muP head (its published checkpoints)
        if multiplier not in (None, 1, 1.0):
            logits.mul_(multiplier)
        cap = getattr(cfg, "final_logit_softcapping", None)
        if cap:
            logits.div_(cap).tanh_().mul_(cap)
        return logits

    def _check_head(self) -> None:
        probe = torch.arange(1, 9, device=self.input_device).remainder(self.vocab_size).view(1, -1)
        with torch.inference_mode():
            full = self.model(input_ids=probe, use_cache=False).logits[0].float()
            hidden = self.model.base_model(input_ids=probe, use_cache=False).last_hidden_state[0]
            native = self._logits(hidden, native=True).float().to(full.device)
            ours = self._logits(hidden).float().to(full.device)
        scale = max(1.0, full.abs().max().item())
        # the same ops at the model's dtype must match its forward; the float32 head differs from a
        # lower-precision forward by that dtype's rounding of the logits
        err = (full - native).abs().max().item()
        loose = max(1e-3, 4 * torch.finfo(self.model.dtype).eps) * scale
        if not (err <= 1e-3 * scale and (full - ours).abs().max().item() <= loose):
            raise LpfError(
                f"reference model {self.model_ref.spec}: its output head does more than this "
                f"rescorer knows (mismatch {err:.3g}); architecture {type(self.model).__name__} is not supported"
            )

    def _chunk_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits buffer [chunk_rows, V] (head dtype) and logprob_rows' float32 work buffer, reused."""
        if self._buffers is None:
            v = self.vocab_size
            work = row_block(self.chunk_rows, v, self.head_device) * v
            self._buffers = (
                torch.empty((self.chunk_rows, v), device=self.head_device, dtype=self.head_dtype),
                torch.empty(work, device=self.head_device, dtype=torch.float32),
            )
        return self._buffers

    # -- scoring -----------------------------------------------------------------------------------
    def batches(self, items: list[ScoreItem]) -> list[list[ScoreItem]]:
        """Sort by (length, request id) and pack so that batch_size * longest <= token_budget."""
        items = [it for it in items if it.output_token_ids]
        plan = plan_batches(
            [len(it.prompt_token_ids) + len(it.output_token_ids) for it in items],
            [it.request_id for it in items],
            self.token_budget,
        )
        return [[items[i] for i in batch] for batch in plan]

    def validate(self, it: ScoreItem) -> None:
        length = len(it.prompt_token_ids) + len(it.output_token_ids)
        if self.max_context is not None and length > self.max_context:
            raise LpfError(f"request {it.request_id}: {length} tokens exceed the reference context {self.max_context}")
        ids = it.prompt_token_ids + it.output_token_ids
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            raise LpfError(
                f"request {it.request_id}: token id outside the reference vocabulary (0..{self.vocab_size - 1})"
            )

    def _inputs(
        self, batch: list[ScoreItem], asked: list[tuple[int, ScoreItem]]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(ids [B, width], flat index of each scored row in [B * width], its target token), sent up
        from one host buffer (pinned for a GPU) in one copy: every output row first, then the prompt
        rows of the `asked` items (row q predicts prompt token q + 1). Right padding: causal attention
        and the causal scan never let later (pad) positions touch earlier ones, so no mask is needed."""
        lengths = [len(it.prompt_token_ids) + len(it.output_token_ids) for it in batch]
        width, n = max(lengths), len(batch)
        n_rows = sum(len(it.output_token_ids) for it in batch) + sum(len(it.prompt_token_ids) - 1 for _, it in asked)
        host = torch.zeros(n * width + 2 * n_rows, dtype=torch.long, pin_memory=self._pin)
        buf = host.numpy()
        at = n * width
        for row, it in enumerate(batch):
            p, o = len(it.prompt_token_ids), len(it.output_token_ids)
            buf[row * width : row * width + p] = it.prompt_token_ids
            buf[row * width + p : row * width + p + o] = it.output_token_ids
            buf[at : at + o] = np.arange(row * width + p - 1, row * width + p - 1 + o)
            buf[at + n_rows : at + n_rows + o] = it.output_token_ids
            at += o
        for row, it in asked:
            p = len(it.prompt_token_ids)
            buf[at : at + p - 1] = np.arange(row * width, row * width + p - 1)
            buf[at + n_rows : at + n_rows + p - 1] = it.prompt_token_ids[1:]
            at += p - 1
        dev = host.to(self.input_device, non_blocking=self._pin)
        return dev[: n * width].view(n, width), dev[n * width : n * width + n_rows], dev[n * width + n_rows :]

    def score_batch(self, batch: list[ScoreItem]) -> pa.Table:
        return self.score_batch_all(batch).reference

    def score_batch_all(self, batch: list[ScoreItem]) -> Scored:
        return self._finish(self._launch(batch))

    @torch.inference_mode()
    def _launch(self, batch: list[ScoreItem]) -> _InFlight:
        """Validate the batch and queue all its device work: the forward, the head and the row statistics
        chunk by chunk, and the copy of its one float32 result block towards the host (into pinned memory,
        non-blocking, on a GPU). Nothing here waits for the device unless `replay` or `on_rows` does, so
        the next batch can be queued while this one runs (`score_planned`)."""
        for it in batch:
            self.validate(it)
        asked = [(row, it) for row, it in enumerate(batch) if it.score_prompt and len(it.prompt_token_ids) > 1]
        ids, rows, targets = self._inputs(batch, asked)
        with shape_stable_attention():
            hidden = self._trunk_fn()(input_ids=ids, use_cache=False).last_hidden_state
        h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows.to(hidden.device))
        del hidden
        targets = targets.to(self.head_device)
        logits_buf, work = self._chunk_buffers()
        k = self.topk
        packed, draws = [], []
        n_out = sum(len(it.output_token_ids) for it in batch)
        replaying = self.replay is not None and all(it.seed is not None for it in batch)
        if replaying:
            seeds = np.repeat([it.seed for it in batch], [len(it.output_token_ids) for it in batch])
            positions = np.concatenate([np.arange(len(it.output_token_ids)) for it in batch])
            engine_tokens = np.concatenate([np.asarray(it.output_token_ids) for it in batch])
        for i in range(0, h.shape[0], self.chunk_rows):
            hc = h[i : i + self.chunk_rows]
            z = self._logits(hc, out=logits_buf[: hc.shape[0]])
            if replaying and i < n_out:  # before logprob_rows overwrites the logits
                j = min(n_out, i + hc.shape[0])
                draws.append(self.replay.draw(z[: j - i], seeds[i:j], positions[i:j], engine_tokens[i:j]))
            if self.on_rows is not None:
                self.on_rows(z, targets[i : i + self.chunk_rows])
            tc = targets[i : i + self.chunk_rows]
            z_token = z.gather(1, tc[:, None])  # before logprob_rows overwrites the logits: the lse from it
            chosen, top_ids, top_lp, rank, entropy = logprob_rows(z, tc, k, work, overwrite=True, fused=self.fused_rows)
            # one float32 block per chunk; ids and ranks are < 2^24, so exact as float32
            packed.append(
                torch.cat(
                    [
                        chosen[:, None],
                        entropy[:, None],
                        rank[:, None].float(),
                        top_lp,
                        top_ids.float(),
                        z_token.float() - chosen[:, None],
                    ],
                    dim=1,
                )
            )
        res = packed[0] if len(packed) == 1 else torch.cat(packed)
        done = None
        if res.is_cuda:  # the copy is queued behind the batch's work; _finish waits for it, once
            host = torch.empty(res.shape, dtype=res.dtype, pin_memory=True)
            host.copy_(res, non_blocking=True)
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(res.device))
            res = host
        return _InFlight(batch, asked, n_out, res, done, draws)

    def _finish(self, f: _InFlight) -> Scored:
        """The batch's tables from its result block: the batch's one wait for the device (on a GPU)."""
        if f.done is not None:
            f.done.synchronize()
        res = f.result.numpy()
        batch, asked, n_out, draws = f.batch, f.asked, f.n_out, f.draws
        kk = max(self.topk, 1)
        reference = self._table(
            res[:n_out], kk, [it.request_id for it in batch], [np.arange(len(it.output_token_ids)) for it in batch]
        )
        prompt = None
        if asked:
            prompt = self._table(
                res[n_out:],
                kk,
                [it.request_id for _, it in asked],
                [np.arange(1, len(it.prompt_token_ids)) for _, it in asked],
            )
        seeded = None
        if draws:
            d = {key: np.concatenate([x[key] for x in draws]) for key in draws[0]}
            seeded = pa.table(
                {
                    "request_id": reference.column("request_id"),
                    "position": reference.column("position"),
                    "seeded_token": pa.array(d["token"]),
                    "seeded_margin": pa.array(d["margin"]),
                    "seeded_runner_up": pa.array(d["runner_up"]),
                },
                schema=schema.SEEDED,
            )
        return Scored(reference, prompt, seeded)

    def _table(self, res: np.ndarray, kk: int, request_ids: list[str], positions: list[np.ndarray]) -> pa.Table:
        """Reference rows from the packed float32 block: request i has len(positions[i]) consecutive
        rows at those positions."""
        k = self.topk
        top_lp, top_ids = res[:, 3 : 3 + kk], res[:, 3 + kk : 3 + 2 * kk].astype(np.int32)
        return pa.table(
            {
                "request_id": pa.array(np.repeat(request_ids, [len(p) for p in positions])),
                "position": pa.array(np.concatenate(positions).astype(np.int32)),
                "ref_logprob": pa.array(res[:, 0].astype(np.float64)),
                "ref_rank": pa.array(res[:, 2].astype(np.int32)),
                "ref_entropy": pa.array(res[:, 1]),
                "ref_top1_id": pa.array(top_ids[:, 0]),
                "ref_top1_logprob": pa.array(top_lp[:, 0].astype(np.float64)),
                "ref_topk_ids": list_column(np.ascontiguousarray(top_ids[:, :k]), pa.int32()),
                "ref_topk_logprobs": list_column(np.ascontiguousarray(top_lp[:, :k]), pa.float32()),
                "ref_logsumexp": pa.array(res[:, 3 + 2 * kk]),
            },
            schema=schema.REFERENCE,
        )

    def score(self, items: list[ScoreItem], on_tokens: Callable[[int], None] | None = None) -> Iterable[pa.Table]:
        """Output positions only, one table per batch."""
        for scored in self.score_all(items, on_tokens):
            yield scored.reference

    def score_all(self, items: list[ScoreItem], on_tokens: Callable[[int], None] | None = None) -> Iterable[Scored]:
        """Output positions and the asked prompt positions, per batch; `on_tokens` counts output positions."""
        for scored in self.score_planned(self.batches(items)):
            if on_tokens:
                on_tokens(scored.reference.num_rows)
            yield scored

    def score_planned(self, batches: Iterable[list[ScoreItem]]) -> Iterable[Scored]:
        """Each batch's scores, in order, one batch ahead: batch i + 1 is queued on the device before
        batch i's results are waited for and turned into tables, so on a GPU the device works while the
        host builds tables, the caller writes them, and the next batch's inputs are packed (rather than
        wait for them). The same results as `score_batch_all` one batch at a time;
        on a CPU, where every op completes as it is called, the same arithmetic in the same order.
        A batch that fails validation still yields the batch before it first (a crash loses at most the
        batch in flight). With `on_rows` set there is no lookahead: its caller reads what the hook
        recorded when each table arrives (`lpf.rl.row_stats.RowStats.take`), so a table must come back
        before the next batch's rows reach the hook."""
        if self.on_rows is not None:
            for batch in batches:
                yield self.score_batch_all(batch)
            return
        pending = None
        for batch in batches:
            try:
                launched = self._launch(batch)
            except Exception:  # an invalid batch: the one before it is whole, let it out first
                if pending is not None:
                    yield self._finish(pending)
                raise
            if pending is not None:
                yield self._finish(pending)
            pending = launched
        if pending is not None:
            yield self._finish(pending)
