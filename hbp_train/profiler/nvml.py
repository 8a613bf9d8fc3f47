"""NVML access for the profiler: device used memory (the paper's memory metric) and the hardware description.

Optional: without the nvidia-ml-py package, a driver or a memory reading, every function returns None and says
so in ONE log line (not once per measurement); the profiler then compares torch's peak allocated memory.
"""

from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger(__name__)

_nvml = {"state": None}  # None = not tried yet, True = initialised, False = unavailable (logged once)


def nvml_available() -> bool:
    """Initialise NVML once. Without a GPU/driver nvmlInit raises NVMLError_LibraryNotFound (~1 ms): degrade to
    torch's counters and say so in one log line, not once per measurement."""
    if _nvml["state"] is None:
        try:
            import pynvml  # the nvidia-ml-py package
        except ImportError:
            _nvml["state"] = False
            log.warning("NVML unavailable (nvidia-ml-py not installed): memory from torch counters only")
            return False
        try:
            pynvml.nvmlInit()
            _nvml["state"] = True
        except pynvml.NVMLError as exc:
            _nvml["state"] = False
            log.warning("NVML unavailable (%s): memory from torch counters only", type(exc).__name__)
    return bool(_nvml["state"])


def nvml_handle(cuda_index: int):
    """The NVML handle of CUDA device `cuda_index` of this process.

    CUDA numbers only the devices CUDA_VISIBLE_DEVICES shows (every cluster scheduler sets it), NVML numbers all of
    the node's: CUDA 0 may be NVML 3, and NVML 0 another job's GPU. So the device is found by its UUID, else by its
    PCI bus id; the index itself only when torch reports neither (then CUDA_VISIBLE_DEVICES must be unset)."""
    import pynvml
    import torch

    props = torch.cuda.get_device_properties(cuda_index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        if text.startswith(("GPU-", "MIG-")):
            return pynvml.nvmlDeviceGetHandleByUUID(text)
        try:  # torch prints the bare UUID; NVML wants "GPU-" before a whole GPU's and "MIG-" before a MIG slice's
            return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{text}")
        except pynvml.NVMLError:
            return pynvml.nvmlDeviceGetHandleByUUID(f"MIG-{text}")
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        pci = f"{getattr(props, 'pci_domain_id', 0):08X}:{bus:02X}:{getattr(props, 'pci_device_id', 0):02X}.0"
        return pynvml.nvmlDeviceGetHandleByPciBusId(pci)
    return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)


def nvml_used_bytes(index: int = 0) -> Optional[int]:
    """Used memory of CUDA device `index` (this process's numbering, see `nvml_handle`) as the driver sees it (all
    processes, allocator cache, CUDA context)."""
    if not nvml_available():
        return None
    import pynvml

    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(nvml_handle(index)).used)
    except pynvml.NVMLError as exc:  # e.g. a virtualised GPU that hides it: fall back to torch's counters
        _nvml["state"] = False
        log.warning("NVML memory reading failed (%s): memory from torch counters only", type(exc).__name__)
        return None


def nvml_hardware() -> Optional[dict]:
    """GPU names, memory, count and driver version from NVML, or None without NVML."""
    if not nvml_available():
        return None
    import pynvml

    try:
        count = pynvml.nvmlDeviceGetCount()
        gpus = []
        for i in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            gpus.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                         "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)})
        driver = pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError as exc:  # called after all the measuring: never lose the profile over it
        log.warning("NVML hardware query failed (%s)", type(exc).__name__)
        return None
    return {"gpu_count": count, "gpus": gpus, "driver": driver.decode() if isinstance(driver, bytes) else driver}
