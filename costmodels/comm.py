"""Communication cost: alpha-beta models of p2p, ring and hierarchical collectives, PCIe, and the
tensor-parallel all-reduces of a transformer block.

Every function is pure: bytes, rank counts and link figures in, seconds out. ``bw`` is the
per-rank unidirectional bandwidth in bytes/s and ``latency`` the per-step latency in seconds
(a ring collective over n ranks takes n-1 steps per phase). Figures are whatever the caller
passes; scale ``bw`` by an efficiency factor to model achieved rather than peak bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass

from targets.specs import ClusterSpec, GPUSpec

__all__ = [
    "p2p_time", "ring_allreduce_time", "allgather_time", "reduce_scatter_time",
    "hierarchical_allreduce_time", "allreduce_time", "alltoall_time", "pcie_time", "megatron_bucket_params", "exposed_reduction_s",
    "TPCommVolume", "TPCommTime", "tp_block_comm_bytes", "tp_block_comm_time",
]


def _check(nbytes: float, n: int = 1, bw: float = 1.0, latency: float = 0.0) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"number of ranks must be a positive integer, got {n!r}")
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if not bw > 0:
        raise ValueError(f"bandwidth must be > 0 bytes/s, got {bw!r}")
    if not latency >= 0:
        raise ValueError(f"latency must be >= 0 s, got {latency!r}")


def p2p_time(nbytes: float, bw: float, latency: float) -> float:
    """Send ``nbytes`` over one link: latency + nbytes / bw."""
    _check(nbytes, bw=bw, latency=latency)
    return latency + nbytes / bw


def ring_allreduce_time(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-reduce of an ``nbytes`` buffer over ``n`` ranks.

    2(n-1)/n * nbytes/bw + 2(n-1) * latency: a reduce-scatter then an all-gather, each n-1
    steps moving nbytes/n per rank. Zero for n == 1.
    """
    _check(nbytes, n, bw, latency)
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * latency


def reduce_scatter_time(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring reduce-scatter of an ``nbytes`` input (each rank keeps nbytes/n): half an all-reduce."""
    _check(nbytes, n, bw, latency)
    if n == 1:
        return 0.0
    return (n - 1) / n * nbytes / bw + (n - 1) * latency


def allgather_time(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-gather whose OUTPUT is ``nbytes`` (each rank contributes nbytes/n): half an all-reduce."""
    return reduce_scatter_time(nbytes, n, bw, latency)


def hierarchical_allreduce_time(nbytes: float, n: int, gpus_per_node_in_group: int,
                                cluster: ClusterSpec) -> float:
    """All-reduce over ``n`` ranks laid out ``gpus_per_node_in_group`` per node.

    Reduce-scatter within each node over NVLink, then all-reduce the 1/k shard across the
    n/k nodes (the k ranks of a node do this in parallel, each on its own share of the NICs),
    then all-gather within the node.
    """
    k = gpus_per_node_in_group
    _check(nbytes, n)
    _check(nbytes, k)
    if n % k:
        raise ValueError(f"group of {n} ranks cannot be split into nodes of {k} ranks "
                         f"({n} is not divisible by {k})")
    if k > cluster.gpus_per_node:
        raise ValueError(f"{k} ranks per node exceeds the cluster's {cluster.gpus_per_node} GPUs per node")
    nodes = n // k
    intra = (cluster.nvlink_bw, cluster.nvlink_latency_s)
    return (reduce_scatter_time(nbytes, k, *intra)
            + ring_allreduce_time(nbytes / k, nodes, cluster.internode_bw, cluster.internode_latency_s)
            + allgather_time(nbytes, k, *intra))


def allreduce_time(nbytes: float, ranks_per_node: int, n_nodes: int, cluster: ClusterSpec) -> float:
    """All-reduce over ``ranks_per_node * n_nodes`` ranks: a NVLink ring within one node,
    otherwise hierarchical (NVLink inside nodes, inter-node links between them)."""
    _check(nbytes, ranks_per_node)
    _check(nbytes, n_nodes)
    if n_nodes == 1:
        if ranks_per_node > cluster.gpus_per_node:
            raise ValueError(f"{ranks_per_node} ranks per node exceeds the cluster's "
                             f"{cluster.gpus_per_node} GPUs per node")
        return ring_allreduce_time(nbytes, ranks_per_node, cluster.nvlink_bw, cluster.nvlink_latency_s)
    return hierarchical_allreduce_time(nbytes, ranks_per_node * n_nodes, ranks_per_node, cluster)


def alltoall_time(nbytes: float, n: int, ranks_per_node: int, cluster: ClusterSpec) -> float:
    """All-to-all over ``n`` ranks laid out ``ranks_per_node`` per node, each rank holding ``nbytes`` of which it
    keeps 1/n and sends 1/n to every other rank (an expert-parallel dispatch or combine). The peers in its node are
    reached over NVLink, the others through the node's NICs, both at once: the slower of the two, plus one latency
    per peer it posts sends to over the slower path (NCCL's all-to-all is a grouped send/recv to every peer)."""
    _check(nbytes, n)
    _check(nbytes, ranks_per_node)
    if n == 1:
        return 0.0
    k = min(ranks_per_node, n)
    near = (k - 1) / n * nbytes / cluster.nvlink_bw + (k - 1) * cluster.nvlink_latency_s
    far = (n - k) / n * nbytes / cluster.internode_bw + (n - k) * cluster.internode_latency_s if n > k else 0.0
    return max(near, far)


def pcie_time(nbytes: float, gpu: GPUSpec) -> float:
    """Copy ``nbytes`` between host and device in one direction at the GPU's PCIe bandwidth."""
    _check(nbytes, bw=gpu.pcie_bw)
    return nbytes / gpu.pcie_bw


@dataclass(frozen=True, kw_only=True, slots=True)
class TPCommVolume:
    """Tensor-parallel communication of one transformer block, one microbatch.

    Megatron's block does 2 all-reduces forward (after attention and after the MLP) and 2
    backward (their conjugates on the input gradients), each of a b*s*h activation. A ring
    all-reduce over t ranks sends 2(t-1)/t of the message from every rank, so per rank per
    layer per microbatch: 4 * 2(t-1)/t * bsh = 8bsh(t-1)/t elements — the thesis' figure
    (D. Narayanan, "Resource-Efficient Execution of Deep Learning Computations",
    Stanford PhD thesis, 2021, sec. 4.3.2).
    """

    allreduce_bytes: float
    """Size of each all-reduce message: b*s*h*dtype_bytes."""
    allreduces_fwd: int
    """All-reduces in the forward pass (2)."""
    allreduces_bwd: int
    """All-reduces in the backward pass (2)."""
    elements_sent_per_gpu: float
    """The thesis' 8bsh(t-1)/t, in elements (fwd + bwd)."""
    bytes_sent_per_gpu: float
    """8bsh(t-1)/t * dtype_bytes: bytes each GPU sends per layer per microbatch (fwd + bwd)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class TPCommTime:
    """Seconds of tensor-parallel all-reduce in one block, one microbatch."""

    fwd_s: float
    bwd_s: float

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s


def _check_block(b: int, s: int, h: int, t: int, dtype_bytes: float) -> None:
    for name, value in (("b", b), ("s", s), ("h", h), ("t", t)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not dtype_bytes > 0:
        raise ValueError(f"dtype_bytes must be > 0, got {dtype_bytes!r}")


def tp_block_comm_bytes(b: int, s: int, h: int, t: int, dtype_bytes: float = 2) -> TPCommVolume:
    """Megatron TP all-reduce volume of one transformer block (b microbatch, s sequence,
    h hidden, t tensor-parallel ranks); see TPCommVolume."""
    _check_block(b, s, h, t, dtype_bytes)
    elements = 8 * b * s * h * (t - 1) / t
    return TPCommVolume(allreduce_bytes=float(b * s * h * dtype_bytes), allreduces_fwd=2,
                        allreduces_bwd=2, elements_sent_per_gpu=elements,
                        bytes_sent_per_gpu=elements * dtype_bytes)


def tp_block_comm_time(b: int, s: int, h: int, t: int, cluster: ClusterSpec,
                       dtype_bytes: float = 2) -> TPCommTime:
    """Forward and backward seconds of the block's TP all-reduces.

    The t ranks fill one node when t <= gpus_per_node (NVLink ring); otherwise they span
    t / gpus_per_node whole nodes (hierarchical all-reduce), so t must then be a multiple of it.
    """
    volume = tp_block_comm_bytes(b, s, h, t, dtype_bytes)
    per_node = cluster.gpus_per_node
    if t <= per_node:
        ranks_per_node, n_nodes = t, 1
    elif t % per_node == 0:
        ranks_per_node, n_nodes = per_node, t // per_node
    else:
        raise ValueError(f"tensor-parallel size t={t} spans nodes but is not a multiple of "
                         f"gpus_per_node={per_node}")
    one = allreduce_time(volume.allreduce_bytes, ranks_per_node, n_nodes, cluster)
    return TPCommTime(fwd_s=volume.allreduces_fwd * one, bwd_s=volume.allreduces_bwd * one)


def megatron_bucket_params(dp: int) -> int:
    """Parameters per gradient bucket in Megatron-Core's DistributedDataParallel: max(40M, 1M x dp)
    (megatron/core/distributed/distributed_data_parallel.py), so that a ring's per-rank message stays large."""
    return max(40_000_000, 1_000_000 * dp)


def exposed_reduction_s(grads_s: list[float], gather_s: list[float], fwd_s: list[float], bwd_s: list[float],
                        bucket: list[float], first_group: int, last_group: int) -> float:
    """Seconds of data-parallel communication a pipeline rank does not hide under its compute when the
    gradient reduction is bucketed and launched during the backward, and the parameter all-gather of a
    sharded optimizer during the next forward (Megatron-Core's --overlap-grad-reduce /
    --overlap-param-gather; DDP and FSDP do the same).

    Per model chunk k of the rank (k = 0 first in the model): grads_s[k] / gather_s[k] its reduction and
    all-gather alone, fwd_s[k] / bwd_s[k] one microbatch through it, bucket[k] the share of its parameters in
    one bucket. Gradients are reduced once, in the last microbatch's backward; under interleaving the rank
    runs its first `first_group` microbatches' forwards chunk by chunk (0 first) and the backwards of its last
    `last_group` microbatches chunk by chunk, v-1 first, so chunk k's
    gradients are final k groups of backwards before the rank's last one. The reductions share one
    communication stream, a bucket starts when its gradients are final, and the bucket of the chunk's
    first layers is final only when the chunk's backward ends: that bucket is always exposed for chunk 0.
    The all-gathers run in model order from the end of the optimizer step; a chunk's first forward waits
    for its first bucket, and its last bucket must arrive before the forward reaches it."""
    v = len(grads_s)
    end = [-last_group * sum(bwd_s[:k]) for k in range(v)]  # chunk k's last backward ends here (rank's last: 0)
    done = float("-inf")
    for k in reversed(range(v)):
        if grads_s[k]:
            start = max(done, end[k] - bwd_s[k])
            done = max(start + grads_s[k], end[k] + grads_s[k] * bucket[k])
    exposed = max(0.0, done)
    if any(gather_s):
        arrived, late = 0.0, gather_s[0] * bucket[0]  # the first forward cannot start before its first bucket
        for k in range(v):
            arrived += gather_s[k]
            begins = first_group * sum(fwd_s[:k])  # warm-up: the rank's first forwards go chunk by chunk
            late = max(late, arrived - begins - fwd_s[k] * (1 - bucket[k]))
        exposed += max(0.0, late)
    return exposed
