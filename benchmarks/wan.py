"""Pipeline traffic over an emulated WAN, per codec: tokens/s and bytes per token at 50 and 100 Mbit/s.

    sudo .venv/bin/python benchmarks/wan.py [--peers relay|swarm] [--steps 8] [--stages 4] [--rates 50,100] [--codecs none,fp16,int8,nf4]
                                            [--shape 8,128,256] [--window 16] [--duration-s 8]
                                            [--min-microbatches 30] [--queue-ms 400] [--json-out PATH]

Each of `--stages` peers runs in its own network namespace behind a link limited by `tc tbf`
to the rate in each direction (benchmarks/netns.py: a bridge, one veth per peer). The peers
are transport-only pipeline stages over plain asyncio TCP and our frame format
(swarmtrain.wire.frames, the codecs of swarmtrain.compress): stage 0 sends activation frames
of `--shape` (B, T, C) forward, each middle stage decodes every frame and re-encodes it to the
next stage (as a stage peer does with its output), the last stage answers each with a
gradient frame of the same shape, which travels back the same way. Stage 0 keeps `--window`
microbatches in flight and counts those finished in `--duration-s` seconds of steady state. No model compute: this measures what the
links and the codecs allow, the ceiling a compressed swarm can reach on such links.

Reported per rate and codec: microbatches/s, tokens/s (B x T tokens a microbatch), wire bytes
per token crossing one boundary (activation + gradient), bytes per element, speedup against
'none' (fp32), and the link-bound prediction (a middle peer's uplink carries one activation
and one gradient per microbatch) with the achieved fraction of it; per codec also its CPU
encode and decode time for one frame. One JSON document goes to stdout.

Needs root and `ip`/`tc`: otherwise it says so and exits with code 2, never falling back to
loopback. Namespaces, links, qdiscs and peer processes are removed on exit, error or Ctrl+C.

`--peers swarm [--steps 8] [--streams per-frame,reuse]` runs real swarmtrain peers instead (a coordinator, one `join` per
stage, `train`; benchmarks/wan_swarm.py): tokens/s with model compute, bytes per token from
the peers' counters, and whether the link or the CPU limits each run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.netns import NetnsError, WanConfig, WanNet, check_prerequisites, remove_stale  # noqa: E402
from benchmarks.wan_swarm import STREAMS  # noqa: E402
from benchmarks.wan_swarm import run_all as run_swarm  # noqa: E402
from swarmtrain.compress import get_codec  # noqa: E402  (also registers the codecs with frames)
from swarmtrain.wire.frames import Frame, read_frame, write_frame  # noqa: E402

PORT = 7700
RUN_ID = "wan"
START_TIMEOUT_S = 120.0
GRAD_SCALE = 1e-3
"""The last stage answers an activation x with gradient x * GRAD_SCALE (gradient-sized values)."""
REPO = Path(__file__).resolve().parent.parent


# the peers (each in its own namespace and process)


async def _relay(listen: str, downstream: str | None) -> None:
    """A middle or last stage: serve one upstream connection until it closes."""
    upstream: asyncio.Future = asyncio.get_running_loop().create_future()
    server = await asyncio.start_server(lambda r, w: upstream.set_result((r, w)), listen, PORT)
    print("ready", flush=True)
    up_reader, up_writer = await upstream
    server.close()
    if downstream is None:  # last stage: answer every activation with its gradient
        while (frame := await _read_or_none(up_reader)) is not None:
            grad = frame.tensors["x"] * GRAD_SCALE
            codecs = {"grad": frame.codecs["x"]} if "x" in frame.codecs else {}
            reply = Frame(kind="result", run_id=RUN_ID, mb_id=frame.mb_id, tensors={"grad": grad}, codecs=codecs,
                          meta={"act_wire": frame.wire_nbytes})  # fmt: skip
            await write_frame(up_writer, reply)
        up_writer.close()
        return
    down_reader, down_writer = await asyncio.open_connection(downstream, PORT)

    async def backward() -> None:
        while (frame := await _read_or_none(down_reader)) is not None:
            await write_frame(up_writer, Frame(kind="result", run_id=RUN_ID, mb_id=frame.mb_id,
                                               tensors=frame.tensors, codecs=frame.codecs, meta=frame.meta))  # fmt: skip

    grads = asyncio.create_task(backward())
    while (frame := await _read_or_none(up_reader)) is not None:
        await write_frame(down_writer, Frame(kind="forward", run_id=RUN_ID, mb_id=frame.mb_id,
                                             tensors=frame.tensors, codecs=frame.codecs))  # fmt: skip
    down_writer.close()
    await grads
    up_writer.close()


async def _read_or_none(reader: asyncio.StreamReader) -> Frame | None:
    try:
        return await read_frame(reader)
    except asyncio.IncompleteReadError:
        return None


async def _phase(
    reader, writer, codec: str, x: torch.Tensor, window: int, duration_s: float, min_mb: int
) -> dict:
    """Stream microbatches with `codec` and count those that finish once the pipeline is full
    (the first `window` are back), for at least `duration_s` seconds and `min_mb` microbatches.

    A sender task keeps `window` microbatches in flight while this coroutine reads results
    without pause (a reader that stopped to write could deadlock the chain of full buffers).
    """
    slots = asyncio.Semaphore(window)
    clock = {"from": None, "until": None}  # the measured interval
    outstanding: dict[str, float] = {}  # mb id -> time sent
    counts = {"microbatches": 0, "act_wire": 0, "grad_wire": 0, "seconds": 0.0}
    latencies, received = [], 0

    async def send() -> None:
        n = 0
        while clock["until"] is None:
            await slots.acquire()
            mb, n = f"{codec}:{n}", n + 1
            outstanding[mb] = time.monotonic()
            await write_frame(writer, Frame(kind="forward", run_id=RUN_ID, mb_id=mb, tensors={"x": x},
                                            codecs={"x": codec}))  # fmt: skip

    sender = asyncio.create_task(send())
    reading = None
    while not (sender.done() and not outstanding):
        reading = reading or asyncio.ensure_future(read_frame(reader))
        await asyncio.wait(
            {reading} if sender.done() else {reading, sender}, return_when=asyncio.FIRST_COMPLETED
        )
        if sender.done() and sender.exception():
            raise sender.exception()
        if not reading.done():
            continue
        frame, reading = reading.result(), None
        now, began = time.monotonic(), outstanding.pop(frame.mb_id)
        slots.release()
        received += 1
        if received == window:
            clock["from"] = now
        elif clock["from"] is not None and clock["until"] is None:
            counts["microbatches"] += 1
            counts["act_wire"] += frame.meta["act_wire"]  # as the last stage received it
            counts["grad_wire"] += frame.wire_nbytes
            counts["seconds"] = now - clock["from"]
            latencies.append(now - began)
            if counts["seconds"] >= duration_s and counts["microbatches"] >= min_mb:
                clock["until"] = now  # the sender stops; what is in flight drains uncounted
    return {"codec": codec, **counts, "median_latency_s": statistics.median(latencies or [0])}


async def _driver(
    downstream: str, codecs: list[str], shape: tuple[int, ...], window: int, duration_s: float, min_mb: int
) -> None:
    """Stage 0: run one phase per codec and print each phase's counts as a JSON line."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))  # (B, T, C) activations
    reader, writer = await asyncio.open_connection(downstream, PORT)
    for codec in codecs:
        print(json.dumps(await _phase(reader, writer, codec, x, window, duration_s, min_mb)), flush=True)
    writer.close()


def peer_main(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    if args.role == "driver":
        shape = tuple(int(d) for d in args.shape.split(","))
        asyncio.run(
            _driver(
                args.downstream,
                args.codecs.split(","),
                shape,
                args.window,
                args.duration_s,
                args.min_microbatches,
            )
        )
    else:
        asyncio.run(_relay(args.listen, args.downstream))


# the orchestrator (root namespace)


def _read_line(proc: subprocess.Popen, deadline: float, what: str) -> str:
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if line:
                return line.strip()
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
    raise RuntimeError(f"{what} said nothing within {START_TIMEOUT_S:.0f} s")


def _peer_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "benchmarks.wan", "--role", *args]


def measure_rate(net: WanNet, rate_mbit: float, args: argparse.Namespace) -> list[dict]:
    """One pipeline over `net` at `rate_mbit`: the driver's counts, one dict per codec."""
    net.set_rate(rate_mbit)
    n = net.config.num_peers
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    popen = {"stdout": subprocess.PIPE, "text": True, "cwd": REPO, "env": env}
    deadline = time.monotonic() + START_TIMEOUT_S
    peers = []
    for k in reversed(range(1, n)):  # downstream first, so each stage finds the next one listening
        down = ["--downstream", net.address(k + 1)] if k < n - 1 else []
        proc = net.spawn(k, _peer_argv("relay", "--listen", net.address(k), *down), **popen)
        if _read_line(proc, deadline, f"stage {k}") != "ready":
            raise RuntimeError(f"stage {k} did not start")
        peers.append(proc)
    driver = net.spawn(0, _peer_argv(
        "driver", "--downstream", net.address(1), "--codecs", ",".join(args.codecs), "--shape", args.shape,
        "--window", str(args.window), "--duration-s", str(args.duration_s),
        "--min-microbatches", str(args.min_microbatches),
    ), **popen)  # fmt: skip
    phase_deadline = time.monotonic() + START_TIMEOUT_S + len(args.codecs) * (args.duration_s + 120)
    results = [json.loads(_read_line(driver, phase_deadline, "stage 0")) for _ in args.codecs]
    for proc in [driver, *peers]:
        proc.wait(30)
    return results


def _codec_cpu(codecs: list[str], shape: tuple[int, ...]) -> dict:
    """CPU encode and decode time (one thread, median of 7 after a warm-up) of one frame's tensor
    per codec, and its bytes per element."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    out = {}
    for name in codecs:
        codec = get_codec(name)
        codec.decode(*codec.encode(x), shape, torch.float32)
        enc, dec = [], []
        for _ in range(7):
            t0 = time.perf_counter()
            payload, meta = codec.encode(x)
            t1 = time.perf_counter()
            codec.decode(payload, meta, shape, torch.float32)
            dec.append(time.perf_counter() - t1)
            enc.append(t1 - t0)
        out[name] = {
            "encode_ms": round(1e3 * statistics.median(enc), 2),
            "decode_ms": round(1e3 * statistics.median(dec), 2),
            "bytes_per_element": round(payload.numel() / x.numel(), 4),
        }
    return out


def summarize(rate_mbit: float, counts: list[dict], tokens_per_mb: int, numel: int) -> list[dict]:
    rows, base = [], None
    for c in counts:
        mbs = c["microbatches"] / c["seconds"]
        wire_per_mb = (c["act_wire"] + c["grad_wire"]) / max(1, c["microbatches"])
        predicted = rate_mbit * 1e6 / 8 / wire_per_mb * tokens_per_mb if c["microbatches"] else 0.0
        tokens_per_s = mbs * tokens_per_mb
        base = tokens_per_s if c["codec"] == "none" else base
        rows.append({
            "codec": c["codec"],
            "microbatches": c["microbatches"],
            "microbatches_per_s": round(mbs, 2),
            "tokens_per_s": round(tokens_per_s),
            "bytes_per_token": round(wire_per_mb / tokens_per_mb, 1),
            "bytes_per_element": round(c["act_wire"] / max(1, c["microbatches"]) / numel, 4),
            "speedup_vs_none": round(tokens_per_s / base, 2) if base else None,
            "link_bound_tokens_per_s": round(predicted),
            "of_link_bound": round(tokens_per_s / predicted, 2) if predicted else None,
            "median_latency_s": round(c["median_latency_s"], 3),
        })  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--role", choices=["driver", "relay"], help=argparse.SUPPRESS)
    parser.add_argument("--listen", help=argparse.SUPPRESS)
    parser.add_argument("--downstream", help=argparse.SUPPRESS)
    parser.add_argument("--stages", type=int, default=4, help="stage peers, each in its own namespace (>= 2)")
    parser.add_argument("--rates", default="50,100", help="link rates to measure, Mbit/s, comma-separated")
    parser.add_argument("--codecs", default="none,fp16,int8,nf4", help="codecs, comma-separated")
    parser.add_argument("--shape", default="8,128,256", help="activation shape B,T,C (B x T tokens)")
    parser.add_argument("--window", type=int, default=16, help="microbatches in flight")
    parser.add_argument(
        "--duration-s", type=float, default=8.0, help="measured seconds per codec and rate, at least"
    )
    parser.add_argument(
        "--min-microbatches", type=int, default=30, help="measured microbatches per codec and rate, at least"
    )
    parser.add_argument("--queue-ms", type=float, default=400.0, help="tbf queue depth of each link, in ms")
    parser.add_argument("--json-out", help="also write the JSON document to this file")
    parser.add_argument(
        "--peers",
        choices=["relay", "swarm"],
        default="relay",
        help="relay: transport-only stages; swarm: real swarmtrain peers (benchmarks/wan_swarm.py)",
    )
    parser.add_argument(
        "--steps", type=int, default=8, help="--peers swarm: optimizer steps per codec and rate"
    )
    parser.add_argument(
        "--streams",
        default="per-frame,reuse",
        help="--peers swarm: the peers' stream use, comma-separated, each run side by side: 'reuse' "
        "(idle streams carry the next call), 'per-frame' (a stream per call, the transport before) and "
        "'paced' (reuse, frames paced to the link's rate: join/train --uplink-mbit)",
    )
    parser.add_argument(
        "--microbatches-per-step",
        type=int,
        default=8,
        help="--peers swarm: microbatches a step (and in flight); more shrink the pipeline's fill and drain",
    )
    args = parser.parse_args()
    if args.role:
        return peer_main(args)

    args.codecs = args.codecs.split(",")
    args.streams = args.streams.split(",")
    if set(args.streams) - set(STREAMS):
        parser.error(f"--streams: each must be one of {', '.join(STREAMS)}, got {args.streams}")
    for name in args.codecs:
        try:
            get_codec(name)
        except ValueError as e:
            parser.error(f"--codecs: {e}")
    shape = tuple(int(d) for d in args.shape.split(","))
    if len(shape) != 3 or args.stages < 2:
        parser.error("--shape must be B,T,C and --stages at least 2")
    tokens_per_mb, numel = shape[0] * shape[1], shape[0] * shape[1] * shape[2]
    rates = [float(r) for r in args.rates.split(",")]
    torch.set_num_threads(1)  # as each peer runs
    codec_cpu = _codec_cpu(args.codecs, shape)  # before the peers start, so they do not compete
    # SIGTERM and SIGINT (even where a shell started us with it ignored) unwind the stack, so
    # the `with` below removes the namespaces, links and peers whichever way the run ends.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        check_prerequisites()
        stale = remove_stale()
        if args.peers == "swarm":
            return _print_report(run_swarm(args, rates) | {"removed_stale_namespaces": stale}, args.json_out)
        with WanNet(WanConfig(num_peers=args.stages, rate_mbit=rates[0], queue_ms=args.queue_ms)) as net:
            measured = []
            for rate in rates:
                print(f"measuring {rate:g} Mbit/s ...", file=sys.stderr, flush=True)
                counts = measure_rate(net, rate, args)
                measured.append({"rate_mbit": rate, "qdisc": net.qdiscs()[0],
                                 "results": summarize(rate, counts, tokens_per_mb, numel)})  # fmt: skip
    except NetnsError as e:
        print(f"error: cannot emulate a WAN here: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted; namespaces, links and peers removed", file=sys.stderr)
        raise SystemExit(130) from None
    report = {
        "benchmark": "wan",
        "topology": f"{args.stages} namespaces on a bridge, tbf on each peer's uplink and downlink",
        "transport": "asyncio TCP, swarmtrain frames; middle stages decode and re-encode every frame",
        "stages": args.stages,
        "activation_shape": list(shape),
        "tokens_per_microbatch": tokens_per_mb,
        "window": args.window,
        "duration_s": args.duration_s,
        "min_microbatches": args.min_microbatches,
        "queue_ms": args.queue_ms,
        "removed_stale_namespaces": stale,
        "codec_cpu": codec_cpu,
        "rates": measured,
        "host": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()},
    }
    _print_report(report, args.json_out)


def _print_report(report: dict, json_out: str | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if json_out:
        Path(json_out).write_text(text + "\n")


if __name__ == "__main__":
    main()
