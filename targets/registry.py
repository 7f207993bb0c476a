"""Look targets up by name, or load them from a user YAML file.

A YAML target either defines a whole GPU and cluster, or starts from a built-in one::

    name: my-cluster
    base: a100-80gb            # optional; then every field below is an override
    gpu:
      hbm_bw: 2.0TB/s          # sizes, bandwidths, FLOP/s and times take units or plain numbers
      peak_flops: {bf16: 312TFLOPS}   # merged into the base's per-dtype peaks
    cluster:
      internode_bw: 100Gb/s    # lower-case b = bits, upper-case B = bytes
      internode_latency_s: 10us

Units: sizes B, kB/MB/GB/TB (powers of 1000) and KiB/MiB/GiB/TiB; bandwidths any size unit per
second ("2.0TB/s"), or bits per second ("200Gb/s", "200Gbps"); FLOP/s GFLOPS/TFLOPS/PFLOPS
(or FLOP/s); times s/ms/us/ns.
"""

from __future__ import annotations

import dataclasses
import math
import re
from decimal import Decimal
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from targets.builtin import BUILTIN_TARGETS, DEFAULT_TARGET
from targets.specs import DTYPES, ClusterSpec, GPUSpec, Target, TargetError

__all__ = ["TargetError", "DEFAULT_TARGET", "get_target", "list_targets", "load_target_yaml",
           "parse_quantity"]

_REGISTRY: dict[str, Target] = {t.name: t for t in BUILTIN_TARGETS}
assert len(_REGISTRY) == len(BUILTIN_TARGETS), "duplicate built-in target names"

_YAML_SUFFIXES = (".yaml", ".yml")


# --- units --------------------------------------------------------------------------------

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40}
_SIZE_UNITS = {"": 1.0} | {f"{p}B": f for p, f in _PREFIX.items()}
_BW_UNITS = ({"": 1.0} | {f"{p}B/s": f for p, f in _PREFIX.items()}
             | {f"{p}{b}": f / 8 for p, f in _PREFIX.items() if "i" not in p
                for b in ("b/s", "bit/s", "bps")})
_FLOPS_UNITS = {"": 1.0} | {f"{p}{u}": f for p, f in _PREFIX.items()
                            if p in ("", "G", "T", "P") for u in ("flops", "flop/s")}
_TIME_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ns": 1e-9}

# kind -> (unit table, whether units are case-insensitive, what to say when it's wrong)
_KINDS: dict[str, tuple[dict[str, float], bool, str]] = {
    "bytes": (_SIZE_UNITS, False, "positive number of bytes (e.g. 80GiB, 8.6e10)"),
    "bandwidth": (_BW_UNITS, False, "positive bandwidth in bytes/s (e.g. 2.0TB/s, 200Gb/s, 2.5e10)"),
    "flops": ({k.lower(): v for k, v in _FLOPS_UNITS.items()}, True,
              "positive FLOP/s figure (e.g. 312TFLOPS, 3.12e14)"),
    "time": (_TIME_UNITS, False, "non-negative time in seconds (e.g. 5us, 5e-6)"),
}
_NUMBER = re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*(\S*)\s*$")


def parse_quantity(value: object, kind: str) -> float:
    """Parse a number or a string with a unit ('80GiB', '2.0TB/s', '312TFLOPS', '5us') into SI.

    ``kind`` is one of 'bytes', 'bandwidth', 'flops', 'time'. Raises ValueError saying what
    was expected and what was given.
    """
    table, fold_case, expected = _KINDS[kind]
    result: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        result = float(value)
    elif isinstance(value, str) and (match := _NUMBER.match(value)):
        unit = match.group(2).lower() if fold_case else match.group(2)
        if unit in table:
            # Decimal, so that '5us' is exactly 5e-6 rather than 5 * 1e-6 = 4.9999999999999996e-06
            result = float(Decimal(match.group(1)) * Decimal(repr(table[unit])))
    minimum_ok = (lambda x: x >= 0) if kind == "time" else (lambda x: x > 0)
    if result is None or not math.isfinite(result) or not minimum_ok(result):
        raise ValueError(f"must be a {expected}, got {value!r}")
    return result


def _positive_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not float(value).is_integer() or value < 1:
        raise ValueError(f"must be a positive integer, got {value!r}")
    return int(value)


# --- file schema --------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


OPTIONAL_GPU_FIELDS = ("name", "matmul_ceiling", "attention_ceiling", "sdpa_attention_ceiling", "fp8_matmul_ceiling", "sms",
                       "gpus_per_host")


class GPUFile(_Strict):
    """The ``gpu:`` section. Every field is required unless the file names a ``base:``."""

    name: str | None = None
    peak_flops: dict[str, float] | None = None
    hbm_bytes: int | None = None
    hbm_bw: float | None = None
    pcie_bw: float | None = None
    matmul_ceiling: float | None = None  # optional: share of peak the best large GEMM reaches (A100's if absent)
    attention_ceiling: float | None = None  # optional: share of peak the flash attention kernel reaches
    sdpa_attention_ceiling: float | None = None  # optional: share of peak torch's scaled_dot_product_attention reaches
    fp8_matmul_ceiling: float | None = None  # optional: share of the FP8 peak the best FP8 GEMM reaches
    sms: int | None = None  # optional: streaming multiprocessors (communication kernels beside a GEMM take some)

    @field_validator("peak_flops", mode="before")
    @classmethod
    def _flops(cls, value: Any) -> Any:
        if value is None:
            return None
        if not isinstance(value, dict) or not value:
            raise ValueError(f"must be a mapping dtype -> FLOP/s (e.g. {{bf16: 312TFLOPS}}), got {value!r}")
        out = {}
        for key, flops in value.items():
            if key not in DTYPES:
                raise ValueError(f"has unknown dtype {key!r} — known dtypes: {', '.join(DTYPES)}")
            try:
                out[key] = parse_quantity(flops, "flops")
            except ValueError as err:
                raise ValueError(f"[{key}] {err}") from None
        return out

    @field_validator("hbm_bytes", mode="before")
    @classmethod
    def _bytes(cls, value: Any) -> Any:
        return None if value is None else round(parse_quantity(value, "bytes"))

    @field_validator("hbm_bw", "pcie_bw", mode="before")
    @classmethod
    def _bandwidth(cls, value: Any) -> Any:
        return None if value is None else parse_quantity(value, "bandwidth")


class ClusterFile(_Strict):
    """The ``cluster:`` section. Every field is required unless the file names a ``base:``."""

    gpus_per_node: int | None = None
    nvlink_bw: float | None = None
    nvlink_latency_s: float | None = None
    internode_bw: float | None = None
    internode_latency_s: float | None = None
    gpus_per_host: int | None = None  # optional: GPUs per host where fewer than the NVLink domain (GB200: 4)

    @field_validator("gpus_per_node", "gpus_per_host", mode="before")
    @classmethod
    def _count(cls, value: Any) -> Any:
        return None if value is None else _positive_int(value)

    @field_validator("nvlink_bw", "internode_bw", mode="before")
    @classmethod
    def _bandwidth(cls, value: Any) -> Any:
        return None if value is None else parse_quantity(value, "bandwidth")

    @field_validator("nvlink_latency_s", "internode_latency_s", mode="before")
    @classmethod
    def _time(cls, value: Any) -> Any:
        return None if value is None else parse_quantity(value, "time")


class TargetFile(_Strict):
    """A user target file (see the module docstring for an example)."""

    schema_version: Literal[1] = 1
    name: str | None = None
    description: str | None = None
    base: str | None = None
    gpu: GPUFile | None = None
    cluster: ClusterFile | None = None


_SECTION_MODELS: dict[tuple[str, ...], type[BaseModel]] = {
    (): TargetFile, ("gpu",): GPUFile, ("cluster",): ClusterFile}


# --- loading ------------------------------------------------------------------------------

def _known() -> str:
    return ", ".join(sorted(_REGISTRY))


def _describe(error: Any) -> str:
    """One pydantic error as '<dotted.field> <what is wrong>, got <value>'."""
    loc = tuple(str(part) for part in error["loc"])
    where = ".".join(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        model = _SECTION_MODELS.get(loc[:-1])
        section = f" in {'.'.join(loc[:-1])}" if loc[:-1] else ""
        allowed = f" — allowed fields{section}: {', '.join(model.model_fields)}" if model else ""
        return f"unknown field {where!r}{allowed}"
    if kind == "value_error":
        message = str(error["ctx"]["error"])
        return f"{where}{'' if message.startswith('[') else ' '}{message}"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{where} must be a mapping of fields, got {error['input']!r}"
    return f"{where}: {error['msg'][:1].lower()}{error['msg'][1:]}, got {error['input']!r}"


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise TargetError(f"target file '{path}' does not exist")
    if not path.is_file():
        raise TargetError(f"target file '{path}' is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise TargetError(f"cannot read target file '{path}': {err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err)
        raise TargetError(f"target file '{path}': YAML syntax error{where}: {problem}") from None
    if not isinstance(data, dict):
        got = "nothing (the file is empty)" if data is None else f"a {type(data).__name__}"
        raise TargetError(f"target file '{path}' must hold a mapping with fields "
                          f"name, base, gpu, cluster; got {got}")
    return data


def _override(spec: Any, section: BaseModel | None) -> Any:
    if section is None:
        return spec
    changes = section.model_dump(exclude_none=True)
    if "peak_flops" in changes:  # merge per dtype: overriding bf16 keeps the base's fp32
        changes["peak_flops"] = {**spec.peak_flops, **changes["peak_flops"]}
    return dataclasses.replace(spec, **changes)


def _from_scratch(model: TargetFile, name: str) -> tuple[GPUSpec, ClusterSpec]:
    gpu, cluster = model.gpu or GPUFile(), model.cluster or ClusterFile()
    missing = [f"{section}.{field}" for section, values in (("gpu", gpu), ("cluster", cluster))
               for field in type(values).model_fields
               if field not in OPTIONAL_GPU_FIELDS and getattr(values, field) is None]
    if missing:
        verb = "is" if len(missing) == 1 else "are"
        raise TargetError(f"{', '.join(missing)} {verb} required when the file has no 'base:' "
                          f"(or add e.g. 'base: {DEFAULT_TARGET}' to override a built-in target)")
    fields = gpu.model_dump(exclude_none=True)
    fields["name"] = fields.get("name") or name
    return GPUSpec(**fields), ClusterSpec(**cluster.model_dump(exclude_none=True))


def _build(model: TargetFile, path: Path) -> Target:
    name = model.name or path.stem
    if model.base is None:
        gpu, cluster = _from_scratch(model, name)
        description = model.description or f"user target from {path.name}"
    else:
        base = _REGISTRY.get(model.base.strip().lower())
        if base is None:
            raise TargetError(f"base {model.base!r} is not a known target — known targets: {_known()}")
        gpu, cluster = _override(base.gpu, model.gpu), _override(base.cluster, model.cluster)
        description = model.description or f"{base.name} with overrides from {path.name}"
    return Target(name=name, gpu=gpu, cluster=cluster, description=description)


def load_target_yaml(path: str | Path) -> Target:
    """Load and validate a target YAML file; every problem raises TargetError naming the field."""
    path = Path(path)
    data = _read_yaml(path)
    try:
        model = TargetFile.model_validate(data)
    except ValidationError as err:
        problems = "; ".join(_describe(e) for e in err.errors())
        raise TargetError(f"target file '{path}': {problems}") from None
    try:
        return _build(model, path)
    except TargetError as err:
        raise TargetError(f"target file '{path}': {err}") from None


def list_targets() -> list[Target]:
    """The built-in targets, sorted by name."""
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def get_target(name_or_path: str | Path, gpus_per_node: int | None = None) -> Target:
    """A built-in target by name ('a100-80gb'), or a target YAML file (path ending .yaml/.yml).

    ``gpus_per_node`` replaces the cluster's GPUs per node (e.g. to plan for half-used nodes).
    """
    text = str(name_or_path).strip()
    if text.lower().endswith(_YAML_SUFFIXES):
        target = load_target_yaml(text)
    elif text.lower() in _REGISTRY:
        target = _REGISTRY[text.lower()]
    else:
        raise TargetError(f"unknown target {text!r} — known targets: {_known()}; "
                          f"or pass a YAML file (.yaml/.yml)")
    if gpus_per_node is not None:
        if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            raise TargetError(f"gpus_per_node must be a positive integer, got {gpus_per_node!r}")
        target = target.with_gpus_per_node(gpus_per_node)
    return target
