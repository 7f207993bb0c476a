"""FP8 training as Transformer Engine and torchao run it: a Llama block's time and memory against the recipe's closed
form, written here from the layer's shapes (not from the cost model's own sums)."""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from costmodels.compute import unit_time  # noqa: E402
from costmodels.fp8 import FP8_RECIPES  # noqa: E402
from costmodels.hardware import Hardware  # noqa: E402
from costmodels.memory import activation_bytes, held_bytes, stage_memory, static_bytes  # noqa: E402
from passes.errors import UserError  # noqa: E402
from passes.pipeline import analyze  # noqa: E402
from planner.api import engine_pins  # noqa: E402
from planner.config import ConfigError, ParallelConfig  # noqa: E402
from planner.search import Pins  # noqa: E402
from targets.registry import get_target  # noqa: E402
from tests.conftest import EXAMPLES  # noqa: E402

H, F, HEADS, KV, SEQ = 4096, 14336, 32, 8, 2048  # Llama 3 8B's layer
KVD = H // HEADS * KV


@pytest.fixture(scope="module")
def llama():
    prof, _ = analyze(EXAMPLES / "hf_llama.py", {"preset": "llama3-8b", "layers": 2, "seq": SEQ})
    return {u.kind: u for u in prof.units}


# each linear of the layer: (its input X width, its output Y width), per token
LINEARS = {"q": (H, H), "k": (H, KVD), "v": (H, KVD), "o": (H, H), "gate": (H, F), "up": (H, F), "down": (F, H)}


def config(fp8: str = "", **kw) -> ParallelConfig:
    return ParallelConfig(**{"tp": 1, "pp": 1, "dp": 1, "b": 1, "m": 4, "fp8": fp8, **kw})


@pytest.mark.parametrize(("target", "recipe"), [("h100-sxm", "delayed"), ("h100-sxm", "tensorwise"),
                                                ("h100-sxm", "blockwise"), ("b200", "mxfp8"),
                                                ("h100-sxm", "torchao-rowwise")])
def test_block_time_is_its_gemms_at_the_fp8_rate_plus_the_casts(llama, target, recipe):
    """FP8 block time - bf16 block time = each linear's forward, dgrad and wgrad FLOPs moved from the bf16 rate to the
    FP8 rate (all seven are compute-bound at this size), plus the casts: X forward, dY backward (torchao casts X
    again there), the weights once per iteration (TE's cached FP8 weights: spread over m) or each microbatch both
    ways (torchao), each cast one more kernel launch forward and two backward. The LM head stays bf16.

    Transformer Engine's cast-transpose reads a tensor (again for the amax of current scaling) and writes two FP8
    copies with their scales. torchao's, eager: an amax pass, a read and one FP8 copy (2.5 x the bf16 bytes); its
    backward casts dY for dX and again for dW, whose transposed operand is copied (2.5 + 2.5 + 1), and recasts X
    (2.5, and its transposed copy, 1); its weights likewise each microbatch (2.5 forward, 3.5 backward)."""
    hw, r, block = Hardware(target=get_target(target)), FP8_RECIPES[recipe], llama["block"]
    fp8, bf16 = unit_time(block, hw, config(recipe)), unit_time(block, hw, config())
    n, bw, m = SEQ, hw.gpu.hbm_bw * hw.eff.hbm, 4
    gemms = sum(3 * 2 * n * x * y * (1 / hw.matmul_rate(2 * n * x * y, r.gemm_dtype)
                                     - 1 / hw.matmul_rate(2 * n * x * y, "bf16")) for x, y in LINEARS.values())
    xs, ys = sum(2 * n * x for x, _ in LINEARS.values()), sum(2 * n * y for _, y in LINEARS.values())
    if r.engine == "transformer_engine":
        passes = 1 + r.amax_pass + 1 + r.scale_bytes
        x, y, x_again, weights = passes, passes, 0 if r.saves_fp8_input else passes, passes / m
    else:
        x, y, x_again, weights = 2.5, 2.5 + 2.5 + 1, 2.5 + 1, 2.5 + 3.5
    casts = (x * xs + y * ys + x_again * xs) / bw + 2 * block.params * weights / bw
    launches = 3 * len(LINEARS) * hw.eff.launch_s
    assert fp8.fwd_s + fp8.bwd_s - bf16.fwd_s - bf16.bwd_s == pytest.approx(gemms + casts + launches, rel=1e-6)
    assert gemms < 0 and fp8.fwd_s + fp8.bwd_s < bf16.fwd_s + bf16.bwd_s  # FP8 is faster at this size, casts and all
    head = llama["head"]
    assert unit_time(head, hw, config(recipe)) == unit_time(head, hw, config())


def test_compiled_torchao_casts_each_input_once_as_inductor_fuses_them():
    """torchtitan's float8 under torch.compile (its blocks compiled, FSDP over 8 gathering the weights in FP8): the
    amax of each cast fuses into the kernel producing the tensor and AOTAutograd's CSE merges the identical casts, so
    a cast reads its tensor once and writes its FP8 copies: X 1 + 1/2 in the forward and again in the backward, for
    the block's four distinct inputs (the two norms' outputs, the attention's, the SwiGLU product: q, k and v share
    one, gate and up another); dY 1 + 1/2 + its transposed 1/2. Each rank casts its weight shard before the
    all-gather (1 + 1/2 of 1/8), forward and backward, and dX takes the gathered FP8 weight transposed (1)."""
    block = next(u for u in analyze(EXAMPLES / "hf_llama.py", {"preset": "llama3-8b", "layers": 2, "seq": SEQ},
                                    kernels="inductor")[0].units if u.kind == "block")
    hw, r = Hardware(target=get_target("h100-sxm")), FP8_RECIPES["torchao-tensorwise"]
    kw = dict(dp=8, zero=3, compile=True)
    fp8, bf16 = unit_time(block, hw, config(r.name, **kw)), unit_time(block, hw, config(**kw))
    n, bw = SEQ, hw.gpu.hbm_bw * hw.eff.hbm
    gemms = sum(3 * 2 * n * x * y * (1 / hw.matmul_rate(2 * n * x * y, "fp8")
                                     - 1 / hw.matmul_rate(2 * n * x * y, "bf16")) for x, y in LINEARS.values())
    xs = 2 * n * (3 * H + F)  # the four distinct inputs
    ys = sum(2 * n * y for _, y in LINEARS.values())
    casts = (1.5 * xs + 2.0 * ys + 1.5 * xs) / bw + 2 * block.params * (1.5 / 8 + 1.5 / 8 + 1) / bw
    launches = 3 * len(LINEARS) * hw.eff.launch_s
    assert fp8.fwd_s + fp8.bwd_s - bf16.fwd_s - bf16.bwd_s == pytest.approx(gemms + casts + launches, rel=1e-6)


@pytest.mark.parametrize("recipe", ["delayed", "blockwise", "mxfp8", "torchao-rowwise"])
def test_block_memory_keeps_fp8_inputs_and_cached_fp8_weights(llama, recipe):
    """Transformer Engine keeps each linear's input X in FP8 (1 byte and its scales per element, not bf16's 2): the
    four distinct inputs of a Llama layer (the two norms' outputs, the attention output, the SwiGLU product) are
    n(3h + f) elements. It caches row- and column-wise FP8 weights, 2 bytes (and scales) per parameter. torchao keeps
    bf16 inputs and no FP8 weights. Full recomputation keeps only the block's input, so FP8 saves nothing there."""
    r, block = FP8_RECIPES[recipe], llama["block"]
    saved = SEQ * (3 * H + F) * (1 - r.scale_bytes) if r.saves_fp8_input else 0.0
    assert activation_bytes(block, config()) - activation_bytes(block, config(recipe)) == pytest.approx(saved)
    assert held_bytes(block, config()) - held_bytes(block, config(recipe)) == pytest.approx(saved)
    copies = block.params * 2 * (1 + r.scale_bytes) if r.weight_cache else 0.0
    assert static_bytes(block, config(recipe)) - static_bytes(block, config()) == pytest.approx(copies)
    full = dict(recompute="full")
    assert activation_bytes(block, config(recipe, **full)) == activation_bytes(block, config(**full))
    hw = Hardware(target=get_target("h100-sxm"))
    mem, base = stage_memory([block], hw, config(recipe), 0), stage_memory([block], hw, config(), 0)
    assert mem.weights - base.weights == pytest.approx(copies) and mem.optimizer == base.optimizer


def test_recipes_a_gpu_or_an_engine_cannot_run_are_refused_in_one_sentence():
    hopper, blackwell, ampere = (Hardware(target=get_target(n)) for n in ("h100-sxm", "b200", "a100-80gb"))
    mega, titan = Pins(fp8="auto", engine="megatron"), Pins(fp8="auto", engine="torchtitan")
    assert engine_pins(mega, hopper).fp8 == "delayed"  # Megatron's default
    assert engine_pins(mega, blackwell).fp8 == "mxfp8"  # native block scaling
    assert engine_pins(titan, hopper).fp8 == "torchao-rowwise"  # torchtitan's float8 converter
    with pytest.raises(UserError, match=r"mxfp8 needs Blackwell's MX block-scaled tensor cores, which the H100"):
        engine_pins(Pins(fp8="mxfp8", engine="megatron"), hopper)
    with pytest.raises(UserError, match=r"delayed needs FP8 tensor cores, which the A100 80GB SXM lacks"):
        engine_pins(mega, ampere)
    with pytest.raises(UserError, match=r"megatron does not run the FP8 recipe torchao-rowwise; it runs delayed"):
        engine_pins(Pins(fp8="torchao-rowwise", engine="megatron"), hopper)
    with pytest.raises(UserError, match=r"^FP8 runs in Megatron-Core .* not in the fxplanner runtime: add --engine"):
        engine_pins(Pins(fp8="auto"), hopper)
    with pytest.raises(UserError, match="--fp8 must be one of"):
        Pins(fp8="e4m3")
    with pytest.raises(ConfigError, match="bf16 or fp16 mixed precision"):
        config("delayed", precision="fp32")


def test_sequence_parallel_all_gathers_move_fp8_inputs(llama):
    """Under sequence parallelism Transformer Engine casts a column-parallel linear's input before all-gathering it:
    the forward's all-gathers (half its tensor-parallel traffic) move 1-byte elements; reduce-scatters stay bf16."""
    from costmodels.compute import tp_allreduce_s

    hw, block = Hardware(target=get_target("h100-sxm")), llama["block"]
    n = block.tp_allreduces
    forward = n * tp_allreduce_s(block.tp_fwd_allreduce_bytes(1) / n, 4, hw)
    fp8, bf16 = (unit_time(block, hw, config(recipe, tp=4, sp=True)) for recipe in ("delayed", ""))
    assert fp8.tp_comm_s == pytest.approx(bf16.tp_comm_s - 0.25 * forward)
    torchao = unit_time(block, hw, config("torchao-rowwise", tp=4, sp=True))
    assert torchao.tp_comm_s == pytest.approx(bf16.tp_comm_s)


def test_fsdp_gathers_torchao_tensorwise_weights_in_fp8(llama):
    """torchao's tensorwise recipe under FSDP2 (torchtitan's enable_fsdp_float8_all_gather, which the export sets):
    each FP8 block's weights are all-gathered and held whole in one byte each, half the bf16 gather, while the
    embedding and the head stay bf16; rowwise scaling gathers bf16 (torchao has no rowwise float8 all-gather)."""
    from costmodels.memory import in_flight_bytes
    from planner.engines import ENGINES

    units, held = [llama["block"], llama["block"]], ENGINES["torchtitan"].memory
    cfg = {r: config(r, dp=8, zero=3, m=1, b=2) for r in ("torchao-tensorwise", "torchao-rowwise")}
    params = units[0].params  # (t = 1: the unit's every parameter; FSDP2 gathers each whole beside its fp32 shard)
    assert in_flight_bytes(units, cfg["torchao-tensorwise"], held=held)[0] == pytest.approx(2 * params * 1.0)
    assert in_flight_bytes(units, cfg["torchao-rowwise"], held=held)[0] == pytest.approx(2 * params * 2.0)
    head = [llama["head"], llama["head"]]
    assert in_flight_bytes(head, cfg["torchao-tensorwise"], held=held) == in_flight_bytes(head, cfg["torchao-rowwise"],
                                                                                          held=held)
    # below ZeRO-3 the weights are the optimizer's all-gather after the step, bf16 (FSDP's float8 all-gather only);
    # FP8 only where Megatron keeps them so (--fp8-param-gather: its distributed optimizer gathers FP8 parameters)
    assert config("torchao-tensorwise", dp=8, zero=1, m=1).gathered_bytes(True) == 2.0
    megatron = config("delayed", dp=8, zero=1, m=1, fp8_params=True)
    assert (megatron.gathered_bytes(True), megatron.gathered_bytes(False)) == (1.0, 2.0)
