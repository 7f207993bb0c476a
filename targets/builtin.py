"""Built-in targets, every figure with its source.

Conventions (applied to every entry below):
- FLOP/s are DENSE peaks. NVIDIA's Hopper/Ada datasheets print tensor figures "with sparsity"
  (marked *); those are halved here. fp32 is the non-tensor (CUDA core) figure, since an fp32
  matmul without TF32 runs there; fp64 is the FP64 Tensor Core figure where the GPU has one.
- Memory capacity is binary: NVIDIA's "80GB" HBM is 80 GiB (an A100 80GB reports 81920 MiB in
  nvidia-smi). Bandwidths are decimal (1 GB/s = 1e9 B/s).
- Link figures are per direction. Datasheets quote NVLink and PCIe as bidirectional totals
  (A100: "NVLink 600 GB/s", "PCIe Gen4 64 GB/s"); we halve them.
- PCIe is the datasheet peak (Gen3 16, Gen4 32, Gen5 64 GB/s per direction), not the ~80%
  that pinned-memory copies achieve (~25 GB/s on Gen4): every figure here is a peak, and the
  cost models apply efficiency in one place rather than in some figures and not others.
- Inter-node: per-GPU share of the node's compute NICs, at line rate (200 Gb/s = 25e9 B/s).
- Achievable shares of the peak (GPUSpec.matmul_ceiling, attention_ceiling) are measurements, each
  with its source below: the best-shaped large bf16 GEMM ("maximum achievable matmul FLOPS", Stas
  Bekman's ml-engineering, compute/accelerator/README.md, MAMF comparison table, measured with
  mamf-finder.py: A100 SXM 267.9 of 312 TFLOP/s = 85.9% (CUDA 12.1); H100 SXM 792.1 of 989 = 80.1%
  (CUDA 12.1)) and the flash attention kernel the engines dispatch (FlashAttention-2 on Ampere: "50-73% of
  the theoretical maximum FLOPs/s on A100", Dao 2023, arXiv:2307.08691; FlashAttention-3 / cuDNN on Hopper:
  "FP16 reaching up to 740 TFLOPs/s (75% utilization)" on H100, Shah et al. 2024, arXiv:2407.08608, where
  FlashAttention-2 reached 35%). A GPU without a measurement takes the A100's.
- torch's scaled_dot_product_attention (GPUSpec.sdpa_attention_ceiling; what torchtitan and the fxplanner runtime
  run) takes its FlashAttention-2 backend on Hopper in bf16/fp16 from torch 2.5.1 to 2.10: its dispatch
  (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp priority_order) tries flash, efficient, math, cuDNN since
  cuDNN attention was made opt-in after torch 2.5's bugs (pytorch/pytorch#138522); torch 2.9 put cuDNN first again on
  sm90/sm100 (pytorch/pytorch#162073), gated on a bundled cuDNN newer than 9.15 (check_prefer_cudnn_attention),
  which the wheels carry from torch 2.11. FlashAttention-2 on H100 SXM5, bf16/fp16, causal, head dimension 128,
  sequence 8k: 308 TFLOP/s forward and backward together (FlashAttention-2's H100 benchmark, Dao-AILab/flash-attention
  README "H100", assets/flash2_h100_fwd_bwd_benchmark.png panel d; the forward alone 333, Shah et al. 2024 Figure 5d,
  where cuDNN reaches 529 and FlashAttention-3 602). One share prices both passes (Hardware.matmul_rate), so the
  forward-and-backward figure is the one taken: 308/989 = 31.1%. Blackwell's SDPA prefers cuDNN (the same gate): the
  fused kernel's share (attention_ceiling) stands. A run on torch >= 2.11 on Hopper takes cuDNN: set
  sdpa_attention_ceiling in a target file to price it (cuDNN's forward above: 529/989).
- Latencies are NCCL's own per-step estimates for the ring algorithm, Simple protocol
  (NCCL src/graph/tuning.cc, table hwLat): NVLink 3.4 us, PCI 5.7 us, network 9.6 us.
"""

from __future__ import annotations

from dataclasses import replace

from targets.specs import ClusterSpec, GPUSpec, Target

__all__ = ["BUILTIN_TARGETS", "DEFAULT_TARGET"]

GiB = 2**30
GB = 1e9  # bytes/s multiplier for "GB/s"
TFLOPS = 1e12
GBIT = 1e9 / 8  # bytes/s in one Gb/s

NVLINK_LATENCY_S = 3.4e-6  # NCCL tuning.cc hwLat[NVLINK][Ring][Simple]
PCIE_LATENCY_S = 5.7e-6  # NCCL tuning.cc hwLat[PCI][Ring][Simple]
NET_LATENCY_S = 9.6e-6  # NCCL tuning.cc hwLat[NET][Ring][Simple]

# --- V100 SXM2 ---------------------------------------------------------------------------
# NVIDIA Tesla V100 GPU Accelerator datasheet (V100 SXM2 column): double precision 7.8 TFLOPS,
# single precision 15.7 TFLOPS, tensor performance 125 TFLOPS (fp16 in, fp32 accumulate),
# 16 GB or 32 GB HBM2 at 900 GB/s, PCIe Gen3 32 GB/s (bidirectional -> 16 GB/s per direction).
# No bf16, tf32 or fp8 (those arrive with Ampere/Hopper).
_V100_FLOPS = {"fp64": 7.8 * TFLOPS, "fp32": 15.7 * TFLOPS, "fp16": 125 * TFLOPS}
# Streaming multiprocessors (each architecture's whitepaper): V100 80, A100 108, H100 SXM5 132 (H200 the same die),
# H100 PCIe 114, B200 148 (GB200's GPU taken as the same, an ASSUMPTION), RTX 6000 Ada 142, RTX 3080 68.
V100_16GB = GPUSpec(name="V100 SXM2 16GB", peak_flops=_V100_FLOPS, hbm_bytes=16 * GiB,
                    hbm_bw=900 * GB, pcie_bw=16 * GB, sms=80)
V100_32GB = GPUSpec(name="V100 SXM2 32GB", peak_flops=_V100_FLOPS, hbm_bytes=32 * GiB,
                    hbm_bw=900 * GB, pcie_bw=16 * GB, sms=80)

# DGX-1 with V100 (NVIDIA DGX-1 with Tesla V100 System Architecture whitepaper, 2017): 8 GPUs in
# a hybrid cube-mesh of NVLink2, 6 links per GPU x 25 GB/s per direction = 150 GB/s per direction
# (V100 datasheet: "NVLink 300 GB/s" bidirectional); four 100 Gb/s EDR InfiniBand ports per node
# -> 4 x 12.5 GB/s / 8 GPUs = 6.25 GB/s per GPU.
DGX1_V100 = ClusterSpec(gpus_per_node=8, nvlink_bw=150 * GB, nvlink_latency_s=NVLINK_LATENCY_S,
                        internode_bw=4 * 100 * GBIT / 8, internode_latency_s=NET_LATENCY_S)

# --- A100 SXM ----------------------------------------------------------------------------
# NVIDIA A100 Tensor Core GPU datasheet (2021): FP64 Tensor Core 19.5 TFLOPS, FP32 19.5 TFLOPS,
# TF32 156 TFLOPS, BF16 312 TFLOPS, FP16 312 TFLOPS (dense; 2x with sparsity), no FP8;
# A100 40GB SXM: 40 GB HBM2, 1,555 GB/s; A100 80GB SXM: 80 GB HBM2e, 2,039 GB/s;
# NVLink 600 GB/s (bidirectional), PCIe Gen4 64 GB/s (bidirectional -> 32 GB/s per direction).
_A100_FLOPS = {"fp64": 19.5 * TFLOPS, "fp32": 19.5 * TFLOPS, "tf32": 156 * TFLOPS,
               "bf16": 312 * TFLOPS, "fp16": 312 * TFLOPS}
_A100_SHARES = {"matmul_ceiling": 267.9 / 312, "attention_ceiling": 0.73, "sms": 108}  # MAMF table; FlashAttention-2 (above)
A100_40GB = GPUSpec(name="A100 40GB SXM", peak_flops=_A100_FLOPS, hbm_bytes=40 * GiB,
                    hbm_bw=1555 * GB, pcie_bw=32 * GB, **_A100_SHARES)
A100_80GB = GPUSpec(name="A100 80GB SXM", peak_flops=_A100_FLOPS, hbm_bytes=80 * GiB,
                    hbm_bw=2039 * GB, pcie_bw=32 * GB, **_A100_SHARES)

# DGX A100 (NVIDIA DGX A100 datasheet and System Architecture whitepaper): 8 GPUs on NVSwitch,
# NVLink3 12 links x 25 GB/s = 300 GB/s per direction per GPU (A100 datasheet: 600 GB/s
# bidirectional); 8 single-port ConnectX-6 HDR 200 Gb/s InfiniBand for compute = 25 GB/s per GPU.
DGX_A100 = ClusterSpec(gpus_per_node=8, nvlink_bw=300 * GB, nvlink_latency_s=NVLINK_LATENCY_S,
                       internode_bw=200 * GBIT, internode_latency_s=NET_LATENCY_S)

# --- H100 SXM / H200 ---------------------------------------------------------------------
# NVIDIA H100 Tensor Core GPU datasheet (H100 SXM column): FP64 Tensor Core 67 TFLOPS,
# FP32 67 TFLOPS, TF32 989* , BF16 1,979*, FP16 1,979*, FP8 3,958* TFLOPS (* with sparsity,
# halved here: 494.5 / 989.5 / 989.5 / 1979); 80 GB HBM3 at 3.35 TB/s;
# NVLink 900 GB/s (bidirectional), PCIe Gen5 128 GB/s (bidirectional -> 64 GB/s per direction).
_H100_SXM_FLOPS = {"fp64": 67 * TFLOPS, "fp32": 67 * TFLOPS, "tf32": 989 / 2 * TFLOPS,
                   "bf16": 1979 / 2 * TFLOPS, "fp16": 1979 / 2 * TFLOPS, "fp8": 3958 / 2 * TFLOPS}
# FP8 (float8_e4m3fn inputs): the same MAMF table's FP8 part (compute/accelerator/README.md, measured with
# mamf-finder.py): H100 SXM 1402.6 of 1979 TFLOP/s = 70.9% (torch 2.7.0+cu126), H200 SXM 1453.4 = 73.4% (2.7.1+cu128).
# (DeepSeek's DeepGEMM claims "up to 1550 TFLOPS" = 78.3% on H800 with its own block-scaled kernels: a best case.)
_HOPPER_SHARES = {"matmul_ceiling": 792.1 / 989, "attention_ceiling": 740 / 989,  # MAMF table; FlashAttention-3
                  "sdpa_attention_ceiling": 308 / 989,  # torch SDPA's FlashAttention-2 (module docstring)
                  "fp8_matmul_ceiling": 1402.6 / 1979, "sms": 132}  # MAMF FP8 table
H100_SXM = GPUSpec(name="H100 SXM 80GB", peak_flops=_H100_SXM_FLOPS, hbm_bytes=80 * GiB,
                   hbm_bw=3350 * GB, pcie_bw=64 * GB, **_HOPPER_SHARES)

# NVIDIA H200 Tensor Core GPU datasheet (H200 SXM column): same compute figures as H100 SXM
# (FP64 TC 67, FP32 67, TF32 989*, BF16 1,979*, FP16 1,979*, FP8 3,958* TFLOPS);
# 141 GB HBM3e at 4.8 TB/s; NVLink 900 GB/s, PCIe Gen5 128 GB/s (both bidirectional).
H200 = GPUSpec(name="H200 SXM 141GB", peak_flops=_H100_SXM_FLOPS, hbm_bytes=141 * GiB,
               hbm_bw=4800 * GB, pcie_bw=64 * GB,  # the same die: the H100's bf16 shares ("H200 is the same")
               **(_HOPPER_SHARES | {"fp8_matmul_ceiling": 1453.4 / 1979}))  # MAMF FP8 table

# H100 96GB HBM2e at a 500 W power limit, as Meta's Grand Teton hosts run it (pytorch/torchtitan benchmarks/
# llama3_h100_202412_torchtitan.md, "Hardware": "96GB HBM2e with 2.4 TB/sec peak memory bandwidth", "the default 500W
# power limit", 8 GPUs per host on NVLink, 400 Gb/s RDMA per GPU). Its footnote 2: "HBM2e-based SXM H100 with lower
# TDP, the actual peak TFLOPs number is between SXM and NVL, and we don't know its exact value". The peaks are
# therefore ESTIMATED: the midpoint of the H100 SXM datasheet's (above) and the H100 NVL's (H100 datasheet, H100 NVL
# column: BF16 1,671*, FP8 3,341*, TF32 835*, FP64 TC 60, FP32 60 TFLOPS; * with sparsity, halved here), the
# estimate whose error is least in the worst case (at most half the gap, 8% of the bf16 peak) given only that the
# peak lies between them. Memory 96 GB (six 16 GiB stacks: binary, as the 80 GB part's five). The SM count and the
# measured shares are the SXM die's (_HOPPER_SHARES), an ASSUMPTION (no measurement at 500 W is published).
_H100_500W_FLOPS = {k: (_H100_SXM_FLOPS[k] + nvl) / 2 for k, nvl in
                    (("fp64", 60 * TFLOPS), ("fp32", 60 * TFLOPS), ("tf32", 835 / 2 * TFLOPS),
                     ("bf16", 1671 / 2 * TFLOPS), ("fp16", 1671 / 2 * TFLOPS), ("fp8", 3341 / 2 * TFLOPS))}
H100_96GB_500W = GPUSpec(name="H100 SXM 96GB HBM2e 500W", peak_flops=_H100_500W_FLOPS, hbm_bytes=96 * GiB,
                         hbm_bw=2400 * GB, pcie_bw=64 * GB, **_HOPPER_SHARES)

# DGX H100 / DGX H200 (NVIDIA DGX H100 and DGX H200 datasheets): 8 GPUs on NVSwitch, NVLink4
# 18 links x 25 GB/s = 450 GB/s per direction per GPU (900 GB/s bidirectional); 8 single-port
# ConnectX-7 at 400 Gb/s (NDR) for compute = 50 GB/s per GPU.
DGX_H100 = ClusterSpec(gpus_per_node=8, nvlink_bw=450 * GB, nvlink_latency_s=NVLINK_LATENCY_S,
                       internode_bw=400 * GBIT, internode_latency_s=NET_LATENCY_S)

# --- B200 / GB200 ------------------------------------------------------------------------
# NVIDIA DGX B200 datasheet and HGX B200 specifications (8 GPUs; per GPU = the 8-GPU figures / 8): FP4 Tensor Core
# 144 PFLOPS*, FP8/FP6 72 PFLOPS*, BF16/FP16 36 PFLOPS*, TF32 18 PFLOPS*, FP64/FP64 Tensor Core 296 TFLOPS, FP32
# 600 TFLOPS (* with sparsity, halved here: per GPU 9 / 4.5 / 2.25 / 1.125 PFLOPS dense, as ml-engineering's
# compute/accelerator/README.md "TFLOPS comparison table" lists B200 SXM: tf32 1125, bf16 2250, fp8 4500, fp4 9000);
# 1,440 GB HBM3e in all (180 GB per GPU) at 64 TB/s (8 TB/s per GPU); fifth-generation NVLink 1.8 TB/s per GPU
# (bidirectional -> 900 GB/s per direction) on NVSwitch; PCIe Gen5 to the host (64 GB/s per direction). MXFP8 (OCP
# microscaling, block of 32) runs on Blackwell's tensor cores at the FP8 rate (NVIDIA Blackwell architecture
# technical brief: "FP8 and FP6" rates include the MX formats). Measured ceilings (the MAMF tables above): B200 SXM BF16
# 1745.0 of 2250 = 77.6%, FP8 3432.5 of 4500 = 76.3% (torch 2.7.1+cu128); GB200 BF16 1822.0 of 2500 = 72.9%, FP8
# 3615.6 of 5000 = 72.3% (torch 2.10 nightly, cu130). Attention: no measurement of the fused kernel on Blackwell is at
# hand; the H100's FlashAttention-3 share (74.8%) stands in (an ASSUMPTION).
_B200_FLOPS = {"fp64": 37 * TFLOPS, "fp32": 75 * TFLOPS, "tf32": 1125 * TFLOPS, "bf16": 2250 * TFLOPS,
               "fp16": 2250 * TFLOPS, "fp8": 4500 * TFLOPS, "mxfp8": 4500 * TFLOPS, "fp4": 9000 * TFLOPS}
B200 = GPUSpec(name="B200 180GB", peak_flops=_B200_FLOPS, hbm_bytes=180 * GiB, hbm_bw=8000 * GB, pcie_bw=64 * GB,
               matmul_ceiling=1745.0 / 2250, fp8_matmul_ceiling=3432.5 / 4500,
               attention_ceiling=_HOPPER_SHARES["attention_ceiling"], sms=148)
# DGX B200: 8 GPUs on NVLink5 NVSwitch (900 GB/s per direction per GPU); 8 single-port ConnectX-7 VPI at 400 Gb/s for
# compute = 50 GB/s per GPU.
DGX_B200 = ClusterSpec(gpus_per_node=8, nvlink_bw=900 * GB, nvlink_latency_s=NVLINK_LATENCY_S,
                       internode_bw=400 * GBIT, internode_latency_s=NET_LATENCY_S)

# NVIDIA GB200 NVL72 datasheet (72 Blackwell GPUs, 36 Grace CPUs per rack; per GPU = the rack's figures / 72):
# FP4 Tensor Core 1,440 PFLOPS*, FP8/FP6 720 PFLOPS*, FP16/BF16 360 PFLOPS*, TF32 180 PFLOPS*, FP64 3,240 TFLOPS
# (* with sparsity, halved here: per GPU 10 / 5 / 2.5 / 1.25 PFLOPS dense; ml-engineering's table lists GB200 per
# chip: tf32 1250, bf16 2500, fp8 5000, fp4 10000), FP32 taken as the B200's (not stated per GPU); HBM3e 13.4 TB at
# 576 TB/s (186 GB and 8 TB/s per GPU); NVLink 130 TB/s over the rack (1.8 TB/s per GPU, 900 GB/s per direction);
# NVLink-C2C 900 GB/s (bidirectional) between a Grace and its two GPUs (225 GB/s per GPU per direction to the host).
GB200 = GPUSpec(name="GB200 186GB", peak_flops={**_B200_FLOPS, "fp64": 45 * TFLOPS, "tf32": 1250 * TFLOPS,
                                                "bf16": 2500 * TFLOPS, "fp16": 2500 * TFLOPS, "fp8": 5000 * TFLOPS,
                                                "mxfp8": 5000 * TFLOPS, "fp4": 10000 * TFLOPS},
                hbm_bytes=186 * GiB, hbm_bw=8000 * GB, pcie_bw=225 * GB, matmul_ceiling=1822.0 / 2500,
                fp8_matmul_ceiling=3615.6 / 5000, attention_ceiling=_HOPPER_SHARES["attention_ceiling"], sms=148)
# The rack is one NVLink domain of 72 GPUs on 18 compute trays (hosts) of 4 GPUs, one 400 Gb/s ConnectX-7 NIC per GPU
# for the network between racks. A job's parallel groups are powers of two: the domain a job uses is taken as 64 GPUs
# (16 trays) of each rack, the rest kept as spares (Slurm's --segment=16 places it so) -- an ASSUMPTION; a job
# that uses all 72 plans with --gpus-per-node 72.
NVL72 = ClusterSpec(gpus_per_node=64, gpus_per_host=4, nvlink_bw=900 * GB, nvlink_latency_s=NVLINK_LATENCY_S,
                    internode_bw=400 * GBIT, internode_latency_s=NET_LATENCY_S)

# --- PCIe parts --------------------------------------------------------------------------
# NVIDIA H100 Tensor Core GPU datasheet (H100 PCIe column): FP64 Tensor Core 51 TFLOPS,
# FP32 51 TFLOPS, TF32 756*, BF16 1,513*, FP16 1,513*, FP8 3,026* TFLOPS (* with sparsity,
# halved: 378 / 756.5 / 756.5 / 1513); 80 GB HBM2e at 2 TB/s; PCIe Gen5 128 GB/s bidirectional.
H100_PCIE = GPUSpec(
    name="H100 PCIe 80GB",
    peak_flops={"fp64": 51 * TFLOPS, "fp32": 51 * TFLOPS, "tf32": 756 / 2 * TFLOPS,
                "bf16": 1513 / 2 * TFLOPS, "fp16": 1513 / 2 * TFLOPS, "fp8": 3026 / 2 * TFLOPS},
    hbm_bytes=80 * GiB, hbm_bw=2000 * GB, pcie_bw=64 * GB, **(_HOPPER_SHARES | {"sms": 114}))

# NVIDIA RTX 6000 Ada Generation datasheet: 48 GB GDDR6 with ECC, 960 GB/s, FP32 91.1 TFLOPS,
# "Tensor Performance 1,457.0 TFLOPS" = FP8 with sparsity -> 728.5 dense; PCIe Gen4 x16
# (64 GB/s bidirectional), no NVLink. NVIDIA Ada Lovelace GPU Architecture whitepaper (appendix,
# RTX 6000 Ada): BF16/FP16 tensor with FP32 accumulate 364.2 dense, TF32 182.1 dense.
RTX6000_ADA = GPUSpec(
    name="RTX 6000 Ada 48GB",
    peak_flops={"fp32": 91.1 * TFLOPS, "tf32": 182.1 * TFLOPS, "bf16": 364.2 * TFLOPS,
                "fp16": 364.2 * TFLOPS, "fp8": 728.5 * TFLOPS},
    hbm_bytes=48 * GiB, hbm_bw=960 * GB, pcie_bw=32 * GB, sms=142)

# NVIDIA Ampere GA102 GPU Architecture whitepaper (V2.0), table "GeForce RTX 3080" (comparison with the RTX 2080
# Super): peak FP32 (non-tensor) 29.8 TFLOPS; FP16 tensor with FP32 accumulate 59.5 | 119* TFLOPS (GeForce parts run
# it at half the FP16-accumulate rate, 119 | 238*: frameworks accumulate in fp32, so 59.5 is the figure); BF16 tensor
# with FP32 accumulate 59.5 | 119*; TF32 tensor 29.8 | 59.5* (* with sparsity, halved here); 10 GB GDDR6X (binary, as
# above) on a 320-bit bus at 19 Gbps = 760 GB/s; PCIe Gen4 x16 (64 GB/s bidirectional). No FP8. FreeRide's
# Server-II, the lower-tier GPU its cost savings price side tasks on (../shared/seeds/000_..., l.269).
RTX3080 = GPUSpec(
    name="GeForce RTX 3080 10GB",
    peak_flops={"fp32": 29.8 * TFLOPS, "tf32": 29.8 * TFLOPS, "bf16": 59.5 * TFLOPS, "fp16": 59.5 * TFLOPS},
    hbm_bytes=10 * GiB, hbm_bw=760 * GB, pcie_bw=32 * GB, sms=68)

# PCIe servers: the datasheet PCIe figure is the intra-node link (GPU peer-to-peer through PCIe
# switches). The node layout is an ASSUMPTION, not a datasheet figure: 8 GPUs per node and one NIC
# per two GPUs (400 Gb/s NDR for the Gen5 part, 200 Gb/s HDR for the Gen4 part). Override with a
# YAML file that describes your cluster.
PCIE5_SERVER = ClusterSpec(gpus_per_node=8, nvlink_bw=64 * GB, nvlink_latency_s=PCIE_LATENCY_S,
                           internode_bw=400 * GBIT / 2, internode_latency_s=NET_LATENCY_S)
PCIE4_SERVER = ClusterSpec(gpus_per_node=8, nvlink_bw=32 * GB, nvlink_latency_s=PCIE_LATENCY_S,
                           internode_bw=200 * GBIT / 2, internode_latency_s=NET_LATENCY_S)

BUILTIN_TARGETS: tuple[Target, ...] = (
    Target(name="v100-16gb", gpu=V100_16GB, cluster=DGX1_V100,
           description="V100 SXM2 16GB in DGX-1 nodes (8 GPUs, NVLink2 cube-mesh, 4x EDR 100 Gb/s IB)"),
    Target(name="v100-32gb", gpu=V100_32GB, cluster=DGX1_V100,
           description="V100 SXM2 32GB in DGX-1 nodes (8 GPUs, NVLink2 cube-mesh, 4x EDR 100 Gb/s IB)"),
    Target(name="a100-40gb", gpu=A100_40GB, cluster=DGX_A100,
           description="A100 40GB SXM in DGX A100 nodes (8 GPUs, NVLink3 300 GB/s, 8x HDR 200 Gb/s IB)"),
    Target(name="a100-80gb", gpu=A100_80GB, cluster=DGX_A100,
           description="A100 80GB SXM in DGX A100 nodes (8 GPUs, NVLink3 300 GB/s, 8x HDR 200 Gb/s IB)"),
    Target(name="h100-sxm", gpu=H100_SXM, cluster=DGX_H100,
           description="H100 SXM 80GB in DGX H100 nodes (8 GPUs, NVLink4 450 GB/s, 8x NDR 400 Gb/s IB)"),
    # Grand Teton: 8 GPUs on NVLink (taken as the DGX H100's NVSwitch, 450 GB/s per direction), 400 Gb/s per GPU
    Target(name="h100-96gb-hbm2e-500w", gpu=H100_96GB_500W, cluster=DGX_H100,
           description="H100 SXM 96GB HBM2e at 500 W in Grand Teton hosts (8 GPUs, NVLink4, 400 Gb/s RDMA per GPU; "
                       "peak FLOP/s estimated between H100 SXM and NVL)"),
    Target(name="h100-pcie", gpu=H100_PCIE, cluster=PCIE5_SERVER,
           description="H100 PCIe 80GB, 8 per server over PCIe Gen5, one NDR 400 Gb/s NIC per 2 GPUs"),
    Target(name="h200", gpu=H200, cluster=DGX_H100,
           description="H200 SXM 141GB in DGX H200 nodes (8 GPUs, NVLink4 450 GB/s, 8x NDR 400 Gb/s IB)"),
    Target(name="b200", gpu=B200, cluster=DGX_B200,
           description="B200 180GB in DGX B200 nodes (8 GPUs, NVLink5 900 GB/s, 8x NDR 400 Gb/s IB)"),
    Target(name="gb200-nvl72", gpu=GB200, cluster=NVL72,
           description="GB200 NVL72 racks (NVLink5 900 GB/s across a rack; 64 GPUs of each rack per job, 4 per host; "
                       "400 Gb/s per GPU between racks)"),
    Target(name="rtx6000-ada", gpu=RTX6000_ADA, cluster=PCIE4_SERVER,
           description="RTX 6000 Ada 48GB, 8 per server over PCIe Gen4, one HDR 200 Gb/s NIC per 2 GPUs"),
    # One GPU per machine (FreeRide's Server-II); the Gen4 server's links are an ASSUMPTION no one-GPU job crosses.
    Target(name="rtx3080", gpu=RTX3080, cluster=replace(PCIE4_SERVER, gpus_per_node=1),
           description="GeForce RTX 3080 10GB, one per machine (PCIe Gen4)"),
)

#: The target used when none is named.
DEFAULT_TARGET = "a100-80gb"
