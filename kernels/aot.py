"""Compile every Triton kernel for real NVIDIA GPUs, without one: a check the interpreter cannot make.

Under TRITON_INTERPRET=1 the kernels run as numpy, which accepts code that would not compile
for a GPU (a cast the backend lacks, a tile too large for registers). This module compiles each
kernel, in every constexpr variant the launchers use, through Triton's real pipeline (TTIR,
TTGIR, LLVM, PTX, then ptxas, all bundled with triton) for a GPU architecture, and reads the
register use and spills of each with `ptxas -v`, and the widest global load and store in its
PTX. Spilled registers go to local memory, and scalar accesses where 16-byte vector ones could
be issue 4-16x the memory instructions: either makes a bandwidth-bound kernel slow on any GPU.
Pointers and sizes are compiled as 16-aligned, as Triton's JIT specializes them at launch for
tensors from torch's allocator and sizes that are multiples of 16.

    python -m swarmtrain.kernels.aot            # sm_80 and sm_90, one JSON object per kernel variant
    python -m swarmtrain.kernels.aot --arch 90

It must run without TRITON_INTERPRET=1 (the interpreter replaces the compiler), so tests run it
as a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SCALE_TYPES = {False: "*fp32", True: "*fp16"}


@dataclass(frozen=True)
class Variant:
    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, int | bool]

    @property
    def label(self) -> str:
        flags = ",".join(f"{k}={v}" for k, v in self.constexprs.items())
        types = ",".join(t for t in self.signature.values() if t.startswith("*"))
        return f"{self.kernel}[{flags}]({types})"


def variants() -> Iterator[Variant]:
    """Each kernel with the constexprs and pointer types the launchers in quant_triton use on a GPU."""
    from . import quant_triton as q

    def rows(block: int) -> int:
        return max(1, q.TILE_VALUES_GPU // block)

    ints = {"n": "i32", "n_blocks": "i32"}
    for block in (64, 256, 4096):
        for feedback in (False, True):
            for stochastic in (False, True):
                for fp16 in (False, True):
                    yield Variant(
                        "_int8_quant_kernel",
                        {"x_ptr": "*bf16" if not feedback else "*fp32", "r_ptr": "*fp32", "q_ptr": "*i8",
                         "absmax_ptr": SCALE_TYPES[fp16], **ints, "seed": "i32"},
                        {"BLOCK": block, "ROWS": rows(block), "STOCHASTIC": stochastic, "FEEDBACK": feedback,
                         "SCALE_FP16": fp16},
                    )  # fmt: skip
        yield Variant(
            "_int8_dequant_kernel",
            {"q_ptr": "*i8", "absmax_ptr": "*fp32", "out_ptr": "*fp16", **ints},
            {"BLOCK": block, "ROWS": rows(block)},
        )
        for stochastic in (False, True):
            for fp16 in (False, True):
                yield Variant(
                    "_4bit_quant_kernel",
                    {"x_ptr": "*fp32", "code_ptr": "*fp32", "mid_ptr": "*fp32", "packed_ptr": "*u8",
                     "absmax_ptr": SCALE_TYPES[fp16], "n": "i32", "n_bytes": "i32", "n_blocks": "i32", "seed": "i32"},
                    {"BLOCK": block, "ROWS": rows(block), "STOCHASTIC": stochastic,
                     "NUM_LEVELS": q.NUM_LEVELS_4BIT, "SCALE_FP16": fp16},
                )  # fmt: skip
        yield Variant(
            "_4bit_dequant_kernel",
            {
                "packed_ptr": "*u8",
                "code_ptr": "*fp32",
                "absmax_ptr": "*fp32",
                "out_ptr": "*bf16",
                "n": "i32",
                "n_bytes": "i32",
                "n_blocks": "i32",
            },
            {"BLOCK": block, "ROWS": rows(block)},
        )


def _resource_usage(ptx: str, arch: int) -> dict[str, int]:
    """ptxas's own account of a kernel: registers, stack frame, spill stores and loads (bytes)."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = get_ptxas(arch).path  # the ptxas triton itself compiles for this architecture with
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernel.ptx"
        path.write_text(ptx)
        arch_name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        done = subprocess.run(
            [str(tool), f"-arch={arch_name}", "-v", str(path), "-o", str(Path(d) / "kernel.cubin")],
            capture_output=True,
            text=True,
            check=True,
        )
    log = done.stdout + done.stderr
    figures = {
        "registers": r"Used (\d+) registers",
        "stack_bytes": r"(\d+) bytes stack frame",
        "spill_store_bytes": r"(\d+) bytes spill stores",
        "spill_load_bytes": r"(\d+) bytes spill loads",
    }
    found = {}
    for name, pattern in figures.items():
        match = re.search(pattern, log)
        if match is None:
            raise RuntimeError(f"ptxas -v printed no {name}: {log!r}")
        found[name] = int(match.group(1))
    return found


ALIGNED_ARGS = ("n", "n_bytes")
"""Size arguments Triton's JIT sees as multiples of 16 in the usual case (it specializes each
int argument, and each pointer on 16-byte alignment, when it launches): compiled so here too."""


def _widest_access_bytes(ptx: str, op: str) -> int:
    """Bytes moved by the widest `op` ('ld' or 'st') to global memory in `ptx`: 16 for a
    vectorized ld.global.v4.b32, 1 for a lone byte."""
    widths = [
        (int(vec or 1)) * int(bits) // 8
        for vec, bits in re.findall(rf"\b{op}\.global(?:\.[a-z]+)*?(?:\.v(\d))?\.[bufs](\d+)\b", ptx)
    ]
    return max(widths, default=0)


def compile_variant(variant: Variant, arch: int) -> dict:
    """Compile one variant for sm_`arch`: registers, stack and spills (ptxas -v), and the widest
    global load and store in bytes (whether the bulk accesses came out vectorized)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import quant_triton as q

    fn = getattr(q, variant.kernel)
    signature = dict(variant.signature) | {k: "constexpr" for k in variant.constexprs}
    aligned = [n for n, t in variant.signature.items() if t.startswith("*") or n in ALIGNED_ARGS]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(fn=fn, signature=signature, constexprs=dict(variant.constexprs), attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": q.NUM_WARPS})
    ptx = compiled.asm["ptx"]
    return {
        "variant": variant.label,
        "arch": f"sm_{arch}",
        **_resource_usage(ptx, arch),
        "widest_load_bytes": _widest_access_bytes(ptx, "ld"),
        "widest_store_bytes": _widest_access_bytes(ptx, "st"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities, e.g. 80 90"
    )
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: the interpreter replaces the compiler this checks")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    for arch in args.arch:
        for variant in variants():
            print(json.dumps(compile_variant(variant, arch)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
