"""The capacity probe: a real CPU measurement, the record's round trip and checks, memory
sizes, device names, and link measurement against a fake and a real frame transport."""

import asyncio
import dataclasses

import msgpack
import pytest
import torch

import swarmtrain.peers.probe as probe_module
from swarmtrain.errors import ConfigError, PeerUnreachableError, RemoteError
from swarmtrain.peers.probe import (
    Capacity,
    format_capacity_table,
    measure_links,
    parse_bytes,
    probe,
    resolve_device,
)
from swarmtrain.wire.frames import Frame

GiB = 2**30


def capacity(**overrides) -> Capacity:
    fields = dict(
        device="cuda:0",
        device_name="NVIDIA A100-SXM4-80GB",
        kind="cuda",
        memory_total_bytes=80 * GiB,
        memory_free_bytes=79 * GiB,
        cpu_cores=16,
        matmul_flops_per_s=2.5e14,
        dtype="bfloat16",
    )
    return Capacity(**{**fields, **overrides})


# the probe on this machine's CPU


@pytest.fixture(scope="module")
def cpu_capacity() -> Capacity:
    return probe("cpu", dtype="bfloat16", seconds=0.2)


def test_cpu_probe_returns_sane_numbers(cpu_capacity):
    c = cpu_capacity
    assert c.device == "cpu" and c.kind == "cpu"
    assert c.device_name
    assert c.dtype == "float32"  # the CPU probe measures float32 whatever the run's dtype
    assert c.matmul_flops_per_s > 1e8
    assert 0 < c.memory_free_bytes <= c.memory_total_bytes
    assert c.usable_memory_bytes == c.memory_free_bytes
    assert c.cpu_cores >= 1
    assert not c.is_spot and c.links == {} and c.slowdown == 1.0


def test_flags_slowdown_max_memory_and_spot(monkeypatch):
    monkeypatch.setattr(probe_module, "measure_matmul_flops", lambda device, dtype, *, seconds: 8e9)
    c = probe("cpu", slowdown=4, max_memory_bytes=parse_bytes("1MiB"), is_spot=True)
    assert c.matmul_flops_per_s == 2e9
    assert c.slowdown == 4.0
    assert c.max_memory_bytes == 2**20 and c.usable_memory_bytes == 2**20
    assert c.is_spot
    roomy = probe("cpu", max_memory_bytes=2**62)
    assert roomy.usable_memory_bytes == roomy.memory_free_bytes


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dtype": "int8"}, "dtype 'int8'"),
        ({"seconds": 0}, "seconds must be a positive number"),
        ({"slowdown": 0.5}, "--slowdown must be a number >= 1"),
        ({"max_memory_bytes": 0}, "--max-memory must be a positive size"),
    ],
)
def test_probe_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        probe("cpu", **kwargs)


# the record


def test_usable_memory_is_the_smaller_of_free_and_the_cap():
    assert capacity().usable_memory_bytes == 79 * GiB
    assert capacity(max_memory_bytes=12 * GiB).usable_memory_bytes == 12 * GiB
    assert capacity(max_memory_bytes=100 * GiB).usable_memory_bytes == 79 * GiB


def test_round_trip_through_msgpack():
    c = capacity(
        max_memory_bytes=12 * GiB,
        is_spot=True,
        slowdown=2.0,
        links={
            "QmPeerA": {"rtt_s": 0.002, "bandwidth_bytes_per_s": 1.2e9},
            "QmPeerB": {"error": "timed out"},
        },
    )
    data = msgpack.unpackb(msgpack.packb(c.to_dict()), raw=False)
    assert data["usable_memory_bytes"] == 12 * GiB
    assert Capacity.from_dict(data) == c
    assert Capacity.from_dict(capacity().to_dict()) == capacity()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d.update(colour="red"), r"unknown fields \['colour'\]"),
        (lambda d: d.pop("cpu_cores"), "cpu_cores"),
        (lambda d: d.update(kind="tpu"), "kind must be 'cuda' or 'cpu'"),
        (lambda d: d.update(memory_free_bytes=81 * GiB), "exceeds memory_total_bytes"),
        (lambda d: d.update(matmul_flops_per_s=0), "matmul_flops_per_s must be > 0"),
        (lambda d: d.update(cpu_cores=True), "cpu_cores must be a finite number"),
        (lambda d: d.update(links={"QmPeer": {"rtt_s": 0.1}}), "must hold rtt_s and bandwidth_bytes_per_s"),
        (lambda d: d.update(links={"QmPeer": {"error": 3}}), r"must be \{'error': str\} alone"),
        (lambda d: d.update(links=[1]), "links must be a mapping"),
    ],
)
def test_from_dict_rejects_bad_records(change, match):
    data = capacity().to_dict()
    change(data)
    with pytest.raises(ConfigError, match=match):
        Capacity.from_dict(data)


def test_capacity_table_shows_the_numbers_and_links():
    from rich.console import Console

    c = capacity(
        links={
            "QmPeerAAAAAAAA": {"rtt_s": 0.0015, "bandwidth_bytes_per_s": 1.25e8},
            "QmPeerBBBBBBBB": {"error": "no answer"},
        }
    )
    console = Console(width=120, record=True)
    console.print(format_capacity_table(c))
    text = console.export_text()
    for expected in (
        "NVIDIA A100-SXM4-80GB",
        "79.0 GiB free of 80.0 GiB",
        "250.0 TFLOP/s in bfloat16",
        "rtt 1.50 ms, 125.0 MB/s",
        "unreachable: no answer",
    ):
        assert expected in text


# memory sizes and devices


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12GB", 12 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5G", int(1.5 * 2**30)),
        ("4096", 4096),
        ("100 kb", 100_000),
        ("2 gib", 2 * 2**30),
        (" 1T ", 2**40),
        ("7B", 7),
        (".5K", 512),
    ],
)
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("", "not a number with a unit"),
        ("twelve GB", "not a number with a unit"),
        ("12 GBs", "not a number with a unit"),
        ("-1GB", "not a number with a unit"),
        ("1e9", "not a number with a unit"),
        ("0", "under one byte"),
        ("0.1B", "under one byte"),
    ],
)
def test_parse_bytes_errors(text, match):
    with pytest.raises(ConfigError, match=match):
        parse_bytes(text)


def test_resolve_device():
    assert resolve_device(" CPU ") == "cpu"
    assert resolve_device("auto") == ("cuda:0" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match=r"--gpu cuda:99: this machine has .*use --gpu auto or --gpu cpu"):
        resolve_device("cuda:99")
    with pytest.raises(ConfigError, match="is not a device: use auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")


# links


class FakeTransport:
    """Answers pings after a fixed latency plus the payload at a fixed rate, on a fake clock."""

    def __init__(self, clock, replies):
        self.clock = clock
        self.replies = replies  # peer -> "pong" | an exception | another frame kind
        self.calls = []

    async def call(self, peer, name, request, *, timeout_s):
        self.calls.append((peer, name, request.kind, sum(t.nbytes for t in request.tensors.values())))
        reply = self.replies[peer]
        if isinstance(reply, Exception):
            raise reply
        self.clock.now += 0.010 + self.calls[-1][3] / 50e6
        return Frame(kind=reply, run_id=request.run_id)


class FakeClock:
    now = 100.0

    def __call__(self):
        return self.now


def test_measure_links_reports_rtt_bandwidth_and_errors():
    clock = FakeClock()
    transport = FakeTransport(
        clock,
        {
            "QmGood": "pong",
            "QmGone": PeerUnreachableError("peer QmGone did not answer within 1.0 s"),
            "QmAngry": RemoteError("this peer serves run 'x'", retryable=False),
            "QmOdd": "result",
        },
    )
    links = asyncio.run(
        measure_links(transport, ["QmGood", "QmGone", "QmAngry", "QmOdd"], "run-1", 2**20, clock=clock)
    )
    assert links["QmGood"] == pytest.approx({"rtt_s": 0.010, "bandwidth_bytes_per_s": 50e6})
    assert links["QmGone"] == {"error": "peer QmGone did not answer within 1.0 s"}
    assert links["QmAngry"] == {"error": "this peer serves run 'x'"}
    assert "not a pong" in links["QmOdd"]["error"]
    good = [c for c in transport.calls if c[0] == "QmGood"]
    assert [c[3] for c in good] == [0, 0, 0, 2**20, 2**20, 2**20]
    assert {c[1] for c in good} == {"/swarmtrain/run-1/1"} and {c[2] for c in good} == {"ping"}
    # the result fits the record
    assert dataclasses.replace(capacity(), links=links).links == links


@pytest.mark.swarm
def test_measure_links_over_real_p2p_streams():
    from hivemind.p2p import P2P

    from swarmtrain.transport import TensorTransport, handler_name

    async def pong(frame: Frame, peer: str) -> Frame:  # what a stage peer answers
        return Frame(kind="pong", run_id=frame.run_id, stage=0)

    async def go():
        server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        client = await P2P.create(initial_peers=await server.get_visible_maddrs())
        try:
            await TensorTransport(server).serve(handler_name("run-1"), pong)
            server_id = server.peer_id.to_base58()
            transport = TensorTransport(client)
            links = await measure_links(transport, [server_id, "not-a-peer-id"], "run-1", 2**16, timeout_s=10)
            other_run = await measure_links(transport, [server_id], "run-2", 2**16, timeout_s=10)
            return server_id, links, other_run
        finally:
            await client.shutdown()
            await server.shutdown()

    server_id, links, other_run = asyncio.run(go())
    assert set(links[server_id]) == {"rtt_s", "bandwidth_bytes_per_s"}
    assert 0 < links[server_id]["rtt_s"] < 10 and links[server_id]["bandwidth_bytes_per_s"] > 0
    assert "cannot open a stream" in links["not-a-peer-id"]["error"]
    assert "error" in other_run[server_id]
