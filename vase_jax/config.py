"""`Qwen3Config`: the static shape and numerics of a dense Qwen3 model, read from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
    """Frozen and hashable, so it can be a static argument of `jax.jit`."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    @property
    def group(self) -> int:
        """Query heads per kv head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    def axis_sizes(self) -> dict[str, int]:
        """The size of every logical axis of the parameters and the cache that this config fixes."""
        return {"vocab": self.vocab_size, "embed": self.hidden_size, "mlp": self.intermediate_size,
                "layers": self.num_layers, "q_heads": self.num_heads, "kv_heads": self.num_kv_heads,
                "group": self.group, "head_dim": self.head_dim}

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> Qwen3Config:
        """Build from the dict of a HF `config.json`; raise `ValueError` naming any field we do not support."""
        model_type = hf.get("model_type")
        if model_type != "qwen3":
            raise ValueError(f"config.json: model_type={model_type!r} is not supported; only dense 'qwen3' is")
        for field in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            if hf.get(field):
                raise ValueError(f"config.json: {field}={hf[field]!r}: mixture-of-experts Qwen3 is not supported")
        if hf.get("use_sliding_window") or (
            hf.get("layer_types") and any(t != "full_attention" for t in hf["layer_types"])
        ):
            raise ValueError(
                "config.json: use_sliding_window / layer_types: sliding-window attention layers are not supported"
            )
        rope_theta = hf.get("rope_theta")
        rope_params = hf.get("rope_parameters") or {}  # transformers >= 5 folds rope_theta in here
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 1_000_000.0)
        scaling = hf.get("rope_scaling") or {}
        rope_type = scaling.get("rope_type", scaling.get("type")) or rope_params.get("rope_type", "default")
        if rope_type not in ("default", None):
            raise ValueError(f"config.json: rope_scaling type {rope_type!r} is not implemented (only default RoPE)")
        if hf.get("attention_bias"):
            raise ValueError("config.json: attention_bias=True is not supported (Qwen3 has no attention bias)")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act={hf['hidden_act']!r}; only 'silu' is supported")
        num_heads = int(hf["num_attention_heads"])
        num_kv = int(hf.get("num_key_value_heads") or num_heads)
        if num_heads % num_kv:
            raise ValueError(
                f"config.json: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}"
            )
        head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // num_heads
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=num_kv,
            head_dim=int(head_dim),
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 40960)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        )

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> Qwen3Config:
        with open(path) as f:
            return cls.from_hf_config(json.load(f))


# Logical axis names of every kind of parameter (sharding over a `("data", "model")` mesh is a table from these
# names to mesh axes: DESIGN.md, "Scaling out"). Decoder layers hold their weights per layer, as HF checkpoints
# do: the kind ("layers", name) is one array per layer, at path ("layers", i, name) for i < num_layers
# (`param_axes` lists every path).
PARAM_AXES: dict[tuple[str, ...], tuple[str, ...]] = {
    # Matrices are [out, in], the layout of HF checkpoints: XLA:CPU runs bf16 matmuls against a weight whose
    # contracted axis is the last 1.3-2x faster than against [in, out] (docs/BENCHMARKS.md, bf16).
    ("embedding",): ("vocab", "embed"),
    ("lm_head",): ("vocab", "embed"),
    ("norm", "weight"): ("embed",),
    ("layers", "input_norm"): ("embed",),
    ("layers", "q_proj"): ("q_heads", "head_dim", "embed"),
    ("layers", "k_proj"): ("kv_heads", "head_dim", "embed"),
    ("layers", "v_proj"): ("kv_heads", "head_dim", "embed"),
    ("layers", "o_proj"): ("embed", "q_heads", "head_dim"),
    ("layers", "q_norm"): ("head_dim",),
    ("layers", "k_norm"): ("head_dim",),
    ("layers", "post_attn_norm"): ("embed",),
    ("layers", "gate_proj"): ("mlp", "embed"),
    ("layers", "up_proj"): ("mlp", "embed"),
    ("layers", "down_proj"): ("embed", "mlp"),
}
LAYER_PARAMS = tuple(kind[1] for kind in PARAM_AXES if kind[0] == "layers")
NORM_PARAMS = ("input_norm", "q_norm", "k_norm", "post_attn_norm")  # RMSNorm scales: initialized to 1
MATRIX_PARAMS = tuple(name for name in LAYER_PARAMS if name not in NORM_PARAMS)  # the matmul weights


def param_kind(path: tuple) -> tuple[str, ...]:
    """The `PARAM_AXES` kind of a parameter path: ("layers", i, name) -> ("layers", name); others unchanged."""
    return ("layers", path[2]) if path[0] == "layers" else tuple(path)


def param_axes(cfg: Qwen3Config) -> dict[tuple, tuple[str, ...]]:
    """Path -> logical axes of every parameter of a `Qwen3(cfg)` (no `lm_head` when the embeddings are tied), in
    the order of HF checkpoints: embedding, layers 0 .. L-1, final norm, head."""
    top = {kind: axes for kind, axes in PARAM_AXES.items() if kind[0] != "layers"
           and not (kind == ("lm_head",) and cfg.tie_word_embeddings)}
    layers = {("layers", i, name): PARAM_AXES[("layers", name)] for i in range(cfg.num_layers)
              for name in LAYER_PARAMS}
    return {("embedding",): top.pop(("embedding",))} | layers | top


def param_shapes(cfg: Qwen3Config) -> dict[tuple, tuple[int, ...]]:
    """Path -> shape of every parameter of a `Qwen3(cfg)` (`param_axes` with the sizes of `cfg`)."""
    sizes = cfg.axis_sizes()
    return {path: tuple(sizes[a] for a in axes) for path, axes in param_axes(cfg).items()}
