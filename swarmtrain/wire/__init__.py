"""One vocabulary for the wire and the DHT: typed records (`records`, torch-free) and the
tensor frames peers exchange (`frames`, `codec`).

The frame names below load on first use, so importing the records (as the pure planner does)
does not import torch.
"""

from importlib import import_module

from swarmtrain.wire.records import (
    BatchConfig,
    CompressionConfig,
    OptimizerConfig,
    PeerRecord,
    RunManifest,
    even_split,
)

_LAZY = {
    "Encoded": "swarmtrain.wire.codec",
    "Frame": "swarmtrain.wire.frames",
    "error_frame": "swarmtrain.wire.frames",
    "read_frame": "swarmtrain.wire.frames",
    "write_frame": "swarmtrain.wire.frames",
}

__all__ = [
    "BatchConfig",
    "CompressionConfig",
    "Encoded",
    "Frame",
    "OptimizerConfig",
    "PeerRecord",
    "RunManifest",
    "error_frame",
    "even_split",
    "read_frame",
    "write_frame",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'swarmtrain.wire' has no attribute {name!r}")
