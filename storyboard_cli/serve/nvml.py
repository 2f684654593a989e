"""A GPU's NVML figures for a worker's lease requests and heartbeats (nvidia-ml-py, where it is installed):
utilisation (0-1), power draw (W) and energy used since the driver loaded (J). A figure NVML cannot give (no
nvidia-ml-py, no driver, a board or MIG slice without the sensor) is left out, never zero. Torch-free."""

from __future__ import annotations

import time
from typing import Callable

# Reading the energy counter takes about 3.3 ms on an H200 (utilisation and power: microseconds), and a worker
# reports on every lease request: the counter is read again only this long after the last read. A scrape every
# 5-15 s sees the same totals.
ENERGY_EVERY_S = 5.0

_energy: dict[str, tuple[float, float]] = {}  # the GPU's NVML uuid -> (when it was read, joules)


def figures(uuid: str, clock: Callable[[], float] = time.monotonic) -> dict[str, float]:
    """The NVML figures of the GPU whose NVML uuid ("GPU-...") is `uuid`: {} without NVML."""
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()  # counted: each call's init is one more reference, as torch.cuda.utilization's
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)  # this device, whatever CUDA_VISIBLE_DEVICES says
    except Exception:  # noqa: BLE001 - NVML missing or refused: its figures are left out, not guessed
        return {}
    readings = {"utilization": lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100,  # percent
                "power_watts": lambda: pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3}  # milliwatts
    stats = {}
    for key, read in readings.items():
        try:
            stats[key] = read()
        except pynvml.NVMLError:  # not on this board
            pass
    now, last = clock(), _energy.get(uuid)
    if last is None or now - last[0] >= ENERGY_EVERY_S:
        try:
            _energy[uuid] = last = (now, pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) / 1e3)  # millijoules
        except pynvml.NVMLError:
            last = None
    if last is not None:
        stats["energy_joules"] = last[1]
    return stats
