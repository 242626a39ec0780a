"""Deadlines for the waits a stage cannot bound otherwise: the hub (a server that answers the reachability probe and
then stalls), and a chat template (Jinja code the operator did not write, which may loop for hours).

- `HUB_SECONDS` bounds each hub exchange before any model loads (a config, a tokenizer, a dataset's first record);
  huggingface_hub's own connect and read timeouts (10 s) bound each socket operation, but its retries multiply
  them without limit. `EAGLE3_HUB_TIMEOUT_S` moves it.
- `TEMPLATE_SECONDS` bounds one render of a chat template (a real one takes milliseconds). `EAGLE3_TEMPLATE_TIMEOUT_S`
  moves it.
- `worker_seconds` bounds stage 01's wait on one worker's chunk of conversations (about a second's work; a worker
  stopped or stuck in a lock inherited across the fork never answers). `EAGLE3_WORKER_TIMEOUT_S` moves it.
- A render's alarm interrupts Python code only: one C call (a Jinja expression that builds a 10 GB string) runs to
  its end deaf to it. Renders of what the operator gave therefore run in worker processes that write where their
  render must end (`Watch`): the stage kills a worker still rendering `overdue_grace()` past that point.
A wait past its deadline is one line naming what was waited on: exit 2 for what the operator gave (the hub, a
template), 1 for a worker.
Nothing here imports a heavy library.
"""
import contextlib
import math
import multiprocessing
import os
import queue
import signal
import threading
import time

from . import faults
from .errors import UsageError


MOST = 86400.0  # seconds: a day; past it a limit is no deadline (and setitimer overflows long before 1e12)
LEAST = 0.01
# the environment's knobs of waits: (name, default, least); every stage checks them all at once (check_environment)
KNOBS = {"EAGLE3_HUB_TIMEOUT_S": 30.0, "EAGLE3_TEMPLATE_TIMEOUT_S": 10.0, "EAGLE3_LIFELINE_GRACE": 5.0,
         "EAGLE3_WORKER_TIMEOUT_S": 1800.0}


def _seconds(name, default, zero_ok=False):
    text = os.environ.get(name)
    if text is None or text == "":
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    # a limit below LEAST is no limit anyone meant (1e-300 was taken, and a template then blamed for a slow render)
    if not (math.isfinite(value) and (value >= 0 if zero_ok else value >= LEAST) and value <= MOST):
        least = 0 if zero_ok else LEAST
        raise UsageError(f"{name}={text}: expected a number of seconds, at least {least:g} and at most {MOST:g}")
    return value


def hub_seconds():
    return _seconds("EAGLE3_HUB_TIMEOUT_S", KNOBS["EAGLE3_HUB_TIMEOUT_S"])


def template_seconds():
    return _seconds("EAGLE3_TEMPLATE_TIMEOUT_S", KNOBS["EAGLE3_TEMPLATE_TIMEOUT_S"])


def lifeline_grace():
    return _seconds("EAGLE3_LIFELINE_GRACE", KNOBS["EAGLE3_LIFELINE_GRACE"], zero_ok=True)


def worker_seconds():
    return _seconds("EAGLE3_WORKER_TIMEOUT_S", KNOBS["EAGLE3_WORKER_TIMEOUT_S"])


def check_environment():
    """Every knob checked at a stage's start: a bad one found only when its wait comes (the watchdog's grace, when
    the stage has died) would be found too late."""
    hub_seconds(), template_seconds(), lifeline_grace(), worker_seconds()


def call(fn, seconds, what, *args, **kwargs):
    """fn(*args, **kwargs), or a UsageError naming `what` once `seconds` pass without an answer. The call runs in a
    daemon thread: a stalled socket cannot be interrupted, but the stage no longer waits for it, and the thread dies
    with the process. Exceptions of fn are raised here, as they are."""
    box = {}

    def target():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = e
    t = threading.Thread(target=target, daemon=True, name=f"deadline: {what}")
    t.start()
    t.join(seconds)
    if t.is_alive():
        raise UsageError(f"{what}: no answer within {seconds:g} s (EAGLE3_HUB_TIMEOUT_S moves the limit); check the "
                         f"network, or give a local copy")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def iterate(iterable, seconds, what):
    """The items of `iterable`, each within `seconds` of the one before (a streamed hub dataset): a producer thread
    reads ahead into a short queue, so a stalled stream is one line instead of a wait without end."""
    q = queue.Queue(maxsize=64)
    done = object()
    stop = threading.Event()

    def produce():
        try:
            for item in iterable:
                while not stop.is_set():
                    try:
                        q.put(("item", item), timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(("end", done))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            q.put(("error", e))
    threading.Thread(target=produce, daemon=True, name=f"deadline: {what}").start()
    try:
        while True:
            try:
                kind, item = q.get(timeout=seconds)
            except queue.Empty:
                raise UsageError(f"{what}: no record within {seconds:g} s (EAGLE3_HUB_TIMEOUT_S moves the limit); "
                                 f"check the network, or give a local copy")
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()


class TemplateTimeout(BaseException):
    """Raised inside a render that ran past its budget. A BaseException, so that no `except Exception` in Jinja or
    transformers turns it into a template error of one conversation."""


@contextlib.contextmanager
def time_budget(seconds):
    """Interrupt the Python code in the `with` block (a Jinja render is Python code) once `seconds` pass, with
    TemplateTimeout. Needs the main thread (SIGALRM); elsewhere the block runs unbounded. In a watched worker the
    block's end is also written where the stage sees it (Watch), for a C call the alarm cannot interrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise TemplateTimeout()
    previous = signal.signal(signal.SIGALRM, expire)
    if _watched is not None:
        _watched[0].ends[_watched[1]] = time.monotonic() + seconds
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        faults.deaf_point("render")
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if _watched is not None:
            _watched[0].ends[_watched[1]] = 0.0


_watched = None  # (Watch, slot) in a watched worker process


def overdue_grace(seconds):
    """How long past a render's end the stage waits before it kills the worker: the alarm ends Python code within
    milliseconds, so this only spares a loaded machine's slow process."""
    return 2.0 + 0.2 * seconds


class Watch:
    """Where each of a pool's worker processes must end its current render (CLOCK_MONOTONIC, one clock for every
    process of the machine; 0: not rendering) and which item it is on, in memory the stage shares with the workers
    it forks. A worker takes its slot as it starts (join)."""

    def __init__(self, workers):
        self.ends = multiprocessing.RawArray("d", workers)
        self.items = multiprocessing.RawArray("q", workers)
        self.taken = multiprocessing.Value("i", 0)

    def join(self):
        global _watched
        with self.taken.get_lock():
            slot, self.taken.value = self.taken.value, self.taken.value + 1
        _watched = (self, slot)

    @staticmethod
    def working_on(item):
        """In a worker: the item its next renders are for."""
        if _watched is not None:
            _watched[0].items[_watched[1]] = item

    def overdue(self, grace):
        """The item a worker has rendered for more than `grace` seconds past its render's end, or None."""
        now = time.monotonic()
        for end, item in zip(self.ends, self.items):
            if end and now > end + grace:
                return item
        return None
