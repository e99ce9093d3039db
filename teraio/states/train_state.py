"""The small, non-tensor part of a training checkpoint, as JSON that round-trips exactly: optimizer
hyperparameters, random number generators, the state of an LR scheduler or a GradScaler.

Note: [A checkpoint's small values round-trip exactly]
    A resumed run is bit-identical only if every value it reads back is the one saved: a Python float
    through JSON's shortest representation is exact, but a tuple (AdamW's ``betas``) would come back a
    list, an int-keyed dict (a scheduler's) a str-keyed one, and a tensor (``lr`` as a tensor, a
    generator's state) not at all. :func:`encode` tags those (``{"__tuple__": [...]}``,
    ``{"__tensor__": {...}}``, ...) and :func:`decode` undoes it; anything else (a function, an object) is
    refused in one line naming where it is, instead of being pickled: loading a checkpoint never runs code.
"""

from __future__ import annotations

import base64
import random
import sys
from typing import Any

import torch

from teraio.states.errors import CheckpointError
from teraio.states.safetensors_files import DTYPES, dtype_name

_TAGS = ("__tuple__", "__dict__", "__tensor__", "__bytes__", "__ndarray__")


def encode(value: Any, where: str = "value") -> Any:
    """``value`` as JSON-able data that :func:`decode` turns back into an equal value (Note: [A
    checkpoint's small values round-trip exactly]).

    Raises:
        CheckpointError: a value of another type, named by ``where``.
    """
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: encode(v, f"{where}.{k}") for k, v in value.items()}
        return {"__dict__": [[encode(k, where), encode(v, f"{where}[{k!r}]")] for k, v in value.items()]}
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {
            "__tensor__": {
                "dtype": dtype_name(t.dtype),
                "shape": list(t.shape),
                "data": base64.b64encode(raw).decode(),
            }
        }
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.ndarray):
        arr = numpy.ascontiguousarray(value)
        return {
            "__ndarray__": {
                "dtype": arr.dtype.str,
                "shape": list(arr.shape),
                "data": base64.b64encode(arr.tobytes()).decode(),
            }
        }
    if numpy is not None and isinstance(value, numpy.generic):
        return encode(value.item(), where)
    raise CheckpointError(
        f"{where} is a {type(value).__name__}, which a checkpoint does not store (numbers, strings, lists, "
        "dicts, tuples and tensors only)"
    )


def decode(value: Any) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, body),) = value.items()
        if tag == "__tuple__":
            return tuple(decode(v) for v in body)
        if tag == "__dict__":
            return {decode(k): decode(v) for k, v in body}
        if tag == "__bytes__":
            return base64.b64decode(body)
        if tag == "__tensor__":
            dtype = DTYPES[body["dtype"]]
            raw = bytearray(base64.b64decode(body["data"]))
            flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
            return flat.view(dtype).reshape(body["shape"]).clone()
        if tag == "__ndarray__":
            import numpy

            arr = numpy.frombuffer(base64.b64decode(body["data"]), dtype=numpy.dtype(body["dtype"]))
            return arr.reshape(body["shape"]).copy()
    return {k: decode(v) for k, v in value.items()}


def rng_state() -> dict[str, Any]:
    """The random number generators a training loop draws from (dropout, data shuffling), encoded:
    torch's CPU generator, every CUDA device's, Python's ``random``, and NumPy's global one when NumPy is
    in use (what Hugging Face's Trainer saves too)."""
    out: dict[str, Any] = {"torch": encode(torch.get_rng_state()), "python": encode(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = encode(torch.cuda.get_rng_state_all())
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        out["numpy"] = encode(numpy.random.get_state())
    return out


def restore_rng_state(saved: dict[str, Any]) -> None:
    """Set the generators :func:`rng_state` saved (CUDA's only when this process has as many devices)."""
    torch.set_rng_state(decode(saved["torch"]))
    random.setstate(decode(saved["python"]))
    if "cuda" in saved and torch.cuda.is_available():
        states = decode(saved["cuda"])
        if len(states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(states)
    if "numpy" in saved and sys.modules.get("numpy") is not None:
        import numpy

        numpy.random.set_state(decode(saved["numpy"]))
