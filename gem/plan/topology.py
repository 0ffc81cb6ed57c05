"""The target cluster: hosts x GPUs, memory per GPU and host, link bandwidths (`topology.*` keys of `gem plan`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gem.config import UserError

GB = 10**9


class PlanError(UserError):
    """A `gem plan` input or layout problem; the message is one line naming the key, rank or bytes."""


@dataclass(frozen=True)
class ClusterSpec:
    hosts: int = 1
    gpus_per_host: int = 8
    hbm_gb: float = 141.0  # per GPU (GB = 1e9 bytes)
    ddr_gb: float = 2048.0  # host memory per host, shared by its GPUs (UVM-cached tables live there)
    intra_gbps: float = 450.0  # GB/s per GPU inside a host (NVLink)
    inter_gbps: float = 50.0  # GB/s per GPU across hosts (a 400 Gb/s NIC per GPU)
    compute_device: str = "cuda"

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> ClusterSpec:
        d = dict(d or {})
        fields = {f.name: f for f in dataclasses.fields(cls)}
        for k in d:
            if k not in fields:
                raise PlanError(f"topology.{k}: unknown key (expected one of {', '.join(sorted(fields))})")
        out = {}
        for k, v in d.items():
            kind = str if k == "compute_device" else (int if k in ("hosts", "gpus_per_host") else float)
            try:
                out[k] = kind(v) if kind is not int or float(v) == int(float(v)) else None
            except (TypeError, ValueError):
                out[k] = None
            if out[k] is None:
                raise PlanError(f"topology.{k}: expected {kind.__name__} (got {v!r})")
        spec = cls(**out)
        for k in ("hosts", "gpus_per_host", "hbm_gb", "ddr_gb", "intra_gbps", "inter_gbps"):
            if getattr(spec, k) <= 0 and not (k == "ddr_gb" and spec.ddr_gb == 0):
                raise PlanError(f"topology.{k}: must be > 0 (got {getattr(spec, k)})")
        if spec.compute_device not in ("cuda", "cpu"):
            raise PlanError(f"topology.compute_device: expected cuda or cpu (got {spec.compute_device!r})")
        return spec

    @property
    def world(self) -> int:
        return self.hosts * self.gpus_per_host

    @property
    def hbm_bytes(self) -> int:
        return int(self.hbm_gb * GB)

    @property
    def ddr_bytes_per_rank(self) -> int:
        return int(self.ddr_gb * GB) // self.gpus_per_host

    def spans_hosts(self, ranks: Iterable[int]) -> bool:
        return len({r // self.gpus_per_host for r in ranks}) > 1

    def bandwidth(self, ranks: Iterable[int]) -> float:
        """Bytes/s per GPU for a collective over `ranks`: the inter-host links bound any group that spans hosts."""
        return (self.inter_gbps if self.spans_hosts(ranks) else self.intra_gbps) * GB
