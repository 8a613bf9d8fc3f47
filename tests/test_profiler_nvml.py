"""Tests for hbp_train/profiler/nvml.py: without NVML, or without a memory reading, one log line and None; under
CUDA_VISIBLE_DEVICES the CUDA device is found in NVML by UUID or PCI bus id, never by its index (a fake NVML)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from hbp_train.profiler import nvml


def test_no_nvml_degrades_with_one_log_line(monkeypatch, caplog):
    import pynvml

    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    monkeypatch.setitem(nvml._nvml, "state", None)
    with caplog.at_level(logging.WARNING, logger="hbp_train.profiler.nvml"):
        assert nvml.nvml_used_bytes(0) is None
        assert nvml.nvml_used_bytes(0) is None
        assert nvml.nvml_hardware() is None
    lines = [r for r in caplog.records if "NVML" in r.getMessage()]
    assert len(lines) == 1 and "NVMLError_LibraryNotFound" in lines[0].getMessage()


def test_nvml_reading_failure_degrades_to_torch_counters(monkeypatch, caplog):
    import pynvml

    def fail(*args):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    monkeypatch.setitem(nvml._nvml, "state", True)  # NVML initialised, but this GPU hides its memory reading
    monkeypatch.setattr(nvml, "nvml_handle", lambda index: object())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", fail)
    with caplog.at_level(logging.WARNING, logger="hbp_train.profiler.nvml"):
        assert nvml.nvml_used_bytes(0) is None
        assert nvml.nvml_used_bytes(0) is None and nvml.nvml_hardware() is None
    assert len([r for r in caplog.records if "NVML" in r.getMessage()]) == 1


class FakeNvml:
    """A node of three GPUs as NVML numbers them; each one's used memory tells which one was read."""

    GPUS = [{"uuid": "GPU-aaaa", "pci": "00000000:07:00.0", "used": 70 << 30},   # another job's GPU
            {"uuid": "GPU-bbbb", "pci": "00000000:0A:00.0", "used": 5 << 30},    # ours: CUDA_VISIBLE_DEVICES=1,2
            {"uuid": "GPU-cccc", "pci": "00000000:0F:00.0", "used": 9 << 30}]

    def __init__(self, monkeypatch, pynvml):
        by = lambda key: (lambda value: next(g for g in self.GPUS if g[key] == value))  # noqa: E731
        monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda i: self.GPUS[i])
        monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", by("uuid"))
        monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByPciBusId", by("pci"))
        monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda h: SimpleNamespace(used=h["used"]))


@pytest.mark.parametrize("identity", ["uuid", "pci"])
def test_cuda_index_is_mapped_to_the_nvml_device_by_uuid_or_pci_bus_id(monkeypatch, identity):
    import pynvml

    FakeNvml(monkeypatch, pynvml)
    monkeypatch.setitem(nvml._nvml, "state", True)
    # CUDA_VISIBLE_DEVICES=1,2: CUDA 0 is NVML 1 and CUDA 1 is NVML 2; NVML 0 belongs to another job.
    visible = {0: FakeNvml.GPUS[1], 1: FakeNvml.GPUS[2]}

    def props(index):
        gpu = visible[index]
        if identity == "uuid":
            return SimpleNamespace(uuid=gpu["uuid"][4:])  # torch prints the UUID without NVML's "GPU-" prefix
        domain, bus, dev = gpu["pci"].split(":")[0], gpu["pci"].split(":")[1], gpu["pci"].split(":")[2][:2]
        return SimpleNamespace(pci_domain_id=int(domain, 16), pci_bus_id=int(bus, 16), pci_device_id=int(dev, 16))

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    assert nvml.nvml_used_bytes(0) == 5 << 30
    assert nvml.nvml_used_bytes(1) == 9 << 30


def test_a_mig_slice_is_found_by_its_mig_uuid(monkeypatch):
    """torch prints a MIG slice's UUID bare, like a whole GPU's; NVML knows it only as "MIG-<uuid>"."""
    import pynvml

    slices = {"MIG-1234": SimpleNamespace(used=3 << 30)}

    def by_uuid(uuid):
        if uuid not in slices:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return slices[uuid]

    monkeypatch.setitem(nvml._nvml, "state", True)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByUUID", by_uuid)
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", lambda handle: handle)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: SimpleNamespace(uuid="1234"))
    assert nvml.nvml_used_bytes(0) == 3 << 30
