"""What this machine can offer the swarm: the capacity probe behind `--gpu auto`.

`probe()` measures one device: its name, total and free memory, the host's CPU cores, and
the matmul throughput it achieves in the run's dtype. `measure_links()` adds round-trip
time and bandwidth to a few peers over the real frame transport. The result, `Capacity`,
is plain data (`to_dict()` is msgpack-friendly) for the planner and for `swarmtrain probe`.
A CPU-only machine is a valid, slow peer.
"""

from __future__ import annotations

import math
import os
import platform
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from swarmtrain.errors import ConfigError, SwarmError

if TYPE_CHECKING:
    from rich.table import Table

    from swarmtrain.transport import TensorTransport

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""Dtypes the matmul probe measures in."""
CPU_MATMUL_SIZE = 512
"""Side of the CPU probe's square matmuls: 0.27 GFLOP each, milliseconds on one core."""
CUDA_MATMUL_SIZE = 4096
"""Side of the CUDA probe's square matmuls: large enough to reach the tensor cores' steady rate."""
LINK_ROUNDS = 3
"""Pings per peer and per payload size; the fastest of them is kept (the least disturbed)."""


def resolve_device(gpu: str) -> str:
    """Map a --gpu value ('auto', 'cpu', 'cuda', 'cuda:N') to a torch device string.

    'auto' takes the first CUDA device when there is one, else the CPU. Naming a CUDA
    device this machine does not have raises ConfigError saying what it has.
    """
    gpu = gpu.strip().lower()
    if gpu == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if gpu == "cpu":
        return "cpu"
    if gpu == "cuda":
        gpu = "cuda:0"
    if gpu.startswith("cuda:") and gpu[5:].isdigit():
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        index = int(gpu[5:])
        if index >= count:
            have = f"{count} CUDA device(s)" if count else "no CUDA device (or a CPU-only torch build)"
            raise ConfigError(f"--gpu {gpu}: this machine has {have}; use --gpu auto or --gpu cpu")
        return gpu
    raise ConfigError(f"--gpu {gpu!r} is not a device: use auto, cpu, cuda or cuda:N")


COMPUTE_DTYPES = ("auto", "fp32", "bf16", "fp16")
"""What a stage peer computes in (`join --dtype`): parameters, gradients and optimizer state stay
float32 (the master copy) whatever it is; 'bf16' and 'fp16' run forward and backward under
autocast, 'fp16' with the stage's own loss scaling (`swarmtrain.train.loss_scale`)."""


def resolve_dtype(dtype: str, device: str) -> str:
    """Map a --dtype value to what a stage peer on `device` computes in: 'fp32', 'bf16' or 'fp16'.

    'auto' takes bf16 on a CUDA device that supports it (2-16x the fp32 rate and half the
    activation memory), fp16 on one that does not (a T4, a V100, a GTX/RTX 20xx: fp16 tensor
    cores, and loss scaling for the range), and fp32 on a CPU: a CPU swarm then matches one
    process to rounding, though a CPU with native bf16 may well be faster with 'bf16'
    (`benchmarks/mixed_precision.py` measures it). ConfigError for a name that is not a
    dtype, or bf16 on a CUDA device without it."""
    dtype = dtype.strip().lower()
    if dtype not in COMPUTE_DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not a compute dtype: use {', '.join(COMPUTE_DTYPES)}")
    cuda = device.startswith("cuda")
    if dtype == "auto":
        if not cuda:
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    if dtype == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"--dtype bf16: {device} does not support bfloat16; use --dtype fp16 (or fp32)")
    return dtype


# memory sizes

_BYTE_UNITS = {
    "": 1,
    "b": 1,
    **{f"{p}b": 1000**i for i, p in enumerate("kmgt", start=1)},
    **{p: 1024**i for i, p in enumerate("kmgt", start=1)},
    **{f"{p}ib": 1024**i for i, p in enumerate("kmgt", start=1)},
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$")


def parse_bytes(text: str) -> int:
    """'12GB', '512MiB', '1.5G', '4096' -> a positive number of bytes (rounded down).

    KB/MB/GB/TB are powers of 1000; KiB/MiB/GiB/TiB and the bare K/M/G/T are powers of
    1024 (as docker and ulimit read them); no unit or B means bytes; case is ignored.
    Raises ConfigError for anything else, or for a size under one byte.
    """
    match = _SIZE.match(str(text).lower())
    if match is None or match.group(2) not in _BYTE_UNITS:
        raise ConfigError(
            f"memory size {text!r} is not a number with a unit: write e.g. 12GB, 512MiB, 1.5G or 4096 (bytes)"
        )
    size = int(float(match.group(1)) * _BYTE_UNITS[match.group(2)])
    if size < 1:
        raise ConfigError(f"memory size {text!r} is under one byte: give a positive size, e.g. 12GB")
    return size


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _human_rate(n: float, unit: str) -> str:
    for prefix in ("", "K", "M", "G", "T"):
        if abs(n) < 1000:
            return f"{n:.1f} {prefix}{unit}"
        n /= 1000
    return f"{n:.1f} P{unit}"


# the record


def _check_count(name: str, value: Any, *, positive: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"Capacity: {name} must be a finite number, got {value!r}")
    if value < 0 or (positive and value == 0):
        raise ConfigError(f"Capacity: {name} must be {'> 0' if positive else '>= 0'}, got {value!r}")


def _check_link(peer: Any, link: Any) -> None:
    if not isinstance(peer, str) or not isinstance(link, dict):
        raise ConfigError(f"Capacity: links must map peer ids to mappings, got {peer!r}: {link!r}")
    if "error" in link:
        if set(link) != {"error"} or not isinstance(link["error"], str):
            raise ConfigError(f"Capacity: link to {peer} must be {{'error': str}} alone, got {link!r}")
        return
    if set(link) != {"rtt_s", "bandwidth_bytes_per_s"}:
        raise ConfigError(
            f"Capacity: link to {peer} must hold rtt_s and bandwidth_bytes_per_s (or error), got {sorted(link)}"
        )
    _check_count(f"links[{peer}].rtt_s", link["rtt_s"])
    _check_count(f"links[{peer}].bandwidth_bytes_per_s", link["bandwidth_bytes_per_s"], positive=True)


@dataclass(frozen=True, kw_only=True)
class Capacity:
    """What one peer measured about itself; build it with `probe()`, add links with `measure_links()`."""

    device: str
    """Torch device the run would use, e.g. 'cuda:0' or 'cpu'."""
    device_name: str
    """Marketing name of the device: 'NVIDIA A100-SXM4-80GB', or the CPU model."""
    kind: str
    """'cuda' or 'cpu'."""
    memory_total_bytes: int
    """Device memory (host memory for a CPU peer)."""
    memory_free_bytes: int
    """Device memory free at probe time (MemAvailable for a CPU peer)."""
    cpu_cores: int
    """CPU cores this process may run on."""
    matmul_flops_per_s: float
    """Measured square-matmul throughput in `dtype`, already divided by `slowdown`."""
    dtype: str
    """Dtype the matmuls ran in: the run's dtype on CUDA, always float32 on the CPU."""
    is_spot: bool = False
    """The machine may be preempted at any time (--spot)."""
    max_memory_bytes: int | None = None
    """Cap on the memory the run may use (--max-memory); None: no cap beyond what is free."""
    slowdown: float = 1.0
    """Compute is made this many times slower (--slowdown, for testing heterogeneous swarms)."""
    links: dict[str, dict[str, Any]] = field(default_factory=dict)
    """peer id -> {'rtt_s', 'bandwidth_bytes_per_s'}, or {'error'} for a peer that did not answer."""

    def __post_init__(self):
        for name in ("device", "device_name", "dtype"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ConfigError(f"Capacity: {name} must be a non-empty string, got {getattr(self, name)!r}")
        if self.kind not in ("cuda", "cpu"):
            raise ConfigError(f"Capacity: kind must be 'cuda' or 'cpu', got {self.kind!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"Capacity: dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("memory_total_bytes", "memory_free_bytes"):
            _check_count(name, getattr(self, name))
        if self.memory_free_bytes > self.memory_total_bytes:
            raise ConfigError(
                f"Capacity: memory_free_bytes={self.memory_free_bytes} exceeds "
                f"memory_total_bytes={self.memory_total_bytes}"
            )
        _check_count("cpu_cores", self.cpu_cores, positive=True)
        _check_count("matmul_flops_per_s", self.matmul_flops_per_s, positive=True)
        if not isinstance(self.is_spot, bool):
            raise ConfigError(f"Capacity: is_spot must be a bool, got {self.is_spot!r}")
        if self.max_memory_bytes is not None:
            _check_count("max_memory_bytes", self.max_memory_bytes, positive=True)
        _check_count("slowdown", self.slowdown)
        if self.slowdown < 1:
            raise ConfigError(f"Capacity: slowdown must be >= 1 (1 is full speed), got {self.slowdown!r}")
        if not isinstance(self.links, dict):
            raise ConfigError(f"Capacity: links must be a mapping, got {type(self.links).__name__}")
        for peer, link in self.links.items():
            _check_link(peer, link)

    @property
    def usable_memory_bytes(self) -> int:
        """Memory the run may fill: what is free, capped by max_memory_bytes."""
        if self.max_memory_bytes is None:
            return self.memory_free_bytes
        return min(self.memory_free_bytes, self.max_memory_bytes)

    def to_dict(self) -> dict[str, Any]:
        """Plain msgpack/JSON-friendly values; includes the derived usable_memory_bytes."""
        return {
            "device": self.device,
            "device_name": self.device_name,
            "kind": self.kind,
            "memory_total_bytes": self.memory_total_bytes,
            "memory_free_bytes": self.memory_free_bytes,
            "usable_memory_bytes": self.usable_memory_bytes,
            "cpu_cores": self.cpu_cores,
            "matmul_flops_per_s": self.matmul_flops_per_s,
            "dtype": self.dtype,
            "is_spot": self.is_spot,
            "max_memory_bytes": self.max_memory_bytes,
            "slowdown": self.slowdown,
            "links": {peer: dict(link) for peer, link in self.links.items()},
        }

    @classmethod
    def from_dict(cls, data: Any) -> Capacity:
        """Rebuild a Capacity from `to_dict()`'s output (e.g. off the wire); raises ConfigError
        naming the field for a missing, unknown or invalid one. usable_memory_bytes is
        recomputed, not trusted."""
        if not isinstance(data, dict):
            raise ConfigError(f"Capacity: expected a mapping, got {type(data).__name__}")
        data = {k: v for k, v in data.items() if k != "usable_memory_bytes"}
        fields = set(cls.__dataclass_fields__)
        unknown = set(data) - fields
        if unknown:
            raise ConfigError(f"Capacity: unknown fields {sorted(unknown)}")
        links = data.get("links", {})
        if isinstance(links, dict):
            data["links"] = {
                peer: dict(link) if isinstance(link, dict) else link for peer, link in links.items()
            }
        try:
            return cls(**data)
        except TypeError as e:  # a required field is missing
            raise ConfigError(f"Capacity: {e}") from None


# measuring


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "Hardware") and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _host_memory() -> tuple[int, int]:
    """(total, available) host memory in bytes: /proc/meminfo, else sysconf."""
    try:
        info = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info[key] = int(value.split()[0]) * 1024  # the values are in kB
        return info["MemTotal"], min(info["MemAvailable"], info["MemTotal"])
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        total = page * os.sysconf("SC_PHYS_PAGES")
        return total, min(total, page * os.sysconf("SC_AVPHYS_PAGES"))


def _cpu_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def measure_matmul_flops(
    device: str, dtype: torch.dtype, *, seconds: float, size: int | None = None
) -> float:
    """FLOP/s of back-to-back (size x size) @ (size x size) matmuls on `device` in `dtype`.

    Runs a short warm-up (kernel selection, clock ramp-up), then matmuls for about `seconds`,
    synchronizing CUDA before reading the clock. Each matmul counts 2 size^3 FLOPs.
    """
    is_cuda = torch.device(device).type == "cuda"
    n = size or (CUDA_MATMUL_SIZE if is_cuda else CPU_MATMUL_SIZE)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if is_cuda else (lambda: None)
    chunk = 8 if is_cuda else 1  # matmuls launched between clock reads
    with torch.no_grad():
        warmup_end = time.perf_counter() + min(0.2, 0.1 * seconds)
        for _ in range(2):
            torch.mm(a, b, out=c)
        sync()
        while time.perf_counter() < warmup_end:
            torch.mm(a, b, out=c)
            sync()
        count, start = 0, time.perf_counter()
        while True:
            for _ in range(chunk):
                torch.mm(a, b, out=c)
            sync()
            count += chunk
            elapsed = time.perf_counter() - start
            if elapsed >= seconds:
                break
    return 2.0 * n**3 * count / elapsed


def probe(
    gpu: str = "auto",
    *,
    dtype: str = "float32",
    seconds: float = 1.0,
    is_spot: bool = False,
    max_memory_bytes: int | None = None,
    slowdown: float = 1.0,
) -> Capacity:
    """Measure the device `gpu` names (see `resolve_device`) and return its Capacity, without links.

    Takes about `seconds` plus a short warm-up. On the CPU the matmuls run in float32
    whatever `dtype` is, on torch's current intra-op thread count (what a stage would use).
    Raises ConfigError for an unknown device or dtype, a non-positive `seconds` or
    `max_memory_bytes`, or a `slowdown` under 1.
    """
    device = resolve_device(gpu)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one the probe measures: use {', '.join(DTYPES)}")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise ConfigError(f"probe seconds must be a positive number, got {seconds!r}")
    if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not 1 <= slowdown < math.inf:
        raise ConfigError(f"--slowdown must be a number >= 1 (1 is full speed), got {slowdown!r}")
    if max_memory_bytes is not None and max_memory_bytes < 1:
        raise ConfigError(f"--max-memory must be a positive size, got {max_memory_bytes!r}")
    kind = torch.device(device).type
    if kind == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        name = torch.cuda.get_device_name(device)
    else:
        total, free = _host_memory()
        name = _cpu_model()
        dtype = "float32"
    flops = measure_matmul_flops(device, DTYPES[dtype], seconds=seconds)
    return Capacity(
        device=device,
        device_name=name,
        kind=kind,
        memory_total_bytes=int(total),
        memory_free_bytes=int(free),
        cpu_cores=_cpu_cores(),
        matmul_flops_per_s=flops / slowdown,
        dtype=dtype,
        is_spot=is_spot,
        max_memory_bytes=max_memory_bytes,
        slowdown=float(slowdown),
    )


async def measure_links(
    transport: TensorTransport,
    peers: list[str],
    run_id: str,
    payload_bytes: int = 2**20,
    *,
    timeout_s: float = 10.0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, dict[str, Any]]:
    """Round-trip time and bandwidth from this peer to each of `peers`, one peer at a time.

    Pings each peer's stage handler for run `run_id` (the pong carries no tensors):
    rtt_s is the fastest of LINK_ROUNDS empty pings; then pings carrying a `payload_bytes`
    tensor, which the peer does not echo, so bandwidth_bytes_per_s = payload_bytes /
    (fastest payload ping - rtt_s), or payload_bytes / (fastest payload ping) when jitter
    leaves no difference (a lower bound). Each call has `timeout_s`. A peer that does not
    answer, answers with an error or with something other than a pong is reported as
    {'error': reason}; this function does not raise for it. Put the result in a Capacity
    with `dataclasses.replace(capacity, links=...)`. `clock` (seconds) is for tests.
    """
    from swarmtrain.transport import handler_name
    from swarmtrain.wire.frames import Frame

    if payload_bytes < 1:
        raise ConfigError(f"payload_bytes must be >= 1, got {payload_bytes}")
    name = handler_name(run_id)
    payload = torch.zeros(payload_bytes, dtype=torch.uint8)

    async def fastest(peer: str, tensors: dict[str, torch.Tensor]) -> float:
        best = math.inf
        for _ in range(LINK_ROUNDS):
            start = clock()
            reply = await transport.call(
                peer, name, Frame(kind="ping", run_id=run_id, tensors=tensors), timeout_s=timeout_s
            )
            elapsed = clock() - start
            if reply.kind != "pong":
                raise SwarmError(f"answered a ping with a {reply.kind!r} frame, not a pong")
            best = min(best, elapsed)
        return best

    links: dict[str, dict[str, Any]] = {}
    for peer in peers:
        try:
            rtt = await fastest(peer, {})
            transfer = await fastest(peer, {"payload": payload})
        except SwarmError as e:
            links[peer] = {"error": str(e) or type(e).__name__}
            continue
        extra = transfer - rtt
        links[peer] = {
            "rtt_s": rtt,
            "bandwidth_bytes_per_s": payload_bytes / (extra if extra > 0 else transfer),
        }
    return links


# display


def format_capacity_table(capacity: Capacity) -> Table:
    """A two-column rich Table of `capacity` for the terminal, links included."""
    from rich.table import Table

    table = Table(title=f"capacity of {capacity.device}", show_header=False, box=None, pad_edge=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    memory_cap = "none" if capacity.max_memory_bytes is None else _human_bytes(capacity.max_memory_bytes)
    rows = [
        ("device", f"{capacity.device} ({capacity.kind})"),
        ("name", capacity.device_name),
        (
            "memory",
            f"{_human_bytes(capacity.memory_free_bytes)} free of {_human_bytes(capacity.memory_total_bytes)}",
        ),
        ("usable memory", f"{_human_bytes(capacity.usable_memory_bytes)} (cap: {memory_cap})"),
        ("cpu cores", str(capacity.cpu_cores)),
        ("matmul", f"{_human_rate(capacity.matmul_flops_per_s, 'FLOP/s')} in {capacity.dtype}"),
        ("slowdown", f"{capacity.slowdown:g}x" if capacity.slowdown != 1 else "none"),
        ("spot", "yes" if capacity.is_spot else "no"),
    ]
    for peer, link in capacity.links.items():
        if "error" in link:
            value = f"[red]unreachable: {link['error']}[/red]"
        else:
            rtt_ms = 1000 * link["rtt_s"]
            value = f"rtt {rtt_ms:.2f} ms, {_human_rate(link['bandwidth_bytes_per_s'], 'B/s')}"
        rows.append((f"link …{peer[-8:]}", value))
    for key, value in rows:
        table.add_row(key, value)
    return table
