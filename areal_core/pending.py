"""A call that runs elsewhere (an event loop, a thread of its own) and is waited for later, with a timeout.

One type for every place the project starts work it collects afterwards: the
rollout controller's calls on its event loop (``update_weights(..., wait=False)``,
``evaluate``) and the trainer's weight export beside training (a daemon thread).
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable

from areal_core.clock import REAL_CLOCK, Clock


class PendingCall:
    """:meth:`result` waits for the call, at most ``timeout_s``, and then names what was waited for.

    ``waited_for`` completes "waited N s for ...": "the rollout controller to
    pause generation". A TimeoutError the call itself raised (an engine's own,
    naming its server and its wait) goes out unchanged: since Python 3.11
    ``concurrent.futures.TimeoutError`` is the builtin, so it cannot be told
    from the wait's own by its type alone.
    """

    def __init__(self, future: concurrent.futures.Future, timeout_s: float, waited_for: str,
                 clock: Clock = REAL_CLOCK) -> None:
        self._future, self._timeout_s, self.waited_for = future, timeout_s, waited_for
        self._clock = clock  # a virtual clock counts the wait as blocked (the timeout stays wall-clock)

    @classmethod
    def on_thread(cls, fn: Callable[[], Any], timeout_s: float, waited_for: str) -> PendingCall:
        """Run ``fn`` on a daemon thread of its own: unlike ``ThreadPoolExecutor``'s workers, a run that fails
        meanwhile is not held at exit by a call still waiting on an inference server (those carry their own
        timeouts)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()

        def run() -> None:
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever waits in result()
                future.set_exception(exc)

        threading.Thread(target=run, name="areal-pending-call", daemon=True).start()
        return cls(future, timeout_s, waited_for)

    def done(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> Any:
        """The call's result (or its exception), waiting at most ``timeout`` seconds (default: the timeout it
        was made with), as ``concurrent.futures.Future.result`` does."""
        timeout_s = self._timeout_s if timeout is None else timeout
        try:
            return self._clock.wait_future(self._future, timeout_s)
        except TimeoutError:
            if self._future.done():  # the call's own TimeoutError: keep its message
                raise
            self._future.cancel()  # a call on an event loop that has not started yet never starts
            raise TimeoutError(f"waited {timeout_s:.0f} s for {self.waited_for}") from None
