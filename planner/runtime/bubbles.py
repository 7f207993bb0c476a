"""One pipeline rank's bubbles as its fill executor is told of them: the one home of that signalling, shared by
fxplanner's own runtime (planner/runtime/executor.py, at its BUBBLE actions) and the engine adapters
(planner/engines/pipelining.py for torch's pipeline runtime, planner/engines/megatron_fill.py for Megatron-LM), so
that they hand the fill job the same durations, the same memory and the same start.

- A bubble's duration is the median of what this rank measured of it in the steps so far, else the plan's (which is
  for the target GPU): one step's can be far off (the first step's warm-up, a descheduled process).
- Its memory is the plan's free bytes; on CUDA also no more than the device has beside what the main job reserved,
  after the allocator's cached free blocks were handed back (PipeFill 4.2).
- On CUDA the fill may start when the compute stream has drained the main job's work: an event recorded there goes
  with bubble_begin (the fill client's sender thread waits it).
- Step 0 runs without fill and measures every bubble; the fill executor starts before step 1 (`start_fill`), once its
  jobs have loaded, outside the timed steps.
"""
from __future__ import annotations

import importlib.util
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Protocol

import torch

from ..plan import Plan

__all__ = ["Bubbles", "FillHooks", "NullFill", "load_fill_client", "mps_running", "sharing_mismatch", "start_fill"]


class FillHooks(Protocol):
    def bubble_begin(self, bubble_id: int, duration_s: float, free_bytes: int, **kw: Any) -> None: ...
    def bubble_end(self, bubble_id: int) -> None: ...
    def report(self) -> dict: ...
    def close(self) -> None: ...


class NullFill:
    """Fill hooks that do nothing: step 0, --no-fill, or no fill client installed."""

    def bubble_begin(self, bubble_id: int, duration_s: float, free_bytes: int, ready: Any = None) -> None:
        pass

    def bubble_end(self, bubble_id: int) -> None:
        pass

    def report(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class Bubbles:
    """The bubbles of one pipeline rank: which one is open, what each lasted, what the fill client is told."""

    def __init__(self, plan: Plan, pipeline_rank: int, device: str) -> None:
        self.info = {b.id: b for b in plan.bubbles if b.rank == pipeline_rank}
        self.cuda = str(device).startswith("cuda")
        self.device_bytes = torch.cuda.get_device_properties(device).total_memory if self.cuda else 0
        self.fill: Any = NullFill()
        self.samples: dict[int, list[float]] = {}
        """Bubble id -> what each step measured of it (seconds, this rank)."""
        self.open: tuple[int, float] | None = None
        """The bubble the rank is in: (id, time.perf_counter() at its start)."""

    @property
    def filling(self) -> bool:
        return not isinstance(self.fill, NullFill)

    def reset(self) -> None:
        """Forget the fill client and the measurements (a new run of the same rank)."""
        self.fill, self.samples, self.open = NullFill(), {}, None

    def duration(self, bubble_id: int) -> float:
        """What the fill client is told the bubble lasts: the median measured so far, else the plan's."""
        if bubble_id in self.samples:
            return statistics.median(self.samples[bubble_id])
        info = self.info.get(bubble_id)
        return info.duration_s if info else 0.0

    def begin(self, bubble_id: int) -> None:
        """The rank idles from now (an open bubble ends first)."""
        self.end(None)
        self.open = (bubble_id, time.perf_counter())
        info = self.info.get(bubble_id)
        free, kwargs = (info.free_bytes if info else 0), {}
        if self.cuda and self.filling:
            # CUDA-only, as PipeFill does at every bubble (4.2): hand the allocator's cached free blocks back so
            # the fill job can use them, and give it no more than the device has beside what the main job holds
            torch.cuda.empty_cache()
            free = min(free, max(0, self.device_bytes - torch.cuda.memory_reserved()))
            ev = torch.cuda.Event()  # the fill job may start once the compute stream reaches this point
            ev.record(torch.cuda.current_stream())
            kwargs["ready"] = ev
        self.fill.bubble_begin(bubble_id, self.duration(bubble_id), free, **kwargs)

    def end(self, t0: float | None) -> dict[str, Any] | None:
        """The rank resumes: the open bubble's record (start relative to `t0`, the step's start), or None."""
        if self.open is None:
            return None
        bubble_id, start = self.open
        self.open = None
        self.fill.bubble_end(bubble_id)
        now = time.perf_counter()
        info = self.info.get(bubble_id)
        return {"id": bubble_id, "start_s": start - (t0 if t0 is not None else start), "duration_s": now - start,
                "predicted_start_s": info.start_s if info else None,
                "predicted_s": info.duration_s if info else None}

    def measured(self, records: list[dict[str, Any]]) -> None:
        """A step's bubble records (from `end`): their durations join each bubble's samples."""
        for b in records:
            self.samples.setdefault(b["id"], []).append(b["duration_s"])


def load_fill_client() -> Any:
    """``planner.runtime.fill_client.FillClient`` if that module exists and imports, else None (the
    main job then runs without fill; a broken fill client is reported, never fatal)."""
    if importlib.util.find_spec("planner.runtime.fill_client") is None:
        return None
    try:
        from .fill_client import FillClient  # noqa: PLC0415 - optional, written separately
    except Exception as exc:  # noqa: BLE001
        print(f"warning: fill client unavailable ({type(exc).__name__}: {exc}); running without fill",
              file=sys.stderr, flush=True)
        return None
    return FillClient


def start_fill(client: Any, plan: Plan, pipeline_rank: int, global_rank: int, device: str, *, grace_s: float,
               options: Any = None) -> Any:
    """This rank's fill executor started and its jobs loaded (the fill client), or NullFill where the plan gives the
    rank no fill chunk or the client did not start (fill is best effort: the main job goes on, warned)."""
    try:
        started = client.start(plan, pipeline_rank, global_rank, device, grace_s=grace_s, options=options)
    except Exception as exc:  # noqa: BLE001 - fill is best effort; the main job goes on
        print(f"warning: rank {global_rank}: fill client did not start ({type(exc).__name__}: {exc})",
              file=sys.stderr, flush=True)
        return NullFill()
    if started is None:
        return NullFill()
    if str(device).startswith("cuda") and (why := sharing_mismatch(plan.fill.gpu_sharing, mps_running())):
        print(f"warning: rank {global_rank}: {why}", file=sys.stderr, flush=True)
    if hasattr(started, "wait_ready"):  # fill models load once, outside the timed steps
        started.wait_ready()
    return started


def mps_running() -> bool:
    """Whether an MPS control daemon serves this node: it listens on the socket `control` in
    CUDA_MPS_PIPE_DIRECTORY (default /tmp/nvidia-mps), which its `quit` leaves behind (seen on an H200: the file
    stays, so only a connection tells)."""
    path = Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")) / "control"
    with socket.socket(socket.AF_UNIX) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def sharing_mismatch(planned: str, mps: bool) -> str | None:
    """One sentence where the node does not share its GPUs the way the plan priced its fill, else None."""
    if planned == "mps" and not mps:
        return ("the plan priced its fill under MPS and no MPS control daemon serves this node: the fill runs "
                "time-sliced beside the main job, slower than planned (start `nvidia-cuda-mps-control -d` first, "
                "as the plan's launch commands do)")
    if planned == "timeslice" and mps:
        return ("an MPS control daemon serves this node and the plan priced its fill time-sliced: the fill may run "
                "faster than planned (plan it with `gpu_sharing: mps`)")
    return None
