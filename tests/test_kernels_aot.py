"""The Triton kernels compiled for real GPUs (sm_86: RTX 30xx; sm_90: H100/H200) without one.

The interpreter runs the kernels as numpy (test_kernels.py checks their results); this compiles
every variant the launchers use through Triton's whole pipeline down to ptxas, which the
interpreter skips, and holds each to what a bandwidth-bound kernel needs on any GPU: no
register spills, registers to spare for resident warps, and 16-byte vector accesses.
"""

import json
import os
import subprocess
import sys

import pytest

from swarmtrain.kernels.aot import variants

MAX_REGISTERS = 128
"""At most this many a thread (of 255), so that at least two 256-thread programs fit an SM."""
VECTOR_BYTES = 16
"""The widest global access there is (ld/st.global.v4.b32): what the float side of every kernel
must use, for the tensors a GPU peer sends (16-byte aligned, sizes multiples of 16)."""
PACKED_BYTES = 4
"""The narrowest access allowed on the quantized side (8 values a thread: 4 bytes of 4-bit)."""
ARCHS = (86, 90)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[int, list[dict]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    procs = {
        arch: subprocess.Popen(
            [sys.executable, "-m", "swarmtrain.kernels.aot", "--arch", str(arch)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for arch in ARCHS  # one process per architecture, side by side
    }
    results = {}
    for arch, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        results[arch] = [json.loads(line) for line in out.splitlines()]
    return results


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_variant_compiles_within_its_register_budget(compiled, arch):
    rows = compiled[arch]
    assert [r["variant"] for r in rows] == [v.label for v in variants()]  # every one, each once
    assert {r["arch"] for r in rows} == {f"sm_{arch}"}
    for r in rows:
        assert 0 < r["registers"] <= MAX_REGISTERS, r
        assert r["spill_store_bytes"] == r["spill_load_bytes"] == 0, r
        # floats in for the quantizers, out for the dequantizers: 16-byte vectors, not the
        # stride-2 scalar accesses an even/odd split of 4-bit values makes
        floats, packed = ("load", "store") if "_quant_" in r["variant"] else ("store", "load")
        assert r[f"widest_{floats}_bytes"] == VECTOR_BYTES, r
        assert r[f"widest_{packed}_bytes"] >= PACKED_BYTES, r


def test_the_variants_cover_every_kernel_and_flag():
    seen = {}
    for v in variants():
        seen.setdefault(v.kernel, set()).update(f"{k}={x}" for k, x in v.constexprs.items())
    assert set(seen) == {
        "_int8_quant_kernel",
        "_int8_dequant_kernel",
        "_4bit_quant_kernel",
        "_4bit_dequant_kernel",
    }
    for flag in ("STOCHASTIC", "FEEDBACK", "SCALE_FP16"):
        assert {f"{flag}=True", f"{flag}=False"} <= seen["_int8_quant_kernel"]
    assert {"BLOCK=64", "BLOCK=4096"} <= seen["_4bit_quant_kernel"]


def test_the_check_refuses_to_run_under_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "swarmtrain.kernels.aot"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 2 and "unset TRITON_INTERPRET" in proc.stderr
