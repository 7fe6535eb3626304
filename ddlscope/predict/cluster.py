"""The cluster a prediction is for: nodes, devices, links, and (collaborative) peers.

Written by hand as TOML (see ``examples/cluster-*.toml``) or measured by ``ddlscope calibrate``.
Units are in the field names: seconds, GB/s (1e9 bytes/s), GiB.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class LinkSpec(BaseModel):
    """A link between two workers: time to send B bytes = ``latency_s + B / (bandwidth_gb_per_s * 1e9)``."""

    model_config = ConfigDict(extra="forbid")

    bandwidth_gb_per_s: float = Field(gt=0, description="1e9 bytes per second")
    latency_s: float = Field(ge=0)

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to send ``nbytes`` bytes over this link (Hockney's alpha-beta model)."""
        return self.latency_s + nbytes / (self.bandwidth_gb_per_s * 1e9)


class DeviceSpec(BaseModel):
    """One device (a GPU, or on CPU clusters a set of cores). ``kind`` must be a known kind
    (:data:`ddlscope.predict.devices.DEVICE_KINDS`); ``local`` is the device the profile ran on."""

    model_config = ConfigDict(extra="forbid")

    kind: str
    memory_gib: float | None = Field(None, gt=0, description="capacity per device; default: the kind's")


class PeerSpec(BaseModel):
    """A collaborative peer: its compute in profiled devices and its network link."""

    model_config = ConfigDict(extra="forbid")

    compute_share: float = Field(gt=0, description="throughput relative to the profiled device (1 = same device)")
    bandwidth_gb_per_s: float = Field(gt=0)
    latency_s: float = Field(0.0, ge=0)
    memory_gib: float | None = Field(None, gt=0)


class ClusterSpec(BaseModel):
    """A cluster: ``nodes`` x ``devices_per_node`` identical devices, or a list of collaborative peers.

    Attributes:
        intra_node / inter_node: links between devices of one node / of different nodes
            (``inter_node`` is required when ``nodes > 1``).
        collective_fixed_s: fixed cost of one collective call beyond its latency and bytes
            (negotiation, buffer allocation and copies; thesis 002 ch. 5.2 names it as the reason
            eq. 5.1 fails for MobileNetV2).
        p2p_fixed_s: the same for one point-to-point send/recv pair.
        concurrent_compute_slowdown: factor (>= 1) by which a device computes slower when every
            device of its node computes at once (shared memory bandwidth, caches, clocks).
        comm_overlap: fraction (0..1) of a collective's time that can overlap computation
            (1: DMA engines as on GPUs; less on CPU, where communication threads share the cores).
        peers: collaborative peers; when empty, peers are the cluster's devices.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = "cluster"
    nodes: int = Field(1, ge=1)
    devices_per_node: int = Field(1, ge=1)
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec | None = None
    collective_fixed_s: float = Field(0.0, ge=0)
    p2p_fixed_s: float = Field(0.0, ge=0)
    concurrent_compute_slowdown: float = Field(1.0, ge=1)
    comm_overlap: float = Field(1.0, ge=0, le=1)
    peers: list[PeerSpec] = Field(default_factory=list)

    @property
    def workers(self) -> int:
        """Devices in the cluster."""
        return self.nodes * self.devices_per_node

    def ring_link(self, workers: int) -> LinkSpec:
        """The slowest link in a ring over the first ``workers`` devices (node-major placement)."""
        if workers > self.devices_per_node and self.inter_node is not None:
            return self.inter_node
        return self.intra_node
