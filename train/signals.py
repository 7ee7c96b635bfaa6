"""Stop signals: Ctrl-C (SIGINT) or a scheduler's SIGTERM lets the current step finish, then the loop saves
a checkpoint and stops with a resume hint. A second signal acts as usual (aborts at once)."""
import signal
import sys
import threading


class StopSignal:
    """Context manager over the training loop; `received` is the first signal's name (e.g. "SIGTERM") or
    None. Handlers are installed only in the main thread (Python allows no other) and restored on exit."""

    def __init__(self):
        self.received = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signal.Signals(signum).name
        self._restore()  # a second signal aborts as it would without us
        print(f"\n{self.received}: finishing this step, then saving a checkpoint (send it again to abort)",
              file=sys.stderr, flush=True)

    def _restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __exit__(self, *exc):
        self._restore()
        return False
