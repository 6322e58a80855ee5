"""Bandwidth floors: measured quickly, and the span -> floor mapping."""

import time

import pytest
import torch

from profiler.floors import floor_for_span, measure_floors


def test_cpu_floors_measure_host_copy_quickly():
    start = time.perf_counter()
    floors = measure_floors(torch.device("cpu"))
    elapsed = time.perf_counter() - start
    assert set(floors) == {"host_copy"}
    # Any real machine copies faster than 100 MB/s and slower than 10 TB/s.
    assert 1e8 < floors["host_copy"] < 1e13
    assert elapsed < 1.0


def test_failed_floor_is_omitted_not_zero(monkeypatch):
    import profiler.floors as floors_mod

    def boom(budget_s):
        raise RuntimeError("no memory for the scratch buffer")

    monkeypatch.setattr(floors_mod, "_host_copy_bytes_per_s", boom)
    assert measure_floors(torch.device("cpu")) == {}


FLOORS = {"device_copy": 4e12, "pinned_d2h": 5e10, "pinned_h2d": 5.5e10, "host_copy": 2e10}


def test_floor_for_span_on_cuda():
    assert floor_for_span("d2h_copy", FLOORS, is_cuda=True) == ("pinned_d2h", 5e10)
    assert floor_for_span("h2d_copy", FLOORS, is_cuda=True) == ("pinned_h2d", 5.5e10)
    assert floor_for_span("target.pack_hidden", FLOORS, is_cuda=True) == ("device_copy", 4e12)
    assert floor_for_span("d2h_copy", {"device_copy": 4e12}, is_cuda=True) is None


def test_floor_for_span_on_cpu_is_host_copy():
    assert floor_for_span("transfer.send", FLOORS, is_cuda=False) == ("host_copy", 2e10)
    assert floor_for_span("d2h_copy", FLOORS, is_cuda=False) == ("host_copy", 2e10)
    assert floor_for_span("transfer.send", {}, is_cuda=False) is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_floors_plausible_and_fast():
    device = torch.device("cuda", torch.cuda.current_device())
    torch.ones(1, device=device)  # context creation is not the floors' cost
    start = time.perf_counter()
    floors = measure_floors(device)
    elapsed = time.perf_counter() - start
    assert set(floors) == {"device_copy", "pinned_d2h", "pinned_h2d", "host_copy"}, floors
    assert floors["device_copy"] > 500e9  # an H200 copies at several TB/s (read + write)
    assert 1e9 < floors["pinned_d2h"] < 2e11 and 1e9 < floors["pinned_h2d"] < 2e11  # PCIe/C2C range
    assert elapsed < 1.0, floors
