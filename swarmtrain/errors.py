"""The flat exception tree: `SwarmError` and a few children.

Every error a user can hit says what was wrong and what to do about it; the CLI prints
`str(error)` as one line and exits non-zero, without a traceback.
"""

from enum import StrEnum


class SwarmError(Exception):
    """Base of every error swarmtrain raises on purpose."""


class ConfigError(SwarmError, ValueError):
    """A flag, a config field or a manifest value is invalid."""


class UnknownModelError(ConfigError):
    """A model builder name or import path does not resolve to a builder."""


class BadFrameError(SwarmError):
    """A frame on the wire is malformed, oversized, or holds a tensor we refuse to use."""


class Cause(StrEnum):
    """Why a peer refused or failed a request: error replies carry one, and callers decide on
    it (replay elsewhere, drop the microbatch, fail the step) without reading message text."""

    DRAINING = "draining"
    """The peer is leaving its stage; another replica will do."""
    WRONG_STEP = "wrong_step"
    """The peer is at another optimizer step (it fell behind, or the caller did)."""
    WRONG_STAGE = "wrong_stage"
    """The peer serves another stage (it moved; routing lags by a heartbeat)."""
    WRONG_RUN = "wrong_run"
    """The request names another run."""
    BAD_FRAME = "bad_frame"
    """The request is malformed: it would fail on any peer."""
    REFUSED = "refused"
    """The model refused this microbatch (a non-finite loss or gradient): it would fail anywhere."""
    UNREACHABLE = "unreachable"
    """A peer further down the pipeline did not answer in time, or at all."""
    OWN_FAILURE = "own_failure"
    """The peer's own failure (an internal error, state it lacks); another try may succeed."""
    BANNED = "banned"
    """The peer bans the caller after repeated bad frames."""
    CLAIMED = "claimed"
    """Another trainer holds the commit of this step (`swarmtrain.train.commit` claims)."""
    VERSION_GONE = "version_gone"
    """The peer no longer holds the policy version asked for (it keeps only the newest few:
    `swarmtrain.train.versions`); a replica further behind may, else ask for a newer one."""
    UNAUTHORIZED = "unauthorized"
    """The run does not authorize the caller to do this (not its trainer, not a replica of
    the stage, not the microbatch's owner, or no proof of the private swarm's key)."""

    @property
    def retryable(self) -> bool:
        """Whether another replica (or a later try) may succeed where this one failed."""
        return self not in _FINAL


_FINAL = frozenset(
    {Cause.WRONG_RUN, Cause.BAD_FRAME, Cause.REFUSED, Cause.BANNED, Cause.UNAUTHORIZED, Cause.CLAIMED}
)


class RemoteError(SwarmError):
    """A peer answered a request with an error reply, or a protocol step failed with a cause.

    `cause` says why (`Cause`). `retryable` is False when the request itself is bad (it would
    fail again anywhere), True when the failure was the peer's own (overloaded, shutting down,
    a downstream hop failed); it defaults to what the cause implies.
    """

    def __init__(
        self,
        message: str,
        *,
        cause: Cause = Cause.OWN_FAILURE,
        peer: str = "",
        retryable: bool | None = None,
    ):
        super().__init__(message)
        self.cause = Cause(cause)
        self.peer = peer
        self.retryable = self.cause.retryable if retryable is None else retryable


class PeerUnreachableError(SwarmError):
    """No answer from a peer within the call's timeout (`timed_out`), or the connection broke."""

    def __init__(self, message: str, *, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class RunNotFoundError(SwarmError):
    """No manifest for the requested run id could be found in the swarm."""
