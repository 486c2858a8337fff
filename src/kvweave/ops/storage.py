"""The width at which a method stores the exact tokens it keeps: one option shared by every method.

Users deploy 16-bit caches, so a compressed cache is compared with a 16-bit ``full`` at equal bytes. On a
float32 model an evictor that kept its tokens at the model's width would hold twice the bytes of the same
tokens at 16 bits, and ``ratio=0.125`` would be 4x, not 8x. ``storage=auto`` (every method's default) stores
exact keys and values at the model's width when that is 16-bit and as float16 on a float32 model; ``model``
keeps the model's width (what every method did before spec version 3, and what old rows are labelled with).
Attention upcasts the held tokens to the model's dtype; the tokens of the current step attend exactly.
"""

from __future__ import annotations

import torch

STORAGE_CHOICES = ("auto", "float16", "bfloat16", "model")
"""Values of every method's ``storage`` option (declared ``storage: str = option("auto", STORAGE_HELP)``)."""

STORAGE_HELP = (
    "dtype of the exact tokens kept: auto (the model's if 16-bit, else float16: what a 16-bit cache holds), "
    "float16, bfloat16 or model (the model's own, also float32)"
)


def storage_dtype(choice: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype exact tokens are stored in for ``storage=choice`` on a model computing in ``model_dtype``."""
    if choice == "model" or (choice == "auto" and model_dtype.itemsize <= 2):
        return model_dtype
    return torch.bfloat16 if choice == "bfloat16" else torch.float16
