"""asyncio front of LLMEngine for the server.

LLMEngine is not thread-safe, so exactly one background thread touches it: it takes new requests and aborts
from lock-protected inboxes, calls step(), and hands each RequestOutput to its request's asyncio.Queue with
loop.call_soon_threadsafe. The event loop therefore never waits on the model. With nothing to do the thread
sleeps on a condition variable (no polling).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading
import traceback
from collections import deque
from contextlib import suppress
from typing import AsyncIterator

from kestrel.engine.outputs import RequestOutput
from kestrel.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while running a request (not the request's fault)."""


class _Stream:
    """Outputs of one request, delivered from the engine thread into the request's event loop. A deque and one
    waiter future instead of an asyncio.Queue: this runs once per streamed token, and the Queue's bookkeeping
    (getters deque, unfinished-task count, its Event) was a third of the event loop's per-token cost."""

    __slots__ = ("loop", "items", "waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque = deque()
        self.waiter: asyncio.Future | None = None

    def put(self, item) -> None:
        with suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self.push, item)

    def push(self, item) -> None:
        """On the stream's loop."""
        self.items.append(item)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def get(self):
        while not self.items:
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        return self.items.popleft()


def _deliver(items) -> None:
    for stream, out in items:
        stream.push(out)


class AsyncLLMEngine:
    def __init__(self, engine):
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, object, SamplingParams]] = []
        self._aborts: list[str] = []
        self._calls: list[tuple] = []  # (fn, concurrent Future): work that must run on the engine thread
        self._streams: dict[str, _Stream] = {}
        self._stats: dict = dict(engine.stats())
        self._closed = False
        # the loaded model, tokenizer and libraries are ~200k long-lived objects that every full (gen-2)
        # collection would walk again, a pause of tens of ms in the serving loop: move them out of the GC's sight
        gc.collect()
        gc.freeze()
        self._thread = threading.Thread(target=self._loop, name="kestrel-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config) -> "AsyncLLMEngine":
        from kestrel.engine.llm_engine import LLMEngine

        return cls(LLMEngine(config))

    # What the server needs to know about the model.
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def stats(self) -> dict:
        """Engine stats as of the end of the engine thread's last iteration (safe to read from any thread)."""
        with self._cv:
            return dict(self._stats)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_active(self) -> int:
        with self._cv:
            return len(self._streams)

    async def generate(self, request_id: str, prompt, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until it finishes. Closing or cancelling the iterator early aborts the
        request (its KV blocks are freed). A rejected request (ValueError from add_request) raises ValueError."""
        stream = _Stream(asyncio.get_running_loop())
        with self._cv:
            if self._closed:
                raise EngineError("the engine is shut down")
            if request_id in self._streams:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._streams[request_id] = stream
            self._inbox.append((request_id, prompt, params))
            self._cv.notify()
        done = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:
                self.abort(request_id)

    async def call(self, fn):
        """Run fn(engine) on the engine thread between steps (e.g. KV block export/import) and return its result."""
        fut = concurrent.futures.Future()
        with self._cv:
            if self._closed:
                raise EngineError("the engine is shut down")
            self._calls.append((fn, fut))
            self._cv.notify()
        return await asyncio.wrap_future(fut)

    def abort(self, request_id: str) -> None:
        with self._cv:
            if request_id in self._streams:
                self._aborts.append(request_id)
                self._cv.notify()

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=30)
        gc.unfreeze()  # let interpreter shutdown see (and free) them again

    # ---- engine thread -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._inbox or self._aborts or self._calls or self._closed
                           or self.engine.has_unfinished()):
                    self._cv.wait()
                if self._closed:
                    streams, self._streams = self._streams, {}
                    break
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = set(self._aborts), []
                calls, self._calls = self._calls, []
            self._apply(inbox, aborts)
            if calls:  # they may read or write KV blocks: nothing may still be running on the device
                self._step(self.engine.drain)
            for fn, fut in calls:
                try:
                    fut.set_result(fn(self.engine))
                except Exception as e:
                    fut.set_exception(e)
            if self.engine.has_unfinished():
                self._step()
            stats = dict(self.engine.stats())
            with self._cv:
                self._stats = stats
        for s in streams.values():
            s.put(EngineError("the engine is shut down"))
        for _, fut in self._calls:
            fut.set_exception(EngineError("the engine is shut down"))

    def _apply(self, inbox, aborts: set[str]) -> None:
        for rid, prompt, params in inbox:
            if rid in aborts:  # given up before it ever reached the engine
                continue
            try:
                self.engine.add_request(rid, prompt, params)
            except Exception as e:  # ValueError = the request's fault; anything else is reported the same way
                s = self._pop(rid)
                if s is not None:
                    s.put(e if isinstance(e, ValueError) else EngineError(f"{type(e).__name__}: {e}"))
        for rid in aborts:
            with suppress(Exception):  # it may have finished meanwhile
                self.engine.abort_request(rid)
            self._pop(rid)

    def _step(self, step=None) -> None:
        try:
            outputs = (step or self.engine.step)()
        except Exception as e:
            # Fail every request in flight instead of hanging them, then drop them from the engine so the
            # next requests start from a clean state.
            log.error("engine step failed:\n%s", traceback.format_exc())
            with self._cv:
                streams, self._streams = self._streams, {}
            for rid, s in streams.items():
                with suppress(Exception):
                    self.engine.abort_request(rid)
                s.put(EngineError(f"engine step failed: {type(e).__name__}: {e}"))
            return
        # one lock and one loop wake-up per step, not per output: at 256 streams the per-output
        # call_soon_threadsafe (a self-pipe write each) cost the engine thread and the event loop ~10 us a token
        by_loop: dict = {}
        with self._cv:
            for out in outputs:
                s = self._streams.pop(out.request_id) if out.finished else self._streams.get(out.request_id)
                if s is not None:
                    by_loop.setdefault(s.loop, []).append((s, out))
        for loop, items in by_loop.items():
            with suppress(RuntimeError):  # the loop is closed: nobody is listening any more
                loop.call_soon_threadsafe(_deliver, items)

    def _pop(self, rid: str) -> _Stream | None:
        with self._cv:
            return self._streams.pop(rid, None)

