"""Our blockwise int8 codec as a hivemind `CompressionBase`, for `DecentralizedAverager(compression=...)`.

hivemind decodes every received part through a global table keyed by the protobuf
`CompressionType` (and all-reduce replies are re-encoded through the same table), so a
custom codec only works once every peer has called `install_hivemind_codec()`, which puts
it in the BLOCKWISE_8BIT slot. Our buffers start with MAGIC; buffers without it are handed
to hivemind's own (bitsandbytes) BlockwiseQuantization, so frames from stock peers still decode.

Buffer: MAGIC (4 bytes) | block_size (int32) | our int8 payload (absmax fp32s, then int8 values).
"""

import numpy as np
import torch
from hivemind.compression.base import CompressionBase, CompressionInfo
from hivemind.compression.quantization import BlockwiseQuantization
from hivemind.proto import runtime_pb2

from swarmtrain.compress.codecs import DTYPES_BY_NAME, Int8Codec
from swarmtrain.errors import BadFrameError

MAGIC = b"STQ8"
_HEADER_BYTES = len(MAGIC) + 4


class HivemindCodec(CompressionBase):
    """Blockwise absmax int8 through hivemind's CompressionBase interface (CPU tensors)."""

    compression_type = runtime_pb2.CompressionType.BLOCKWISE_8BIT

    def __init__(self, block_size: int = Int8Codec.block_size):
        self.codec = Int8Codec(block_size=block_size)
        self._stock = BlockwiseQuantization()

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> runtime_pb2.Tensor:
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        if dtype_name not in DTYPES_BY_NAME:
            raise ValueError(
                f"{type(self).__name__} compresses float32/float16/bfloat16 tensors, got {tensor.dtype}"
            )
        payload, _ = self.codec.encode(tensor.detach().cpu())
        header = MAGIC + np.int32(self.codec.block_size).tobytes()
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=header + payload.numpy().tobytes(),
            size=tensor.shape,
            dtype=dtype_name,
            requires_grad=tensor.requires_grad,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        buffer = serialized_tensor.buffer
        if not buffer.startswith(MAGIC):
            return self._stock.extract(serialized_tensor)
        dtype = DTYPES_BY_NAME.get(serialized_tensor.dtype)
        if dtype is None or len(buffer) < _HEADER_BYTES:
            raise BadFrameError(
                f"int8 hivemind part: bad dtype {serialized_tensor.dtype!r} or truncated header"
            )
        block_size = int(np.frombuffer(buffer, dtype=np.int32, count=1, offset=len(MAGIC))[0])
        codec = self.codec if block_size == self.codec.block_size else _codec_for(block_size)
        shape = tuple(serialized_tensor.size)
        body = bytearray(buffer[_HEADER_BYTES:])
        payload = torch.frombuffer(body, dtype=torch.uint8) if body else torch.empty(0, dtype=torch.uint8)
        meta = {"codec": codec.name, "numel": int(np.prod(shape, dtype=np.int64)), "block_size": block_size}
        return codec.decode(payload, meta, shape, dtype).requires_grad_(serialized_tensor.requires_grad)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        bits = torch.finfo(info.descriptor.dtype).bits
        return (8 + 32 / self.codec.block_size) / bits


def _codec_for(block_size: int) -> Int8Codec:
    try:
        return Int8Codec(block_size=block_size)
    except ValueError as e:
        raise BadFrameError(f"int8 hivemind part: {e}") from None


def install_hivemind_codec(block_size: int = Int8Codec.block_size) -> HivemindCodec:
    """Register HivemindCodec as the decoder for BLOCKWISE_8BIT parts in this process; returns it.

    Every peer of an averaging group must call this before averaging with it (see module doc).
    """
    from hivemind.compression import serialization

    codec = HivemindCodec(block_size)
    serialization._BASE_COMPRESSION_TYPES["BLOCKWISE_8BIT"] = codec
    return codec
