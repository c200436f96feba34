"""The recorder: sampled requests off a bounded queue into the rolling run directory, on a thread of its own.

Contract: `Recorder(run, recording, queue_size, part_rows, part_seconds, retention)`; `offer(sample)` never blocks:
it returns False (and counts a drop) when the queue is full, so a slow disk or a burst costs samples,
never a client's time. The thread turns samples into rows (`record.Recording`) and commits a part when
`part_rows` requests are buffered or the oldest buffered one is `part_seconds` old: a `watch/` part
(the side table: status, requests in flight, upstream request id, replica headers), then tokens, then
requests (`RunDir.append_requests`: a request is recorded iff its requests part exists, so a SIGKILL
loses at most the samples not yet committed, never one already written). After each commit, `retention`
(`lpf.watch.retention.Retention`, `--retain`) deletes the oldest commits once the run is too big or too old
(counted in `pruned_parts` and `pruned_bytes`). `close()` commits what is buffered and stops the thread.
Counters (`recorded`, `dropped`, `failed`, `pruned_parts`) are read by /metrics.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import pyarrow as pa

from lpf.run import schema
from lpf.run.store import RunDir
from lpf.watch.evidence import Sample
from lpf.watch.record import WATCH, Recording
from lpf.watch.retention import Retention

log = logging.getLogger("lpf.watch")
_STOP = object()


class Recorder:
    def __init__(
        self,
        run: RunDir,
        recording: Recording,
        queue_size: int = 1024,
        part_rows: int = 256,
        part_seconds: float = 2.0,
        retention: Retention | None = None,
    ):
        self.run, self.recording, self.retention = run, recording, retention or Retention()
        self.pruned_parts = self.pruned_bytes = 0
        self.part_rows, self.part_seconds = part_rows, part_seconds
        self.q: queue.Queue = queue.Queue(maxsize=queue_size)
        self.recorded = self.dropped = self.failed = self.parts = 0
        self._thread = threading.Thread(target=self._loop, name="lpf-watch-recorder", daemon=True)
        self._thread.start()

    def offer(self, sample: Sample) -> bool:
        try:
            self.q.put_nowait(sample)
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def depth(self) -> int:
        return self.q.qsize()

    def close(self, timeout: float = 30.0) -> None:
        while True:
            try:
                self.q.put(_STOP, timeout=0.1)
                break
            except queue.Full:
                if not self._thread.is_alive():
                    return
        self._thread.join(timeout)

    def _loop(self) -> None:
        buf: list[tuple[dict, list, dict]] = []
        oldest = None
        while True:
            wait = self.part_seconds if oldest is None else max(0.0, oldest + self.part_seconds - time.monotonic())
            try:
                item = self.q.get(timeout=wait if buf else None)
            except queue.Empty:
                item = None
            if item is _STOP:
                self._commit(buf)
                return
            if item is not None:
                try:
                    buf.append(self.recording.rows(item))
                except Exception as e:  # one odd answer must not stop recording
                    self.failed += 1
                    log.warning("lpf watch: sample %s not recorded (%s: %s)", item.seq, type(e).__name__, e)
                oldest = oldest or time.monotonic()
            if buf and (len(buf) >= self.part_rows or time.monotonic() - oldest >= self.part_seconds):
                self._commit(buf)
                buf, oldest = [], None

    def _commit(self, buf: list) -> None:
        if not buf:
            return
        try:
            self.run.append("watch", pa.Table.from_pylist([w for _, _, w in buf], schema=WATCH))
            tokens = [t for _, ts, _ in buf for t in ts]
            self.run.append_requests(
                pa.Table.from_pylist([r for r, _, _ in buf], schema=schema.REQUESTS),
                pa.Table.from_pylist(tokens, schema=schema.TOKENS),
            )
            self.recorded += len(buf)
            self.parts += 1
        except Exception as e:
            self.failed += len(buf)
            log.error("lpf watch: a part of %d samples could not be written (%s: %s)", len(buf), type(e).__name__, e)
        if self.retention:
            try:
                parts, freed = self.retention.prune(self.run.path, time.time())
                self.pruned_parts, self.pruned_bytes = self.pruned_parts + parts, self.pruned_bytes + freed
            except OSError as e:  # a part that cannot be deleted now is tried again after the next commit
                log.error("lpf watch: retention: %s: %s", type(e).__name__, e)
