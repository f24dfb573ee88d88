"""benchmarks/gpu_check.py: it refuses clearly without CUDA, and its checks' code runs (on the
CPU here) so that a machine with a GPU runs it whole the first time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_check

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU: the check would run")
def test_without_cuda_it_refuses_with_one_line_and_exit_code_2():
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith("error: no CUDA GPU here: torch"), proc.stderr
    assert "make test" in proc.stderr


def test_a_device_that_is_no_cuda_gpu_is_refused():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "--device 'cpu': this check is for a CUDA GPU" in proc.stderr


def test_the_codec_check_encodes_and_decodes_where_the_tensor_lives():
    report = gpu_check.check_codecs("cpu", (2, 16, 64))
    assert set(report["codecs"]) == {"fp16", "int8", "nf4"}
    for name, row in report["codecs"].items():
        assert row["encode_gb_per_s"] > 0 and row["decode_gb_per_s"] > 0, name
        assert row["relative_error"] < 0.15, (name, row)
    assert report["codecs"]["int8"]["bytes_per_element"] < 1.1
    assert isinstance(report["meets_aim"], bool)


def test_the_frames_check_round_trips_a_frame_both_ways():
    report = gpu_check.check_frames("cpu", (2, 16, 64), busy_matmuls=1)
    for way in ("write_frame", "blocking"):
        assert report[way]["int8_relative_error"] < 0.02
        assert report[way]["loop_stall_ms"] > 0


@pytest.mark.swarm
def test_the_swarm_check_trains_two_peers_with_int8_on_the_wire():
    model = {"n_layer": 2, "d_model": 64, "n_head": 2, "seq_len": 32}
    report = gpu_check.check_swarm("cpu", 4, model=model, microbatch_size=2)
    assert report["steps"] == 4 and report["tokens_per_s"] > 0
    # int8 on activations and gradients (what else the peers send, such as replies' metadata,
    # weighs on so small a model)
    assert report["compression_ratio"] > 1.5, report
    assert report["loss_first"] > 0 and report["loss_last"] > 0
    assert [s["stage"] for s in report["stages"]] == [0, 1]
    assert all(s["memory_used_bytes"] > 0 for s in report["stages"])
