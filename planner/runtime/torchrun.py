"""``python -m planner.runtime.torchrun ARGS``: torchrun with the same arguments, whose failure is one line.

When a rank exits nonzero (a plan started with the wrong number of processes, a model file that
changed), that rank has already printed its own one-sentence reason; torchrun then adds its
ChildFailedError report and a Python traceback of itself. This runs torchrun's own `run()` and ends
such a failure with one line naming the failed ranks and their exit code.
"""
from __future__ import annotations

import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(argv))
    except ChildFailedError as exc:
        failures = sorted(exc.failures.items())  # global rank -> ProcessFailure
        code = next((f.exitcode for _, f in failures if f.exitcode), 1)
        ranks = ", ".join(str(r) for r, _ in failures[:8]) + (" ..." if len(failures) > 8 else "")
        print(f"error: {len(failures)} rank(s) failed (rank {ranks}; exit code {code}); each rank's message above "
              "says why", file=sys.stderr)
        return code if 0 < code < 256 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
