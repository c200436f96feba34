"""Reference rescorer: one teacher-forced pass of a plain HF model over prompt + output ids.

Contract: `Rescorer(model, dtype, device, token_budget, ...)` loads the reference; `score_all(items)`
yields, per batch, a `Scored`: for each output position of each `ScoreItem` the logprob of the engine's
token, its rank (1 = argmax), the entropy, the top-1 and the top-k and the log-sum-exp of the raw logits,
as a `reference` Arrow table; for items that ask (`ScoreItem.score_prompt`), the prompt positions 1..P-1
too (the logprob of prompt token p given the tokens before it), as a `prompt_reference` table from the
same pass; with a `replay`, the engine's sampler redrawn on the reference's logits (`seeded`).
`describe_reference` is the manifest's entry for it without loading the weights.

Memory contract: it never holds float32 logits of shape [batch, seq, vocab]. Sequences are packed by
`lpf.pipeline.batch_plan` (the Ray executor packs with the same rule); the base model returns hidden
states; only the rows that predict scored tokens (`lpf.pipeline.reference_rows`) are projected to the
vocabulary by the head (`lpf.pipeline.reference_head`: float32 unless `float32_head=False`, checked once
against the model's own forward), `chunk_rows` rows at a time into one reused buffer.

Devices (`lpf.core.devices`): cpu, cuda or auto; a model larger than one GPU is spread with
`device_map="auto"`. Inputs go up through one pinned host buffer per batch and the results come
back as one float32 block per batch, copied into pinned memory without blocking: the only host
synchronisation a batch makes, and it is made one batch late (`score_planned` queues batch i + 1
before it waits for batch i), so the device is not left idle while the host builds tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import pyarrow as pa
import torch

from lpf.core.devices import load_model, resolve_device
from lpf.core.errors import LpfError
from lpf.core.model_specs import ModelRef, tokenizer_fingerprint
from lpf.core.torch_utils import max_context, quiet_transformers, row_block, shape_stable_attention, torch_dtype
from lpf.pipeline.batch_plan import plan_batches
from lpf.pipeline.reference_head import Head, check_head, head_chunk_rows, mixed_mm_supported
from lpf.pipeline.reference_rows import batch_inputs, row_stats, rows_table, seeded_table


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


def describe_reference(model: ModelRef, dtype: str, tokenizer) -> dict:
    """The manifest's `reference` entry (what scored the run), without loading the weights."""
    import transformers

    return {
        **model.describe(),
        "dtype": dtype,
        "implementation": f"transformers {transformers.__version__}",
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
    }


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
        out_weight = self.model.get_output_embeddings().weight
        self.head_device = out_weight.device
        self.vocab_size = out_weight.shape[0]
        if self.vocab_size >= 1 << 24:  # ids and ranks travel back as exact float32 integers
            raise LpfError(f"reference vocabulary of {self.vocab_size} tokens: more than this rescorer handles (2^24)")
        self.max_context = max_context(self.model.config)
        self.chunk_rows = chunk_rows or head_chunk_rows(self.vocab_size, self.device)
        self.head = Head(self.model, float32_head, self.mixed_head)
        self.head_dtype = self.head.dtype
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
        """[N, H] hidden states -> [N, V] logits (`Head.logits`): the one call every scored row goes
        through, so a subclass can replace the head (`lpf.rl.trainer`'s batch-variant drill)."""
        return self.head.logits(hidden, out=out, native=native)

    def _check_head(self) -> None:
        check_head(self.model, self._logits, self.input_device, self.vocab_size, self.model_ref.spec)

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
        ids, rows, targets = batch_inputs(batch, asked, self.input_device, self._pin)
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
            packed.append(row_stats(z, targets[i : i + self.chunk_rows], k, work, self.fused_rows))
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
        reference = rows_table(
            res[:n_out],
            self.topk,
            [it.request_id for it in batch],
            [np.arange(len(it.output_token_ids)) for it in batch],
        )
        prompt = None
        if asked:
            prompt = rows_table(
                res[n_out:],
                self.topk,
                [it.request_id for _, it in asked],
                [np.arange(1, len(it.prompt_token_ids)) for _, it in asked],
            )
        seeded = seeded_table(reference, draws) if draws else None
        return Scored(reference, prompt, seeded)

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
