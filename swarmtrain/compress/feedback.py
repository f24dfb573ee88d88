"""Encoding one tensor, and error feedback: what a lossy codec drops now is sent later.

With error feedback a sender keeps, per tensor stream, the residual r of what it meant to
send but did not: it sends codec(t + r) and keeps r <- t + r - decoded. Over many sends the
sum of what arrived trails the sum of what was given by exactly the current residual (at most
one quantization step per value), instead of accumulating every send's rounding error.

    feedback = ErrorFeedback()
    frame = Frame(..., tensors={"grad": feedback.compress("grad", g, "int8")})
"""

from __future__ import annotations

import torch

from swarmtrain.compress.codecs import Int8Codec, get_codec
from swarmtrain.wire.codec import Codec, Encoded


def _codec(codec: str | Codec) -> Codec:
    return get_codec(codec) if isinstance(codec, str) else codec


def encode_tensor(t: torch.Tensor, codec: str | Codec) -> Encoded:
    """`t` encoded with `codec` (not 'none'), payload on t's device; ValueError for inf/NaN."""
    c = _codec(codec)
    if c.name == "none":
        raise ValueError("codec 'none' sends tensors as they are: put the tensor itself in the frame")
    payload, meta = c.encode(t.detach())
    return Encoded(codec=c.name, payload=payload, meta=meta, shape=tuple(t.shape), dtype=t.dtype)


def decode_encoded(enc: Encoded) -> torch.Tensor:
    """The tensor a receiver decodes from `enc` (on the payload's device; CPU is what frames use)."""
    return get_codec(enc.codec).decode(enc.payload, enc.meta, enc.shape, enc.dtype)


def roundtrip(t: torch.Tensor, codec: str | Codec) -> torch.Tensor:
    """decode(encode(t)) on t's device: what the far side of a link sees ('none': t itself)."""
    c = _codec(codec)
    if c.name == "none":
        return t
    return decode_encoded(encode_tensor(t, c))


class ErrorFeedback:
    """Error-feedback residuals of lossy codecs, one fp32 tensor per key (on the tensor's device).

    A key names one stream of tensors: a stage boundary's activation gradients, or one
    parameter's gradient sums. A key whose shape or device changes starts over from zero (a
    smaller last microbatch, a peer that moved to another stage). Not thread-safe.
    """

    def __init__(self):
        self.residuals: dict[str, torch.Tensor] = {}

    def compress(self, key: str, t: torch.Tensor, codec: str | Codec) -> torch.Tensor | Encoded:
        """What to put in Frame.tensors to send `t` with `codec` plus this key's residual.

        Returns `t` itself for codec 'none' (nothing is lost, the residual is untouched),
        else an Encoded of t + residual, and updates the residual to what the receiver will
        miss. ValueError for inf/NaN in `t`, before the residual changes.
        """
        c = _codec(codec)
        if c.name == "none":
            return t
        t = t.detach()
        r = self.residuals.get(key)
        if r is None or r.shape != t.shape or r.device != t.device:
            r = self.residuals[key] = torch.zeros(t.shape, dtype=torch.float32, device=t.device)
        if isinstance(c, Int8Codec) and t.dtype == torch.float32:
            payload, meta = c.encode_feedback(t.contiguous(), r)  # one fused kernel pass
        else:
            v = t.float() + r
            payload, meta = c.encode(v)
            r.copy_(v - c.decode(payload, meta, tuple(t.shape), t.dtype).float())
        return Encoded(codec=c.name, payload=payload, meta=meta, shape=tuple(t.shape), dtype=t.dtype)

    def residual_norm(self) -> float:
        """L2 norm of every residual together: what the receivers are still owed."""
        return float(sum(float(r.float().pow(2).sum()) for r in self.residuals.values()) ** 0.5)

    def reset(self) -> None:
        """Forget every residual (e.g. after the receivers' state was replaced by a download)."""
        self.residuals.clear()
