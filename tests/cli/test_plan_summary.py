"""Issue 51 (9): `planner plan`'s summary reads as a Megatron user expects: one measure (MFU and model TFLOP/s per GPU
as PaLM / Megatron count them) in the headline and the runners-up, runners-up fastest first, precision and sequence
length, tokens/s/GPU, HFU below MFU explained, and figures printed sensibly."""
from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from planner.cli import app
from planner.cli_plan import _rate, print_summary, runners_up
from planner.plan import load_plan
from tests.conftest import EXAMPLES, FIXTURES


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    """GPT 18B on 64 GPUs with fused causal attention: HFU below MFU (the kernel runs half the scores)."""
    path = tmp_path_factory.mktemp("summary") / "plan.json"
    res = CliRunner().invoke(app, ["plan", str(EXAMPLES / "gpt.py"), "--gpus", "64", "--model-arg", "flash=true",
                                   "-o", str(path)])
    assert res.exit_code == 0, res.stdout
    return load_plan(path), " ".join(res.stdout.split())


def _peak(p) -> float:
    return p.source.gpu["peak_flops"][p.config.precision]


def test_the_headline_names_precision_sequence_and_tokens_per_gpu(flash):
    p, text = flash
    s = p.source
    seq = s.model_shape["seq"]
    assert f"global batch {s.global_batch} x sequence {seq}, precision bf16" in text
    per_gpu = s.global_batch * seq / p.predictions.iteration_s / s.gpus  # Megatron's / NeMo's tokens/s/GPU
    assert f"{per_gpu:,.0f} tokens/s/GPU" in text
    assert f"{p.predictions.tokens_per_s:,.0f} tokens/s," in text


def test_one_measure_in_the_headline_and_the_runners_up(flash):
    p, text = flash
    pr = p.predictions
    assert f"MFU {pr.mfu:.1%} (PaLM) = {pr.mfu * _peak(p) / 1e12:.1f} model TFLOP/s/GPU" in text
    assert "thesis eq. 4.2" not in text and f"{pr.tflops_per_gpu:.1f}" not in text.split("runners-up")[0]
    assert "runners-up, fastest first (MFU and model TFLOP/s/GPU as above)" in text
    for a in runners_up(p)[:5]:
        row = re.search(re.escape(str(a.config.to_config())) + r" │ ([^│]+) │ ([^│]+) │ ([^│]+) │", text)
        assert row, a.config
        assert row.group(2).strip() == f"{a.mfu:.1%}" and row.group(3).strip() == f"{a.mfu * _peak(p) / 1e12:.1f}"


def test_hfu_below_mfu_is_explained_on_its_line(flash):
    p, text = flash
    pr = p.predictions
    assert pr.hfu < pr.mfu  # MFU counts causal attention's scores in full (PaLM, Megatron), HFU as the kernel runs
    line = text.split(f"HFU {pr.hfu:.1%}")[1].split("┏")[0]
    assert "causal attention as run: half the scores MFU counts, hence below MFU" in line


def test_runners_up_are_printed_fastest_first(flash, capsys):
    p, _ = flash
    shuffled = p.model_copy(update={"alternatives": list(reversed(p.alternatives))})
    capsys.readouterr()
    print_summary(shuffled)
    text = capsys.readouterr().out
    rows = [str(a.config.to_config()) for a in sorted(p.alternatives, key=lambda a: a.iteration_s)[:5]]
    where = [text.index(r + " ") for r in rows]
    assert where == sorted(where)


def test_an_encoder_decoder_gets_no_tokens_per_second(flash, capsys):
    p, _ = flash
    t5 = p.model_copy(update={"source": p.source.model_copy(update={"model_shape": {**p.source.model_shape,
                                                                                      "family": "t5"}})})
    capsys.readouterr()
    print_summary(t5)
    text = " ".join(capsys.readouterr().out.split())
    assert "tokens/s" not in text and "the plan does not know its decoder's tokens" in text
    assert "x sequence 2048 (the encoder input)" in text


def test_samples_per_second_print_as_whole_numbers_and_zbh1_says_what_it_needs():
    assert _rate(45254.0) == "45,254" and _rate(12.345) == "12.3" and _rate(0.5) == "0.5"
    res = CliRunner().invoke(app, ["plan", str(FIXTURES / "cnn_bias.py"), "--gpus", "8", "-o", "/dev/null"])
    assert res.exit_code == 0, res.stdout
    assert re.search(r"[0-9] samples/s", res.stdout) and not re.search(r"\.0 samples/s", res.stdout)
    assert "fills pipeline bubbles" not in res.stdout
    from planner.schedules import SCHEDULES

    assert SCHEDULES["zbh1"].check(1, 1, 8) == "zbh1 needs p > 1: it removes pipeline bubbles, and one stage has none"
