"""Export a plan as the configuration of the engines people already run: torchtitan and Megatron-LM.

Each exporter returns the file's text, the argument list it holds (what tests feed to the engine's own
config code), and what the engine cannot express: a fill job, a partition it has no knob for, a
precision or optimizer it lacks. That list heads the file as comments and is printed on the terminal;
nothing is dropped silently.

torchtitan (0.3 and later) takes no TOML job file: a job is a `config_registry` function of a model
module plus command-line overrides (`--module llama3 --config llama3_8b --parallelism.… …`), parsed by
its `ConfigManager`. The export is that command line, in a shell script that runs `torchtitan.train`. With
pipelining it also writes the plan's own per-rank order as torch's compute-only pipeline CSV
(`--parallelism.pipeline_parallel_schedule_csv`): torchtitan then runs torch's `_PipelineScheduleRuntime`, whose
lowering adds the sends, receives and gradient reductions, so the job runs the planned order, not one of torch's
schedule classes. Megatron-LM's export is the `pretrain_gpt.py` argument list, with the model's shape where the plan
records one (`source.model_shape`).
"""
from __future__ import annotations

import csv
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path, PurePath

from costmodels.fp8 import FP8_RECIPES
from passes.errors import UserError

from .engines import ENGINES
from .plan import Plan
from .schedule_ir import PLACEMENTS, placement_of
from .schedules import get_schedule
from .schedules.interleaved import group_size

__all__ = ["Export", "layout", "placement", "schedule_rows", "to_megatron", "to_torchtitan",
           "check_megatron", "check_megatron_args", "check_torchtitan", "check_schedule_csv"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Export:
    engine: str
    argv: list[str]  # the engine's own arguments, in order
    unexpressed: list[str] = field(default_factory=list)  # what the plan says and the engine cannot
    text: str = ""
    files: dict[str, str] = field(default_factory=dict)  # path as argv names it -> text: what the job reads beside it
    # environment the script sets before the engine starts (None: the script unsets the variable)
    env: dict[str, str | None] = field(default_factory=dict)


_BLOCK = re.compile(r"\.(\d+)$")


def layout(plan: Plan) -> list[list[tuple[str, int]]] | None:
    """Per virtual stage (in the plan's order: chunk c of rank r is stage c*p + r), its units as
    ("embedding" | "block" | "head", block index). None when a unit is none of these (a model whose
    layers are not one repeated block stack cannot be described to either engine)."""
    stages = sorted(plan.partition, key=lambda s: s.stage)
    names = [u for s in stages for u in s.units]
    blocks = [i for i, n in enumerate(names) if _BLOCK.search(n)]
    if not blocks:
        return None
    first, last = blocks[0], blocks[-1]
    if blocks != list(range(first, last + 1)) or first > 1 or last < len(names) - 2:
        return None
    out = []
    for s in stages:
        row = []
        for n in s.units:
            i = names.index(n)
            row.append(("embedding", -1) if i < first else ("head", -1) if i > last
                       else ("block", blocks.index(i)))
        out.append(row)
    return out


_COMPUTE = re.compile(r"\d+[FIWB]\d+")  # torch's compute actions; the rest its lowering adds
_SPLIT_BACKWARD = re.compile(r"\d+[IW]\d+")


def placement(plan: Plan) -> str | None:
    """How the plan places virtual stages on pipeline ranks, read from its partition: a style of
    planner.schedule_ir.Placement ("loop" or "v"), or None for any other placement."""
    ranks = tuple(s.rank for s in sorted(plan.partition, key=lambda s: s.stage))
    return next((style for style in PLACEMENTS if placement_of(style, plan.config.pp, plan.config.vp).rank_of == ranks),
                None)


def schedule_rows(plan: Plan) -> list[list[str]]:
    """torch's compute-only pipeline CSV of the plan: per pipeline rank, its F/I/W/B actions in the plan's order."""
    return [[a for a in acts if _COMPUTE.fullmatch(a)] for acts in plan.actions]


def _common_unexpressed(plan: Plan, engine: str, why: str = "runs no work in the pipeline bubbles") -> list[str]:
    out = []
    if plan.fill is not None:
        jobs = ", ".join(j.name for j in plan.fill.jobs)
        out.append(f"fill jobs ({jobs}): {engine} {why}; run the plan with `python -m planner.runtime` to fill them")
    return out


# -- torchtitan -----------------------------------------------------------------------------------

TITAN_AC = {"none": "activation-checkpoint:none", "selective": "activation-checkpoint:selective",
            "full": "activation-checkpoint:full", "block": "activation-checkpoint:full"}
TITAN_LLAMA3 = {(32, 4096): "llama3_8b", (80, 8192): "llama3_70b", (126, 16384): "llama3_405b"}
TITAN_MOE = {("qwen3_moe", 48, 2048): ("qwen3", "qwen3_30b_a3b"),
             ("deepseek_v3", 61, 7168): ("deepseek_v3", "deepseek_v3_671b"),
             ("gpt_oss", 24, 2880): ("gpt_oss", "gpt_oss_20b"), ("gpt_oss", 36, 2880): ("gpt_oss", "gpt_oss_120b")}
"""The mixture-of-experts models torchtitan ships a config for (torchtitan 0.3 config_registry), by the Hugging Face
family, depth and width of the model file: torchtitan trains them with its own MoE (GroupedExperts, its token
dispatcher), as planner.engines prices them."""


def titan_config(plan: Plan) -> tuple[str, str] | None:
    """torchtitan's (module, config function) for the plan's model, when it is one torchtitan ships: a Hugging Face
    Llama, or a model file written as torchtitan's Llama 3 is (examples/titan_llama.py: SwiGLU, RMSNorm, rotary
    positions, no biases, an untied head, no experts), at one of its flavors' depth and width; Qwen3-30B-A3B,
    DeepSeek-V3 and gpt-oss (TITAN_MOE)."""
    shape = plan.source.model_shape
    if shape.get("experts"):
        return TITAN_MOE.get((shape.get("family"), shape.get("layers"), shape.get("hidden")))
    written = shape.get("norm") == "RMSNorm" and shape.get("position") == "rope" and not shape.get("tied") \
        and not shape.get("bias") and not shape.get("experts")
    if (shape.get("family") == "llama" or written) and shape.get("gated"):
        name = TITAN_LLAMA3.get((shape.get("layers"), shape.get("hidden")))
        if name:
            return "llama3", name
    return None


def _titan_fqns(rows: list[list[tuple[str, int]]], head: str) -> list[list[str]]:
    """torchtitan's module names per model part (its Llama-family naming; the output layer is `head`)."""
    names = {"embedding": ["tok_embeddings"], "head": ["norm", head]}
    return [[n for kind, i in row for n in (names[kind] if kind in names else [f"layers.{i}"])] for row in rows]


TITAN_FLAVORS = {"llama3_8b": "8B", "llama3_70b": "70B", "llama3_405b": "405B", "llama3_debugmodel": "debugmodel",
                 "qwen3_30b_a3b": "30B-A3B", "deepseek_v3_671b": "671B"}


def titan_schedule(plan: Plan) -> str:
    """The schedule name torchtitan reads beside the CSV: it places the stages (ZBVZeroBubble in a V, any other name
    in a loop) and, without module names, sets the stages per rank (one, or two for a multi-stage name)."""
    c = plan.config
    if placement(plan) == "v":
        return "ZBVZeroBubble"  # also the name torchtitan's metrics read the loss from rank 0 for
    return ENGINES["torchtitan"].schedule_names.get(c.schedule) or ("1F1B" if c.vp == 1 else "Interleaved1F1B")


def _titan_job(plan: Plan, module: str | None, config: str | None, schedule_csv: str,
               head: str) -> tuple[str, str, dict, list[str], dict[str, str]]:
    """(module, config function, the parallelism and training sections every torchtitan version reads, what
    they leave out, the schedule CSV by its path)."""
    c, src = plan.config, plan.source
    unexpressed = []
    if n := src.model_shape.get("mtp_layers"):
        unexpressed.append(f"the {n} multi-token-prediction layer(s) the plan prices: torchtitan's models have none "
                           "(its job trains the model without them)")
    files: dict[str, str] = {}
    if module is None or config is None:
        known = titan_config(plan)
        if known is None:
            raise UserError(f"torchtitan ships no model matching {src.model_file} "
                            f"({src.model_shape.get('family', 'unknown family')}); name the config_registry "
                            "function to use with --titan-module and --titan-config (e.g. llama3 llama3_8b)")
        module, config = module or known[0], config or known[1]
    # FSDP over d / R ranks in each of R replicas (HSDP: fully_shard over torchtitan's (dp_replicate, fsdp) mesh;
    # R = 1 without --dp-replicate), or DDP over all d ranks without sharding
    parallel = {"data_parallel_replicate_degree": c.dp_replicate if c.zero else c.dp, "expert_parallel_degree": c.ep,
                "data_parallel_shard_degree": c.dp // c.dp_replicate if c.zero else 1, "tensor_parallel_degree": c.tp,
                "pipeline_parallel_degree": c.pp, "context_parallel_degree": c.cp}
    if c.zero:  # torchtitan shards with FSDP: ZeRO-3 reshards after every forward, ZeRO-1/2 never do
        parallel["fsdp_reshard_after_forward"] = "always" if c.zero == 3 else "never"
        if c.zero == 1:
            unexpressed.append("sharded optimizer (ZeRO-1): torchtitan shards with FSDP only; exported as FSDP over "
                               "the data-parallel ranks without resharding after the forward (ZeRO-2: gradients are "
                               "sharded too, parameters gathered once per step)")
    if c.ep > 1 and c.moe_dispatcher != "alltoall":
        unexpressed.append(f"the {c.moe_dispatcher} token dispatcher: torchtitan's model config chooses it "
                           f'(model_registry(..., moe_comm_backend="{c.moe_dispatcher}")), which a job cannot set; '
                           "name a config built with it (--titan-config), or it runs its standard all-to-all")
    if c.tp_comm_overlap:
        unexpressed.append("tensor-parallel communication overlap: torchtitan's nearest is async TP "
                           "(compile.enable_async_tensor_parallel, under torch.compile; re-plan with --compile "
                           "--async-tp to price it); not set")
    if c.pp > 1:
        name = titan_schedule(plan)
        parallel.update(pipeline_parallel_schedule=name, pipeline_parallel_microbatch_size=c.microbatch)
        rows = layout(plan)
        if rows is None:
            unexpressed.append("the plan's partition: its units are not one stack of repeated blocks, so torchtitan's "
                               "module_fqns_per_model_part cannot name them; torchtitan splits the layers itself")
        else:
            parallel["module_fqns_per_model_part"] = _titan_fqns(rows, head)
        if placement(plan) is None:
            unexpressed.append("the plan's stage placement: torchtitan places stages in a loop or a V only; it runs "
                               f"torch's {name} schedule instead of the plan's order")
        elif rows is None and c.vp > 2:
            unexpressed.append(f"the plan's order over {c.vp} stages per rank: without module names torchtitan builds "
                               f"two per rank; it runs torch's {name} schedule instead")
        else:
            parallel["pipeline_parallel_schedule_csv"] = schedule_csv
            files[schedule_csv] = "".join(",".join(row) + "\n" for row in schedule_rows(plan))
    if schedule_csv not in files and plan.fill is not None and plan.fill.chunks:
        unexpressed += _common_unexpressed(plan, "torchtitan", "runs the fill in the plan's own pipeline order only, "
                                           "which this export cannot give it")
    # per data-parallel rank and step: b*m samples (split into m microbatches by the pipeline schedule,
    # or accumulated m times without pipelining)
    local = c.microbatch * c.microbatches if c.pp > 1 else c.microbatch
    precision = {"bf16": "bfloat16", "fp32": "float32"}.get(c.precision)
    if precision is None:
        unexpressed.append(f"precision {c.precision}: torchtitan trains in bf16 or fp32 only; exported as bf16")
        precision = "bfloat16"
    training = {"local_batch_size": local, "global_batch_size": src.global_batch,
                "mixed_precision_param": precision, "dtype": "float32"}
    if src.model_shape.get("seq"):
        training["seq_len"] = src.model_shape["seq"]
    if c.recompute == "selective" and src.engine != "torchtitan":  # (a torchtitan plan prices torchtitan's)
        unexpressed.append("selective recomputation: torchtitan's selective AC recomputes per op (every second "
                           "matmul and cheap ops), not the attention core the plan prices")
    if c.recompute == "block":
        unexpressed.append(f"partial recomputation of the first {c.recompute_layers} blocks of each model chunk: "
                           "torchtitan's AC checkpoints every block or every k-th one; exported as full")
    if c.fp8 and not FP8_RECIPES[c.fp8].titan_recipe:
        unexpressed.append(f"the FP8 recipe {c.fp8} is Transformer Engine's; torchtitan runs torchao's float8: re-plan "
                           "with --fp8 torchao-rowwise (or torchao-tensorwise)")
    sections = {"parallelism": parallel, "training": training}
    if c.compile:  # each TransformerBlock compiled (apply_compile), the loss left eager as the plan prices it
        # (torchtitan's default CompileConfig.components, ["model", "loss"], compiles the loss too)
        sections["compile"] = {"enable": True, "components": ["model"]}
        if c.async_tp:  # torch's micro-pipelined TP over the TP group's symmetric memory (torchtitan 0.3's compile
            # section, distributed/compile.py _maybe_enable_async_tp; 0.2's [parallelism])
            sections["compile"]["enable_async_tensor_parallel"] = True
    return module, config, sections, unexpressed, files


def _titan_float8(plan: Plan, toml: bool) -> tuple[dict[str, dict], list[str]]:
    """torchao's float8 as a torchtitan job sets it: torchtitan 0.1-0.2 (`toml`) turn it on with the `float8` model
    converter and its [float8] section (tensorwise, the default recipe then, with FSDP's float8 all-gather of the
    weights under FSDP and their scales precomputed in one all-reduce: torchtitan docs/float8.md); torchtitan 0.3 sets
    converters in the config function's model spec, with Float8LinearConverter's recipe_name rowwise only."""
    c = plan.config
    recipe = FP8_RECIPES[c.fp8].titan_recipe if c.fp8 else ""
    if not recipe:
        return {}, []
    fsdp = c.zero == 3
    if toml:
        section = {"recipe_name": recipe} if recipe != "tensorwise" else {
            "enable_fsdp_float8_all_gather": fsdp, "precompute_float8_dynamic_scale_for_fsdp": fsdp}
        return {"model": {"converters": ["float8"]}, "float8": section}, []
    if recipe == "tensorwise":
        return {}, [f"FP8 ({c.fp8}): torchtitan 0.3's Float8LinearConverter runs the rowwise recipes only; tensorwise "
                    "scaling with FSDP's float8 all-gather is torchtitan 0.2's (export with --toml), or re-plan with "
                    "--fp8 torchao-rowwise"]
    return {}, [f"FP8 ({c.fp8}): add converters=[Float8LinearConverter.Config(recipe_name=\"{recipe}\")] to the "
                "model spec of your config function (torchtitan 0.3 sets its float8 converters there)"]


def to_torchtitan(plan: Plan, *, module: str | None = None, config: str | None = None, toml: bool = False,
                  schedule_csv: str = "schedule.csv", fill_plan: str = "plan.json") -> Export:
    """torchtitan >= 0.3's command line, or with `toml` the job file of torchtitan 0.1-0.2
    (`--job.config_file job.toml`; `config` is then the model flavor, or a 0.3 config name mapped to it).
    With pipelining the job reads the plan's schedule from `schedule_csv` (in `files`; the shell script finds it
    beside itself, the TOML job at that path from where torchtitan runs). A plan with fill jobs runs in the fill
    trainer (planner.engines.titan: torchtitan's trainer, the config function derived with a `fill` section), which
    reads the plan from `fill_plan` (in `files` too)."""
    if toml:
        return _titan_toml(plan, module, config, schedule_csv)
    c = plan.config
    module, config, sections, unexpressed, files = _titan_job(plan, module, config, schedule_csv, "lm_head")
    unexpressed += _titan_float8(plan, toml=False)[1]
    if plan.fill is not None and plan.fill.chunks and schedule_csv in files:
        module, config = "planner.engines.titan", f"{module}.{config}"
        sections["fill"] = {"plan": fill_plan}
        files[fill_plan] = plan.model_dump_json(by_alias=True, indent=1) + "\n"
    sections["parallelism"]["enable_sequence_parallel"] = c.sp  # 0.3 only: 0.2 always runs SP with TP
    if c.pp > 1 or c.ep > 1:  # torchtitan refuses CUDA graphs with pipelining, and beside a token dispatcher that
        # synchronizes with the host (its standard all-to-all one: torchtitan/trainer.py _validate_cuda_graphs)
        sections["training"]["disable_cuda_graphs"] = True
    argv = ["--module", module, "--config", config]
    for sec, kv in sections.items():
        for key, value in kv.items():
            if isinstance(value, bool):
                argv.append(f"--{sec}.{key}" if value else f"--{sec}.no_{key}")
            elif isinstance(value, list):  # module_fqns_per_model_part: one comma-joined list per part; a list
                # of names (compile.components): the names
                argv += [f"--{sec}.{key}", *(part if isinstance(part, str) else ",".join(part) for part in value)]
            else:
                argv += [f"--{sec}.{key}", str(value)]
    argv.append(TITAN_AC[c.recompute])
    launch = (f"torchrun --nnodes {plan.launch.nnodes} --nproc-per-node {plan.launch.nproc_per_node} "
              "--rdzv-backend c10d --rdzv-endpoint ${RDZV_ENDPOINT:-localhost:29500} -m torchtitan.train")
    beside = {p: '"$(dirname "$0")"/' + shlex.quote(PurePath(p).name) for p in files}
    return Export(engine="torchtitan", argv=argv, unexpressed=unexpressed, files=files,
                  text=_script(plan, "torchtitan", launch, argv, unexpressed, raw=beside))


def _titan_toml(plan: Plan, module: str | None, flavor: str | None, schedule_csv: str) -> Export:
    c, src = plan.config, plan.source
    name, fn, sections, unexpressed, files = _titan_job(plan, module, flavor, schedule_csv, "output")
    if plan.fill is not None and plan.fill.chunks and not any("fill jobs" in u for u in unexpressed):
        unexpressed += _common_unexpressed(plan, "torchtitan 0.1-0.2", "runs no work in the pipeline bubbles (its "
                                           "fill trainer is torchtitan >= 0.3's: export without --toml)")
    if c.tp > 1 and not c.sp:
        unexpressed.append("tensor parallelism without sequence parallelism: torchtitan 0.2 always runs it with "
                           "sequence parallelism")
    if sections.get("compile", {}).pop("enable_async_tensor_parallel", False):  # torchtitan 0.2: a parallelism flag
        sections["parallelism"]["enable_async_tensor_parallel"] = True
    float8, _ = _titan_float8(plan, toml=True)
    sections = {"model": {"name": name, "flavor": TITAN_FLAVORS.get(fn, fn), **float8.pop("model", {})}, **sections,
                **float8, "activation_checkpoint": {"mode": c.recompute}}
    head = [f"# torchtitan (0.1-0.2) job of an fxplanner plan ({src.model_file}, {src.gpus} GPUs: t={c.tp} p={c.pp} "
            f"d={c.dp} cp={c.cp} b={c.microbatch} m={c.microbatches} v={c.vp} {c.schedule} recompute={c.recompute}; "
            f"predicted {plan.predictions.iteration_s:.3f} s/iteration)",
            f"# run: torchrun --nnodes {plan.launch.nnodes} --nproc-per-node {plan.launch.nproc_per_node} "
            "-m torchtitan.train --job.config_file THIS_FILE",
            *(f"# the plan's pipeline order: {p} (read from the directory torchtitan runs in)" for p in files),
            *(["# torch.compile per block: [compile] is torchtitan 0.2's; 0.1 spells it [training] compile = true"]
              if c.compile else []),
            "# not expressed:" if unexpressed else "# everything in the plan is expressed",
            *(f"#   - {u}" for u in unexpressed)]
    body = [f"\n[{sec}]\n" + "\n".join(f"{k} = {_toml_value(v)}" for k, v in kv.items())
            for sec, kv in sections.items()]
    return Export(engine="torchtitan", argv=[], unexpressed=unexpressed, files=files, text="\n".join(head) + "\n" +
                  "\n".join(body) + "\n")


def _toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


# -- Megatron-LM ----------------------------------------------------------------------------------

def _pipeline_layout_arg(rows: list[list[tuple[str, int]]], mtp: int = 0) -> str:
    """Megatron-Core's --pipeline-model-parallel-layout: stages in virtual order split by '|', E the
    embedding, t a transformer layer, L the loss (final norm and output layer), after the `mtp` multi-token-prediction
    layers (m) the head unit holds (planner.hf.MultiTokenPrediction)."""
    letters = {"embedding": "E", "block": "t", "head": "m" * mtp + "L"}
    return "|".join("".join(letters[k] for k, _ in row) for row in rows)


def _even_split(rows: list[list[tuple[str, int]]], p: int) -> bool:
    counts = [sum(1 for k, _ in row if k == "block") for row in rows]
    ends = rows[0][0][0] == "embedding" and rows[-1][-1][0] == "head" and all(
        k == "block" for row in rows[1:] for k, _ in row[:1]) and all(k == "block" for row in rows[:-1] for k, _ in row[-1:])
    return ends and len(set(counts)) == 1 and len(rows) >= p


def to_megatron(plan: Plan, *, fill_plan: str = "plan.json") -> Export:
    """Megatron-LM's `pretrain_gpt.py` arguments. A plan with fill jobs runs the script under the fill adapter
    (`python -m planner.engines.megatron_fill PLAN pretrain_gpt.py ...`), which reads the plan from `fill_plan` (in
    `files`)."""
    c, src, shape = plan.config, plan.source, plan.source.model_shape
    unexpressed, files = [], {}
    if plan.fill is not None and plan.fill.chunks:
        from .engines.megatron_fill import bubble_receives

        try:  # every bubble ends at a receive of Megatron's own schedule (Megatron-LM overlaps p2p when interleaved)
            for rank in range(c.pp):
                bubble_receives(plan, rank, overlap_p2p_comm=c.vp > 1)
            files[fill_plan] = plan.model_dump_json(by_alias=True, indent=1) + "\n"
        except ValueError as e:
            unexpressed += _common_unexpressed(plan, "Megatron-LM", f"cannot mark the plan's bubbles ({e})")
    argv = ["--tensor-model-parallel-size", str(c.tp), "--pipeline-model-parallel-size", str(c.pp),
            "--context-parallel-size", str(c.cp), "--micro-batch-size", str(c.microbatch),
            "--global-batch-size", str(src.global_batch)]
    if c.sp:
        argv.append("--sequence-parallel")
    rows = layout(plan) if c.pp > 1 else None
    if c.pp > 1 and rows is None:
        unexpressed.append("the plan's partition: its units are not one stack of repeated blocks; Megatron splits "
                           "the layers evenly")
    split = get_schedule(c.schedule).split_backward or any(_SPLIT_BACKWARD.fullmatch(a) for acts in plan.actions
                                                            for a in acts)
    what = [f"backwards split into input- and weight-gradient halves ({c.schedule})"] if split else []
    what += ["stages placed in a V (rank r holds stages r and 2p-1-r)"] if placement(plan) == "v" else []
    if what:  # megatron-core 0.16's delay_wgrad_compute defers wgrads only for MoE expert-parallel overlap
        unexpressed.append(f"{' and '.join(what)}: Megatron-Core runs whole backwards in 1F1B or interleaved 1F1B "
                           "with virtual stage k on rank k % p (its delay_wgrad_compute splits backwards only inside "
                           f"MoE expert-parallel overlap); exported as {'interleaved 1F1B' if c.vp > 1 else '1F1B'}")
    if rows is not None and not _even_split(rows, c.pp):
        argv += ["--pipeline-model-parallel-layout", _pipeline_layout_arg(rows, shape.get("mtp_layers") or 0)]
    elif c.vp > 1:
        argv += ["--num-layers-per-virtual-pipeline-stage", str(shape.get("layers", 0) // (c.pp * c.vp))]
    if c.vp > 1 and c.microbatches % c.pp:  # Megatron-Core's default group is p
        argv += ["--microbatch-group-size-per-virtual-pipeline-stage", str(group_size(c.pp, c.microbatches))]
    if c.tp_comm_overlap:
        argv.append("--tp-comm-overlap")
    if c.async_tp:
        unexpressed.append("async tensor parallelism (torch's micro-pipelined TP under torch.compile): Megatron-Core's "
                           "nearest is Transformer Engine's userbuffers (--tp-comm-overlap, re-plan with it); not set")
    if c.zero:
        argv.append("--use-distributed-optimizer")
    if c.zero >= 2:  # Megatron-FSDP: the gradients (and under ZeRO-3 the parameters) sharded too
        argv += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                 "optim_grads" if c.zero == 2 else "optim_grads_params",
                 "--ckpt-format", "fsdp_dtensor"]  # the only checkpoint format Megatron-LM runs Megatron-FSDP with
        if c.dp_replicate > 1:  # hybrid FSDP: sharded within each of R groups of dp x cp / R ranks, the gradients
            # all-reduced across them (mcore_fsdp_adapter.py enable_hsdp; --outer-dp-sharding-strategy no_shard)
            argv += ["--num-distributed-optimizer-instances", str(c.dp_replicate)]
        if c.tp > 1 or c.cp > 1:
            unexpressed.append("tensor or context parallelism beside Megatron-FSDP: before Blackwell they want "
                               "CUDA_DEVICE_MAX_CONNECTIONS=1, which Megatron-FSDP forbids; the script unsets it and "
                               "Megatron-LM warns that the two lose performance together")
    if c.grad_fp32:
        argv.append("--accumulate-allreduce-grads-in-fp32")
    elif c.precision == "bf16":  # Megatron reduces bf16 training's gradients in fp32 unless told otherwise
        argv.append("--grad-reduce-in-bf16")
    if c.overlap_grad_reduce and c.dp * c.cp > 1:
        argv.append("--overlap-grad-reduce")
        if c.zero:
            argv.append("--overlap-param-gather")
    if c.recompute == "selective":
        argv += ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"]
    elif c.recompute == "full":
        argv += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif c.recompute == "block":
        argv += ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
                 str(c.recompute_layers)]
    if c.precision in ("bf16", "fp16"):
        argv.append(f"--{c.precision}")
    if c.fp8:
        recipe = FP8_RECIPES[c.fp8]
        if recipe.megatron_recipe:  # hybrid: E4M3 forward, E5M2 gradients (Transformer Engine's Format.HYBRID)
            argv += ["--fp8-format", "hybrid", "--fp8-recipe", recipe.megatron_recipe]
            argv += ["--fp8-param-gather"] if c.fp8_params else []
        else:
            unexpressed.append(f"the FP8 recipe {c.fp8} is torchao's; Megatron runs Transformer Engine's recipes only "
                               "(re-plan with --fp8 delayed, tensorwise, blockwise or mxfp8)")
    if shape:
        argv += ["--num-layers", str(shape["layers"]), "--hidden-size", str(shape["hidden"]),
                 "--num-attention-heads", str(shape["heads"]), "--ffn-hidden-size", str(shape["ffn"]),
                 "--seq-length", str(shape["seq"]), "--max-position-embeddings", str(shape["seq"]),
                 "--position-embedding-type", str(shape["position"]), "--normalization", str(shape["norm"])]
        if shape["kv_heads"] != shape["heads"]:
            argv += ["--group-query-attention", "--num-query-groups", str(shape["kv_heads"])]
        if shape["gated"]:
            argv.append("--swiglu")
        if not shape["tied"]:
            argv.append("--untie-embeddings-and-output-weights")
        if not shape["bias"]:
            argv.append("--disable-bias-linear")
        if shape.get("experts"):  # Megatron-Core's MoE layer: grouped GEMMs, all-to-all dispatch, experts over ep
            argv += ["--num-experts", str(shape["experts"]), "--moe-router-topk", str(shape["top_k"]),
                     "--moe-ffn-hidden-size", str(shape["moe_ffn"]), "--expert-model-parallel-size", str(c.ep),
                     "--expert-tensor-parallel-size", "1", "--moe-grouped-gemm"]
            argv += (["--moe-token-dispatcher-type", "alltoall"] if c.moe_dispatcher == "alltoall" else
                     ["--moe-token-dispatcher-type", "flex", "--moe-flex-dispatcher-backend", c.moe_dispatcher])
            if c.moe_a2a_overlap:
                argv += ["--overlap-moe-expert-parallel-comm", "--delay-wgrad-compute"]
            if c.moe_capacity:  # each expert padded to its capacity: the busiest rank's share, exactly
                argv += ["--moe-expert-capacity-factor", f"{c.moe_capacity:g}", "--moe-pad-expert-input-to-capacity"]
            if shape.get("moe_layer_freq"):
                argv += ["--moe-layer-freq", str(shape["moe_layer_freq"])]
            if shape.get("shared_expert_ffn"):
                argv += ["--moe-shared-expert-intermediate-size", str(shape["shared_expert_ffn"])]
        if shape.get("mtp_layers"):  # with the loss, on the last stage (Megatron-Core's default placement)
            argv += ["--mtp-num-layers", str(shape["mtp_layers"])]
        argv, missing = _megatron_model_details(shape, argv)
        unexpressed += missing
    else:
        unexpressed.append(f"the model: {src.model_file} is not a transformer stack the exporter can describe; add "
                           "your model's --num-layers/--hidden-size/... arguments")
    fill = (f"-m planner.engines.megatron_fill \"$(dirname \"$0\")\"/{shlex.quote(PurePath(fill_plan).name)} "
            if files else "")
    launch = (f"torchrun --nnodes {plan.launch.nnodes} --nproc-per-node {plan.launch.nproc_per_node} "
              f"--rdzv-backend c10d --rdzv-endpoint ${{RDZV_ENDPOINT:-localhost:29500}} {fill}pretrain_gpt.py")
    env = _megatron_env(argv)
    return Export(engine="megatron", argv=argv, unexpressed=unexpressed, env=env, files=files,
                  text=_script(plan, "Megatron-LM", launch, argv, unexpressed, env=env,
                               tail="  # data, tokenizer, optimizer and checkpoint arguments: your own"))


def _megatron_env(argv: list[str]) -> dict[str, str | None]:
    """CUDA_DEVICE_MAX_CONNECTIONS as Megatron-LM's validate_args (core_v0.16.1) wants it for these arguments: not 1
    under Megatron-FSDP, 1 with tensor or context parallelism (asserted before Blackwell, harmless on it) unless
    MoE expert-parallel overlap is on (then Megatron only warns, and the variable is left as it is)."""
    a = megatron_args(argv)
    if a.get("use_megatron_fsdp"):
        return {"CUDA_DEVICE_MAX_CONNECTIONS": None}
    if (int(a.get("tensor_model_parallel_size", 1)) > 1 or int(a.get("context_parallel_size", 1)) > 1) \
            and not a.get("overlap_moe_expert_parallel_comm"):
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def _megatron_model_details(shape: dict, argv: list[str]) -> tuple[list[str], list[str]]:
    """The arguments beyond the layer shapes that change the model Megatron builds (its defaults otherwise train
    another one: rotary base 10000, dropout 0.1, norm epsilon 1e-5), and what the plan cannot state."""
    argv, missing = list(argv), []
    theta, scaling = shape.get("rope_theta"), shape.get("rope_scaling")
    if shape.get("position") == "rope":
        if theta is None:
            missing.append("the rotary base: the model file does not state it (Megatron's --rotary-base defaults to "
                           "10000)")
        else:
            argv += ["--rotary-base", str(int(theta))]
    if scaling:
        kind, factor = str(scaling).split(":")
        if kind == "llama3":
            argv += ["--use-rope-scaling", "--rope-scaling-factor", factor]
        else:
            missing.append(f"rope scaling {kind} (factor {factor}): Megatron's --use-rope-scaling is Llama 3's")
    for key, flag in (("attention_dropout", "--attention-dropout"), ("hidden_dropout", "--hidden-dropout"),
                      ("norm_eps", "--norm-epsilon")):
        if shape.get(key) is None:
            missing.append(f"{flag.strip('-').replace('-', ' ')}: the model does not state it (Megatron's default "
                           "applies)")
        else:
            argv += [flag, f"{float(shape[key]):g}"]
    if shape.get("vocab"):
        missing.append(f"the vocabulary of {shape['vocab']} tokens: Megatron takes it from your tokenizer (padded to a "
                       "multiple of --make-vocab-size-divisible-by x t)")
    return argv, missing


def _script(plan: Plan, engine: str, launch: str, argv: list[str], unexpressed: list[str], tail: str = "",
            raw: dict[str, str] | None = None, env: dict[str, str | None] | None = None) -> str:
    """The launch script; `raw` writes some arguments as shell words of their own (unquoted); `env` is exported
    (None: unset) before the launch."""
    raw = raw or {}
    c = plan.config
    head = ["#!/usr/bin/env bash", f"# {engine} configuration of an fxplanner plan ({plan.source.model_file}, "
            f"{plan.source.gpus} GPUs: t={c.tp} p={c.pp} d={c.dp} cp={c.cp} b={c.microbatch} m={c.microbatches} "
            f"v={c.vp} {c.schedule} recompute={c.recompute}; predicted {plan.predictions.iteration_s:.3f} s/iteration)"]
    head += ["# not expressed:" if unexpressed else "# everything in the plan is expressed"]
    head += [f"#   - {u}" for u in unexpressed]
    pairs, i = [], 0
    while i < len(argv):  # one option per line, with its values
        j = i + 1
        while j < len(argv) and not argv[j].startswith("-") and ":" not in argv[j]:
            j += 1
        pairs.append(" ".join(raw.get(a) or shlex.quote(a) for a in argv[i:j]))
        i = j
    last = [pairs.pop()] if pairs and pairs[-1].startswith("activation-checkpoint:") else []  # tyro: subcommand last
    body = " \\\n  ".join([launch, *pairs, '"$@"', *last]) + (f"\n{tail}" if tail else "")
    setenv = "".join(f"unset {k}\n" if v is None else f"export {k}={shlex.quote(v)}\n" for k, v in (env or {}).items())
    return "\n".join(head) + "\nset -euo pipefail\n" + setenv + body + "\n"


# -- the engines' own config code ---------------------------------------------------------------------

def check_torchtitan(ex: Export, world: int, plan: Plan | None = None) -> dict[str, object]:
    """Parse the export with torchtitan's ConfigManager and build its ParallelDims; the degrees it reports. Given
    the plan, the schedule CSV the job names is loaded as torchtitan loads it (`check_schedule_csv`)."""
    import logging
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchtitan.config.manager import ConfigManager
        from torchtitan.distributed.parallel_dims import ParallelDims

        titan_log = logging.getLogger()  # torchtitan logs on the root logger: quiet its notes on absent files
        level, titan_log.level = titan_log.level, logging.ERROR
        try:
            cfg = ConfigManager().parse_args(list(ex.argv))
        finally:
            titan_log.setLevel(level)
    dims = ParallelDims.from_config(cfg.parallelism, world)
    par = cfg.parallelism
    seen = {"dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "tp": dims.tp, "pp": dims.pp, "cp": dims.cp,
            "ep": dims.ep,
            "microbatch": par.pipeline_parallel_microbatch_size,
            "local_batch": cfg.training.local_batch_size, "global_batch": cfg.training.global_batch_size,
            "seq": cfg.training.seq_len, "parts": len(par.module_fqns_per_model_part or []),
            "sequence_parallel": par.enable_sequence_parallel,
            "compile": (cfg.compile.enable, tuple(cfg.compile.components)),
            "async_tp": cfg.compile.enable_async_tensor_parallel,
            "recompute": type(cfg.activation_checkpoint).__qualname__.split(".")[0] if cfg.activation_checkpoint
            else "none"}
    if dims.pp > 1:
        seen.update(schedule=par.pipeline_parallel_schedule, schedule_csv=par.pipeline_parallel_schedule_csv or None)
        if plan is not None and par.pipeline_parallel_schedule_csv:
            check_schedule_csv(plan, par.pipeline_parallel_schedule_csv, par.pipeline_parallel_schedule)
        if getattr(cfg, "fill", None) is not None:  # the fill trainer's (planner.engines.titan)
            seen["fill_plan"] = cfg.fill.plan or None
    model = getattr(getattr(cfg, "model_spec", None), "model", None)  # torchtitan >= 0.3's model config
    if model is not None and hasattr(model, "layers") and hasattr(model, "dim"):
        seen.update(layers=len(model.layers) if hasattr(model.layers, "__len__") else int(model.layers),
                    hidden=int(model.dim))
        shape = plan.source.model_shape if plan is not None else {}
        if shape.get("layers") and (shape["layers"], shape["hidden"]) != (seen["layers"], seen["hidden"]):
            raise ValueError(f"its config {ex.argv[ex.argv.index('--config') + 1]} builds {seen['layers']} layers of "
                             f"width {seen['hidden']}, the plan's model {shape['layers']} of width {shape['hidden']}; "
                             "name the config that builds the plan's model (--titan-module, --titan-config)")
    return seen


def _torch_reads(cell: str) -> str:
    """A CSV cell as torch's `_Action.from_str` reads it, printed back as `_Action.__repr__` prints it."""
    from torch.distributed.pipelining.schedules import _Action

    try:
        action = _Action.from_str(cell)
    except RuntimeError:
        return f"{cell!r}, no action"
    return "nothing" if action is None else repr(action)


def check_schedule_csv(plan: Plan, path: str | Path, schedule: str) -> dict[int, int]:
    """Read the schedule CSV as torchtitan does (torch's `_PipelineScheduleRuntime._load_csv`: parse each cell with
    `_Action.from_str`, validate, infer the stage -> rank mapping, lower to sends and receives) and compare it with
    the plan: its compute actions cell by cell, its stage -> rank mapping, the stages torchtitan builds on each
    rank under `schedule`, and with fill jobs that every bubble of the plan falls before an action that waits for a
    receive in torch's lowered order (planner.engines.pipelining.check_bubbles). Returns the mapping torch inferred; a difference is a UserError naming rank and cell."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    from torchtitan.distributed.pipeline_parallel import _get_pp_rank_to_stage_indices_mapping

    c = plan.config
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if len(rows) != c.pp:
        raise UserError(f"schedule CSV {path} holds {len(rows)} rows for the plan's {c.pp} pipeline ranks")
    for r, (row, planned) in enumerate(zip(rows, schedule_rows(plan))):
        for i in range(max(len(row), len(planned))):
            got = _torch_reads(row[i]) if i < len(row) else "nothing"
            want = planned[i] if i < len(planned) else "nothing"
            if got != want:
                raise UserError(f"schedule CSV {path}, rank {r}, cell {i}: torch reads {got} where the plan has {want}")
    stages = c.pp * c.vp
    # _PipelineScheduleRuntime reads only these of its stages before step(): no process group needed
    stub = SimpleNamespace(num_stages=stages, group_size=c.pp, group_rank=0)
    runtime = _PipelineScheduleRuntime([stub], n_microbatches=c.microbatches)
    try:
        runtime._load_csv(str(path))
    except AssertionError as e:
        stuck = getattr(runtime, "pipeline_order_with_comms", None)
        if "can't schedule sends/recvs" not in str(e) or not stuck:
            raise UserError(f"torch's pipeline runtime refuses the schedule CSV {path}: "
                            f"{str(e).strip().splitlines()[0]}") from None
        r = min(stuck)  # the lowering pops what it placed: each rank's head is the action it cannot place
        left = [a for a in stuck[r] if a is not None and a.is_compute_op]
        raise UserError(f"torch cannot lower the schedule CSV {path} to sends and receives: rank {r}, cell "
                        f"{len(rows[r]) - len(left)} ({left[0]!r}) waits for an input no rank sends first") from None
    inferred = dict(runtime.stage_index_to_group_rank)
    planned_ranks = {s.stage: s.rank for s in plan.partition}
    for k in sorted(planned_ranks):
        if inferred.get(k) != planned_ranks[k]:
            raise UserError(f"schedule CSV {path}: torch places stage {k} on rank {inferred.get(k)}, the plan on rank "
                            f"{planned_ranks[k]}")
    for r in range(c.pp):
        built = sorted(_get_pp_rank_to_stage_indices_mapping(r, c.pp, schedule, stages))
        mine = sorted(k for k, rank in planned_ranks.items() if rank == r)
        if built != mine:
            raise UserError(f"torchtitan builds stages {built} on rank {r} under pipeline_parallel_schedule "
                            f"{schedule}, but the schedule CSV {path} runs stages {mine} there")
    if plan.fill is not None and plan.fill.chunks:  # the fill adapter marks each bubble where its receive is waited
        from .engines.pipelining import check_bubbles

        try:
            check_bubbles(runtime, plan)
        except ValueError as e:
            raise UserError(f"schedule CSV {path}: the fill adapter cannot mark a bubble of the plan: {e}") from None
    return inferred


def megatron_args(argv: list[str]) -> dict[str, object]:
    """Megatron-LM's argparse destinations of an argument list (flags True, values as given)."""
    out: dict[str, object] = {}
    i = 0
    while i < len(argv):
        key = argv[i].lstrip("-").replace("-", "_")
        vals = []
        while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            i += 1
            vals.append(argv[i])
        out[key] = True if not vals else vals[0] if len(vals) == 1 else vals
        i += 1
    return out


MEGATRON_LM = "core_v0.16.1"  # the Megatron-LM release check_megatron_args follows (that of megatron-core 0.16.1)


def check_megatron_args(argv: list[str], env: dict[str, str | None] | None = None, world: int | None = None) -> None:
    """The checks Megatron-LM's validate_args (megatron/training/arguments.py at tag core_v0.16.1; line numbers
    below are that file's) makes on what the export can write, before it builds any config. `env`: the environment
    the job starts with (a None value: unset; a variable not named: unset); `world`: the number of ranks, for the
    checks on the data-parallel size. The GPU-dependent check is made as on Hopper and earlier (Megatron drops it from
    Blackwell on). A violation is a ValueError of one sentence naming the rule."""
    a, env = megatron_args(argv), env or {}
    num = lambda k, d=None: int(a[k]) if k in a else d  # noqa: E731

    def rule(ok: object, what: str) -> None:
        if not ok:
            raise ValueError(f"Megatron-LM's validate_args ({MEGATRON_LM}) requires that {what}")

    tp, pp, cp = (num("tensor_model_parallel_size", 1), num("pipeline_model_parallel_size", 1),
                  num("context_parallel_size", 1))
    fsdp, dist_opt = bool(a.get("use_megatron_fsdp")), bool(a.get("use_distributed_optimizer"))
    connections = env.get("CUDA_DEVICE_MAX_CONNECTIONS")
    # L317: world size divisible by t*p*cp; L328: data-parallel size = world // (t*p*cp)
    if world is not None:
        rule(world % (tp * pp * cp) == 0, f"the world size ({world}) is divisible by tensor x pipeline x context "
             f"parallel size ({tp} x {pp} x {cp})")
    # L495-500: --micro-batch-size given and positive; --global-batch-size positive
    rule(num("micro_batch_size", 0) > 0, "--micro-batch-size is given and positive")
    rule(num("global_batch_size", 1) > 0, "--global-batch-size is positive")
    # megatron-core 0.16.1 num_microbatches_calculator (Megatron-LM's initialization, right after validate_args):
    # the global batch is a whole number of micro-batch x data-parallel-size batches
    if world is not None and world % (tp * pp * cp) == 0 and "global_batch_size" in a:
        dp = world // (tp * pp * cp)
        rule(num("global_batch_size") % (num("micro_batch_size") * dp) == 0,
             f"--global-batch-size ({num('global_batch_size')}) is divisible by --micro-batch-size x data-parallel "
             f"size ({num('micro_batch_size')} x {dp})")
    # L502-513: at most one way of stating virtual pipeline stages
    ways = [k for k in ("num_layers_per_virtual_pipeline_stage", "num_virtual_stages_per_pipeline_rank",
                        "pipeline_model_parallel_layout") if k in a]
    rule(len(ways) <= 1, "at most one of --num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-"
         f"rank and --pipeline-model-parallel-layout is given (got {', '.join(ways)})")
    layers = num("num_layers")
    if layers is not None:  # L537-541, L564-568: the embedding and the loss may count as layers of the split
        layers += sum(bool(a.get(f"account_for_{k}_in_pipeline_split")) for k in ("embedding", "loss"))
    vp = None
    uneven = "decoder_first_pipeline_num_layers" in a or "decoder_last_pipeline_num_layers" in a
    if "pipeline_model_parallel_layout" in a:  # L516-525: the layout's stages are a multiple of p
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

        stages = PipelineParallelLayerLayout.get_num_stages_from_str(a["pipeline_model_parallel_layout"])
        rule(stages % pp == 0, f"the stages of --pipeline-model-parallel-layout ({stages}) are a multiple of "
             f"--pipeline-model-parallel-size ({pp})")
        vp = stages // pp
    elif "num_layers_per_virtual_pipeline_stage" in a and layers is not None:  # L528-551
        per = num("num_layers_per_virtual_pipeline_stage")
        rule(layers % pp == 0, f"--num-layers ({layers}) is divisible by --pipeline-model-parallel-size ({pp})")
        rule((layers // pp) % per == 0, f"the layers per pipeline stage ({layers // pp}) are divisible by "
             f"--num-layers-per-virtual-pipeline-stage ({per})")
        vp = layers // pp // per
    elif "num_virtual_stages_per_pipeline_rank" in a:
        vp = num("num_virtual_stages_per_pipeline_rank")
    elif layers is not None and not uneven:  # L552-571: without virtual stages the layers split evenly over p
        rule(layers % pp == 0, f"--num-layers ({layers}) is divisible by --pipeline-model-parallel-size ({pp}) "
             "(no layout or uneven first/last stage is given)")
    if vp is not None and vp > 1:  # L573-583: interleaving needs p > 1 with p2p overlap (the default), else p > 2
        overlap_p2p = not a.get("no_overlap_p2p_communication")
        rule(pp > (1 if overlap_p2p else 2), f"the interleaved schedule runs with --pipeline-model-parallel-size > "
             f"{1 if overlap_p2p else 2}{'' if overlap_p2p else ' under --no-overlap-p2p-communication'} (got {pp})")
    if a.get("overlap_param_gather"):  # L597-603
        rule(dist_opt or fsdp, "--overlap-param-gather runs with --use-distributed-optimizer or --use-megatron-fsdp")
        rule(a.get("overlap_grad_reduce"), "--overlap-param-gather runs with --overlap-grad-reduce")
    if a.get("fp8_param_gather"):  # L655-657 (training, not inference)
        rule(dist_opt or fsdp or a.get("use_torch_fsdp2"), "--fp8-param-gather runs with --use-distributed-optimizer, "
             "--use-torch-fsdp2 or --use-megatron-fsdp")
        # L1331 passes it to TransformerConfig as fp8_param, whose __post_init__ (megatron-core 0.16.1) needs fp8
        rule(a.get("fp8_format"), "--fp8-param-gather runs with --fp8-format (TransformerConfig's fp8_param needs fp8)")
    ckpt = a.get("ckpt_format", "torch_dist")  # training_config.CheckpointConfig.ckpt_format's default
    if fsdp:  # L687-691
        rule(connections != "1", "Megatron-FSDP (--use-megatron-fsdp) runs without CUDA_DEVICE_MAX_CONNECTIONS=1")
        rule(ckpt == "fsdp_dtensor", f"--use-megatron-fsdp runs with --ckpt-format fsdp_dtensor (got {ckpt})")
    if ckpt == "fsdp_dtensor":  # L1049-1050
        rule(fsdp, "--ckpt-format fsdp_dtensor runs with --use-megatron-fsdp")
    rule(not (a.get("fp16") and a.get("bf16")), "at most one of --fp16 and --bf16 is given")  # L703, L712
    for key in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"):  # L795-799
        rule(key in a, f"--{key.replace('_', '-')} is given")
    if "kv_channels" not in a:  # L813-815
        rule(num("hidden_size") % num("num_attention_heads") == 0, f"--hidden-size ({num('hidden_size')}) is "
             f"divisible by --num-attention-heads ({num('num_attention_heads')}) when --kv-channels is not given")
    seq = num("seq_length")
    if seq is not None and cp > 1:  # L817-820
        rule(seq % (2 * cp) == 0, f"--seq-length ({seq}) is a multiple of 2 x --context-parallel-size ({cp})")
    if seq is not None:  # L829-832
        rule(num("max_position_embeddings") >= seq, f"--max-position-embeddings ({num('max_position_embeddings')}) "
             f"is at least --seq-length ({seq})")
    if a.get("recompute_granularity") == "selective":  # L899-902
        rule("recompute_method" not in a, "--recompute-granularity selective runs without --recompute-method")
    sp = bool(a.get("sequence_parallel"))
    if tp == 1:  # L904-913: Megatron turns sequence parallelism off (with a warning), so the job would not run it
        rule(not sp, "--sequence-parallel runs with --tensor-model-parallel-size > 1 (Megatron turns it off at 1)")
    if a.get("tp_comm_overlap"):  # L915-916
        rule(sp, "--tp-comm-overlap runs with --sequence-parallel")
    # L924-953, before Blackwell: t or cp > 1 asserts CUDA_DEVICE_MAX_CONNECTIONS=1, except beside FSDP or MoE
    # expert-parallel overlap (there Megatron only warns)
    if (tp > 1 or cp > 1) and not (fsdp or a.get("use_torch_fsdp2") or a.get("overlap_moe_expert_parallel_comm")):
        rule(connections == "1", "tensor or context parallelism runs with CUDA_DEVICE_MAX_CONNECTIONS=1 (asserted on "
             f"Hopper and earlier; the job has {'it unset' if connections is None else repr(connections)})")
    ep = num("expert_model_parallel_size", 1)
    if ep > 1:  # L1024-1028
        experts = num("num_experts")
        rule(experts and experts % ep == 0, f"--num-experts ({experts}) is a multiple of "
             f"--expert-model-parallel-size ({ep})")
    if a.get("delay_wgrad_compute"):  # L1209-1211
        rule(a.get("transformer_impl", "transformer_engine") == "transformer_engine",
             "--delay-wgrad-compute runs with --transformer-impl transformer_engine")
    if num("mtp_num_layers"):  # L1229-1234
        rule(a.get("position_embedding_type", "learned_absolute") in ("rope", "none"),
             "--mtp-num-layers runs with --position-embedding-type rope or none")


def check_megatron(ex: Export, world: int | None = None) -> dict[str, object]:
    """Run Megatron-LM's validate_args checks on the export (`check_megatron_args`, with the environment its script
    sets and, given, the world size), then build megatron-core's TransformerConfig (a ModelParallelConfig) and
    DistributedDataParallelConfig from it, as Megatron-LM's core_transformer_config_from_args does; their checks run
    in __post_init__."""
    import warnings

    import torch

    check_megatron_args(ex.argv, ex.env, world)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.distributed import DistributedDataParallelConfig
        from megatron.core.enums import Fp8Recipe
        from megatron.core.transformer.transformer_config import TransformerConfig

        a = megatron_args(ex.argv)
        num = lambda k, d=None: int(a[k]) if k in a else d  # noqa: E731
        dtype = torch.bfloat16 if a.get("bf16") else torch.float16 if a.get("fp16") else torch.float32
        pp, layers = num("pipeline_model_parallel_size", 1), num("num_layers")
        per_chunk = num("num_layers_per_virtual_pipeline_stage")
        vp = layers // (pp * per_chunk) if per_chunk else None
        cfg = TransformerConfig(
            tensor_model_parallel_size=num("tensor_model_parallel_size", 1), pipeline_model_parallel_size=pp,
            context_parallel_size=num("context_parallel_size", 1), virtual_pipeline_model_parallel_size=vp,
            sequence_parallel=bool(a.get("sequence_parallel")), pipeline_model_parallel_layout=a.get(
                "pipeline_model_parallel_layout"),
            num_layers=layers, hidden_size=num("hidden_size"), num_attention_heads=num("num_attention_heads"),
            ffn_hidden_size=num("ffn_hidden_size"), num_query_groups=num("num_query_groups"),
            gated_linear_unit=bool(a.get("swiglu")), normalization=a.get("normalization", "LayerNorm"),
            add_bias_linear=not a.get("disable_bias_linear"), recompute_granularity=a.get("recompute_granularity"),
            recompute_method=a.get("recompute_method"), recompute_num_layers=num("recompute_num_layers"),
            recompute_modules=[a["recompute_modules"]] if isinstance(a.get("recompute_modules"), str)
            else a.get("recompute_modules"),
            bf16=bool(a.get("bf16")), fp16=bool(a.get("fp16")), params_dtype=dtype, pipeline_dtype=dtype,
            microbatch_group_size_per_vp_stage=num("microbatch_group_size_per_virtual_pipeline_stage"),
            hidden_dropout=float(a.get("hidden_dropout", 0.1)), attention_dropout=float(a.get("attention_dropout", 0.1)),
            layernorm_epsilon=float(a.get("norm_epsilon", 1e-5)), fp8=a.get("fp8_format"),
            fp8_recipe=Fp8Recipe(a.get("fp8_recipe", "delayed")).value, num_moe_experts=num("num_experts"),
            moe_router_topk=num("moe_router_topk", 2), moe_ffn_hidden_size=num("moe_ffn_hidden_size"),
            expert_model_parallel_size=num("expert_model_parallel_size", 1),
            expert_tensor_parallel_size=num("expert_tensor_parallel_size"), moe_grouped_gemm=bool(a.get(
                "moe_grouped_gemm")), moe_token_dispatcher_type=a.get("moe_token_dispatcher_type", "allgather"),
            moe_flex_dispatcher_backend=a.get("moe_flex_dispatcher_backend", "deepep"),
            moe_expert_capacity_factor=float(a["moe_expert_capacity_factor"]) if "moe_expert_capacity_factor" in a
            else None, moe_pad_expert_input_to_capacity=bool(a.get("moe_pad_expert_input_to_capacity")),
            overlap_moe_expert_parallel_comm=bool(a.get("overlap_moe_expert_parallel_comm")),
            delay_wgrad_compute=bool(a.get("delay_wgrad_compute")),
            moe_layer_freq=parse_layer_freq(a["moe_layer_freq"]) if "moe_layer_freq" in a else 1,
            moe_shared_expert_intermediate_size=num("moe_shared_expert_intermediate_size"),
            mtp_num_layers=num("mtp_num_layers"))
        ddp = DistributedDataParallelConfig(use_distributed_optimizer=bool(a.get("use_distributed_optimizer")),
                                            use_megatron_fsdp=bool(a.get("use_megatron_fsdp")),
                                            data_parallel_sharding_strategy=a.get("data_parallel_sharding_strategy",
                                                                                  "no_shard"),
                                            # megatron/training/arguments.py: bf16 forces fp32 gradients unless
                                            # --grad-reduce-in-bf16
                                            grad_reduce_in_fp32=bool(a.get("accumulate_allreduce_grads_in_fp32")) or (
                                                bool(a.get("bf16")) and not a.get("grad_reduce_in_bf16")),
                                            overlap_grad_reduce=bool(a.get("overlap_grad_reduce")),
                                            overlap_param_gather=bool(a.get("overlap_param_gather")),
                                            num_distributed_optimizer_instances=num(
                                                "num_distributed_optimizer_instances", 1))
        stages = cfg.pipeline_model_parallel_layout
        return {"tp": cfg.tensor_model_parallel_size, "pp": cfg.pipeline_model_parallel_size,
                "cp": cfg.context_parallel_size, "sp": cfg.sequence_parallel,
                "vp": (stages.virtual_pipeline_model_parallel_size if stages is not None
                       else cfg.virtual_pipeline_model_parallel_size or 1),
                "distributed_optimizer": ddp.use_distributed_optimizer, "grad_fp32": ddp.grad_reduce_in_fp32,
                "fsdp": ddp.data_parallel_sharding_strategy if ddp.use_megatron_fsdp else None,
                "fsdp_replicas": ddp.num_distributed_optimizer_instances,
                "overlap": (ddp.overlap_grad_reduce, ddp.overlap_param_gather),
                "microbatch_group": cfg.microbatch_group_size_per_vp_stage,
                "recompute": cfg.recompute_granularity or "none",
                "recompute_layers": (cfg.recompute_method, cfg.recompute_num_layers),
                "microbatch": num("micro_batch_size"), "global_batch": num("global_batch_size"),
                "layout": stages, "rotary_base": num("rotary_base", 10000),
                "dropout": (cfg.attention_dropout, cfg.hidden_dropout), "norm_eps": cfg.layernorm_epsilon,
                "fp8": (cfg.fp8, cfg.fp8_recipe) if cfg.fp8 else None,
                "mtp": cfg.mtp_num_layers or 0,
                "moe": (cfg.num_moe_experts, cfg.moe_router_topk, cfg.expert_model_parallel_size,
                        cfg.moe_token_dispatcher_type, cfg.overlap_moe_expert_parallel_comm)
                if cfg.num_moe_experts else None}


def parse_layer_freq(pattern: str) -> list[int]:
    """Megatron's --moe-layer-freq as a list (the export writes it as a plain list of 0/1, which Megatron's own
    parser evaluates; here without eval)."""
    return [int(x) for x in pattern.strip("[]() ").split(",")]
