"""The transformer shape of a model, in the words the engines' configurations use.

Recorded in the plan (`source.model_shape`) so an exporter can write Megatron-LM's model arguments or
pick torchtitan's model config without running the model file again. A Hugging Face model states its
shape in `model.config`; any other model is read off its modules: the repeated blocks, the largest
embedding (vocabulary x hidden), the widest projection out of the hidden size (the MLP), a second one
as wide (a gated MLP: SwiGLU), RMSNorm against LayerNorm, a position embedding table against rotary
positions, a head that reuses the embedding's weight; and what else changes the model an engine builds: the rotary
base and scaling, dropout, the norm's epsilon (None where the model file does not say), and the multi-token-prediction
layers a model built with them has (`mtp_layers`, _hf_models.MultiTokenPrediction). Empty when the model has no
repeated blocks.
"""
from __future__ import annotations

from typing import Any

from torch import nn

from .units import Unit

__all__ = ["model_shape"]

_GATED_HF = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "gemma", "gemma2", "qwen2_moe", "qwen3_moe",
             "deepseek_v3", "gpt_oss")


def model_shape(root: nn.Module, units: tuple[Unit, ...], seq: int) -> dict[str, Any]:
    blocks = [u for u in units if u.kind == "block"]
    if not blocks:
        return {}
    cfg = getattr(root, "config", None)
    if cfg is not None and hasattr(cfg, "hidden_size") and hasattr(cfg, "num_hidden_layers"):
        shape = _from_hf(cfg, seq)
        mtp = {"mtp_layers": n} if (n := int(getattr(root, "mtp_layers", 0) or 0)) else {}  # examples/_hf_models.py
        return shape | _moe_shape(blocks, shape["hidden"], shape["gated"], cfg) | mtp
    emb = max((m for m in root.modules() if isinstance(m, nn.Embedding)), key=lambda m: m.num_embeddings, default=None)
    if emb is None:
        return {}
    hidden, vocab = emb.embedding_dim, emb.num_embeddings
    first = root.get_submodule(blocks[0].name)
    ups = [m.out_features for m in first.modules() if isinstance(m, nn.Linear) and m.in_features == hidden]
    downs = [m for m in first.modules() if isinstance(m, nn.Linear) and m.out_features == hidden]
    ffn = max((d.in_features for d in downs), default=4 * hidden)
    positions = any(isinstance(m, nn.Embedding) and m is not emb and m.num_embeddings == seq for m in root.modules())
    rms = any(type(m).__name__.lower().endswith("rmsnorm") for m in first.modules())
    # a weight two units use (a head reusing the embedding's) is in both units' counts, once in the model's
    tied = sum(u.params for u in units) > sum(p.numel() for p in root.parameters())
    drops = [m.p for m in root.modules() if isinstance(m, nn.Dropout)]
    eps = next((float(m.eps) for m in first.modules() if "norm" in type(m).__name__.lower()
                and isinstance(getattr(m, "eps", None), (int, float))), None)
    return {"family": type(root).__name__.lower(), "layers": len(blocks), "hidden": hidden,
            "heads": blocks[0].heads, "kv_heads": blocks[0].kv_heads or blocks[0].heads, "ffn": ffn, "vocab": vocab,
            "seq": seq, "gated": ups.count(ffn) >= 2, "norm": "RMSNorm" if rms else "LayerNorm",
            "position": "learned_absolute" if positions else "rope", "tied": tied,
            "bias": any(m.bias is not None for m in first.modules() if isinstance(m, nn.Linear)),
            "rope_theta": None if positions else _rope_theta(root), "rope_scaling": None,
            "attention_dropout": max(drops, default=0.0), "hidden_dropout": max(drops, default=0.0), "norm_eps": eps,
            **_moe_shape(blocks, hidden, ups.count(ffn) >= 2, None)}


def _moe_shape(blocks: list[Unit], hidden: int, gated: bool, cfg: Any) -> dict[str, Any]:
    """The mixture-of-experts fields (none for a dense model): experts, top-k, each expert's hidden width (from its
    weights: 3 h f per gated expert, 2 h f otherwise), which layers route (Megatron's --moe-layer-freq pattern when
    not all do), and a shared expert's width where the config states one."""
    moe = [u for u in blocks if u.experts]
    if not moe:
        return {}
    first = moe[0]
    width = getattr(cfg, "moe_intermediate_size", None) or getattr(cfg, "intermediate_size", None) or \
        round(first.moe.params / first.experts / ((3 if gated else 2) * hidden))  # biases aside
    shared = (getattr(cfg, "shared_expert_intermediate_size", None)
              or (getattr(cfg, "n_shared_experts", 0) or 0) * (getattr(cfg, "moe_intermediate_size", 0) or 0)) or None
    flags = [int(bool(u.experts)) for u in blocks]
    return {"experts": first.experts, "top_k": first.top_k, "moe_ffn": width, "shared_expert_ffn": shared,
            "moe_layer_freq": None if all(flags) else "[" + ",".join(map(str, flags)) + "]"}


def _rope_theta(root: nn.Module) -> float | None:
    """The rotary base a model states as an attribute (`rope_theta`, or `theta`/`base` of a rotary module); None
    when it does not (its tables are meta tensors while planning: their values cannot be read)."""
    for m in (root, *root.modules()):
        for name in ("rope_theta", "theta", "base"):
            value = getattr(m, name, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                    (name == "rope_theta" or "rot" in type(m).__name__.lower() or "rope" in type(m).__name__.lower()):
                return float(value)
    return None


def _from_hf(cfg: Any, seq: int) -> dict[str, Any]:
    kind = getattr(cfg, "model_type", "")
    heads = cfg.num_attention_heads
    gated = kind in _GATED_HF
    return {"family": kind, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "heads": heads,
            "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
            "ffn": getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size, "vocab": cfg.vocab_size,
            "seq": seq, "gated": gated, "norm": "RMSNorm" if gated else "LayerNorm",
            "position": "rope" if gated else "learned_absolute", "tied": bool(getattr(cfg, "tie_word_embeddings", False)),
            "bias": bool(getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False)) if gated else True,
            "rope_theta": _rope(cfg)[0] if gated else None, "rope_scaling": _rope(cfg)[1] if gated else None,
            # a dropout or epsilon the config has no field for is one the model does not apply
            "attention_dropout": _first(cfg, "attention_dropout", "attention_probs_dropout_prob", "attn_pdrop"),
            "hidden_dropout": _first(cfg, "hidden_dropout", "hidden_dropout_prob", "resid_pdrop"),
            "norm_eps": _first(cfg, "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", default=None)}


def _first(cfg: Any, *names: str, default: float | None = 0.0) -> float | None:
    """The first of these config fields the model's config has (as a float), else `default`."""
    return next((float(getattr(cfg, n)) for n in names if isinstance(getattr(cfg, n, None), (int, float))), default)


def _rope(cfg: Any) -> tuple[float, str | None]:
    """(rotary base, scaling as "type:factor" or None) of a Hugging Face config: transformers 5 keeps both in
    `rope_parameters`, earlier versions in `rope_theta` and `rope_scaling`."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    params = params if isinstance(params, dict) else {}
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    kind = params.get("rope_type") or params.get("type")
    scaling = f"{kind}:{float(params.get('factor', 1.0))}" if kind not in (None, "default") else None
    return float(theta if theta is not None else 10000.0), scaling
