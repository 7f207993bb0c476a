"""Targets: built-in figures, the registry, and user YAML files (good and bad)."""

from __future__ import annotations

import dataclasses
import pickle
import textwrap
from pathlib import Path

import pytest

from targets.builtin import BUILTIN_TARGETS, DEFAULT_TARGET
from targets.registry import TargetError, get_target, list_targets, load_target_yaml, parse_quantity
from targets.specs import DTYPES, GPUSpec

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "targets" / "my-cluster.yaml"
NAMES = ["a100-40gb", "a100-80gb", "b200", "gb200-nvl72", "h100-96gb-hbm2e-500w", "h100-pcie", "h100-sxm", "h200",
         "rtx3080", "rtx6000-ada", "v100-16gb", "v100-32gb"]


def write(tmp_path: Path, text: str, name: str = "t.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# --- built-ins ----------------------------------------------------------------------------

def test_registry_lists_every_builtin_sorted():
    assert [t.name for t in list_targets()] == NAMES
    assert DEFAULT_TARGET == "a100-80gb"
    assert get_target(DEFAULT_TARGET) is next(t for t in BUILTIN_TARGETS if t.name == DEFAULT_TARGET)


@pytest.mark.parametrize("name", NAMES)
def test_builtin_loads_with_positive_figures(name):
    target = get_target(name)
    assert target.name == name and target.description
    gpu, cluster = target.gpu, target.cluster
    assert gpu.hbm_bytes > 0 and gpu.hbm_bw > 0 and gpu.pcie_bw > 0
    assert gpu.peak_flops and all(v > 0 for v in gpu.peak_flops.values())
    assert set(gpu.peak_flops) <= set(DTYPES) and {"fp32", "fp16"} <= set(gpu.peak_flops)
    assert cluster.gpus_per_node >= 1 and cluster.nvlink_bw > 0 and cluster.internode_bw > 0
    assert cluster.nvlink_latency_s >= 0 and cluster.internode_latency_s >= 0
    # sanity: tensor-core half precision beats fp32; the intra-node link is at least the NIC share
    assert gpu.peak("fp16") > gpu.peak("fp32")
    assert cluster.nvlink_bw >= cluster.internode_bw
    assert pickle.loads(pickle.dumps(target)) == target


@pytest.mark.parametrize(
    ("name", "dtype", "flops"),
    [
        ("a100-80gb", "bf16", 312e12), ("a100-80gb", "tf32", 156e12), ("a100-80gb", "fp32", 19.5e12),
        ("a100-40gb", "fp16", 312e12), ("v100-16gb", "fp16", 125e12), ("v100-32gb", "fp32", 15.7e12),
        ("h100-sxm", "bf16", 989.5e12), ("h100-sxm", "fp8", 1979e12), ("h200", "bf16", 989.5e12),
        ("h100-pcie", "bf16", 756.5e12), ("rtx6000-ada", "bf16", 364.2e12), ("rtx6000-ada", "fp8", 728.5e12),
        ("rtx3080", "fp16", 59.5e12), ("rtx3080", "fp32", 29.8e12),
        ("b200", "bf16", 2250e12), ("b200", "fp8", 4500e12), ("b200", "mxfp8", 4500e12), ("b200", "fp4", 9000e12),
        ("gb200-nvl72", "bf16", 2500e12), ("gb200-nvl72", "mxfp8", 5000e12), ("gb200-nvl72", "nvfp4", 10000e12),
    ],
)
def test_datasheet_peaks(name, dtype, flops):
    assert get_target(name).gpu.peak(dtype) == pytest.approx(flops, rel=1e-12)


def test_a100_80gb_figures_exact():
    t = get_target("a100-80gb")
    assert t.gpu.peak("bf16") == 312e12
    assert t.gpu.peak("torch.bfloat16") == 312e12
    assert t.gpu.hbm_bytes == 80 * 2**30 and t.gpu.hbm_bw == 2039e9
    assert (t.cluster.gpus_per_node, t.cluster.nvlink_bw, t.cluster.internode_bw) == (8, 300e9, 25e9)
    assert get_target("h200").gpu.hbm_bw == 4.8e12 and get_target("h100-sxm").gpu.hbm_bw == 3.35e12


def test_blackwell_racks_and_fp8_ceilings():
    """GB200 NVL72: the NVLink domain a job uses (64 of a rack's 72) is the cost models' node, torchrun runs 4 per
    host; the launch commands follow the hosts. FP8 GEMMs reach their measured share (MAMF: 1402.6 of 1979 TFLOP/s on
    H100, 3432.5 of 4500 on B200)."""
    from planner.launch import torchrun_commands

    nvl = get_target("gb200-nvl72").cluster
    assert (nvl.gpus_per_node, nvl.host_gpus, nvl.nvlink_bw) == (64, 4, 900e9)
    assert torchrun_commands("p.json", 128, nvl.host_gpus)[:2] == (32, 4)
    assert get_target("gb200-nvl72", 72).cluster.host_gpus == 4  # a whole rack still runs 4 per host
    assert get_target("b200").cluster.host_gpus == 8 and get_target("b200").gpu.hbm_bw == 8e12
    h100 = get_target("h100-sxm").gpu
    assert h100.ceiling("fp8") == pytest.approx(1402.6 / 1979) and h100.ceiling("bf16") == pytest.approx(792.1 / 989)
    b200 = get_target("b200").gpu
    assert (b200.ceiling("bf16"), b200.ceiling("mxfp8")) == (pytest.approx(1745 / 2250), pytest.approx(3432.5 / 4500))
    assert get_target("a100-80gb").gpu.ceiling("fp8") == get_target("a100-80gb").gpu.matmul_ceiling
    assert "mxfp8" not in h100.peak_flops  # MXFP8 is Blackwell's


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(TargetError, match=r"'V100 SXM2 16GB' has no bf16 peak .* supports fp16, fp32, fp64"):
        get_target("v100-16gb").gpu.peak("bf16")
    with pytest.raises(TargetError, match="unknown dtype 'int4'"):
        get_target("a100-80gb").gpu.peak("int4")


def test_specs_are_frozen_and_validated():
    gpu = get_target("a100-80gb").gpu
    with pytest.raises(dataclasses.FrozenInstanceError):
        gpu.hbm_bw = 1.0  # type: ignore[misc]
    with pytest.raises(TargetError, match=r"hbm_bw must be a positive finite number, got -1"):
        dataclasses.replace(gpu, hbm_bw=-1)
    with pytest.raises(TargetError, match=r"unknown dtype 'int4'"):
        GPUSpec(name="x", peak_flops={"int4": 1.0}, hbm_bytes=1, hbm_bw=1.0, pcie_bw=1.0)


def test_get_target_errors_and_overrides():
    with pytest.raises(TargetError) as err:
        get_target("a100")
    message = str(err.value)
    assert "unknown target 'a100'" in message and "YAML" in message
    assert all(name in message for name in NAMES)
    assert get_target("A100-80GB", gpus_per_node=4).cluster.gpus_per_node == 4
    assert get_target("a100-80gb").cluster.gpus_per_node == 8  # the registry entry is untouched
    with pytest.raises(TargetError, match="gpus_per_node must be a positive integer, got 0"):
        get_target("a100-80gb", gpus_per_node=0)


# --- units --------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("text", "kind", "value"),
    [
        ("80GiB", "bytes", 80 * 2**30), ("40 GB", "bytes", 40e9), (1024, "bytes", 1024), ("8.6e10", "bytes", 8.6e10),
        ("2.0TB/s", "bandwidth", 2e12), ("200Gb/s", "bandwidth", 25e9), ("400Gbps", "bandwidth", 50e9),
        ("312TFLOPS", "flops", 312e12), ("19.5 TFLOP/s", "flops", 19.5e12), ("3.12e14", "flops", 3.12e14),
        ("5us", "time", 5e-6), ("1.5ms", "time", 1.5e-3), (0, "time", 0.0),
    ],
)
def test_parse_quantity(text, kind, value):
    assert parse_quantity(text, kind) == pytest.approx(value)


@pytest.mark.parametrize(("text", "kind"), [("lots", "bytes"), ("2TB", "bandwidth"), (-1, "flops"),
                                            ("80GiB/s", "bytes"), (True, "bytes"), ("5 parsecs", "time")])
def test_parse_quantity_rejects(text, kind):
    with pytest.raises(ValueError, match="got"):
        parse_quantity(text, kind)


# --- YAML files ---------------------------------------------------------------------------

FULL = """\
    name: lab
    description: two workstations
    gpu:
      name: Lab GPU
      peak_flops: {fp32: 20TFLOPS, bf16: 300e12}
      hbm_bytes: 24GiB
      hbm_bw: 1TB/s
      pcie_bw: 32GB/s
    cluster:
      gpus_per_node: 2
      nvlink_bw: 32GB/s
      nvlink_latency_s: 5us
      internode_bw: 100Gb/s
      internode_latency_s: 1.0e-5
"""


def test_load_full_yaml(tmp_path):
    target = get_target(str(write(tmp_path, FULL)))
    assert target.name == "lab" and target.description == "two workstations"
    assert target.gpu == GPUSpec(name="Lab GPU", peak_flops={"fp32": 20e12, "bf16": 300e12},
                                 hbm_bytes=24 * 2**30, hbm_bw=1e12, pcie_bw=32e9)
    assert target.cluster.internode_bw == 12.5e9 and target.cluster.nvlink_latency_s == 5e-6
    assert get_target(str(tmp_path / "t.yaml"), gpus_per_node=1).cluster.gpus_per_node == 1


def test_base_override_merges(tmp_path):
    path = write(tmp_path, """\
        base: a100-80gb
        gpu:
          hbm_bytes: 40GiB
          peak_flops: {bf16: 280TFLOPS}
        cluster:
          internode_bw: 100Gb/s
    """, name="half.yml")
    target = load_target_yaml(path)
    base = get_target("a100-80gb")
    assert target.name == "half"  # from the file name
    assert target.gpu.hbm_bytes == 40 * 2**30 and target.gpu.hbm_bw == base.gpu.hbm_bw
    assert target.gpu.peak("bf16") == 280e12 and target.gpu.peak("tf32") == 156e12
    assert target.cluster.internode_bw == 12.5e9 and target.cluster.nvlink_bw == base.cluster.nvlink_bw


def test_example_file_loads():
    target = get_target(str(EXAMPLE))
    assert target.name == "my-cluster"
    assert target.gpu == get_target("a100-80gb").gpu
    assert target.cluster.internode_bw == 6.25e9 and target.cluster.internode_latency_s == pytest.approx(12e-6)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("base: a100-80gb\ngpu: {hbm_bytes: lots}\n", ["gpu.hbm_bytes must be a positive number", "'lots'"]),
        ("base: a100-80gb\ngpu: {hbm_byts: 1GiB}\n", ["unknown field 'gpu.hbm_byts'", "hbm_bytes"]),
        ("base: a100-80gb\ncolour: red\n", ["unknown field 'colour'", "allowed fields: schema_version"]),
        ("base: a100-80gb\ngpu: {hbm_bw: 2TB}\n", ["gpu.hbm_bw must be a positive bandwidth", "'2TB'"]),
        ("base: a100-80gb\ngpu: {peak_flops: {int4: 1PFLOPS}}\n", ["gpu.peak_flops has unknown dtype 'int4'"]),
        ("base: a100-80gb\ngpu: {peak_flops: {bf16: fast}}\n", ["gpu.peak_flops[bf16] must be", "'fast'"]),
        ("base: a100-80gb\ncluster: {gpus_per_node: 2.5}\n", ["cluster.gpus_per_node must be a positive integer",
                                                              "2.5"]),
        ("base: a100-80gb\ncluster: {nvlink_latency_s: -1}\n", ["cluster.nvlink_latency_s must be", "-1"]),
        ("base: a100-80gb\ncluster: 8\n", ["cluster must be a mapping", "8"]),
        ("base: a100\n", ["base 'a100' is not a known target", "a100-40gb, a100-80gb"]),
        ("schema_version: 2\nbase: a100-80gb\n", ["schema_version", "got 2"]),
        ("name: x\ngpu: {hbm_bytes: 1GiB}\n", ["gpu.peak_flops, gpu.hbm_bw", "cluster.gpus_per_node",
                                              "are required when the file has no 'base:'"]),
        ("gpu: [1, 2\n", ["YAML syntax error at line 2"]),
        ("", ["the file is empty"]),
        ("- a100-80gb\n", ["must hold a mapping", "got a list"]),
    ],
)
def test_bad_yaml_names_the_problem(tmp_path, text, fragments):
    path = write(tmp_path, text)
    with pytest.raises(TargetError) as err:
        get_target(str(path))
    message = str(err.value)
    assert message.startswith(f"target file '{path}'")
    for fragment in fragments:
        assert fragment in message
    assert "\n" not in message


def test_missing_file(tmp_path):
    with pytest.raises(TargetError, match="does not exist"):
        get_target(str(tmp_path / "nope.yaml"))
    assert issubclass(TargetError, ValueError)
