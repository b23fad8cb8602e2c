"""Reading checkpoints for ``srround audit``, tensor by tensor.

``open_checkpoint(path)`` reads only the names, shapes and dtypes; ``Entry.read()`` then maps
or reads one tensor at a time, so memory stays near the largest tensor whatever the file size:

* ``.safetensors``: the JSON header is parsed here and each tensor is a read-only
  ``np.memmap`` of its byte range (no copy; unmapped when dropped);
* ``.npy``: one tensor, ``np.load(mmap_mode="r")``;
* ``.npz``: member headers first, then one member at a time (decompressed if compressed);
  big-endian ``.npy``/``.npz`` tensors are converted to the machine's byte order;
* torch ``.pt``/``.pth``/``.bin``: ``torch.load(weights_only=True, mmap=True)`` (a legacy,
  non-zip file is loaded whole); nested dicts and lists are flattened to dotted names.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import zipfile
from collections.abc import Callable

import numpy as np

from ._formats import get_format

FORMATS = {
    ".safetensors": "safetensors",
    ".pt": "torch",
    ".pth": "torch",
    ".bin": "torch",
    ".npz": "npz",
    ".npy": "npy",
}
NARROW_DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2")  # ml_dtypes in NumPy
FLOAT_DTYPES = ("float64", "float32", *NARROW_DTYPES)
_SAFETENSORS_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
}
# names that are not trained weights: optimizer state and normalization statistics
_OPTIMIZER_PARTS = {
    "optimizer",
    "optim",
    "optimizer_state",
    "optimizer_states",
    "opt_state",
    "scheduler",
    "lr_scheduler",
    "scaler",
}
_OPTIMIZER_LEAVES = {
    "exp_avg",
    "exp_avg_sq",
    "max_exp_avg_sq",
    "momentum_buffer",
    "square_avg",
    "acc_delta",
    "step",
}
_BUFFER_LEAVES = {"running_mean", "running_var", "num_batches_tracked"}


class CheckpointError(Exception):
    """A checkpoint that cannot be read; the message says which file and why."""


@dataclasses.dataclass
class Entry:
    """One tensor of a checkpoint, not yet read.

    Attributes:
        name: dotted name (``"model.layer.weight"``).
        shape: the tensor's shape.
        dtype: ``"float32"``, ``"bfloat16"``, ``"int64"``, ... (the stored type).
        unreadable: why the tensor has no values to read (``"meta tensor (no data)"``, a
            sparse layout), or None.
    """

    name: str
    shape: tuple
    dtype: str
    _read: Callable = dataclasses.field(repr=False)
    _release: Callable | None = dataclasses.field(default=None, repr=False)
    unreadable: str | None = None

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def read(self) -> np.ndarray:
        """The tensor as a flat NumPy array of its stored dtype (bf16 as ``ml_dtypes``),
        memory-mapped where the format allows."""
        return self._read()

    def release(self) -> None:
        """Drop the pages of a memory-mapped tensor from this process (after its last use;
        they stay in the page cache). A no-op for tensors read into memory."""
        if self._release is not None:
            self._release()


def classify(name: str, dtype: str) -> str | None:
    """Why a tensor is not a trained weight (``"optimizer state"``, ``"buffer"``,
    ``"not floating point"``), or None for a weight; judged by name and dtype."""
    parts = name.lower().split(".")
    if dtype not in FLOAT_DTYPES:
        return "not floating point"
    if _OPTIMIZER_PARTS.intersection(parts) or parts[-1] in _OPTIMIZER_LEAVES:
        return "optimizer state"
    if parts[-1] in _BUFFER_LEAVES:
        return "buffer"
    return None


def _numpy_dtype(dtype: str):
    return get_format(dtype).numpy_dtype if dtype in NARROW_DTYPES else np.dtype(dtype)


def _safetensors(path: str) -> list[Entry]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("file shorter than its 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > size - 8:
            raise ValueError(f"header length {length} beyond the end of the file")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    base = 8 + length
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(info["dtype"], info["dtype"].lower())
        shape = tuple(int(d) for d in info["shape"])
        start, end = (int(o) for o in info["data_offsets"])
        if not 0 <= start <= end <= size - base:
            raise ValueError(f"{name}: data offsets {start}..{end} outside the file")
        if dtype in _SAFETENSORS_DTYPES.values() and (
            min(shape, default=0) < 0
            or math.prod(shape) * _numpy_dtype(dtype).itemsize != end - start
        ):
            raise ValueError(
                f"{name}: shape {list(shape)} of {dtype} does not fit its data offsets"
                f" {start}..{end} ({end - start} bytes)"
            )

        def read(start=start, end=end, dtype=dtype, name=name):
            np_dtype = _numpy_dtype(dtype)
            count = (end - start) // np_dtype.itemsize
            if count == 0:
                return np.empty(0, np_dtype)
            return np.memmap(path, np_dtype, mode="r", offset=base + start, shape=(count,))

        entries.append(Entry(name, shape, dtype, read))
    return entries


def _native(array: np.ndarray) -> np.ndarray:
    """``array`` in the machine's byte order (a big-endian file's tensor: a converted copy)."""
    return array if array.dtype.isnative else array.astype(array.dtype.newbyteorder("="))


def _npz(path: str) -> list[Entry]:
    """The members of one archive, opened once (its central directory is parsed on opening:
    once per member would be quadratic in the members); closed when the entries are dropped."""
    entries = []
    archive = zipfile.ZipFile(path)
    for info in archive.infolist():
        if not info.filename.endswith(".npy"):
            continue
        with archive.open(info) as f:
            version = np.lib.format.read_magic(f)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, _, dtype = read_header(f)

        def read(member=info):
            with archive.open(member) as f:
                return _native(np.lib.format.read_array(f, allow_pickle=False).reshape(-1))

        entries.append(Entry(info.filename[:-4], tuple(shape), dtype.name, read))
    return entries


def _npy(path: str) -> list[Entry]:
    array = np.load(path, mmap_mode="r", allow_pickle=False)
    name = os.path.splitext(os.path.basename(path))[0]
    return [Entry(name, array.shape, array.dtype.name, lambda: _native(array.reshape(-1)))]


def torch_numpy(tensor):
    """A torch tensor as a flat NumPy array on the host (bf16/fp8: ml_dtypes' dtypes)."""
    import torch

    tensor = tensor.detach().cpu().reshape(-1)
    name = str(tensor.dtype).removeprefix("torch.")
    if name in NARROW_DTYPES and name != "float16":  # NumPy has no such dtype: ml_dtypes'
        bits = torch.int16 if tensor.element_size() == 2 else torch.uint8
        return tensor.view(bits).numpy().view(get_format(name).numpy_dtype)
    return tensor.numpy()


def _drop_pages(tensor) -> None:
    """``madvise(MADV_DONTNEED)`` on the whole pages of a tensor of a file mapping (read-only
    here): the process's resident memory stops growing with every tensor read."""
    import ctypes
    import mmap

    start = tensor.data_ptr()
    end = (
        start + tensor.untyped_storage().nbytes() - tensor.storage_offset() * tensor.element_size()
    )
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first and hasattr(mmap, "MADV_DONTNEED"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)


def _weights_only_refusal(error: Exception) -> str:
    """One line for ``torch.load(weights_only=True)`` refusing a file: torch's reason (its own
    message advises ``torch.load`` options over many lines), and what to do instead."""
    reason = str(error).split("WeightsUnpickler error:", 1)[-1].strip().split("\n", 1)[0]
    reason = reason.split(" Please use", 1)[0].strip().rstrip(".")
    return (
        f"torch.load(weights_only=True) refuses it: {reason or 'not only tensors'}; srround"
        " never runs a checkpoint's code, so audit a file of the weights alone, written with"
        " torch.save(model.state_dict(), path)"
    )


def _load(path: str, **mmap):
    """``torch.load`` of tensors and containers only (``weights_only=True``), on the CPU."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, **mmap)
    except pickle.UnpicklingError as error:
        raise ValueError(_weights_only_refusal(error)) from error


def _torch(path: str) -> list[Entry]:
    import torch

    mapped = True
    try:
        tree = _load(path, mmap=True)
    except RuntimeError as error:  # a legacy (non-zip) file cannot be mapped
        if "mmap" not in str(error):
            raise
        tree = _load(path)
        mapped = False
    entries = []

    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        elif isinstance(node, (list, tuple)):
            for i, value in enumerate(node):
                walk(value, f"{prefix}{i}.")
        elif isinstance(node, torch.Tensor):
            dtype = str(node.dtype).removeprefix("torch.")
            release = (lambda t=node: _drop_pages(t)) if mapped else None
            unreadable = None
            if node.is_meta:
                unreadable = "meta tensor (no data)"
            elif node.layout is not torch.strided:
                unreadable = f"{str(node.layout).removeprefix('torch.')} tensor"
            entries.append(
                Entry(
                    prefix[:-1],
                    tuple(node.shape),
                    dtype,
                    lambda t=node: torch_numpy(t),
                    release,
                    unreadable,
                )
            )

    walk(tree, "")
    return entries


def open_checkpoint(path: str) -> list[Entry]:
    """The tensors of the checkpoint at ``path`` (every dtype), in file order, unread.

    Raises:
        CheckpointError: no such file, a folder, an unknown extension, an empty file, a
            missing reader library or a file its library cannot read.
    """
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file")
    if os.path.isdir(path):
        try:
            names = os.listdir(path)
        except OSError:  # an unreadable folder: named without its files
            names = []
        inside = sorted(n for n in names if os.path.splitext(n)[1].lower() in FORMATS)
        found = f" (here: {', '.join(inside)})" if inside else ""
        raise CheckpointError(f"{path}: is a folder; pass one checkpoint file{found}")
    kind = FORMATS.get(os.path.splitext(path)[1].lower())
    if kind is not None and os.path.getsize(path) == 0:
        raise CheckpointError(f"{path}: empty file")
    if kind is None:
        raise CheckpointError(
            f"{path}: unknown checkpoint format; expected one of {', '.join(FORMATS)}"
        )
    reader = {"safetensors": _safetensors, "npz": _npz, "npy": _npy, "torch": _torch}[kind]
    try:
        return reader(path)
    except ImportError as error:
        raise CheckpointError(f"{path}: reading {kind} files needs {error.name}") from error
    except Exception as error:  # each library raises its own types for a corrupt file
        raise CheckpointError(f"{path}: not a readable {kind} file ({error})") from error
