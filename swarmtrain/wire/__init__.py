from swarmtrain.wire.codec import Encoded
from swarmtrain.wire.frames import Frame, error_frame, read_frame, write_frame
from swarmtrain.wire.records import (
    BatchConfig,
    CompressionConfig,
    OptimizerConfig,
    PeerRecord,
    RunManifest,
    even_split,
)

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
