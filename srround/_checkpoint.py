"""Reading checkpoints for ``srround audit``: safetensors, torch state dicts, NumPy ``.npz``."""

from __future__ import annotations

import os

import numpy as np

FORMATS = {
    ".safetensors": "safetensors",
    ".pt": "torch",
    ".pth": "torch",
    ".bin": "torch",
    ".npz": "npz",
}


class CheckpointError(Exception):
    """A checkpoint that cannot be read; the message says which file and why."""


def _flatten(tree, prefix=""):
    """Float tensors of a (nested) state dict as ``{"a.b.c": tensor}``."""
    out = {}
    if isinstance(tree, dict):
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{key}."))
    elif hasattr(tree, "is_floating_point") and tree.is_floating_point():
        out[prefix[:-1]] = tree
    return out


def load(path: str) -> dict:
    """``{name: array}`` of every floating-point tensor in the checkpoint at ``path`` (NumPy
    arrays, or torch tensors for ``.pt``; bf16 stays bf16)."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file")
    kind = FORMATS.get(os.path.splitext(path)[1].lower())
    if kind is None:
        raise CheckpointError(
            f"{path}: unknown checkpoint format; expected one of {', '.join(FORMATS)}"
        )
    try:
        if kind == "safetensors":
            from safetensors.numpy import load_file

            tensors = load_file(path)
        elif kind == "npz":
            with np.load(path, allow_pickle=False) as archive:
                tensors = {name: archive[name] for name in archive.files}
        else:
            import torch

            tensors = _flatten(torch.load(path, map_location="cpu", weights_only=True))
    except ImportError as error:
        raise CheckpointError(f"{path}: reading {kind} files needs {error.name}") from error
    except Exception as error:  # each library raises its own types for a corrupt file
        raise CheckpointError(f"{path}: not a readable {kind} file ({error})") from error
    return {
        name: value
        for name, value in tensors.items()
        if kind == "torch"
        or np.issubdtype(np.asarray(value).dtype, np.floating)
        or str(np.asarray(value).dtype) == "bfloat16"
    }
