"""The runtime holds and runs what the plan prices (real torchrun, gloo, 2 processes): tensor-parallel
parameter counts, the sharded optimizer, recomputation modes, and `planner validate` flagging what differs."""
from __future__ import annotations

import pytest
import torch

from planner.metrics import load_metrics
from planner.validate import compare, mismatches

from ._util import GPT, gpt_args, percent, plan_file, reference, torchrun

pytestmark = pytest.mark.multiprocess

B, STEPS, LR = 4, 3, 1e-3
CASES = {  # name: pins; all on GPT tiny with 2 layers, 2 processes
    "t2": dict(t=2, p=1, d=1, b=2, v=1, schedule="1f1b"),
    "d2": dict(t=1, p=1, d=2, b=2, v=1, schedule="1f1b"),
    "d2_zero": dict(t=1, p=1, d=2, b=2, v=1, schedule="1f1b", zero=1, overlap=True),
    # ZeRO-2: two microbatches per replica, each one's gradients reduce-scattered during its backward
    "d2_zero2": dict(t=1, p=1, d=2, b=1, v=1, schedule="1f1b", zero=2, overlap=True),
    "bf16_d2_zero2_fp32_grads": dict(t=1, p=1, d=2, b=1, v=1, schedule="1f1b", zero=2, overlap=True, precision="bf16",
                                     grad_fp32=True),
    "none": dict(t=1, p=2, d=1, b=1, v=1, schedule="1f1b", recompute="none"),
    "selective": dict(t=1, p=2, d=1, b=1, v=1, schedule="1f1b", recompute="selective"),
    "full": dict(t=1, p=2, d=1, b=1, v=1, schedule="1f1b", recompute="full"),
    # partial recomputation (Megatron's block method): the first of the stage's two blocks checkpointed
    "d2_block1": dict(t=1, p=1, d=2, b=2, v=1, schedule="1f1b", recompute="block", recompute_layers=1),
    "bf16_p2": dict(t=1, p=2, d=1, b=1, v=1, schedule="1f1b", precision="bf16"),
    "bf16_d2_zero": dict(t=1, p=1, d=2, b=2, v=1, schedule="1f1b", zero=1, overlap=True, precision="bf16"),
    "bf16_p2_fp32_grads": dict(t=1, p=2, d=1, b=1, v=1, schedule="1f1b", precision="bf16", grad_fp32=True),
    "fp16_p2": dict(t=1, p=2, d=1, b=1, v=1, schedule="1f1b", precision="fp16"),  # dynamic loss scaling
    # attention through F.scaled_dot_product_attention, its core checkpointed, heads split over t
    "t2_flash_selective": dict(t=2, p=1, d=1, b=2, v=1, schedule="1f1b", recompute="selective"),
    # sequence parallelism: norms, dropout and residual on 1/t of the sequence between the split linears
    "t2_sp": dict(t=2, p=1, d=1, b=2, v=1, schedule="1f1b", sp=True),
    "t2_sp_selective": dict(t=2, p=1, d=1, b=2, v=1, schedule="1f1b", sp=True, recompute="selective"),
    # the vocabulary split (issue 47): the tied embedding and head hold half of its 1027 rows each (padded to 1028),
    # without and with sequence parallelism (the head then reads 1/t of the sequence)
    "t2_vocab": dict(t=2, p=1, d=1, b=2, v=1, schedule="1f1b"),
    "t2_sp_vocab": dict(t=2, p=1, d=1, b=2, v=1, schedule="1f1b", sp=True),
    # context parallelism: each rank holds half of every sequence (Megatron's two load-balanced chunks); the
    # optimizer sharded over dp x cp. Written-out attention (Q K^T, mask, softmax, . V), then the fused one
    "cp2_zero": dict(t=1, p=1, d=1, b=2, v=1, schedule="1f1b", cp=2, zero=1, overlap=True),
    "cp2_flash_selective": dict(t=1, p=1, d=1, b=2, v=1, schedule="1f1b", cp=2, recompute="selective"),
}
MODEL_ARGS = {"t2_flash_selective": {**gpt_args(2), "flash": True}, "cp2_flash_selective": {**gpt_args(2), "flash": True},
              "t2_vocab": {**gpt_args(2), "vocab": 1027}, "t2_sp_vocab": {**gpt_args(2), "vocab": 1027}}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("fidelity")
    plans = {n: plan_file(tmp / f"{n}.json", GPT, MODEL_ARGS.get(n, gpt_args(2)), gpus=2, global_batch=B, **pins)
             for n, pins in CASES.items()}
    proc = torchrun(2, [*(str(tmp / f"{n}.json") for n in CASES), "--steps", str(STEPS), "--optimizer", "adam",
                        "--lr", str(LR), "--no-fill", "--metrics", str(tmp / "metrics.json"),
                        "--dump-params", str(tmp / "dump")], cwd=tmp)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    doc = load_metrics(tmp / "metrics.json")
    return {"dir": tmp, "plans": plans, "runs": dict(zip(CASES, doc.runs))}


def _holds(run: dict, name: str):
    return [r.holds for r in run["runs"][name].ranks]


def _dump(run: dict, name: str, rank: int) -> dict:
    return torch.load(run["dir"] / "dump" / str(list(CASES).index(name)) / f"rank{rank}.pt")


def test_each_tensor_parallel_rank_holds_exactly_the_plans_parameters(run):
    plan = run["plans"]["t2"]
    planned = plan.predictions.memory[0].weights / 4  # fp32
    every = {f"layers.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")}
    for h in _holds(run, "t2"):
        assert h.parameters == planned
        assert set(h.tensor_parallel) == every == set(plan.partition[0].tensor_parallel)
    # half of every attention and MLP weight (and of the column-parallel biases) left on each rank
    full = _dump(run, "d2", 0)["params"]
    halved = sum(p.numel() for n, p in full.items() if n.rsplit(".", 1)[0] in every
                 and (n.endswith("weight") or plan.partition[0].tensor_parallel[n.rsplit(".", 1)[0]] == "colwise"))
    assert _holds(run, "t2")[0].parameters == _holds(run, "d2")[0].parameters - halved // 2
    # and the attention runs split by heads: what each rank saves for the backward is the plan's, as is all else
    assert not mismatches(plan, run["runs"]["t2"])


def test_scaled_dot_product_attention_runs_split_by_heads_with_its_core_recomputed(run):
    name = "t2_flash_selective"
    ref = reference(GPT, MODEL_ARGS[name], global_batch=B, steps=STEPS, optimizer="adam", lr=LR)
    assert run["runs"][name].loss == pytest.approx(ref["loss"], abs=1e-5)
    assert not mismatches(run["plans"][name], run["runs"][name])
    assert {h.recompute for h in _holds(run, name)} == {"selective"}
    for rank in range(2):
        for pname, value in _dump(run, name, rank)["params"].items():  # shards gathered in the model's order
            # the key bias has an analytically zero gradient (softmax is shift-invariant): Adam turns its float
            # noise into lr-sized steps (see test_e2e), so it can only agree to within the steps taken
            tol = STEPS * LR if pname.endswith("qkv.bias") else 1e-5
            assert torch.allclose(value, ref["params"][pname], rtol=0, atol=tol), pname


def test_zero1_matches_replicated_adam_and_holds_one_dth_of_its_state(run):
    for rank in range(2):
        plain, zero = _dump(run, "d2", rank)["params"], _dump(run, "d2_zero", rank)["params"]
        for name, value in plain.items():
            assert torch.allclose(zero[name], value, rtol=0, atol=1e-5), name
    assert run["runs"]["d2"].loss == pytest.approx(run["runs"]["d2_zero"].loss, abs=1e-6)
    ref = reference(GPT, gpt_args(2), global_batch=B, steps=STEPS, optimizer="adam", lr=LR)
    assert run["runs"]["d2_zero"].loss == pytest.approx(ref["loss"], abs=1e-5)
    full = _holds(run, "d2")[0].optimizer_state_bytes
    for h in _holds(run, "d2_zero"):
        assert h.optimizer_state_bytes == pytest.approx(full / 2, abs=8)  # padding to a multiple of d
        assert h.overlapped_buckets >= 1  # reduced during the backward, not after it
    for name in ("d2", "d2_zero"):
        assert not mismatches(run["plans"][name], run["runs"][name])


def test_zero2_reduces_every_microbatch_and_matches_replicated_adam(run):
    """ZeRO-2 over two replicas of two microbatches each: the parameters after three steps equal the replicated
    optimizer's (d2: one microbatch of two), the loss the single process's; each rank owns half the optimizer state;
    buckets were reduced during every backward (both microbatches), not after it."""
    ref = reference(GPT, gpt_args(2), global_batch=B, steps=STEPS, optimizer="adam", lr=LR)
    assert run["plans"]["d2_zero2"].config.zero == 2 and run["plans"]["d2_zero2"].config.microbatches == 2
    for rank in range(2):
        plain, zero2 = _dump(run, "d2", rank)["params"], _dump(run, "d2_zero2", rank)["params"]
        for name, value in plain.items():
            if name.endswith("qkv.bias"):  # the keys' bias gets no gradient (softmax ignores it): Adam turns the
                h = value.numel() // 3  # rounding noise of two microbatches summed in another order into steps
                value, other = torch.cat([value[:h], value[2 * h:]]), torch.cat([zero2[name][:h], zero2[name][2 * h:]])
            else:
                other = zero2[name]
            assert torch.allclose(other, value, rtol=0, atol=1e-5), name
    assert run["runs"]["d2_zero2"].loss == pytest.approx(ref["loss"], abs=1e-5)
    full = _holds(run, "d2")[0].optimizer_state_bytes
    for h in _holds(run, "d2_zero2"):
        assert h.optimizer_state_bytes == pytest.approx(full / 2, abs=8)
        assert h.overlapped_buckets >= 2
    assert not mismatches(run["plans"]["d2_zero2"], run["runs"]["d2_zero2"])


def test_selective_recomputation_saves_between_none_and_full_as_planned(run):
    ref = reference(GPT, gpt_args(2), global_batch=B, steps=STEPS, optimizer="adam", lr=LR)
    saved = {}
    for mode in ("none", "selective", "full"):
        holds = _holds(run, mode)
        assert {h.recompute for h in holds} == {mode}
        saved[mode] = [holds[r].saved_activation_bytes[str(r)] for r in range(2)]
        planned = [st.activation_bytes for st in run["plans"][mode].partition]
        assert run["runs"][mode].loss == pytest.approx(ref["loss"], abs=1e-5)  # recomputation changes no number
        if mode != "full":  # full keeps only block inputs: a few KiB, where the embedding's own saves dominate
            assert saved[mode] == pytest.approx(planned, rel=0.05)
    for r in range(2):
        assert saved["none"][r] > saved["selective"][r] > saved["full"][r]


def test_partial_recomputation_checkpoints_the_first_blocks_of_each_stage_as_planned(run):
    """Recompute "block" with one of two blocks: the rank keeps the other block's activations and the first one's
    input, as the plan says, below what the same layout keeps without recomputation; the numbers do not change."""
    ref = reference(GPT, gpt_args(2), global_batch=B, steps=STEPS, optimizer="adam", lr=LR)
    plan, ran = run["plans"]["d2_block1"], run["runs"]["d2_block1"]
    assert plan.config.recompute_layers == 1
    assert {h.recompute for h in _holds(run, "d2_block1")} == {"block"}
    assert ran.loss == pytest.approx(ref["loss"], abs=1e-5)
    for r in range(2):
        saved = _holds(run, "d2_block1")[r].saved_activation_bytes["0"]
        assert saved == pytest.approx(plan.partition[0].activation_bytes, rel=0.05)
        assert saved < _holds(run, "d2")[r].saved_activation_bytes["0"]
    assert not mismatches(plan, ran)


def test_validate_flags_a_planted_mismatch(run):
    plan, metrics = run["plans"]["d2"], run["runs"]["d2"]
    assert not compare(plan, _doc(metrics)).mismatches
    mem = plan.predictions.memory[0].model_copy(update={"optimizer": plan.predictions.memory[0].optimizer / 2})
    planted = plan.model_copy(update={"predictions": plan.predictions.model_copy(update={"memory": [mem]})})
    found = compare(planted, _doc(metrics)).mismatches
    assert len(found) == 2 and all("optimizer state bytes" in f and "(+100.0%)" in f for f in found)
    stage = plan.partition[0].model_copy(update={"tensor_parallel": {"blocks.0.mlp.fc1": "colwise"}})
    assert any("tensor-parallel layout" in f for f in mismatches(plan.model_copy(update={"partition": [stage]}), metrics))
    fp16 = plan.model_copy(update={"config": plan.config.model_copy(update={"precision": "fp16"})})
    assert any("trains in float32, the plan in fp16" in f for f in mismatches(fp16, metrics))


def _doc(entry):
    from planner.metrics import MetricsDocument

    return MetricsDocument(runs=[entry])


def test_bf16_plans_train_in_bf16_with_fp32_master_weights_and_match_a_bf16_single_process(run):
    ref = reference(GPT, gpt_args(2), global_batch=B, steps=STEPS, optimizer="adam", lr=LR, dtype=torch.bfloat16)
    fp32 = reference(GPT, gpt_args(2), global_batch=B, steps=STEPS, optimizer="adam", lr=LR)
    for name in ("bf16_p2", "bf16_d2_zero", "bf16_p2_fp32_grads", "bf16_d2_zero2_fp32_grads"):
        entry = run["runs"][name]
        assert entry.dtype == "bfloat16" and {h.parameter_dtype for h in _holds(run, name)} == {"bfloat16"}
        # microbatches accumulate bf16 gradients where the reference takes one backward: bf16 rounding apart
        assert entry.loss == pytest.approx(ref["loss"], rel=1e-3)
        assert not mismatches(run["plans"][name], entry)  # 12 bytes of optimizer state per parameter, as planned
        for rank in range(2):
            for pname, value in _dump(run, name, rank)["params"].items():
                assert value.dtype == torch.bfloat16
                assert torch.allclose(value.float(), ref["params"][pname].float(), rtol=0, atol=2e-2), pname
    assert ref["loss"] != pytest.approx(fp32["loss"], rel=1e-3)  # the tolerance tells bf16 from fp32 training


def test_fp16_trains_under_dynamic_loss_scaling_skipping_the_steps_that_overflow(run):
    entry, plan = run["runs"]["fp16_p2"], run["plans"]["fp16_p2"]
    assert entry.dtype == "float16" and {h.parameter_dtype for h in _holds(run, "fp16_p2")} == {"float16"}
    decisions = {tuple((s.loss_scale, s.skipped) for s in r.steps) for r in entry.ranks}
    assert len(decisions) == 1  # every rank sees the overflow and skips the same steps
    (steps,) = decisions
    assert steps[0][0] == 2.0 ** 16
    for (scale, skipped), (after, _) in zip(steps, steps[1:]):
        assert after == (scale / 2 if skipped else scale)  # halved after an overflow, else kept (window 1000)
    skips = tuple(i for i, (_, skipped) in enumerate(steps) if skipped)
    assert 0 < len(skips) < STEPS  # four microbatches of fp16 gradients at 2^16 overflow; half of that does not
    ref = reference(GPT, gpt_args(2), global_batch=B, steps=STEPS, optimizer="adam", lr=LR, dtype=torch.float16,
                    skip=skips)
    assert entry.loss == pytest.approx(ref["loss"], rel=1e-3)  # fp16 rounding apart, as bf16
    assert not mismatches(plan, entry)


def test_sequence_parallelism_splits_the_norms_and_residual_over_the_sequence(run):
    ref = reference(GPT, gpt_args(2), global_batch=B, steps=STEPS, optimizer="adam", lr=LR)
    for name, plain in (("t2_sp", "t2"), ("t2_sp_selective", None)):
        entry, plan = run["runs"][name], run["plans"][name]
        assert plan.config.sp
        assert entry.loss == pytest.approx(ref["loss"], abs=1e-5)
        assert not mismatches(plan, entry)  # saved bytes within 5% of Korthikanti's sbh/t (34 + 5as/h) per layer
        if plain:  # and really fewer than without it
            assert _holds(run, name)[0].saved_activation_bytes["0"] < 0.9 * _holds(run, plain)[0].saved_activation_bytes["0"]
    for rank in range(2):
        for pname, value in _dump(run, "t2_sp", rank)["params"].items():
            tol = STEPS * LR if pname.endswith("qkv.bias") else 1e-5  # see the flash test
            assert torch.allclose(value, ref["params"][pname], rtol=0, atol=tol), pname


def test_the_tied_embedding_and_head_split_by_vocabulary_rows_train_as_one_process_does(run):
    """Megatron's VocabParallelEmbedding and column-parallel output layer, the logits gathered for loss_fn: each rank
    holds its rows of the one tied weight (V/t rounded up), and after three Adam steps every weight, gathered in the
    model's order, is the single process's."""
    ref = reference(GPT, MODEL_ARGS["t2_vocab"], global_batch=B, steps=STEPS, optimizer="adam", lr=LR)
    for name in ("t2_vocab", "t2_sp_vocab"):
        entry, plan = run["runs"][name], run["plans"][name]
        assert plan.config.sp == (name == "t2_sp_vocab")
        assert plan.partition[0].tensor_parallel["embedding.tok"] == "vocab"
        assert entry.loss == pytest.approx(ref["loss"], abs=1e-5)
        assert not mismatches(plan, entry)
        for h in _holds(run, name):  # 514 of the 1027 rows of the tied weight, 64 wide
            assert h.parameters == _holds(run, "t2")[0].parameters + (514 - 128) * 64
            assert "embedding.tok" in h.tensor_parallel
        for rank in range(2):
            for pname, value in _dump(run, name, rank)["params"].items():
                tol = STEPS * LR if pname.endswith("qkv.bias") else 1e-5  # see the flash test
                assert torch.allclose(value, ref["params"][pname], rtol=0, atol=tol), pname


def test_context_parallel_ranks_hold_half_of_each_sequence_and_train_as_one_process_does(run):
    for name in ("cp2_zero", "cp2_flash_selective"):
        entry, plan = run["runs"][name], run["plans"][name]
        ref = reference(GPT, MODEL_ARGS.get(name, gpt_args(2)), global_batch=B, steps=STEPS, optimizer="adam", lr=LR)
        assert plan.config.cp == 2 and {r.cp for r in entry.ranks} == {0, 1}
        assert entry.loss == pytest.approx(ref["loss"], abs=1e-5)
        # what each rank saves is the plan's: its tokens' activations, and of attention what the fused ring kernel
        # keeps (q, k, v, output, log-sum-exp), not the scores a written-out attention keeps without cp
        assert not mismatches(plan, entry)
        for rank in range(2):
            for pname, value in _dump(run, name, rank)["params"].items():
                tol = STEPS * LR if pname.endswith("qkv.bias") else 1e-5  # see the flash test
                assert torch.allclose(value, ref["params"][pname], rtol=0, atol=tol), pname
    assert {h.recompute for h in _holds(run, "cp2_flash_selective")} == {"selective"}
    full = _holds(run, "d2")[0].optimizer_state_bytes  # gradients reduced, and Adam's state sharded, over dp x cp
    assert [h.optimizer_state_bytes for h in _holds(run, "cp2_zero")] == pytest.approx([full / 2] * 2, abs=8)


FOUR = {  # 4 processes: context parallelism with a pipeline, and inside a tensor-parallel group (sequence-parallel);
    # a pipeline of tensor-parallel stages (each rank sends 1/t of a boundary tensor, the next all-gathers it)
    "t2_p2_sp": (gpt_args(2), dict(t=2, p=2, d=1, b=1, v=1, schedule="1f1b", sp=True)),
    "p2_cp2": (gpt_args(2), dict(t=1, p=2, d=1, b=1, v=1, schedule="1f1b", cp=2)),
    "cp4": (gpt_args(2), dict(t=1, p=1, d=1, b=2, v=1, schedule="1f1b", cp=4)),  # 8 chunks of 4 tokens
    "t2_cp2": (gpt_args(2), dict(t=2, p=1, d=1, b=2, v=1, schedule="1f1b", cp=2)),
    "t2_cp2_sp_flash": ({**gpt_args(2), "flash": True}, dict(t=2, p=1, d=1, b=2, v=1, schedule="1f1b", cp=2, sp=True)),
}


def test_context_tensor_and_pipeline_parallelism_compose(tmp_path):
    plans = {n: plan_file(tmp_path / f"{n}.json", GPT, args, gpus=4, global_batch=B, **pins)
             for n, (args, pins) in FOUR.items()}
    proc = torchrun(4, [*(str(tmp_path / f"{n}.json") for n in FOUR), "--steps", "2", "--optimizer", "adam",
                        "--lr", str(LR), "--no-fill", "--metrics", str(tmp_path / "metrics.json")], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    ref = reference(GPT, gpt_args(2), global_batch=B, steps=2, optimizer="adam", lr=LR)
    for (name, plan), entry in zip(plans.items(), load_metrics(tmp_path / "metrics.json").runs):
        assert entry.loss == pytest.approx(ref["loss"], abs=1e-5), name
        found = mismatches(plan, entry)  # parameters, optimizer state, saved bytes per stage
        if name == "t2_p2_sp":  # b=1 on a 2-layer model: a few KiB of stage-level offsets are 6-8% here
            found = [m for m in found if not ("saved activation bytes" in m and percent(m) < 10)]
        assert not found, name
