"""The fxplanner runtime's memory against its plan's, on CPU: one rank rehearsed under a tracker of every tensor storage.

    python bench/runtime_memory.py [--ranks 0 2 3] [--json out.json]

Plans examples/hf_llama.py (Llama 3's shape at hidden 512, 8 layers, 8 heads / 2 kv heads, FFN 1792, vocabulary
16000, seq 512) for p = 4, bf16, 1F1B, b = 1, on the cpu-core target, and rehearses each rank in this process
(`planner rehearse`: its stages built by the runtime's own prepare, its peers replayed). A dispatch mode records every
storage an op creates and when it dies: the peak of their sum is what the rank allocates at once, comparable with
the plan's memory less its fixed reserve. It prints, per rank, the two and what was alive at the peak by the op that
made it (aten._to_copy bf16: weights; zeros_like fp32: Adam's moments; clone fp32: master weights; mm and the
elementwise ops: gradients and activations). The CPU counterpart of bench/rehearse.py's "peak allocated" on a GPU
(bench/results/README_cuda_2026-11-28.md), without the caching allocator.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import weakref
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL_ARGS = {"preset": "llama3-8b", "layers": 8, "hidden_size": 512, "intermediate_size": 1792,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 16000, "seq": 512}
MIB = 2 ** 20


class LiveStorages(TorchDispatchMode):
    """Bytes of the tensor storages ops create while the mode is on and that are still alive; their peak, and what
    was alive at it ({(op, dtype): bytes})."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.alive: dict[int, tuple[int, str]] = {}
        self.at_peak: Counter = Counter()
        self._op = ""

    def _track(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
            key, n = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # fake or functional tensors hold no memory
            return
        if key in self.alive or n == 0:
            return
        self.alive[key] = (n, f"{self._op} {t.dtype}".replace("torch.", ""))
        self.live += n
        if self.live > self.peak:
            self.peak = self.live
            self.at_peak = Counter()
            for size, what in self.alive.values():
                self.at_peak[what] += size
        weakref.finalize(storage, self._gone, key)

    def _gone(self, key: int) -> None:
        entry = self.alive.pop(key, None)
        if entry is not None:
            self.live -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._op = str(func).removesuffix(".default")
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                self._track(t)
        return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[0, 2, 3])
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    from planner.api import make_plan
    from planner.plan import save_plan
    from planner.runtime.rehearse import RehearseOptions, rehearse
    from planner.search import Pins

    plan, _ = make_plan(str(ROOT / "examples" / "hf_llama.py"), gpus=4, global_batch=16,
                        target=str(ROOT / "examples" / "targets" / "cpu-core.yaml"), gpus_per_node=4,
                        model_args=MODEL_ARGS, pins=Pins(tp=1, pp=4, dp=1, cp=1, b=1, v=1, schedule="1f1b",
                                                         precision="bf16", recompute="none"))
    path = Path(tempfile.mkdtemp(prefix="fxp-memory-")) / "plan.json"
    save_plan(plan, path)
    rows = []
    for rank in args.ranks:
        m = plan.predictions.memory[rank]
        tracker = LiveStorages()
        with tracker:
            rehearse(path, RehearseOptions(rank=rank, steps=3, device="cpu"), log=lambda _: None)
        planned = m.total - m.reserve
        rows.append({"rank": rank, "planned_bytes": planned, "tracked_peak_bytes": tracker.peak,
                     "planned": {k: getattr(m, k) for k in ("weights", "grads", "optimizer", "activations")},
                     "alive_at_peak": dict(tracker.at_peak.most_common())})
        print(f"rank {rank}: planned {planned / MIB:.1f} MiB, tracked peak {tracker.peak / MIB:.1f} MiB "
              f"({tracker.peak / planned - 1:+.1%})")
        for what, n in tracker.at_peak.most_common(8):
            print(f"    {n / MIB:8.1f} MiB  {what}")
    if args.json:
        Path(args.json).write_text(json.dumps({"command": " ".join(["python", "bench/runtime_memory.py",
                                                                     *(argv or sys.argv[1:])]),
                                               "torch": torch.__version__, "model_args": MODEL_ARGS,
                                               "config": plan.config.model_dump(), "ranks": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
