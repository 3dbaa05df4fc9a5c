"""Low-precision formats and training recipes. The quantize/dequantize ops live in moe_kernels.ops.quant;
this package holds the recipes that use them."""

from moe_kernels.quant import weight_cache
from moe_kernels.quant.recipe import RECIPES, Fp8BlockwiseRecipe, Nvfp4Recipe

__all__ = ["RECIPES", "Fp8BlockwiseRecipe", "Nvfp4Recipe", "weight_cache"]
