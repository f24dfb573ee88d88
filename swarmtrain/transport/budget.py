"""How many bytes each peer's requests hold in memory on this peer.

A request's bytes are charged as they arrive (its header, then each payload chunk; see
`read_frame`'s `charge`) and released when the request has been answered, so a header that
promises a large payload commits nothing until the bytes come. A peer whose requests would
hold more than the limit at once is refused: it cannot make us hold more than the limit plus
one chunk, however many streams it opens.
"""

from __future__ import annotations

from swarmtrain.errors import BadFrameError


class PeerBudget:
    """Bytes held per peer, against one limit per peer."""

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self._held: dict[str, int] = {}
        self.total_bytes = 0
        """Bytes all peers' requests hold now."""
        self.peak_bytes = 0
        """Most bytes all peers' requests held at once."""

    def held(self, peer: str) -> int:
        return self._held.get(peer, 0)

    def hold(self, peer: str) -> Hold:
        """A new request's account: charge it as its bytes arrive, release it when answered."""
        return Hold(self, peer)

    def _charge(self, peer: str, nbytes: int) -> None:
        after = self._held.get(peer, 0) + nbytes
        if after > self.limit_bytes:
            raise BadFrameError(
                f"your requests in flight here would hold {after} bytes, over the limit of "
                f"{self.limit_bytes} bytes per peer: send fewer large frames at once"
            )
        self._held[peer] = after
        self.total_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.total_bytes)

    def _release(self, peer: str, nbytes: int) -> None:
        left = self._held[peer] - nbytes
        assert left >= 0, f"released {nbytes} bytes of peer {peer[-8:]}, which held {self._held[peer]}"
        if left:
            self._held[peer] = left
        else:
            del self._held[peer]
        self.total_bytes -= nbytes


class Hold:
    """One request's bytes in a `PeerBudget`; a context manager that releases them on exit."""

    def __init__(self, budget: PeerBudget, peer: str):
        self.budget = budget
        self.peer = peer
        self.nbytes = 0
        """Bytes charged so far (0: not even a frame's prefix arrived)."""

    def charge(self, nbytes: int) -> None:
        """Count `nbytes` more; BadFrameError (nothing counted) if the peer would go over its limit."""
        self.budget._charge(self.peer, nbytes)
        self.nbytes += nbytes

    def release(self) -> None:
        if self.nbytes:
            self.budget._release(self.peer, self.nbytes)
            self.nbytes = 0

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *_exc) -> None:
        self.release()
