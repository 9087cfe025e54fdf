"""What a simulated node reports about itself: attributes, resources, GPUs.

The attributes are those of Nomad's fingerprinters (`kernel.name`,
`cpu.totalcompute`, `unique.network.ip-address`, drivers as Bool attributes,
`consul.version`, ...); GPUs look like the NVIDIA device plugin's: NVML model
names, `GPU-<uuid>` instance IDs and typed attributes such as
`memory = {"Int": 81559, "Unit": "MiB"}`. Everything here is pure.
"""

from __future__ import annotations

import platform
import signal
import uuid

from caravan_llm.devcluster.nomad.matching import Attribute
from caravan_llm.devcluster.nomad.model import DeviceGroup, DeviceInstance, HostVolume, Node
from caravan_llm.devcluster.nomad.settings import NodeSpec

NOMAD_VERSION = "1.10.5"
CONSUL_VERSION = "1.21.4"
NVIDIA_DRIVER_VERSION = "550.127.08"
SIGNALS = ",".join(
    sorted(
        name
        for name in dir(signal)
        if name.startswith("SIG") and not name.startswith("SIG_") and name.isupper()
    )
)
NODE_HTTP_PORT = 4646


def loopback_address(number: int, block: int = 0) -> str:
    """The address of node `number` (1-based) in loopback block `block` (0-255).

    Block 0: 127.0.0.2, 127.0.0.3, ...; block b: 127.b.0.2, ... Every devcluster
    draws its own block, so two of them on one host (a second demo, parallel
    test processes) never hand out the same address and port: their nodes'
    engines would collide on the host, which separate machines never do.
    """
    if not 0 <= block <= 255:
        raise ValueError(f"loopback block must be in 0..255, got {block}")
    host = number + 1
    return f"127.{block}.{host // 254}.{host % 254 + (1 if host // 254 else 0)}"


def gpu_devices(spec: NodeSpec, node_id: str) -> tuple[DeviceGroup, ...]:
    if spec.gpus == 0:
        return ()
    instances = tuple(
        DeviceInstance(
            id=f"GPU-{uuid.uuid5(uuid.NAMESPACE_URL, f'{node_id}/gpu/{index}')}",
            healthy=True,
            pci_bus_id=f"00000000:{0x18 + index * 0x10:02X}:00.0",
        )
        for index in range(spec.gpus)
    )
    attributes = {
        "memory": Attribute(spec.gpu_memory, "MiB"),
        "bar1": Attribute(131072, "MiB"),
        "power": Attribute(700, "W"),
        "cores_clock": Attribute(1980, "MHz"),
        "memory_clock": Attribute(2619, "MHz"),
        "pci_bandwidth": Attribute(63015, "MB/s"),
        "driver_version": Attribute(NVIDIA_DRIVER_VERSION),
        "display_state": Attribute("Disabled"),
        "persistence_mode": Attribute("Enabled"),
    }
    return (DeviceGroup("nvidia", "gpu", spec.gpu_model, instances, attributes),)


def fingerprint(spec: NodeSpec, *, name: str, address: str, http_port: int) -> dict[str, str]:
    """The node attributes Nomad's fingerprinters would report for this node."""
    attributes = {
        "kernel.name": "linux",
        "kernel.arch": platform.machine() or "x86_64",
        "kernel.version": platform.release(),
        "os.name": "debian",
        "os.version": "12",
        "os.signals": SIGNALS,
        "arch": "amd64" if platform.machine() in {"x86_64", "AMD64", ""} else platform.machine(),
        "cpu.arch": "amd64"
        if platform.machine() in {"x86_64", "AMD64", ""}
        else platform.machine(),
        "cpu.numcores": str(spec.cpu_cores),
        "cpu.reservablecores": str(spec.cpu_cores),
        "cpu.frequency": str(spec.cpu_mhz_per_core),
        "cpu.totalcompute": str(spec.cpu_cores * spec.cpu_mhz_per_core),
        "cpu.modelname": "devcluster virtual CPU",
        "memory.totalbytes": str(spec.memory_mb * 1024 * 1024),
        "unique.hostname": name,
        "unique.network.ip-address": address,
        "unique.storage.volume": "/dev/devcluster",
        "unique.storage.bytestotal": str(spec.disk_mb * 1024 * 1024),
        "unique.storage.bytesfree": str(spec.disk_mb * 1024 * 1024),
        "network.ip-address": address,
        "nomad.version": NOMAD_VERSION,
        "nomad.revision": "devcluster",
        "nomad.advertise.address": f"{address}:{http_port}",
        "nomad.service_discovery": "true",
        "consul.version": CONSUL_VERSION,
        "consul.revision": "devcluster",
        "consul.server": "false",
        "consul.datacenter": spec.datacenter,
        "consul.connect": "false",
        "consul.grpc": "-1",
        "unique.consul.name": name,
    }
    for driver in spec.drivers:
        # Drivers fingerprint a Bool attribute, which a node attribute writes as "true".
        attributes[f"driver.{driver}"] = "true"
    if "docker" in spec.drivers:
        attributes["driver.docker.version"] = "27.5.1"
        attributes["driver.docker.runtimes"] = "io.containerd.runc.v2,runc"
    return attributes


def node_from_spec(
    spec: NodeSpec, *, node_id: str, name: str, address: str, registered_at_ns: int
) -> Node:
    """The `Node` a client with this spec registers (status `initializing`)."""
    return Node(
        id=node_id,
        name=name,
        address=address,
        datacenter=spec.datacenter,
        node_class=spec.node_class,
        node_pool=spec.node_pool,
        attributes=fingerprint(spec, name=name, address=address, http_port=NODE_HTTP_PORT),
        meta=dict(spec.meta),
        drivers=tuple(spec.drivers),
        cpu_cores=spec.cpu_cores,
        cpu_mhz_per_core=spec.cpu_mhz_per_core,
        memory_mb=spec.memory_mb,
        disk_mb=spec.disk_mb,
        devices=gpu_devices(spec, node_id),
        http_port=NODE_HTTP_PORT,
        registered_at_ns=registered_at_ns,
        host_volumes={
            name: HostVolume(path=volume.path, read_only=volume.read_only)
            for name, volume in spec.host_volumes.items()
        },
    )
