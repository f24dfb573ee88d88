"""Tensor compression for frames and for hivemind averaging (DESIGN.md section 7).

Importing this package registers the codecs with the frame layer (swarmtrain.wire.codec).
What the stage peer calls:
- forward activations: `Frame(..., tensors={"x": h}, codecs={"x": name})`;
- backward gradients with error feedback: `tensors={"grad": feedback.compress(key, g, name)}`;
- replica exchange: `compress_for_exchange(grads, name, feedback)`;
- 'auto' made concrete per link: `resolve_codec(name, bandwidth_bytes_per_s, tensor_bytes)`.
"""

from swarmtrain.compress.codecs import Codec, Meta, codec_names, get_codec
from swarmtrain.compress.exchange import compress_for_exchange
from swarmtrain.compress.feedback import ErrorFeedback, decode_encoded, encode_tensor, roundtrip
from swarmtrain.compress.policy import choose_codec, resolve_codec

__all__ = [
    "Codec",
    "ErrorFeedback",
    "Meta",
    "choose_codec",
    "codec_names",
    "compress_for_exchange",
    "decode_encoded",
    "encode_tensor",
    "get_codec",
    "resolve_codec",
    "roundtrip",
]
