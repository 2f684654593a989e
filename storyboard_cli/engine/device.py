"""The device and the dtype: `--device` / `--dtype` resolved, and the names reports give them.

Imports nothing of the engine: every engine module (and the compile children) may import it."""

from __future__ import annotations

from functools import cache

import torch

from storyboard_cli.errors import BadInput, DeviceUnusable, first_line

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def resolve_device(device: str | None, dtype: str | None) -> tuple[torch.device, torch.dtype]:
    """`--device` / `--dtype` -> torch's; None: cuda when available, fp16 there and fp32 on the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise BadInput(f"--device: unknown device {device!r} (use cpu or cuda)")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DeviceUnusable("--device cuda: no CUDA device is available here (use --device cpu)")
    if dtype is None:
        dtype = "fp32" if device == "cpu" else "fp16"
    if dtype not in DTYPES:
        raise BadInput(f"--dtype: unknown dtype {dtype!r} (use fp16, bf16 or fp32)")
    if device == "cpu" and dtype == "fp16":
        raise BadInput("--dtype fp16 is not supported on the CPU (use fp32 or bf16)")
    return torch.device(device), DTYPES[dtype]


def probe(device: torch.device) -> None:
    """One element written on the device and read back: a driver that lists a GPU it cannot use (fallen off the
    bus, a broken driver) raises DeviceUnusable here, before a model is loaded."""
    try:
        torch.ones(1, device=device).add_(1).cpu()
    except RuntimeError as e:
        raise DeviceUnusable(f"{device}: the device does not work ({first_line(e, 200)})") from None


def indexed(device: torch.device) -> torch.device:
    """`device` with its index where it is a GPU named without one (the current one): as its tensors name it, and as a
    child process or a record kept for another process must name it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def capability(device: torch.device) -> tuple[int, int] | None:
    """The device's CUDA compute capability (None: not a CUDA device), asked of the driver once per GPU and process:
    every check of a kernel row (engine/variants.py) and every artifact key read it from here."""
    if device.type != "cuda":
        return None
    return _capability(indexed(device).index)


@cache
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def device_name(device: torch.device) -> str:
    """The device as reports and bench records name it: `cpu`, or `cuda (<GPU model>)`."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return "cpu"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_flag(dtype: torch.dtype) -> str:
    """The dtype as `--dtype` spells it (fp16, bf16, fp32): the inverse of DTYPES."""
    return next(flag for flag, dt in DTYPES.items() if dt == dtype)
