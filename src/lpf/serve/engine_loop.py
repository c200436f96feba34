"""One asyncio loop that owns the built-in engine, so concurrent HTTP requests share engine steps.

Contract: handlers call `await loop.submit(requests)`; the requests are queued and the call returns
them once all are finished (output tokens, raw logprobs, top-k, finish_reason, or error set when the
engine refused one, e.g. it can never fit the cache). A single background task is the only code that
touches the engine: between steps it admits everything queued since the last step, then runs
`engine.step()` in one worker thread (torch releases the GIL, so the event loop keeps accepting
connections meanwhile) and resolves the futures of the requests that finished (and `next_step()`'s
waiters: streamed answers send the tokens each step added). Requests that arrive
while a step runs join the next one: that is the batching.

Every step's trace rows and fault ground truth are drained in the worker thread; `stats` keeps the
counters `/metrics` shows (steps, largest batch, ...), and a `TraceSink` (optional) appends them as
Parquet parts under a --trace-dir for later forensics (`trace/part-*.parquet`, `faults/part-*.parquet`,
same schemas as a run directory), written whole whenever the loop goes idle (a trace join after the last
answer finds its steps: `lpf.adapters.vllm_trace` reads the directory). If a step raises, the engine is considered dead: every waiting
request fails with a 500 and /health turns 500, as vLLM does. A `submit` whose caller is cancelled
(its HTTP client went away) takes its requests back: between two steps they leave the queue or the
engine (`engine.abort`: slot and KV blocks freed), counted in `stats.requests_cancelled`.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from lpf.builtin.request import Request
from lpf.serve.protocol import ApiError


@dataclass
class LoopStats:
    steps: int = 0
    max_batch_size: int = 0
    scheduled_sum: int = 0  # sum of batch sizes over steps (mean batch = scheduled_sum / steps)
    requests_added: int = 0
    requests_finished: int = 0
    requests_rejected: int = 0
    tokens_generated: int = 0
    preemptions: int = 0
    requests_submitted: int = 0  # handed to the loop: each ends finished, rejected or cancelled
    requests_cancelled: int = 0  # taken back by a client that went away

    def to_dict(self) -> dict:
        return asdict(self)


class TraceSink:
    """Appends trace / faults tables as atomically written Parquet parts under one directory."""

    def __init__(self, path: Path, flush_rows: int = 4096, flush_seconds: float = 2.0):
        self.path = Path(path)
        for sub in ("trace", "faults"):
            (self.path / sub).mkdir(parents=True, exist_ok=True)
        self.flush_rows, self.flush_seconds = flush_rows, flush_seconds
        self._buf: dict[str, list[pa.Table]] = {"trace": [], "faults": []}
        self._next = {sub: len(list((self.path / sub).glob("part-*.parquet"))) for sub in self._buf}
        self._last = time.monotonic()

    def add(self, name: str, table: pa.Table | None) -> None:
        if table is not None and table.num_rows:
            self._buf[name].append(table)
        rows = sum(t.num_rows for ts in self._buf.values() for t in ts)
        if rows >= self.flush_rows or (rows and time.monotonic() - self._last >= self.flush_seconds):
            self.flush()

    def flush(self) -> None:
        for name, tables in self._buf.items():
            if not tables:
                continue
            target = self.path / name / f"part-{self._next[name]:06d}.parquet"
            tmp = target.with_name(f".tmp-{target.name}")
            pq.write_table(pa.concat_tables(tables), tmp, compression="zstd")
            os.replace(tmp, target)
            self._next[name] += 1
            self._buf[name] = []
        self._last = time.monotonic()


class EngineLoop:
    def __init__(self, engine, sink: TraceSink | None = None):
        self.engine = engine
        self.sink = sink
        self.stats = LoopStats()
        self.dead: str | None = None
        self._queue: list[Request] = []
        self._cancelled: list[Request] = []
        self._futures: dict[str, tuple[Request, asyncio.Future]] = {}  # by request id: who waits for what
        self._wake = asyncio.Event()
        self._stopping = False
        self._seq = 0
        self._task: asyncio.Task | None = None
        self._stepped: asyncio.Future | None = None  # resolved after the next step (streams wait on it)
        # one thread: the engine is never stepped concurrently, and torch's thread settings hold
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lpf-engine")

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="lpf-engine-loop")

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            await self._task
        self._fail_all(ApiError("the server is shutting down", 503, "ServiceUnavailableError"))
        self._executor.shutdown(wait=True)
        if self.sink is not None:
            self.sink.flush()

    @property
    def running(self) -> int:
        return len(self._futures)

    async def next_step(self) -> None:
        """Returns after the engine's next step (or once the loop stops): streamed answers send what it added."""
        if self._stepped is None or self._stepped.done():
            self._stepped = asyncio.get_running_loop().create_future()
        await asyncio.wait({self._stepped})  # (not the future itself: a cancelled waiter must not cancel it)

    def _notify_step(self) -> None:
        if self._stepped is not None and not self._stepped.done():
            self._stepped.set_result(None)

    # -- handlers ----------------------------------------------------------------------------------
    async def submit(self, requests: list[Request]) -> list[Request]:
        if self.dead is not None:
            raise ApiError(f"the engine is dead: {self.dead}", 500, "InternalServerError")
        if self._stopping:
            raise ApiError("the server is shutting down", 503, "ServiceUnavailableError")
        ids = [r.request_id for r in requests]
        clash = next((i for i in ids if i in self._futures), None) or (next((i for i in ids if ids.count(i) > 1), None))
        if clash is not None:
            raise ApiError(f"request id {clash!r} is already in flight", param="request_id")
        loop = asyncio.get_running_loop()
        self.stats.requests_submitted += len(requests)
        futures = []
        for r in requests:
            fut = loop.create_future()
            self._futures[r.request_id] = (r, fut)
            self._queue.append(r)
            futures.append(fut)
        self._wake.set()
        try:
            results = await asyncio.gather(*futures, return_exceptions=True)
        except asyncio.CancelledError:
            self._cancel(requests)
            raise
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return list(results)

    def _cancel(self, requests: list[Request]) -> None:
        """Take requests back (the loop drops them before its next step); their ids are free at once."""
        for r in requests:
            owner, _ = self._futures.get(r.request_id, (None, None))
            if owner is r:  # (its future is already cancelled: gather cancels what it waits for)
                del self._futures[r.request_id]
                self._cancelled.append(r)
        self._wake.set()

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        gone, self._cancelled = self._cancelled, []
        queued = {id(r) for r in gone}
        self._queue = [r for r in self._queue if id(r) not in queued]  # never reached the engine
        for r in gone:
            self.engine.abort(r.request_id)  # None when it was still queued here
            self.stats.requests_cancelled += 1

    # -- the loop ----------------------------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            self._drop_cancelled()
            if not self._queue and not self.engine.has_unfinished():
                if (
                    self.sink is not None
                ):  # idle: the steps of every answered request go to disk now (a join reads them)
                    self.sink.flush()
                self._wake.clear()
                await self._wake.wait()
                continue
            self._admit()
            if not self.engine.has_unfinished():
                continue
            try:
                finished = await loop.run_in_executor(self._executor, self._step)
            except Exception as e:  # a bug in the engine: say so loudly, stop serving requests
                traceback.print_exc(file=sys.stderr)
                self.dead = f"{type(e).__name__}: {e}"
                self._fail_all(ApiError(f"the engine failed: {self.dead}", 500, "InternalServerError"))
                self._notify_step()
                return
            for req in finished:
                self._resolve(req)
            self._notify_step()
        self._notify_step()

    def _admit(self) -> None:
        pending, self._queue = self._queue, []
        for req in pending:
            req.seq, self._seq = self._seq, self._seq + 1
            self.stats.requests_added += 1
            rejected = self.engine.add_request(req)
            if rejected is not None:
                self.stats.requests_rejected += 1
                self._resolve(rejected)

    def _step(self) -> list[Request]:
        """Runs in the worker thread."""
        finished = self.engine.step()
        trace = self.engine.drain_trace()
        faults = self.engine.truth.drain()
        if trace is not None:
            preempted = trace["preempted"].to_pylist()
            sizes = [b for b, p in zip(trace["batch_size"].to_pylist(), preempted) if not p]
            s = self.stats
            s.steps += 1
            s.preemptions += sum(preempted)
            if sizes:
                s.max_batch_size = max(s.max_batch_size, max(sizes))
                s.scheduled_sum += sizes[0]
        if self.sink is not None:
            self.sink.add("trace", trace)
            self.sink.add("faults", faults)
        return finished

    def _resolve(self, req: Request) -> None:
        owner, fut = self._futures.get(req.request_id, (None, None))
        if owner is not req or fut.done():  # taken back by its client: the id may already name a new request
            return
        del self._futures[req.request_id]
        if req.error is None:
            self.stats.requests_finished += 1
            self.stats.tokens_generated += len(req.output_token_ids)
        fut.set_result(req)

    def _fail_all(self, error: ApiError) -> None:
        self._queue = []
        futures, self._futures = self._futures, {}
        for _, fut in futures.values():
            if not fut.done():
                fut.set_exception(error)
