"""Model FLOPs utilisation.

local MFU = achieved model FLOP/s of one device / that device's peak (bf16 dense, vendor sheet; also against a
measured matmul peak when one is given). Scaling ratio = MFU per device at N devices / local MFU measured on
one device (pass that reference from a 1-device run).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# bf16 dense tensor-core peak (no sparsity), FLOP/s, matched against torch.cuda.get_device_name().
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
}


def device_peak_flops(device: torch.device) -> float | None:
    """Vendor bf16 peak of `device`, or None where unknown (e.g. CPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device).upper()
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):  # longest first: GH200 before H200
        if key in name:
            return PEAK_BF16_FLOPS[key]
    return None


def measure_matmul_peak(device: torch.device, n: int = 8192, iters: int = 20) -> float:
    """Measured bf16 matmul FLOP/s on `device` (a square n×n×n GEMM)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    torch.cuda.synchronize(device)
    return 2.0 * n**3 * iters / (time.perf_counter() - t0)


@dataclass
class MFUReport:
    flops_per_s: float  # achieved model FLOP/s per device
    mfu: float | None  # vs the vendor peak
    mfu_measured_peak: float | None  # vs a measured matmul peak
    scaling_ratio: float | None

    def scalars(self) -> dict[str, float]:
        out = {"perf/tflops_per_device": self.flops_per_s / 1e12}
        if self.mfu is not None:
            out["perf/mfu"] = self.mfu
        if self.mfu_measured_peak is not None:
            out["perf/mfu_vs_measured_peak"] = self.mfu_measured_peak
        if self.scaling_ratio is not None:
            out["perf/scaling_ratio"] = self.scaling_ratio
        return out


def mfu_report(
    flops_per_device: float,
    seconds: float,
    peak_flops: float | None,
    measured_peak_flops: float | None = None,
    single_device_mfu: float | None = None,
) -> MFUReport:
    """MFU of `flops_per_device` model FLOPs done in `seconds` on one device."""
    rate = flops_per_device / seconds if seconds > 0 else 0.0
    mfu = rate / peak_flops if peak_flops else None
    mfu_m = rate / measured_peak_flops if measured_peak_flops else None
    ratio = mfu / single_device_mfu if (mfu is not None and single_device_mfu) else None
    return MFUReport(rate, mfu, mfu_m, ratio)
