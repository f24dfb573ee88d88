"""The flat exception tree: `SwarmError` and a few children.

Every error a user can hit says what was wrong and what to do about it; the CLI prints
`str(error)` as one line and exits non-zero, without a traceback.
"""


class SwarmError(Exception):
    """Base of every error swarmtrain raises on purpose."""


class ConfigError(SwarmError, ValueError):
    """A flag, a config field or a manifest value is invalid."""


class UnknownModelError(ConfigError):
    """A model builder name or import path does not resolve to a builder."""


class BadFrameError(SwarmError):
    """A frame on the wire is malformed, oversized, or holds a tensor we refuse to use."""


class RemoteError(SwarmError):
    """A peer answered a request with an error reply.

    `retryable` is False when the peer judged the request itself bad (it would fail again
    anywhere), True when the failure was the peer's own (overloaded, shutting down, a
    downstream hop failed).
    """

    def __init__(self, message: str, *, peer: str = "", retryable: bool = True):
        super().__init__(message)
        self.peer = peer
        self.retryable = retryable


class PeerUnreachableError(SwarmError):
    """No answer from a peer within the call's timeout, or the connection broke."""


class RunNotFoundError(SwarmError):
    """No manifest for the requested run id could be found in the swarm."""
