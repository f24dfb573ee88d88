"""Tensor compression for frames and for hivemind averaging (DESIGN.md section 7)."""

from swarmtrain.compress.codecs import Codec, Meta, codec_names, get_codec

__all__ = ["Codec", "Meta", "codec_names", "get_codec"]
