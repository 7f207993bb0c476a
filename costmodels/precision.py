"""Training precisions and what each costs per parameter: the one table of bytes per parameter.

Mixed precision (bf16, fp16) keeps the weight and its gradient in 2 bytes and, in the optimizer, an
fp32 master weight plus Adam's momentum and variance (12 bytes): 16 bytes per parameter, as
Megatron counts them (Korthikanti et al. 2022; the thesis' eq. 4.3 memory). fp32 training keeps
4-byte weights and gradients and Adam's two fp32 moments: also 16 bytes. The optimizer part can be
sharded over the data-parallel replicas (ZeRO-1 / Megatron's distributed optimizer).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Precision", "PRECISIONS", "ADAM_HOST_BYTES"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Precision:
    name: str
    """Also the key of the GPU's dense peak FLOP/s (``GPUSpec.peak``)."""
    weight_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    """Adam's state per parameter: fp32 master weight (mixed precision only), momentum, variance."""
    help: str

    def bytes_per_param(self, optimizer_shards: int = 1) -> float:
        """Weights + gradients + optimizer state, the optimizer part divided over its shards."""
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes / optimizer_shards


PRECISIONS: dict[str, Precision] = {
    "bf16": Precision(name="bf16", weight_bytes=2.0, grad_bytes=2.0, optimizer_bytes=12.0,
                      help="bf16 mixed precision, fp32 master weights and Adam state"),
    "fp16": Precision(name="fp16", weight_bytes=2.0, grad_bytes=2.0, optimizer_bytes=12.0,
                      help="fp16 mixed precision (loss scaling), fp32 master weights and Adam state"),
    "fp32": Precision(name="fp32", weight_bytes=4.0, grad_bytes=4.0, optimizer_bytes=8.0,
                      help="fp32 weights, gradients and Adam state"),
}

ADAM_HOST_BYTES = 16.0
"""Bytes an Adam step on the host streams per parameter (read grad, read/write weight and moments)."""
