"""The main job's handle on its rank's fill executor (PipeFill's bubble signalling, §4.2).

The main job's rank process calls bubble_begin / bubble_end at its BUBBLE actions. Both only read
the clocks and put a tuple on an in-process queue (tens of microseconds at worst, mostly the futex
that wakes the sender thread; no lock the executor can hold); a sender thread turns it into a
message on a pipe to the executor process, after waiting for the CUDA `ready` event when one is
given. The main job waits on the executor only in wait_ready(), report() and close(), each with a
timeout; an executor that crashed or hangs changes nothing else.

The executor is started with the 'spawn' context, which re-imports the caller's __main__ module in
the child: keep a launcher script's work under `if __name__ == "__main__":` (`python -m
planner.runtime` is fine).
"""
from __future__ import annotations

import atexit
import hashlib
import multiprocessing as mp
import queue
import sys
import threading
import time
from typing import Any

from planner.plan import Plan

from .fill_executor import GRACE_S, BubbleBegin, BubbleEnd, FillExecutorOptions, Request, executor_main

__all__ = ["FillClient"]

_REPORT_LISTS = ("jobs", "bubbles", "overruns", "kills", "errors", "transitions")
_STARTS = 0  # executors started by this process: with the plan, names the run for the fill jobs' replicas


class FillClient:
    """Signals bubbles to this rank's fill executor process and collects its report."""

    def __init__(self, proc: Any, cmd: Any, results: Any, pipeline_rank: int, jobs: list[str]) -> None:
        self.pipeline_rank, self.jobs = pipeline_rank, jobs
        self._proc, self._cmd, self._results = proc, cmd, results
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._seq = 0
        self._ended_seq = 0
        self._dead = False
        self._ready: dict[str, str] | None = None
        self._report: dict[str, Any] | None = None
        self._closed = False
        self._sender = threading.Thread(target=self._send_loop, name=f"fxp-fill-signal-{pipeline_rank}", daemon=True)
        self._sender.start()
        atexit.register(self.close)  # before multiprocessing's own exit hook joins the executor

    @classmethod
    def start(cls, plan: Plan, pipeline_rank: int, global_rank: int, device: str,
              measured_bubbles: dict[int, float] | None = None, grace_s: float = GRACE_S, *,
              options: FillExecutorOptions | None = None) -> "FillClient | None":
        """Spawn this rank's executor process (multiprocessing 'spawn' context) if the plan assigns fill
        chunks to pipeline_rank; None otherwise. Returns at once: the fill jobs load in the background
        (wait_ready() waits for them). `measured_bubbles` (bubble id -> seconds) caps the duration the
        main job passes to bubble_begin; `grace_s` is how long past a bubble's end a fill task may take
        to pause before it is killed."""
        chunks = [c for c in plan.fill.chunks if c.rank == pipeline_rank] if plan.fill else []
        if not chunks:
            return None
        if grace_s < 0:
            raise ValueError(f"grace_s={grace_s} must be >= 0")
        unknown = sorted({c.job for c in chunks} - {j.name for j in plan.fill.jobs})
        if unknown:
            raise ValueError(f"fill chunks of pipeline rank {pipeline_rank} name jobs {unknown} that the plan's "
                             "fill section does not list")
        device = _explicit_device(str(device))
        global _STARTS
        _STARTS += 1  # every rank of a stage starts the same plans in the same order: the same key
        run_key = f"{hashlib.sha1(plan.model_dump_json().encode()).hexdigest()[:12]}-{_STARTS}"
        ctx = mp.get_context("spawn")
        cmd_r, cmd_w = ctx.Pipe(duplex=False)
        res_r, res_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=executor_main, name=f"fxp-fill-executor-{global_rank}",
                           args=(plan.model_dump_json(by_alias=True), pipeline_rank, global_rank, device,
                                 dict(measured_bubbles or {}), float(grace_s), options or FillExecutorOptions(),
                                 cmd_r, res_w, run_key))
        proc.start()
        cmd_r.close()
        res_w.close()
        jobs = list(dict.fromkeys(c.job for c in chunks))
        return cls(proc, cmd_w, res_r, pipeline_rank, jobs)

    # ---- the main job's hot path ------------------------------------------------------------------

    def bubble_begin(self, bubble_id: int, duration_s: float, free_bytes: int, ready: Any = None) -> None:
        """Non-blocking: a bubble starts now; its deadline is now + duration_s. With `ready` (a CUDA
        event recorded after the main job's last kernel) the bubble starts, and the signal is sent,
        when event.synchronize() returns in the sender thread: when the GPU goes idle."""
        self._seq += 1
        self._queue.put((self._seq, bubble_id, duration_s, free_bytes, time.time(), time.monotonic(), ready))

    def bubble_end(self, bubble_id: int) -> None:
        """Non-blocking: the main job resumes; the executor pauses its task now."""
        wall, mono = time.time(), time.monotonic()
        self._ended_seq = self._seq
        self._queue.put(("end", self._seq, bubble_id, wall, mono))

    # ---- shutdown ----------------------------------------------------------------------------------

    def wait_ready(self, timeout_s: float = 120.0) -> bool:
        """Block until every fill job of the rank has built its model and been initialized on the device
        (InitSideTask, done while this waits: the device is idle), or failed; for setup time only."""
        if self._ready is None:
            self._await("ready", timeout_s)
        return self._ready is not None

    def report(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Blocking, at shutdown: stops the fill jobs and returns what the executor did, as plain JSON
        data: "jobs" (state, stop reason, error, units/iterations/samples done, measured and predicted
        unit times), "bubbles" (per occurrence: id, main_begin/gpu_idle/main_end/deadline timestamps
        from time.time(), steps with start/end, units_done, samples_done, overruns, kills, errors),
        "overruns", "kills", "errors" and "transitions" (the state-machine log). Never raises: a dead
        or hung executor gives the same keys, empty, plus "error"."""
        if self._report is None:
            self._queue.put(Request(kind="report"))
            got = self._await("report", timeout_s)
            self._report = got if isinstance(got, dict) else {**{k: [] for k in _REPORT_LISTS}, "error": got}
        return self._report

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the fill jobs and the executor process; idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._proc.is_alive() and not self._dead:
            self._queue.put(Request(kind="close"))
            self._await("closed", timeout_s)
        self._queue.put(None)
        self._sender.join(timeout=1.0)
        self._proc.join(timeout=max(0.1, timeout_s / 2))
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=1.0)
        for conn in (self._cmd, self._results):
            conn.close()

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def __enter__(self) -> "FillClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------------------

    def _await(self, kind: str, timeout_s: float) -> Any:
        """The executor's next `kind` message, or an error string; keeps 'ready' when it passes by."""
        until = time.monotonic() + timeout_s
        while True:
            left = until - time.monotonic()
            try:
                if left <= 0 or not self._results.poll(left):
                    return f"fill executor did not answer '{kind}' within {timeout_s:.0f} s"
                tag, body = self._results.recv()
            except (EOFError, OSError):
                self._proc.join(timeout=1.0)
                return f"fill executor exited (code {self._proc.exitcode}) before answering '{kind}'"
            if tag == "ready":
                self._ready = body
            if tag == "crashed":
                return f"fill executor crashed: {body}"
            if tag == kind:
                return body

    def _send_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, tuple):
                item = self._message(item)
            if self._dead:
                continue
            try:
                self._cmd.send(item)
            except (OSError, ValueError):
                self._dead = True  # executor gone: drop signals, the main job carries on

    def _message(self, item: tuple) -> BubbleBegin | BubbleEnd:
        if item[0] == "end":
            _, seq, bubble_id, wall, mono = item
            return BubbleEnd(seq=seq, bubble_id=bubble_id, wall=wall, mono=mono)
        seq, bubble_id, duration_s, free_bytes, wall, mono, ready = item
        start_wall, start_mono, ended = wall, mono, False
        if ready is not None:  # CUDA path: the bubble starts when the GPU has drained the main job's work
            try:
                ready.synchronize()
                start_wall, start_mono = time.time(), time.monotonic()
                ended = self._ended_seq >= seq  # the main job resumed before the GPU went idle
            except Exception:  # noqa: BLE001 - a broken event must not kill the signal thread
                pass
        return BubbleBegin(seq=seq, bubble_id=bubble_id, duration_s=float(duration_s), free_bytes=int(free_bytes),
                           called_at=wall, start_wall=start_wall, start_mono=start_mono,
                           ended=ended)


def _explicit_device(device: str) -> str:
    """'cuda' means the caller's current device; in a fresh process it would mean cuda:0."""
    torch = sys.modules.get("torch")
    if device == "cuda" and torch is not None and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return device
