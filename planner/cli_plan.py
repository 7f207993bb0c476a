"""`planner plan`, `planner show`, `planner chart`."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from passes.errors import UserError
from targets.builtin import DEFAULT_TARGET

from .cli import GiB, TARGET_HELP, _ms, _si, app, err, out, print_json, user_errors
from .config import FIELDS, choices_text
from .engines import ENGINES
from .options import PACKER_NAMES as PACKERS  # (.fill.assign.PACKERS' names: it imports torch)
from .fill.physics import TIMESLICE_S
from .schedule_ir import gc_paused

if TYPE_CHECKING:  # (pydantic: imported where a command needs it, not for --help)
    from .plan import ConfigModel, Plan


def _choices(registry: dict) -> str:
    return ", ".join(registry)


def pin_option(name: str) -> Any:
    """`planner plan`'s option for the pin of ParallelConfig field `name`, from the field's metadata (planner.config):
    its flag, its help with its choices, and its default (None where the search chooses, saying what it does)."""
    f = FIELDS[name]
    meta, choices = f.metadata, choices_text(name, cli=True)
    return typer.Option(None if meta["unpinned"] else f.default, meta["flag"],
                        help=meta["help"] + (f": {choices}" if choices else "") +
                        (f"; by default {meta['unpinned']}" if meta["unpinned"] else ""))


@app.command()
def plan(
    model: str = typer.Argument(..., help="model file defining build_model() and example_inputs()"),
    gpus: int = typer.Option(..., "--gpus", help="number of GPUs"),
    target: str = typer.Option(DEFAULT_TARGET, help=TARGET_HELP),
    gpus_per_node: Optional[int] = typer.Option(None, "--gpus-per-node", help="override the target's"),
    global_batch: int = typer.Option(512, "--global-batch", "-B", help="samples per iteration"),
    model_arg: List[str] = typer.Option([], "--model-arg", help="key=value passed to build_model"),
    leaf: List[str] = typer.Option([], "--leaf", help="module class or name to trace as one node"),
    tp: Optional[int] = pin_option("tp"),
    pp: Optional[int] = pin_option("pp"),
    dp: Optional[int] = pin_option("dp"),
    cp: Optional[int] = pin_option("cp"),
    ep: Optional[int] = pin_option("ep"),
    moe_dispatcher: str = pin_option("moe_dispatcher"),
    moe_a2a_overlap: bool = pin_option("moe_a2a_overlap"),
    expert_load: Optional[float] = pin_option("expert_load"),
    moe_capacity: float = pin_option("moe_capacity"),
    microbatch: Optional[int] = pin_option("b"),
    vp: Optional[int] = pin_option("v"),
    recompute: Optional[str] = pin_option("recompute"),
    recompute_layers: Optional[int] = pin_option("recompute_layers"),
    schedule: Optional[str] = pin_option("schedule"),
    pipeline_layout: Optional[str] = typer.Option(
        None, "--pipeline-layout", help="pin the partition: Megatron-Core's --pipeline-model-parallel-layout "
        "(E embedding, t layer, m multi-token prediction, L loss, '|' between virtual stages, '(..)*n' repeats; e.g. "
        "'Et|(tt|)*30mL'), or "
        "'even' (Megatron's default split)"),
    allow_cross_node_tp: bool = typer.Option(False, "--allow-cross-node-tp", help="let t span nodes"),
    zero: Optional[int] = pin_option("zero"),
    dp_replicate: int = pin_option("dp_replicate"),
    shard_optimizer: Optional[bool] = typer.Option(
        None, "--shard-optimizer/--no-shard-optimizer", help="pin optimizer state sharded over d x cp (ZeRO-1, "
        "Megatron's distributed optimizer) or replicated; by default sharded wherever there are replicas"),
    grad_fp32: Optional[bool] = pin_option("grad_fp32"),
    overlap_grad_reduce: Optional[bool] = pin_option("overlap_grad_reduce"),
    tp_comm_overlap: bool = pin_option("tp_comm_overlap"),
    async_tp: Optional[bool] = pin_option("async_tp"),
    sequence_parallel: Optional[bool] = pin_option("sp"),
    dtype: str = pin_option("precision"),
    engine: str = typer.Option("fxplanner", "--engine", help="what runs the plan: fxplanner (its runtime), "
                               f"{' or '.join(n for n, e in ENGINES.items() if e.export)} (plans what that engine "
                               "runs; the launch commands are the export's)"),
    fp8_params: bool = pin_option("fp8_params"),
    fp8: str = pin_option("fp8"),
    compile_blocks: Optional[bool] = pin_option("compile"),
    calibration: Optional[str] = typer.Option(None, "--calibration", help="file from `planner calibrate`"),
    fill: Optional[str] = typer.Option(None, "--fill", help="fill-job YAML: pack these jobs into the bubbles"),
    main_slack: float = typer.Option(0.0, "--main-slack", help="how much slower than the fastest a main "
                                     "configuration may be and still be considered for its fill (0.05 = 5%)"),
    fill_value: float = typer.Option(0.0, "--fill-value", help="what one recovered fill GPU-second is worth against "
                                     "one main-job GPU-second (0: never slow the main job for fill; fill only breaks "
                                     "ties); chooses among the configurations --main-slack admits"),
    offload: str = typer.Option("auto", "--offload", help="main-job optimizer offload to host: auto, on, off"),
    fill_solver: str = typer.Option("greedy", "--fill-solver", help=f"fill packer: {_choices(PACKERS)}"),
    fill_time_limit: float = typer.Option(5.0, "--fill-time-limit", help="seconds for all CP-SAT solves together "
                                          "(--fill-solver cpsat); past it the greedy packing stands"),
    output: str = typer.Option("plan.json", "-o", "--output", help="where to write the plan"),
    as_json: bool = typer.Option(False, "--json", help="print the plan JSON instead of the summary"),
) -> None:
    """Choose the whole PTD-P configuration for MODEL on N GPUs (and the fill of its bubbles)."""
    from costmodels.calibration import load_calibration
    from targets.registry import get_target

    from .fill.spec import load_fill_spec
    from .options import (Pins, check_cluster, check_fill_time_limit, check_fill_value, check_main_slack,
                          parse_model_args)

    with user_errors():  # the arguments are checked before torch is imported (seconds): an error answers at once
        if offload not in ("auto", "on", "off"):
            raise UserError(f"--offload takes auto, on or off, got {offload!r}")
        if fill_solver not in PACKERS:
            raise UserError(f"--fill-solver takes {_choices(PACKERS)}, got {fill_solver!r}")
        check_fill_value(fill_value)  # before the progress bar starts (make_plan checks too)
        spec = load_fill_spec(fill) if fill else None
        cal = load_calibration(calibration) if calibration else None
        if dtype == "fp8":
            dtype, fp8 = "bf16", fp8 or "auto"
        pins = Pins(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, b=microbatch, v=vp, recompute=recompute,
                    recompute_layers=recompute_layers, schedule=schedule, layout=pipeline_layout,
                    zero=zero if zero is not None else None if shard_optimizer is None else int(shard_optimizer), grad_fp32=grad_fp32, overlap_grad_reduce=overlap_grad_reduce,
                    tp_comm_overlap=tp_comm_overlap, sp=sequence_parallel, precision=dtype, fp8=fp8, engine=engine, fp8_params=fp8_params,
                    compile=compile_blocks, dp_replicate=dp_replicate, async_tp=async_tp,
                    expert_load=expert_load, moe_capacity=moe_capacity, moe_dispatcher=moe_dispatcher,
                    moe_a2a_overlap=moe_a2a_overlap,
                    allow_cross_node_tp=allow_cross_node_tp)
        if global_batch < 1:
            raise UserError(f"--global-batch must be positive, got {global_batch}")
        check_main_slack(main_slack)
        if spec is not None:
            check_fill_time_limit(fill_time_limit)
        model_args = parse_model_args(model_arg)
        check_cluster(gpus, get_target(target, gpus_per_node).cluster.gpus_per_node)
        # what it is doing, on stderr while it works (nothing with --json, nor where stderr is no terminal); the
        # cyclic GC paused meanwhile: its full collections walked the ~10^6 objects importing torch and transformers
        # leaves, again and again, and found next to nothing to free (1.2 s of Llama-3-405B's plan on 1024 GPUs,
        # for 13 MiB more at the peak)
        with gc_paused(), Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                                   console=err, transient=True, disable=as_json) as bar:
            task = bar.add_task("loading torch and the cost models", total=None)

            def searching(i: int, n: int) -> None:
                bar.update(task, description=f"searching: {i:,}/{n:,} configurations")

            from .api import make_plan
            from .plan import save_plan

            plan_, _ = make_plan(model, gpus=gpus, global_batch=global_batch, target=target,
                                 gpus_per_node=gpus_per_node, model_args=model_args, pins=pins,
                                 leaves=tuple(leaf), plan_path=output, fill=spec,
                                 main_slack=main_slack, fill_value=fill_value, offload=offload,
                                 fill_solver=fill_solver,
                                 fill_time_limit_s=fill_time_limit, calibration=cal,
                                 progress=lambda phase: bar.update(task, description=phase),
                                 search_progress=searching)
            bar.update(task, description=f"writing {output}")
            save_plan(plan_, output)
    if as_json:
        print_json(plan_.model_dump_json(by_alias=True, indent=2))
        return
    print_summary(plan_)
    for note in plan_.source.notes:
        out.print(f"note: {note}", highlight=False)
    from passes.errors import UNLAUNCHABLE

    if any(n.startswith(UNLAUNCHABLE) for n in plan_.source.notes):  # (the note above says why): no commands
        out.print(f"plan written to [bold]{output}[/]; it cannot be launched until the model file defines what the "
                  "runtime calls (see the note above), then re-plan", highlight=False)
        return
    if ENGINES[plan_.source.engine].export:  # the export's script, the same on every node
        out.print(f"plan written to [bold]{output}[/] for {plan_.source.engine}; launch on each of the "
                  f"{plan_.launch.nnodes} nodes with:", highlight=False)
        out.print(f"  {plan_.launch.commands[0]}", highlight=False, soft_wrap=True)
        return
    out.print(f"plan written to [bold]{output}[/]; launch on each node with:", highlight=False)
    for cmd in plan_.launch.commands[:2]:
        out.print(f"  {cmd}", highlight=False, soft_wrap=True)
    if len(plan_.launch.commands) > 2:
        out.print(f"  ... ({len(plan_.launch.commands)} nodes; --node-rank 0..{len(plan_.launch.commands) - 1})")


# Hugging Face model types (and wrapper class names) of encoder-decoder models: they train on their decoder's tokens,
# and the plan records only the first input's length (the encoder's), so `plan` counts them in samples
ENCODER_DECODER = frozenset({"t5", "mt5", "umt5", "longt5", "switch_transformers", "bart", "mbart", "plbart", "pegasus",
                             "pegasus_x", "bigbird_pegasus", "marian", "blenderbot", "blenderbot-small", "led",
                             "m2m_100", "nllb-moe", "fsmt", "prophetnet", "whisper", "encoder-decoder"})


def _rate(x: float) -> str:
    """A throughput: whole units with thousands separators from 100 up, three significant digits below."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _model_tflops(p: Plan, config: ConfigModel, mfu: float) -> Optional[float]:
    """Model TFLOP/s per GPU as PaLM and Megatron count them (MFU x the dense peak MFU is measured against)."""
    from targets.specs import GPUSpec, TargetError

    try:
        return mfu * GPUSpec(**p.source.gpu).peak(config.to_config().peak_dtype) / 1e12
    except (TargetError, TypeError, ValueError):
        return None


def runners_up(p: Plan) -> list:
    """The plan's alternatives, fastest first."""
    return sorted(p.alternatives, key=lambda a: a.iteration_s)


def tokens_per_gpu(p: Plan) -> Optional[float]:
    """Tokens/s per GPU as Megatron and NeMo report it (global batch x sequence / iteration / GPUs), or None where
    the plan does not know the tokens the model trains on (no token-id input, or an encoder-decoder)."""
    if not p.predictions.tokens_per_s or str(p.source.model_shape.get("family", "")) in ENCODER_DECODER:
        return None
    return p.predictions.tokens_per_s / p.source.gpus


def print_summary(p: Plan) -> None:
    pr, s = p.predictions, p.source
    c = p.config
    precision = c.precision + (f" with FP8 GEMMs ({c.fp8})" if c.fp8 else "")
    seq = s.model_shape.get("seq") or (round(pr.tokens_per_s / pr.samples_per_s) if pr.tokens_per_s else None)
    encdec = str(s.model_shape.get("family", "")) in ENCODER_DECODER
    shape = (f" x sequence {seq}{' (the encoder input)' if encdec else ''}" if seq else "")
    out.print(f"[bold]{Path(s.model_file).name}[/] on {s.gpus} x {s.target}, global batch {s.global_batch}{shape}, "
              f"precision {precision}", highlight=False)
    out.print(f"chosen: [bold green]{c.to_config()}[/]", highlight=False)
    per_gpu = tokens_per_gpu(p)
    if per_gpu is not None:
        rate = f"{_rate(pr.tokens_per_s)} tokens/s, {_rate(per_gpu)} tokens/s/GPU"
    elif encdec:
        rate = f"{_rate(pr.samples_per_s)} samples/s (encoder-decoder: the plan does not know its decoder's tokens)"
    else:
        rate = f"{_rate(pr.samples_per_s)} samples/s"
    out.print(f"predicted: iteration {_ms(pr.iteration_s)}, {rate}, bubble fraction {pr.bubble_fraction:.1%}",
              highlight=False)
    model = _model_tflops(p, c, pr.mfu)
    peak = c.to_config().peak_dtype
    out.print(f"  MFU {pr.mfu:.1%} (PaLM)" + (f" = {model:.1f} model TFLOP/s/GPU" if model is not None else "")
              + f" (PaLM / Megatron: 3 x the forward's matmuls, attention in full, over the {peak} peak)",
              highlight=False)
    why = ": half the scores MFU counts, hence below MFU" if pr.hfu < pr.mfu else ""
    out.print(f"  HFU {pr.hfu:.1%} = {pr.hardware_tflops_per_gpu:.1f} TFLOP/s/GPU executed (recomputation as "
              f"planned, causal attention as run{why})", highlight=False)
    mem = Table(title="memory per pipeline rank (GiB)")
    for col in ("rank", "weights", "grads", "optimizer", "activations", "reserve", "total", "capacity"):
        mem.add_column(col, justify="right")
    rows = p.predictions.memory
    for m in rows if len(rows) <= 16 else rows[:8] + rows[-8:]:
        mem.add_row(str(m.rank), *(f"{x / GiB:.1f}" for x in (m.weights, m.grads, m.optimizer, m.activations,
                                                              m.reserve, m.total, m.capacity)))
    out.print(mem)
    if p.alternatives:
        alt = Table(title="runners-up, fastest first (MFU and model TFLOP/s/GPU as above)")
        for col in ("configuration", "iteration", "MFU", "model TFLOP/s/GPU", "peak GiB", "simulated"):
            alt.add_column(col)
        for a in runners_up(p)[:5]:
            model = _model_tflops(p, a.config, a.mfu)
            alt.add_row(str(a.config.to_config()), _ms(a.iteration_s), f"{a.mfu:.1%}",
                        "-" if model is None else f"{model:.1f}", f"{a.peak_memory / GiB:.1f}",
                        "yes" if a.simulated else "analytic")
        out.print(alt)
    if p.fill is not None:
        _print_fill(p)
    rej = ", ".join(f"{k}: {v}" for k, v in p.search.rejected.items())
    out.print(f"search: {p.search.evaluated} configurations in {p.search.seconds:.2f}s; rejected: {rej or 'none'}",
              highlight=False)


def _span(seconds: float) -> str:
    """A predicted time from the run's start, in the unit that reads best."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.1f} s"


_SHARING = {
    "timeslice": "time slices beside the main job's waiting receive (it takes one of "
                 f"~{TIMESLICE_S * 1e3:.1f} ms at each synchronize of the fill, which the runtime does after every "
                 "unit, or after a batch of short units where that is cheaper (every unit under 0.8 of a slice), "
                 "and half the GPU while both have work: planner/fill/physics.py); `gpu_sharing: mps` in the fill "
                 "file runs the units at their own speed",
    "mps": "MPS (the launch commands start nvidia-cuda-mps-control on each node)",
    "none": "nothing: the main job waits on the host",
}


def _print_fill(p: Plan) -> None:
    f = p.fill
    fp = f.predictions
    out.print(f"fill: {fp.fill_tflops_per_gpu:.2f} TFLOP/s/GPU recovered, {fp.bubble_time_used:.0%} of bubble time "
              f"used, total useful {fp.total_useful_tflops_per_gpu:.1f} TFLOP/s/GPU; main optimizer offload: "
              f"{'yes' if fp.offload_optimizer else 'no'}; packing: {fp.solver}", highlight=False)
    mps = (f"; under MPS it would recover {fp.under_mps_tflops_per_gpu:.2f} TFLOP/s/GPU"
           if fp.under_mps_tflops_per_gpu is not None else "")
    out.print(f"fill shares the GPU by {_SHARING[f.gpu_sharing]}{mps}", highlight=False)
    if fp.choice:
        out.print(f"shrink or fill: {fp.choice}", highlight=False)
    gpus = p.config.to_config().gpus_per_stage
    table = Table(title=f"fill per pipeline rank (each rank's {gpus} GPU{'s' if gpus > 1 else ''} divide its share; "
                        f"one job at a time{' or a pair' if f.pairs else ''}, next by {f.policy})")
    for col in ("rank", "job", "resident", "batches", "turn", "chunks", "units/iteration", "busy in bubbles"):
        table.add_column(col)
    turns = sorted(((s.rank, s.start_s, j, s) for j in f.jobs for s in j.shards), key=lambda x: x[:2])
    for rank in range(p.config.pp):
        here = [(job, shard) for r, _, job, shard in turns if r == rank]
        if not here:
            table.add_row(str(rank), "-", "", "0", "", "0", "0", "0")
        for job, shard in here:
            chunks = [c for c in f.chunks if c.rank == rank and c.job == job.name]
            table.add_row(str(rank), job.name, "yes" if job.resident else "loaded per bubble",
                          f"{shard.first_batch}-{shard.first_batch + shard.batches - 1}",
                          f"{_span(shard.start_s)}-{_span(shard.end_s)}", str(len(chunks)),
                          str(sum(c.units for c in chunks)), _ms(sum(c.expected_s for c in chunks)))
    out.print(table)
    for name, why in fp.unplaceable.items():
        out.print(f"[yellow]unplaceable[/] {name}: {why}", highlight=False)
    for name, why in fp.not_chosen.items():
        out.print(f"[yellow]not chosen[/] {name}: {why}", highlight=False)
    for pair in f.pairs:
        a, b = pair.jobs
        side, budget = _si(pair.side_by_side_bytes, "B"), _si(pair.budget_bytes, "B")
        why = (f"side by side they would need {side}, more than the {budget} they may use" if
               pair.side_by_side_bytes > pair.budget_bytes else
               f"they would fit side by side too ({side} of {budget}); paired as asked (pair_with)")
        out.print(f"paired (Waterwave) on rank {pair.rank}: {a} and {b} run together, their node groups taking turns; "
                  f"at once they use at most {_si(pair.peak_bytes, 'B')} and hold {_si(pair.held_bytes, 'B')} between "
                  f"bubbles: {why}", highlight=False)
    for name, why in fp.notes.items():
        out.print(f"[yellow]note[/] {name}: {why}", highlight=False)
    for job in f.jobs:
        for why in job.notes:
            out.print(f"[yellow]note[/] {job.name}: {why}", highlight=False)


@app.command()
def show(plan_file: str = typer.Argument("plan.json"),
         as_json: bool = typer.Option(False, "--json", help="print the validated plan as JSON"),
         full: bool = typer.Option(False, "--full", help="print every step of every rank, however wide (for "
                                   "`less -S`); by default each row fits the terminal")) -> None:
    """Print a plan's summary, its schedule grid and its bubbles per pipeline rank."""
    from .plan import load_plan, plan_schedule
    from .schedule_ir import grid

    with user_errors():
        p = load_plan(plan_file)
        if as_json:
            print_json(p.model_dump_json(by_alias=True, indent=2))
            return
        print_summary(p)
        try:
            sched = plan_schedule(p)
        except ValueError as exc:
            raise UserError(f"plan {plan_file}: its action lists do not parse: {exc}") from None
    filled = {(c.rank, c.bubble_id) for c in p.fill.chunks} if p.fill is not None else set()
    lines = grid(sched).splitlines()
    out.print("schedule (rank x step" + ("; BUBBLEn* runs fill" if filled else "") + "):", highlight=False)
    cut = 0
    for line in lines if full else lines[:GRID_RANKS]:
        text, left_out = grid_row(line, filled, None if full else out.width)
        cut = max(cut, left_out)
        out.print(text, highlight=False, markup=False, soft_wrap=True)
    if not full and len(lines) > GRID_RANKS:
        out.print(f"… {len(lines) - GRID_RANKS} more ranks", highlight=False)
    if cut or (not full and len(lines) > GRID_RANKS):
        out.print(f"(cut to {out.width} columns: `planner show {plan_file} --full | less -S` prints every step of "
                  f"every rank, `planner chart {plan_file}` draws them)", highlight=False, markup=False)
    rows = bubble_summary(p)
    bub = Table(title=f"bubbles per pipeline rank, one iteration ({len(p.bubbles)} in all)")
    cols = ["rank", "A", "B", "C", "bubbles", "total", "largest", "of iteration"] + (["fill uses"] if filled else [])
    for col in cols:
        bub.add_column(col, justify="right")
    for row in rows if len(rows) <= 16 else rows[:8] + rows[-8:]:
        cells = [str(row["rank"]), *(str(row[k]) for k in "ABC"), str(row["bubbles"]), _ms(row["total_s"]),
                 _ms(row["largest_s"]), f"{row['total_s'] / p.predictions.iteration_s:.1%}"]
        if filled:
            cells.append(f"{row['fill_s'] / row['total_s']:.0%}" if row["total_s"] else "-")
        bub.add_row(*cells)
    if len(rows) > 16:
        bub.caption = f"ranks 8-{len(rows) - 9} left out"
    out.print(bub)
    out.print("bubble kinds (FreeRide): A = fill/drain at the start or end of the iteration, B = before a "
              "backward (waiting for a gradient), C = before a forward (waiting for an activation)"
              + ("; fill uses: the share of the rank's bubble time its fill runs in (of jobs taking turns, the "
                 "busiest)" if filled else "") + f"; `planner show {plan_file} --json` lists each bubble",
              highlight=False, markup=False)


GRID_RANKS = 16  # what `show` prints before it says "… more ranks"


def grid_row(line: str, filled: set = frozenset(), width: Optional[int] = None) -> tuple[str, int]:
    """One rank's row of `schedule.grid`, its filled bubbles starred, cut to `width` columns by leaving out the
    middle steps (so the warm-up and the drain both show); returns the row and how many steps it left out."""
    head, _, body = line.partition("|")
    rank = int(head.split()[1])
    cells = body.split()
    size = max((len(c) for c in cells), default=1) + 1  # the grid pads each cell to its widest one
    cells = [c + "*" if c.startswith("BUBBLE") and (rank, int(c[6:])) in filled else c for c in cells]
    size += 1 if filled else 0
    fmt = lambda cs: "".join(" " + c.ljust(size - 1) for c in cs).rstrip()  # noqa: E731
    room = None if width is None else width - len(head) - 1
    if room is None or len(cells) * size <= room:
        return f"{head}|{fmt(cells)}", 0
    wide = len(f"  … {len(cells)} steps …  ")  # the gap names how many steps it stands for
    keep = max((room - wide) // size, 2)
    first, last = (keep + 1) // 2, keep // 2
    gap = f"… {len(cells) - first - last} steps …".center(wide)
    return f"{head}|{fmt(cells[:first])}{gap}{fmt(cells[len(cells) - last:])}", len(cells) - first - last


def bubble_summary(p: Plan) -> list[dict]:
    """Per pipeline rank: bubbles by kind, how many, their total and largest duration, and the time the fill uses
    (of jobs taking turns on the rank, the busiest; a pair's jobs together)."""
    rows = []
    for rank in range(p.config.pp):
        mine = [b for b in p.bubbles if b.rank == rank]
        used = 0.0
        if p.fill is not None:
            groups = [set(pair.jobs) for pair in p.fill.pairs if pair.rank == rank]
            for c in p.fill.chunks:
                if c.rank == rank and not any(c.job in g for g in groups):
                    groups.append({c.job})
            used = max((sum(c.expected_s for c in p.fill.chunks if c.rank == rank and c.job in g) for g in groups),
                       default=0.0)
        rows.append({"rank": rank, **{k: sum(b.kind == k for b in mine) for k in "ABC"}, "bubbles": len(mine),
                     "total_s": sum(b.duration_s for b in mine),
                     "largest_s": max((b.duration_s for b in mine), default=0.0), "fill_s": used})
    return rows


@app.command()
def chart(plan_file: str = typer.Argument("plan.json"),
          output: str = typer.Option("schedule.png", "-o", "--output", help="image file to write")) -> None:
    """Draw the Gantt chart of one iteration per pipeline rank, bubbles labelled."""
    from .chart import draw_plan
    from .plan import load_plan

    with user_errors():
        note = draw_plan(load_plan(plan_file), output)
    out.print(f"chart written to {output}" + (f"; on it: {note}" if note else ""), highlight=False)
