"""Tests for hbp_train/profiler/nvml.py: without NVML, or without a memory reading, one log line and None."""

from __future__ import annotations

import logging

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
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: object())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", fail)
    with caplog.at_level(logging.WARNING, logger="hbp_train.profiler.nvml"):
        assert nvml.nvml_used_bytes(0) is None
        assert nvml.nvml_used_bytes(0) is None and nvml.nvml_hardware() is None
    assert len([r for r in caplog.records if "NVML" in r.getMessage()]) == 1
