"""``StepMeter``: the FLOP and MFU arithmetic, the report line, and real gloo ranks naming a slow rank."""

from __future__ import annotations

import pytest
import torch
from conftest import dist_test

from zeta_fsdp.training import StepMeter, StepReport, training_flops_per_token
from zeta_fsdp.training.meter import PEAK_TFLOPS, peak_flops_of

test_two_ranks = dist_test("meter_cases.py", 2)


def test_peak_table_matches_device_names_specific_first():
    assert peak_flops_of("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops_of("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_of("NVIDIA H100 NVL", "fp32") == 60e12
    assert peak_flops_of("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_of("NVIDIA L4") == 121e12 and peak_flops_of("NVIDIA L40S") == 362.1e12  # L4 is not L40S
    assert peak_flops_of("NVIDIA A10") == 125e12 and peak_flops_of("NVIDIA A100 80GB PCIe", "fp32") == 19.5e12
    assert peak_flops_of("Tesla V100-SXM2-32GB", "bf16") is None  # no bf16 on Volta
    assert peak_flops_of("NVIDIA GeForce RTX 3050") is None and peak_flops_of("cpu") is None
    assert all(set(p) <= {"bf16", "fp16", "fp32"} for p in PEAK_TFLOPS.values())


def test_training_flops_are_six_per_parameter_plus_attention():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))  # 40 + 18 parameters
    assert training_flops_per_token(model) == 6 * 58
    assert training_flops_per_token(model, seq_len=16, n_layers=3, dim=8) == 6 * 58 + 12 * 3 * 8 * 16
    tied = torch.nn.Module()
    tied.a = torch.nn.Linear(4, 4, bias=False)
    tied.b = torch.nn.Linear(4, 4, bias=False)
    tied.b.weight = tied.a.weight
    assert training_flops_per_token(tied) == 6 * 16  # a tied weight counts once


def test_one_process_windows_mfu_and_the_line(monkeypatch):
    clock = iter([10.0, 11.0, 12.0, 14.5, 15.0])  # perf_counter at each synchronization
    monkeypatch.setattr("zeta_fsdp.training.meter.time.perf_counter", lambda: next(clock))
    lines: list[str] = []
    meter = StepMeter(every=2, flops_per_token=100.0, peak_flops=1000.0, device="cpu", log=lines.append)
    assert meter.step(tokens=5) is None  # t=10: the clock starts
    assert meter.step(tokens=5) is None
    report = meter.step(tokens=7)  # 2 steps done: report at t=11 -> 1 s for 10 tokens
    assert (report.step, report.steps, report.step_ms, report.tokens_per_s) == (2, 2, 500.0, 10.0)
    assert report.mfu == 10.0 * 100.0 / 1000.0 and report.slowest_rank == 0
    report = meter.finish()  # the window restarted at t=12 after the report; 1 step of 7 tokens to t=14.5
    assert (report.step, report.steps, report.step_ms, report.tokens_per_s) == (3, 1, 2500.0, 7 / 2.5)
    assert meter.finish() is None
    assert lines[0].startswith("zeta_fsdp step=2 step_ms=500.0 tokens_per_s=10 mfu=1.000 peak_mem_mib=")
    assert lines[0].endswith(" slowest_rank=0 slowest_lag_ms=0.0")


def test_the_line_is_key_value_and_leaves_out_unknowns():
    report = StepReport(10, 10, 123.45, 9876.5, None, 2048.4, None, 3, 12.34)
    assert (
        report.line()
        == "zeta_fsdp step=10 step_ms=123.5 tokens_per_s=9876 peak_mem_mib=2048 slowest_rank=3 slowest_lag_ms=12.3"
    )
    cuda = StepReport(10, 10, 100.0, 1.0, 0.4123, 30000.0, 32000.0, 0, 0.0)
    assert dict(kv.split("=") for kv in cuda.line().split()[1:])["mfu"] == "0.412"
    assert "peak_reserved_mib=32000" in cuda.line()


@pytest.mark.parametrize("every", [0, -1, 2.5, True])
def test_bad_every_is_refused(every):
    with pytest.raises(ValueError, match=rf"StepMeter\(every={every!r}\) is not accepted. Accepted: an int >= 1"):
        StepMeter(every=every)
