"""Shared pieces of the runtime tests: plans, torchrun, the single-process reference."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from passes.load import load_model_file
from planner.api import make_plan
from planner.plan import Plan, save_plan
from planner.runtime import child_env
from planner.runtime.stage import to_precision
from planner.search import Pins

ROOT = Path(__file__).resolve().parents[2]
GPT = ROOT / "examples" / "gpt.py"
SKIPNET = Path(__file__).resolve().parent / "skipnet.py"


def gpt_args(layers: int = 4) -> dict[str, Any]:
    """GPT tiny under PyTorch's default init (gpt.py's before issue 51), on which these tests' tolerances were set:
    its larger activations and gradients make fp16 at a 2^16 loss scale overflow, bf16's rounding show in the loss,
    and keep Adam out of its epsilon regime, where float noise in a near-zero gradient becomes a visible step (under
    Megatron's N(0, 0.02) init a parameter or two drift 2e-5 from the single process's, bf16 and fp32 losses 1e-5
    apart). What is compared, the runtime against one process, does not depend on the init."""
    return {"preset": "tiny", "layers": layers, "dropout": 0, "init": "pytorch"}


def plan_file(path: Path, model: Path, model_args: dict[str, Any], *, gpus: int, global_batch: int,
              t: int, p: int, d: int, b: int, v: int, schedule: str, recompute: str = "none", zero: int = 0,
              overlap: bool = False, precision: str = "fp32", grad_fp32: bool = False, sp: bool = False, cp: int = 1,
              recompute_layers: int | None = None) -> Plan:
    plan, _ = make_plan(str(model), gpus=gpus, global_batch=global_batch, target="a100-80gb", gpus_per_node=gpus,
                        model_args=model_args,
                        pins=Pins(tp=t, pp=p, dp=d, b=b, v=v, schedule=schedule, recompute=recompute, sp=sp, cp=cp,
                                  recompute_layers=recompute_layers,
                                  precision=precision, zero=zero, overlap_grad_reduce=overlap, grad_fp32=grad_fp32))
    c = plan.config
    assert (c.tp, c.pp, c.dp, c.cp, c.microbatch, c.vp, c.schedule, c.zero) == (t, p, d, cp, b, v, schedule, zero)
    save_plan(plan, path)
    return plan


def torchrun(nproc: int, args: list[str], *, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """Real torchrun on CPU: --standalone picks a free rendezvous port; --tee prefixes each rank's lines."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
           "--nproc-per-node", str(nproc), "--tee", "3", "-m", "planner.runtime", *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=child_env())


def launch_plans(plans: dict[str, Plan], tmp: Path, *, steps: int, optimizer: str, lr: float) -> dict[str, Any]:
    """Save the plans, run them one after the other in one torchrun of 2 processes (no fill), and return each plan's
    run (planner.metrics.RunEntry) by its name."""
    from planner.metrics import load_metrics

    for name, plan in plans.items():
        save_plan(plan, tmp / f"{name}.json")
    proc = torchrun(2, [*(str(tmp / f"{n}.json") for n in plans), "--steps", str(steps), "--optimizer", optimizer,
                        "--lr", str(lr), "--no-fill", "--metrics", str(tmp / "metrics.json")], cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    return dict(zip(plans, load_metrics(tmp / "metrics.json").runs))


def rank_lines(text: str, rank: int) -> list[str]:
    """Lines a rank printed (torchrun --tee prefixes them with [default<rank>]:)."""
    prefix = f"[default{rank}]:"
    return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


_FAILURE = re.compile(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def exit_codes(text: str) -> dict[int, int]:
    """Per-rank exit codes from torchrun's failure summary."""
    return {int(r): int(code) for r, code in _FAILURE.findall(text)}


def reference(model: Path, model_args: dict[str, Any], *, global_batch: int, steps: int, optimizer: str,
              lr: float, seed: int = 0, dtype: torch.dtype = torch.float32, skip: tuple[int, ...] = ()) -> dict[str, Any]:
    """Single-process training on the full global batch: losses, final parameters and gradients. Under
    bf16/fp16 the model runs in that dtype (initialised in fp32, then rounded) and the optimizer steps fp32
    master weights, the loss in fp32 (mixed precision as Megatron runs it). Steps in `skip` compute their loss
    and take no optimizer step (an fp16 run's overflowed steps)."""
    mf = load_model_file(model, model_args)
    torch.manual_seed(seed)
    net = to_precision(mf.build("cpu", torch.float32), dtype)
    net.train()
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in net.parameters()] \
        if dtype != torch.float32 else list(net.parameters())
    opt = (torch.optim.Adam if optimizer == "adam" else torch.optim.SGD)(masters, lr=lr)
    losses = []
    for step in range(steps):
        net.zero_grad(set_to_none=True)
        inputs, targets = mf.call("sample_batch", global_batch, step)
        out = net(*(i.to(dtype) if i.is_floating_point() else i for i in inputs))  # as the runtime casts them
        loss = mf.module.loss_fn(out.float() if isinstance(out, torch.Tensor) else out, targets)
        loss.backward()
        if step in skip:
            losses.append(loss.item())
            continue
        if dtype != torch.float32:
            for p, m in zip(net.parameters(), masters):
                m.grad = p.grad.float()
        opt.step()
        if dtype != torch.float32:
            with torch.no_grad():
                for p, m in zip(net.parameters(), masters):
                    p.copy_(m)
        losses.append(loss.item())
    return {"loss": losses, "params": {n: p.detach().clone() for n, p in net.named_parameters()},
            "grads": {n: p.grad.clone() for n, p in net.named_parameters()}}


def percent(mismatch: str) -> float:
    """The error of a `planner.validate.mismatches` sentence, in percent ('... (+7.3%)' -> 7.3)."""
    return float(mismatch.rsplit("(", 1)[1][:-2])
