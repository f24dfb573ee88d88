"""Compressed gradient exchange between the replicas of a stage, still exact.

Replicas send each other their gradient sums and add them all up in sorted peer order
(swarmtrain.train.averaging.group_sum), so they stay bit-identical. With a lossy codec that
holds only if every replica adds the very same values for every peer, its own included: a
replica must not add its exact local gradients while the others add a decoded copy. So each
replica adds decode(encode(local + residual)), decoded on the CPU by the same function that
decodes a received frame, and keeps what the codec dropped as its error-feedback residual.

    sent, mine = compress_for_exchange(runner.grads(), manifest.compression.codec("averaging", stage), feedback)
    frame = Frame(kind="grads", ..., tensors=sent)          # to every other replica
    total = group_sum(my_id, mine, received)                # received: decoded frame tensors
"""

from __future__ import annotations

import torch

from swarmtrain.compress.feedback import ErrorFeedback, decode_encoded, encode_tensor
from swarmtrain.wire.codec import Encoded


def compress_for_exchange(
    local_grads: list[torch.Tensor], codec: str, residuals: ErrorFeedback | None = None
) -> tuple[dict[str, torch.Tensor | Encoded], list[torch.Tensor]]:
    """What this replica sends its group, and what it must add in place of its own gradients.

    `codec` is a codec name ('auto' made concrete first with resolve_codec). Replicas may use
    different codecs: each frame names its own, and the sums stay identical as long as every
    replica adds decoded_local for itself.

    Returns (tensors, decoded_local):
    - tensors: for a 'grads' frame, named "0".."N-1" in `local_grads` order; Encoded
      payloads in CPU memory, or CPU copies of the gradients for codec 'none';
    - decoded_local: CPU tensors (each of its gradient's shape and dtype), bit for bit what
      every other replica decodes from `tensors` (for 'none': the copies themselves).

    With `residuals` (error feedback, keyed "0".."N-1") each gradient is sent with what
    earlier exchanges dropped, and the residuals are updated in place; residuals are kept on
    each gradient's device. ValueError for inf/NaN in a gradient (nothing is updated for it).
    """
    tensors: dict[str, torch.Tensor | Encoded] = {}
    decoded: list[torch.Tensor] = []
    for i, g in enumerate(local_grads):
        key = str(i)
        if codec == "none":
            copy = g.detach().cpu().clone()
            tensors[key] = copy
            decoded.append(copy)
            continue
        enc = residuals.compress(key, g, codec) if residuals is not None else encode_tensor(g, codec)
        assert isinstance(enc, Encoded)
        enc = enc.cpu()
        tensors[key] = enc
        decoded.append(decode_encoded(enc))  # the CPU decode read_frame runs on every receiver
    return tensors, decoded
