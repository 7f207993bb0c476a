"""torchrun commands that run a plan: one per node, rendezvous endpoint as a parameter.

They call torchrun through `python -m planner.runtime.torchrun` (the same arguments), which ends a failed
rank with one line instead of torchrun's own traceback."""
from __future__ import annotations

__all__ = ["TORCHRUN", "MPS_START", "torchrun_commands", "launch_script"]

TORCHRUN = "python -m planner.runtime.torchrun"  # torchrun's arguments, a failure in one line
MPS_START = "nvidia-cuda-mps-control -d"
"""Starts MPS's control daemon on a node (a no-op error if it runs already): a plan whose fill jobs share the GPUs
by MPS (planner/fill/physics.py) runs it on every node before torchrun."""


def torchrun_commands(plan_path: str, n_gpus: int, gpus_per_node: int,
                      endpoint: str = "${RDZV_ENDPOINT:-localhost:29500}",
                      mps: bool = False) -> tuple[int, int, list[str]]:
    """`mps`: the plan's fill jobs share the GPUs by MPS, whose daemon each node's command starts first."""
    nnodes = max(1, n_gpus // gpus_per_node)
    nproc = min(n_gpus, gpus_per_node)
    first = f"{MPS_START}; " if mps else ""
    cmds = [f"{first}{TORCHRUN} --nnodes {nnodes} --nproc-per-node {nproc} --node-rank {i} --rdzv-backend c10d "
            f"--rdzv-endpoint {endpoint} --rdzv-id fxplanner -m planner.runtime {plan_path}"
            for i in range(nnodes)]
    return nnodes, nproc, cmds


def launch_script(plan_path: str, n_gpus: int, gpus_per_node: int, mps: bool = False) -> str:
    nnodes, nproc, _ = torchrun_commands(plan_path, n_gpus, gpus_per_node)
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# Run on each of the {nnodes} node(s): ./launch.sh NODE_RANK  (RDZV_ENDPOINT=host:port of node 0)",
        "set -euo pipefail",
        'NODE_RANK="${1:?usage: launch.sh NODE_RANK}"',
        *([f"{MPS_START} || true  # the fill jobs share the GPUs by MPS (fill gpu_sharing: mps)"] if mps else []),
        f"exec {TORCHRUN} --nnodes {nnodes} --nproc-per-node {nproc} --node-rank \"$NODE_RANK\" "
        f"--rdzv-backend c10d --rdzv-endpoint \"${{RDZV_ENDPOINT:-localhost:29500}}\" --rdzv-id fxplanner "
        f"-m planner.runtime {plan_path}",
        "",
    ])

