"""The Hugging Face models of the hf_*.py example model files: built from transformers configs, never downloaded.

Each example is `build_model, example_inputs, sample_batch, loss_fn = hf.model_file(family, default_preset)`;
the model loader (passes/load.py) puts this folder on sys.path, so they import it as `_hf_models`.

A family names a transformers model class; a preset is a published configuration written out here
(or pass `config=path/to/config.json`, e.g. a checkpoint's own). Models are built with
`use_cache=False` and SDPA attention, as training runs them. Needs `pip install -e ".[hf]"`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from passes.errors import ModelFileError

__all__ = ["FAMILIES", "PRESETS", "MultiTokenPrediction", "build", "example_inputs", "sample_batch", "loss_fn", "model_file"]

# family -> (config class, model class, layers field, default sequence length)
FAMILIES: dict[str, tuple[str, str, str, int]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "num_hidden_layers", 8192),
    "mistral": ("MistralConfig", "MistralForCausalLM", "num_hidden_layers", 4096),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "num_hidden_layers", 4096),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "n_layer", 1024),
    "bert": ("BertConfig", "BertForMaskedLM", "num_hidden_layers", 512),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "num_hidden_layers", 4096),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "num_hidden_layers", 4096),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", "num_hidden_layers", 4096),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", "num_hidden_layers", 4096),
}

EAGER = {"gpt_oss": "eager"}
"""Families whose transformers code has no SDPA path (gpt-oss: attention sinks): their attention is written out,
and priced so (the engines' fused kernels with sinks keep less)."""

_QWEN3_MOE = dict(vocab_size=151936, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                  decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=40960,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
_LLAMA3 = dict(vocab_size=128256, rope_theta=500000.0, num_key_value_heads=8, max_position_embeddings=8192,
               rms_norm_eps=1e-5, tie_word_embeddings=False)
# Published configurations (the config.json of each checkpoint), the fields that set the shapes.
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-8b": ("llama", _LLAMA3 | dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                          num_attention_heads=32)),
    "llama3-70b": ("llama", _LLAMA3 | dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                           num_attention_heads=64)),
    "llama3-405b": ("llama", _LLAMA3 | dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                                            num_attention_heads=128)),
    # Mistral-7B-v0.1: sliding window 4096 (= the default sequence length, so attention is causal)
    "mistral-7b": ("mistral", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                   num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                   max_position_embeddings=32768, sliding_window=4096, rope_theta=10000.0)),
    "qwen2-7b": ("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                               num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                               rope_theta=1000000.0, tie_word_embeddings=False)),
    "gpt2-xl": ("gpt2", dict(vocab_size=50257, n_embd=1600, n_layer=48, n_head=25, n_positions=1024)),
    "bert-large": ("bert", dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                                intermediate_size=4096, max_position_embeddings=512)),
    "mixtral-8x7b": ("mixtral", dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                     num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
                                     rope_theta=1000000.0)),
    # Qwen3-30B-A3B and Qwen3-235B-A22B: every layer routes each token to 8 of 128 experts (no shared expert)
    "qwen3-30b-a3b": ("qwen3_moe", _QWEN3_MOE | dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                                     num_hidden_layers=48, num_attention_heads=32)),
    "qwen3-235b-a22b": ("qwen3_moe", _QWEN3_MOE | dict(hidden_size=4096, intermediate_size=12288,
                                                       moe_intermediate_size=1536, num_hidden_layers=94,
                                                       num_attention_heads=64)),
    # DeepSeek-V3 (671B, 37B active): multi-head latent attention, 3 dense layers then 58 MoE layers of 256 routed
    # experts (top-8, grouped routing) and one shared expert; pre-trained at 4096 tokens (its 128K YaRN extension is
    # not part of this config; its multi-token-prediction layer is built with `mtp=1`, MultiTokenPrediction)
    "deepseek-v3": ("deepseek_v3", dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                                        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                                        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                                        num_experts_per_tok=8, first_k_dense_replace=3, n_group=8, topk_group=4,
                                        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=1536,
                                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                                        tie_word_embeddings=False)),
    # gpt-oss-120b and -20b: 128 (32) experts, top-4, alternating 128-token sliding-window and full attention
    "gpt-oss-120b": ("gpt_oss", dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                                     num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                     num_local_experts=128, num_experts_per_tok=4, sliding_window=128,
                                     max_position_embeddings=131072, rope_theta=150000.0, rms_norm_eps=1e-5,
                                     tie_word_embeddings=False)),
    "gpt-oss-20b": ("gpt_oss", dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                                    num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                                    num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                                    max_position_embeddings=131072, rope_theta=150000.0, rms_norm_eps=1e-5,
                                    tie_word_embeddings=False)),
}


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ModelFileError('Hugging Face model files need transformers: pip install -e ".[hf]"') from None
    return transformers


def _config(family: str, preset: str | None, config: str | None, layers: int | None, **overrides: Any) -> Any:
    tf = _transformers()
    config_cls, _, layers_field, _ = FAMILIES[family]
    if config is not None:
        path = Path(str(config))
        try:
            fields = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelFileError(f"cannot read the transformers config {path}: {exc}") from None
    else:
        if preset not in PRESETS or PRESETS[preset][0] != family:
            known = ", ".join(k for k, (f, _) in PRESETS.items() if f == family)
            raise ModelFileError(f"unknown {family} preset {preset!r}; known: {known} (or pass config=path/to/config.json)")
        fields = dict(PRESETS[preset][1])
    fields.update(overrides)
    if layers is not None:
        fields[layers_field] = int(layers)
    cfg = getattr(tf, config_cls).from_dict(fields)
    cfg.use_cache = False
    cfg._attn_implementation = EAGER.get(family, "sdpa")
    return cfg


def build(family: str, preset: str | None = None, config: str | None = None, layers: int | None = None,
          seq: int | None = None, mtp: int = 0, **overrides: Any) -> torch.nn.Module:
    """The model of `family` from a preset or a config.json, with `layers` blocks (and `mtp` multi-token-prediction
    layers, MultiTokenPrediction)."""
    depth = int(mtp)
    if depth < 0:
        raise ModelFileError(f"mtp={mtp}: the number of multi-token-prediction layers is 0 or more")
    model = getattr(_transformers(), FAMILIES[family][1])(_config(family, preset, config, layers, **overrides))
    return MultiTokenPrediction(model, depth) if depth else model


class MultiTokenPrediction(torch.nn.Module):
    """A causal LM trained with multi-token prediction as DeepSeek-V3 trains (its technical report, section 2.2) and
    Megatron-Core builds it (`--mtp-num-layers`, megatron/core/transformer/multi_token_prediction.py): after the
    model, layer k takes the previous depth's hidden states and the embedding of the tokens k ahead, normalizes each
    (enorm, hnorm), projects their concatenation from 2h to h (eh_proj), runs one transformer layer of the model's own
    kind (its last layer's: DeepSeek-V3's a mixture-of-experts layer) and a final norm, and the shared output layer
    makes its logits. Transformers' models leave it out (inference does not use it); DeepSeek-V3's config.json has
    one (num_nextn_predict_layers: 1), and Megatron-Bridge's DeepSeek-V3 recipes train with mtp_num_layers = 1.

    It runs where the loss runs (Megatron-Core's default), so the planner prices it in the head unit beside the
    output layer; the embedding it reads is a copy of the first stage's, as Megatron keeps one on the last stage.
    The forward returns the logits of every depth, the model's first (`loss_fn` weighs the others by
    MTP_LOSS_SCALE)."""

    def __init__(self, model: torch.nn.Module, depth: int) -> None:
        super().__init__()
        base = getattr(model, "model", None)
        parts = ("embed_tokens", "layers", "norm", "rotary_emb")
        if base is None or not hasattr(model, "lm_head") or not all(hasattr(base, n) for n in parts):
            raise ModelFileError(f"multi-token prediction (mtp={depth}) needs a causal LM built as Llama's is (model."
                                 f"embed_tokens, .layers, .norm, .rotary_emb and lm_head); {type(model).__name__} is not")
        self.lm = model
        self.config = cfg = model.config
        layer_cls, norm_cls, h = type(base.layers[-1]), type(base.norm), cfg.hidden_size
        eps = getattr(cfg, "rms_norm_eps", 1e-6)
        # a dict, not a list: its layers are not a second stack of blocks (passes.units.block_containers)
        self.mtp = torch.nn.ModuleDict({str(k): _MtpLayer(layer_cls(cfg, cfg.num_hidden_layers - 1), norm_cls, h, eps)
                                        for k in range(depth)})

    @property
    def mtp_layers(self) -> int:
        return len(self.mtp)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        base = self.lm.model
        hidden = base(input_ids=input_ids).last_hidden_state
        logits = [self.lm.lm_head(hidden)]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        rope = base.rotary_emb(hidden, positions)
        ids = input_ids
        for layer in self.mtp.values():
            ids = torch.roll(ids, -1, dims=1)  # the tokens one further ahead (Megatron rolls them so too)
            hidden = layer(hidden, base.embed_tokens(ids), rope, positions)
            logits.append(self.lm.lm_head(hidden))
        return tuple(logits)


class _MtpLayer(torch.nn.Module):
    def __init__(self, layer: torch.nn.Module, norm_cls: type, hidden: int, eps: float) -> None:
        super().__init__()
        self.enorm, self.hnorm = norm_cls(hidden, eps=eps), norm_cls(hidden, eps=eps)
        self.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = layer
        self.final_layernorm = norm_cls(hidden, eps=eps)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope: Any, positions: torch.Tensor) -> torch.Tensor:
        x = self.eh_proj(torch.cat((self.enorm(embedded), self.hnorm(hidden)), dim=-1))
        x = self.layer(x, position_embeddings=rope, attention_mask=None, position_ids=positions)
        return self.final_layernorm(x[0] if isinstance(x, tuple) else x)


def seq_len(family: str, seq: int | None) -> int:
    return int(seq) if seq is not None else FAMILIES[family][3]


def example_inputs(family: str, batch_size: int, seq: int | None = None) -> tuple[torch.Tensor]:
    """(input_ids,): one batch of token ids."""
    return (torch.zeros(batch_size, seq_len(family, seq), dtype=torch.long),)


def sample_batch(family: str, batch_size: int, step: int, preset: str | None = None, config: str | None = None,
                 seq: int | None = None, **overrides: Any) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    """Random token ids and their next-token targets (deterministic in `step`)."""
    vocab = _config(family, preset, config, None, **overrides).vocab_size
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, vocab, (batch_size, seq_len(family, seq) + 1), generator=gen)
    return (ids[:, :-1],), ids[:, 1:]


MTP_LOSS_SCALE = 0.1
"""Weight of the multi-token-prediction losses (their mean over the depths): DeepSeek-V3's lambda for its first 10T
tokens (technical report 4.2), Megatron-Bridge's mtp_loss_scaling_factor."""


def loss_fn(output: Any, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits (a transformers ModelOutput or a tensor) against the targets; with multi-token
    prediction (a tuple of logits), plus MTP_LOSS_SCALE x the mean of each depth's against the targets k ahead."""
    def ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), target.flatten())

    if isinstance(output, tuple):
        main, *ahead = output
        extra = [ce(lg, torch.roll(targets, -k, dims=1)) for k, lg in enumerate(ahead, 1)]
        return ce(main, targets) + (MTP_LOSS_SCALE * sum(extra) / len(extra) if extra else 0.0)
    return ce(getattr(output, "logits", output), targets)


def model_file(family: str, default_preset: str) -> tuple[Callable[..., Any], ...]:
    """build_model, example_inputs, sample_batch and loss_fn of a model file for `family`."""

    def build_model(preset: str = default_preset, config: str | None = None, layers: int | None = None,
                    seq: int | None = None, mtp: int = 0, **overrides: Any) -> torch.nn.Module:
        return build(family, preset, config, layers, seq, mtp, **overrides)

    def example_inputs_(batch_size: int, seq: int | None = None, **_: Any) -> tuple[torch.Tensor]:
        return example_inputs(family, batch_size, seq)

    def sample_batch_(batch_size: int, step: int, preset: str = default_preset, config: str | None = None,
                      layers: int | None = None, seq: int | None = None, mtp: int = 0, **overrides: Any):
        return sample_batch(family, batch_size, step, preset, config, seq, **overrides)

    return build_model, example_inputs_, sample_batch_, loss_fn
