"""Round trip of activation frames over our transport vs a raw hivemind binary-stream echo.

    python benchmarks/transport.py [--sizes 64K,256K,1M,4M,16M] [--repeats N] [--swarm-key] [--json-out PATH]

Two processes on loopback, each with its own SwarmNode (DHT + libp2p daemon) and event loop:
this one is the client; it spawns itself with `--serve` as the server, which serves

- `ECHO_OURS` on `TensorTransport`: the request frame's tensor comes back in a 'result' frame
  (the full path: framing, header validation, size limits, finiteness check, both ways);
- `ECHO_RAW`: hivemind's length-prefixed `receive_raw_data` / `send_raw_data` echo;
- with `--swarm-key`, also `ECHO_KEYED`: `ECHO_OURS` in a private swarm (a fresh key both
  processes load), so every stream opens with the key's handshake (one more round trip).

All open one stream per request (our transport as with --streams per-frame; by default it
reuses them). For each size the client warms up, then alternates them (rotating which goes
first every repetition) so drift on a busy machine hits all alike. One JSON document goes to
stdout; logs go to stderr. The aim, ours within 20% of raw, is reported per size and never
fails the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

import hivemind
import torch
from hivemind.p2p import P2P, PeerID

from swarmtrain.swarm.node import NodeConfig, SwarmNode
from swarmtrain.transport.streams import LINGER_S, TensorTransport, TransportConfig
from swarmtrain.trust.swarmkey import SwarmKey, generate_swarm_key, load_swarm_key
from swarmtrain.wire.frames import Frame

ECHO_OURS = "/swarmtrain-bench/frames/1"
ECHO_RAW = "/swarmtrain-bench/raw/1"
ECHO_KEYED = "/swarmtrain-bench/keyed/1"
RUN_ID = "bench"
DEFAULT_SIZES = "64K,256K,1M,4M,16M"
CHANNELS = 1024  # C of the (B, T, C) activation; every size must hold whole rows of it
MAX_T = 256
WARMUP = 2
CALL_TIMEOUT_S = 60.0
SERVER_START_TIMEOUT_S = 90.0
AIM_RATIO = 1.2


def parse_size(text: str) -> int:
    """'64K' -> 65536, '1M' -> 1048576, '4096' -> 4096 (K and M are KiB and MiB)."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 2**10, "M": 2**20}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    if not digits.isdigit() or int(digits) * scale == 0:
        raise SystemExit(f"--sizes: {text!r} is not a positive size like 64K, 1M or 4096")
    return int(digits) * scale


def label(nbytes: int) -> str:
    return f"{nbytes // 2**20} MiB" if nbytes % 2**20 == 0 else f"{nbytes // 2**10} KiB"


def activation(nbytes: int) -> torch.Tensor:
    """A float32 (B, T, C) tensor of exactly `nbytes` bytes."""
    if nbytes % (4 * CHANNELS):
        raise SystemExit(f"--sizes: {nbytes} bytes is not a whole number of float32 rows of {CHANNELS}")
    rows = nbytes // (4 * CHANNELS)
    T = math.gcd(rows, MAX_T)
    B = rows // T
    return torch.randn(B, T, CHANNELS)  # (B, T, C)


def default_repeats(nbytes: int) -> int:
    # small frames are cheap and noisy, so they get more; the default sizes take ~20 s on 2 cores
    return 50 if nbytes <= 256 * 2**10 else 30 if nbytes <= 2**20 else 15 if nbytes <= 4 * 2**20 else 8


def summarize(rtts_s: list[float], nbytes: int) -> dict:
    median = statistics.median(rtts_s)
    p90 = statistics.quantiles(rtts_s, n=10, method="inclusive")[8]
    return {
        "rtt_ms_median": round(median * 1e3, 3),
        "rtt_ms_p90": round(p90 * 1e3, 3),
        "rtt_ms_min": round(min(rtts_s) * 1e3, 3),
        "mib_per_s": round(2 * nbytes / median / 2**20, 1),
        "calls_per_s": round(1 / median, 1),
    }


# server


async def serve(key: SwarmKey | None) -> None:
    """Serve the echoes until stdin closes or SIGTERM arrives; prints {peer_id, addrs} first."""
    node = SwarmNode(NodeConfig())
    try:
        p2p = await node.p2p()
        transport = TensorTransport(p2p, TransportConfig())

        async def echo_ours(request: Frame, _peer: str) -> Frame:
            return Frame(kind="result", run_id=request.run_id, mb_id=request.mb_id, tensors=request.tensors)

        async def echo_raw(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await P2P.send_raw_data(await P2P.receive_raw_data(reader), writer)
                # the same stream lifecycle as TensorTransport.serve: close once the caller has closed
                await asyncio.wait_for(reader.read(1), LINGER_S)
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError):
                pass
            finally:
                writer.close()

        await transport.serve(ECHO_OURS, echo_ours)
        await p2p.add_binary_stream_handler(ECHO_RAW, echo_raw)
        if key is not None:
            await TensorTransport(p2p, TransportConfig(), swarm_key=key).serve(ECHO_KEYED, echo_ours)

        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        stdin = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(stdin), sys.stdin)

        async def stop_on_eof() -> None:
            await stdin.read()  # the client closes our stdin, or dies
            stop.set()

        eof_task = asyncio.create_task(stop_on_eof())
        print(json.dumps({"peer_id": node.peer_id, "addrs": node.addresses()}), flush=True)
        await stop.wait()
        eof_task.cancel()
    finally:
        node.shutdown()


def start_server(key_path: str | None) -> tuple[subprocess.Popen, dict]:
    key_args = ["--key-file", key_path] if key_path else []
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--serve", *key_args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], SERVER_START_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(
                f"benchmark server did not print its address within {SERVER_START_TIMEOUT_S:.0f} s "
                f"(exit code {proc.poll()}); see its log above"
            )
        return proc, json.loads(line)
    except BaseException:
        stop_server(proc)
        raise


def stop_server(proc: subprocess.Popen) -> None:
    if proc.stdin and not proc.stdin.closed:
        proc.stdin.close()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# client


async def bench(
    node: SwarmNode, server_id: str, sizes: list[int], repeats: int | None, key: SwarmKey | None
) -> list[dict]:
    p2p = await node.p2p()
    transport = TensorTransport(p2p, TransportConfig())
    keyed_transport = TensorTransport(p2p, TransportConfig(), swarm_key=key)
    server = PeerID.from_base58(server_id)

    async def call(x: torch.Tensor, via: TensorTransport, name: str) -> None:
        frame = Frame(kind="forward", run_id=RUN_ID, mb_id="bench:0:0", stage=0, tensors={"x": x})
        reply = await via.call(server_id, name, frame, timeout_s=CALL_TIMEOUT_S)
        assert reply.tensors["x"].shape == x.shape, "echo returned another shape"

    async def ours(x: torch.Tensor) -> None:
        await call(x, transport, ECHO_OURS)

    async def keyed(x: torch.Tensor) -> None:
        await call(x, keyed_transport, ECHO_KEYED)

    async def raw(x: torch.Tensor) -> None:
        async def round_trip() -> bytes:
            _info, reader, writer = await p2p.call_binary_stream_handler(server, ECHO_RAW)
            try:
                await P2P.send_raw_data(memoryview(x.view(-1).view(torch.uint8).numpy()), writer)
                return await P2P.receive_raw_data(reader)
            finally:
                writer.close()

        data = await asyncio.wait_for(round_trip(), CALL_TIMEOUT_S)
        assert len(data) == x.nbytes, "echo returned another length"

    async def timed(fn: Callable[[torch.Tensor], Awaitable[None]], x: torch.Tensor) -> float:
        t0 = time.perf_counter()
        await fn(x)
        return time.perf_counter() - t0

    fns = {"ours": ours, "raw": raw} | ({"keyed": keyed} if key is not None else {})
    results = []
    for nbytes in sizes:
        x = activation(nbytes)
        n = repeats or default_repeats(nbytes)
        for _ in range(WARMUP):
            for fn in fns.values():
                await fn(x)
        rtts: dict[str, list[float]] = {which: [] for which in fns}
        names = list(fns)
        for i in range(n):
            for which in names[i % len(names) :] + names[: i % len(names)]:  # rotate who goes first
                rtts[which].append(await timed(fns[which], x))
        stats = {which: summarize(rtts[which], nbytes) for which in fns}
        ratio = stats["ours"]["rtt_ms_median"] / stats["raw"]["rtt_ms_median"]
        result = {
            "size_bytes": nbytes,
            "size": label(nbytes),
            "shape": list(x.shape),
            "repeats": n,
            **stats,
            "ratio": round(ratio, 3),
            "within_20pct": ratio <= AIM_RATIO,
        }
        line = f"{label(nbytes):>8}: ours/raw = {ratio:.3f}"
        if key is not None:
            result["keyed_ratio"] = round(stats["keyed"]["rtt_ms_median"] / stats["ours"]["rtt_ms_median"], 3)
            line += f", keyed/ours = {result['keyed_ratio']:.3f}"
        results.append(result)
        print(line, file=sys.stderr, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated frame sizes, e.g. 64K,1M,16M")
    parser.add_argument("--repeats", type=int, default=None, help="timed round trips per size and transport")
    parser.add_argument(
        "--swarm-key",
        action="store_true",
        help="also time our transport in a private swarm (the key's handshake on every stream)",
    )
    parser.add_argument("--json-out", default=None, help="also write the JSON document to this file")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--key-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(load_swarm_key(args.key_file) if args.key_file else None))
        return
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    for nbytes in sizes:
        activation(nbytes)  # reject bad sizes before starting any peer
    if args.repeats is not None and args.repeats < 2:
        raise SystemExit(f"--repeats must be at least 2 (for a p90), got {args.repeats}")

    t0, load_before = time.perf_counter(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as key_dir:
        key_path = os.path.join(key_dir, "swarm.key") if args.swarm_key else None
        key = generate_swarm_key(key_path) if key_path else None
        proc, server = start_server(key_path)
        node = None
        try:
            node = SwarmNode(NodeConfig(initial_peers=tuple(server["addrs"][:1])))
            results = asyncio.run(bench(node, server["peer_id"], sizes, args.repeats, key))
        finally:
            if node is not None:
                node.shutdown()
            stop_server(proc)

    doc = {
        "benchmark": "transport",
        "aim": f"our frame transport's median round trip within {AIM_RATIO - 1:.0%} of the raw hivemind stream's",
        "definitions": {
            "rtt": "client-side wall time of one request/reply: open a stream, send the payload, "
            "receive the echo, close; median and p90 over the timed repetitions, after warmup",
            "mib_per_s": "2 * payload bytes / median rtt / 2**20 (payload each way, headers excluded)",
            "ratio": "ours rtt_ms_median / raw rtt_ms_median (above 1: ours is slower)",
            "within_20pct": f"ratio <= {AIM_RATIO}",
            "ours": "TensorTransport.call -> serve() echo: one float32 tensor in a 'forward' frame, "
            "back in a 'result' frame, with all of read_frame's checks on both ends",
            "raw": "P2P.send_raw_data / receive_raw_data echo of the same bytes over "
            "call_binary_stream_handler",
            "calls_per_s": "1 / median rtt: sequential calls per second on one stream at a time",
            "keyed": "(--swarm-key) ours in a private swarm: every stream first does the swarm key's "
            "handshake (hello, challenge, proof: one more round trip)",
            "keyed_ratio": "(--swarm-key) keyed rtt_ms_median / ours rtt_ms_median: the handshake's cost",
        },
        "setup": {
            "transport": "two processes on 127.0.0.1, each with its own SwarmNode and p2pd",
            "warmup_per_size": WARMUP,
            "interleaving": "the transports take turns, rotating which goes first every repetition",
            "python": platform.python_version(),
            "torch": torch.__version__,
            "hivemind": hivemind.__version__,
            "cpu_count": os.cpu_count(),
            "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
            "load_avg_note": "1-minute load average before and after: on a shared host, read ratios with it",
        },
        "results": results,
        "all_within_20pct": all(r["within_20pct"] for r in results),
        "elapsed_s": round(time.perf_counter() - t0, 1),
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
