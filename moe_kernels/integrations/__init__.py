"""Drop-ins for other libraries' models. Importing this package imports none of those libraries."""

from moe_kernels.integrations.hf import patch_hf, unpatch_hf

__all__ = ["patch_hf", "unpatch_hf"]
