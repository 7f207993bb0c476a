"""FP8 training recipes as the engines run them: which GEMMs run in FP8, what the casts move, what they keep.

FP8 training is bf16 mixed precision whose linear layers run their three GEMMs (forward, dgrad, wgrad) on FP8
operands: each operand is cast (scaled to the FP8 range, rounded) on the way in, the GEMM accumulates in fp32 and
writes bf16. Everything else stays bf16: the attention core, norms, the LM head and embeddings (Megatron-Core builds
its output layer as a plain ColumnParallelLinear outside Transformer Engine's fp8_autocast; torchtitan's float8
converter filters the `output` projection), the master weights, gradients and optimizer state.

A recipe says how each tensor is scaled, which decides the extra passes over memory and what is kept:

- Transformer Engine (Megatron-Core, NeMo; `--fp8-format hybrid --fp8-recipe ...`): a GEMM input is cast once by a
  fused cast-transpose kernel that writes its row-wise and column-wise FP8 copies (Hopper's FP8 GEMM takes only the
  TN layout, so the backward reads the transposed copy); the forward saves the FP8 column-wise input for the wgrad
  GEMM (1 byte per element, not bf16's 2); the FP8 weights and their transposes are cast on the first microbatch of
  an iteration and cached until the optimizer step (`is_first_microbatch`), 2 bytes per parameter held beside the
  bf16 weight. `delayed` takes the scale from an amax history (the amax is a by-product of the cast: no extra pass);
  `tensorwise` (current scaling) reduces the tensor's amax first, one more read of it; `blockwise` (DeepSeek-V3's
  1x128 activation tiles, 128x128 weight blocks, Hopper) and `mxfp8` (OCP microscaling, one E8M0 scale per 32
  elements, Blackwell's tensor cores) compute block scales inside the cast, with the scales stored beside the data.
- torchao float8 (torchtitan's float8 converter): dynamic scaling (`tensorwise`, `rowwise`) computes the amax then
  casts; it saves the bf16 input and weight for the backward and casts them again there, and keeps no FP8 weight
  between microbatches.

Sources: Transformer Engine's documentation ("Using FP8 with Transformer Engine": recipes, the cast-transpose and
the cached FP8 weights), Megatron-LM's arguments (`--fp8-recipe` tensorwise | delayed | mxfp8 | blockwise),
DeepSeek-V3 technical report section 3.3 (fine-grained quantization), torchao's float8 README and
`torchao/float8/float8_linear.py` (`matmul_with_hp_or_float8_args` saves the high-precision operands).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Fp8Recipe", "FP8_RECIPES", "default_recipe", "runs_fp8"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Fp8Recipe:
    name: str
    engine: str  # "transformer_engine" | "torchao"
    gemm_dtype: str  # the GPU peak key the FP8 GEMMs run at ("fp8", or "mxfp8" on Blackwell)
    amax_pass: bool  # the amax is reduced in a pass of its own before the cast (current / dynamic scaling)
    scale_bytes: float  # bytes of scale per FP8 element (block scales; per-tensor scales are negligible)
    weight_cache: bool  # FP8 weights (row- and column-wise) cached from the first microbatch to the optimizer step
    saves_fp8_input: bool  # the forward keeps the FP8 column-wise input for wgrad instead of the bf16 one
    megatron_recipe: str  # Megatron-LM --fp8-recipe, "" if Megatron cannot run it
    titan_recipe: str  # torchtitan's float8 recipe_name (torchtitan.components.quantization.float8), "" if torchtitan
    # cannot run it
    help: str
    fsdp_gather: bool = False  # under FSDP (ZeRO-3) the weights are all-gathered in FP8, one byte each, and held so
    # while their unit runs (torchao's enable_fsdp_float8_all_gather: torchao/float8/fsdp_utils.py
    # WeightWithDynamicFloat8CastTensor casts each shard before the all-gather; tensorwise scaling only, the scales
    # precomputed for all weights in one all-reduce by precompute_float8_dynamic_scale_for_fsdp)

    def weight_copy_bytes(self) -> float:
        """Bytes per parameter the cached FP8 weights hold: row- and column-wise copies, with their scales."""
        return 2 * (1 + self.scale_bytes) if self.weight_cache else 0.0

    def cast_passes(self) -> float:
        """Bytes moved per byte of a bf16 tensor Transformer Engine casts: read it (once more for its amax) and write
        its two FP8 copies (2 x half its bytes) with their scales."""
        return 1 + self.amax_pass + (1 + self.scale_bytes)

    def activation_casts(self, compiled: bool) -> tuple[float, float, float]:
        """Bytes moved per byte of a bf16 activation a weight product casts: (its input X in the forward, its output
        gradient dY in the backward, X again in the backward).

        - Transformer Engine: one cast-transpose kernel per tensor (cast_passes); the backward reads the FP8 X the
          forward kept.
        - torchao, eager (torchao/float8/float8_linear.py, matmul_with_hp_or_float8_args): each cast is an amax pass
          and a cast writing one FP8 copy, 1 + 1 + 1/2. The backward casts dY for dX and again for dW, whose
          transposed operand _scaled_mm takes as a copy (1/2 read, 1/2 written): 2.5 + 2.5 + 1. It recasts the bf16 X
          it kept and copies it transposed: 2.5 + 1.
        - torchao compiled (torchtitan's float8 runs under torch.compile): Inductor fuses each amax into the kernel
          producing the tensor, and AOTAutograd's CSE merges identical casts, so a cast reads its tensor once and
          writes its FP8 copies. X: 1 + 1/2. dY: 1 + 1/2 + the transposed 1/2 (tensorwise; rowwise scales dW's
          operand per column, a second pass: 3). X again: 1 + 1/2, its amax kept. Products that share an input (wq, wk,
          wv; w1, w3) cast it once (passes.kernels SHARED_INPUT: the others' X is 0 under "inductor"). Where the
          producer of the amax's tensor is not an Inductor kernel (SDPA's output, its input gradients), the compiled
          figure is one read short."""
        if self.engine == "transformer_engine":
            p = self.cast_passes()
            return p, p, 0.0 if self.saves_fp8_input else p
        if compiled:
            return 1.5, 2.0 if self.name.endswith("tensorwise") else 3.0, 1.5
        return 2.5, 6.0, 3.5

    def weight_casts(self, compiled: bool, shards: int) -> tuple[float, float]:
        """Bytes moved per byte of the bf16 weights a torchao recipe casts every microbatch (no FP8 weight cache),
        (forward, backward). Gathered in FP8 by FSDP (fsdp_gather; `shards` > 1 ranks), each rank casts its shard
        before each all-gather with the scale precomputed once an iteration (torchao/float8/fsdp_utils.py:
        1 + 1/2 of 1/shards), and the backward's dX product takes the gathered FP8 weight transposed (a copy, 1);
        otherwise each use casts the whole weight: amax, cast (2.5), and eagerly the transposed copy again (1)."""
        if shards > 1:
            return 1.5 / shards, 1.5 / shards + 1.0
        return 2.5, 2.5 if compiled else 3.5


_TE = dict(engine="transformer_engine", weight_cache=True, saves_fp8_input=True, titan_recipe="")
FP8_RECIPES: dict[str, Fp8Recipe] = {r.name: r for r in (
    Fp8Recipe(name="delayed", gemm_dtype="fp8", amax_pass=False, scale_bytes=0.0, megatron_recipe="delayed",
              help="Transformer Engine delayed per-tensor scaling (Megatron's default)", **_TE),
    Fp8Recipe(name="tensorwise", gemm_dtype="fp8", amax_pass=True, scale_bytes=0.0, megatron_recipe="tensorwise",
              help="Transformer Engine current per-tensor scaling", **_TE),
    Fp8Recipe(name="blockwise", gemm_dtype="fp8", amax_pass=False, scale_bytes=4 / 128, megatron_recipe="blockwise",
              help="Transformer Engine 1x128 / 128x128 block scaling (DeepSeek-V3), Hopper", **_TE),
    Fp8Recipe(name="mxfp8", gemm_dtype="mxfp8", amax_pass=False, scale_bytes=1 / 32, megatron_recipe="mxfp8",
              help="Transformer Engine MXFP8 (E8M0 scale per 32 elements), Blackwell", **_TE),
    Fp8Recipe(name="torchao-rowwise", engine="torchao", gemm_dtype="fp8", amax_pass=True, scale_bytes=0.0,
              weight_cache=False, saves_fp8_input=False, megatron_recipe="", titan_recipe="rowwise",
              help="torchao float8 dynamic row-wise scaling (torchtitan's float8 converter)"),
    Fp8Recipe(name="torchao-tensorwise", engine="torchao", gemm_dtype="fp8", amax_pass=True, scale_bytes=0.0,
              weight_cache=False, saves_fp8_input=False, megatron_recipe="", titan_recipe="tensorwise",
              help="torchao float8 dynamic per-tensor scaling (torchtitan's float8 recipe through 0.2, with FSDP's "
                   "float8 all-gather)", fsdp_gather=True),
)}


def default_recipe(peak_keys: object) -> str:
    """What Megatron-Core runs on this GPU when asked for FP8: MXFP8 where the tensor cores scale blocks natively
    (Blackwell), else its default delayed scaling."""
    return "mxfp8" if "mxfp8" in peak_keys else "delayed"


def runs_fp8(kind: str) -> bool:
    """Whether a unit of this kind runs its GEMMs in FP8: the repeated blocks (and other layers between them); the
    embedding has no GEMM and the LM head stays bf16, as the engines leave it by default."""
    return kind in ("block", "layer")
