"""The paper's motivating analysis: value-cache quantization error against Range(v) (spec section 5)."""

from vase_jax.analysis.quant import (
    PAPER_CONFIGS,
    QuantConfig,
    hqq_quantize,
    pearson,
    rtn_quantize,
    token_mse,
    token_range,
)

__all__ = ["PAPER_CONFIGS", "QuantConfig", "hqq_quantize", "pearson", "rtn_quantize", "token_mse", "token_range"]
