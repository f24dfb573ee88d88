"""Codecs where the tensors live: a stage's outputs and input gradients stay on its device (a
codec compresses them there and only the compressed bytes are copied to the host), and a peer
decodes compressed tensors of the frames it reads on its device. Without a GPU here, the
kernels' Triton backend under TRITON_INTERPRET=1 stands in for the GPU's (`kernels._backend`
is the seam), and the checks that a frame's bytes get are the same as on the host."""

from __future__ import annotations

import asyncio

import pytest
import torch

import swarmtrain.compress  # noqa: F401  (registers the codecs)
from swarmtrain import kernels
from swarmtrain.errors import BadFrameError
from swarmtrain.kernels import quant_ref, quant_triton
from swarmtrain.model import build_stage
from swarmtrain.train.stage_runner import StageRunner
from swarmtrain.wire.frames import Frame, encode_frame, read_frame
from swarmtrain.wire.records import OptimizerConfig

CONFIG = {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, "vocab_size": 256}


@pytest.fixture
def triton_backend(monkeypatch):
    """Every tensor goes to the Triton kernels (interpreted on the CPU), as a GPU's would."""
    used = []

    def backend(t):
        used.append(t.device)
        return quant_triton

    monkeypatch.setattr(kernels, "_backend", backend)
    return used


def read(frame: Frame, **kw) -> Frame:
    data = b"".join(bytes(b) for b in encode_frame(frame))

    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await read_frame(reader, **kw)

    return asyncio.run(go())


def runner(stage: int) -> StageRunner:
    module = build_stage("tiny-gpt", CONFIG, stage, stage + 1, num_blocks=2, seed=0, device="cpu")
    return StageRunner(module, OptimizerConfig(lr=1e-3), microbatch_size=2)


def test_a_stage_returns_its_output_and_input_gradient_without_copying_them_to_the_host(monkeypatch):
    first, last = runner(0), runner(1)
    x = torch.randint(0, 256, (2, 16))
    copies = []
    original = torch.Tensor.cpu
    monkeypatch.setattr(
        torch.Tensor, "cpu", lambda t, *a, **k: copies.append(t.shape) or original(t, *a, **k)
    )
    out = first.forward("mb", x)
    loss, grad = last.forward_loss_backward("mb", out, {"targets": x}, 0.5)
    grad_in = first.backward("mb", grad)
    assert copies == []  # the host copy is the frame's, of the compressed bytes
    assert out.device == first.device and grad.device == last.device and grad_in is None
    assert out.shape == (2, 16, 32) and grad.shape == out.shape and loss > 0


@pytest.mark.parametrize("codec", ["int8", "nf4"])
def test_frames_encode_with_the_device_kernels_and_decode_on_the_readers_device(triton_backend, codec):
    x = torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(0))
    frame = Frame(kind="forward", run_id="r", mb_id="m", tensors={"x": x}, codecs={"x": codec})
    got = read(frame, device=torch.device("cpu"))
    assert triton_backend  # encode and decode ran the device kernels
    assert all(d == x.device for d in triton_backend)
    # what the host's reference kernels make of the same tensor: the same bytes, the same values
    triton_backend.clear()
    kernels_backend = kernels._backend
    try:
        kernels._backend = lambda t: quant_ref
        expected = read(frame)
    finally:
        kernels._backend = kernels_backend
    torch.testing.assert_close(got.tensors["x"], expected.tensors["x"], rtol=0, atol=1e-6)
    assert got.wire_nbytes == expected.wire_nbytes < x.numel() * 4 / 3


def test_a_frame_decoded_on_the_device_is_checked_as_on_the_host(triton_backend):
    x = torch.randn(4, 256)
    frame = Frame(kind="forward", run_id="r", mb_id="m", tensors={"x": x}, codecs={"x": "int8"})
    data = bytearray(b"".join(bytes(b) for b in encode_frame(frame)))
    # the payload is one fp32 scale per 256-value block, then the 1024 int8 values
    scales = len(data) - x.numel() - 4 * 4
    data[scales : scales + 4] = torch.tensor([float("nan")]).numpy().tobytes()

    async def go():
        reader = asyncio.StreamReader()
        reader.feed_data(bytes(data))
        reader.feed_eof()
        return await read_frame(reader, device=torch.device("cpu"))

    with pytest.raises(BadFrameError, match="'x'"):
        asyncio.run(go())
