"""One request's generation between the head's blocking Generator and the event loop: each
choice read on a thread of its own, its events handed to the loop through one queue, and the
generations in flight kept so that stopping the server can drain them."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import StreamingResponse

from skippy_stage.errors import RuntimeFailure, SkippyError
from skippy_stage.head.generator import Finish, GenerateSpec, Generator, Piece
from skippy_stage.head.tasks import Task

_END = object()


class _Live:
    """The generations in flight, so that stopping the server can drain and then end them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: set[_Generation] = set()

    def add(self, generation: _Generation) -> None:
        with self._lock:
            self._items.add(generation)

    def discard(self, generation: _Generation) -> None:
        with self._lock:
            self._items.discard(generation)

    def snapshot(self) -> list[_Generation]:
        with self._lock:
            return list(self._items)


class _Generation:
    """A request's choices, each read on a thread of its own (``Generator.pieces``); their events
    reach the event loop as ``(choice index, event)`` on one queue.

    Threads (not a shared pool) because a generation may wait in the admission queue for a long
    time and must not hold back others.
    """

    def __init__(self, generator: Generator, spec: GenerateSpec, live: _Live, n: int = 1) -> None:
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[tuple[int, object]] = asyncio.Queue()
        self._gone = threading.Event()
        self._live = live
        self.n = n
        self._ended = 0
        self._lock = threading.Lock()
        self._running = n
        self._tasks: list[Task] = []
        live.add(self)
        threading.Thread(target=self._start, args=(generator, spec), name="openai-generate", daemon=True).start()

    def _start(self, generator: Generator, spec: GenerateSpec) -> None:
        try:
            tasks = generator.start(spec, self.n)
        except Exception as exc:  # noqa: BLE001 -- handed to the request's coroutine, which reports it
            self._live.discard(self)
            self._post((0, exc))
            return
        with self._lock:
            self._tasks = tasks
        if self._gone.is_set():
            self.cancel()
        try:
            for index, task in enumerate(tasks[1:], 1):
                threading.Thread(target=self._drive, args=(generator, spec, index, task), name="openai-generate",
                                 daemon=True).start()
        except RuntimeError as exc:  # no thread to be had: end the whole request, free every choice
            self.cancel()
            self._live.discard(self)
            self._post((0, RuntimeFailure(f"the head could not start a thread per choice: {exc}")))
            return
        self._drive(generator, spec, 0, tasks[0])

    def _drive(self, generator: Generator, spec: GenerateSpec, index: int, task: Task) -> None:
        try:
            events = generator.pieces(task, spec, remaining_s=lambda: None, is_active=lambda: not self._gone.is_set())
            try:
                for event in events:
                    if self._gone.is_set():
                        break
                    self._post((index, event))
            finally:
                events.close()
                task.cancel()  # the scheduler frees the session on every stage
        except Exception as exc:  # noqa: BLE001 -- handed to the request's coroutine, which reports it
            self._post((index, exc))
        finally:
            with self._lock:
                self._running -= 1
                last = self._running == 0
            if last:
                self._live.discard(self)
            self._post((index, _END))

    def _post(self, item: tuple[int, object]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, item)
        except RuntimeError:  # the event loop is closed (server stopped): nobody is listening
            self._gone.set()

    def cancel(self) -> None:
        """Stop generating: the client is gone or has what it needs."""
        self._gone.set()
        with self._lock:
            tasks = list(self._tasks)
        for task in tasks:
            task.cancel()

    def prompt_tokens(self) -> tuple[int, int]:
        """The first choice's prompt length and how much of it a resident prefix holds, as far as
        the scheduler knows now ((0, 0) before it started): for an answer's header, before its Finish."""
        with self._lock:
            task = self._tasks[0] if self._tasks else None
        return (len(task.prompt), task.cached_tokens) if task is not None else (0, 0)

    def abort(self, exc: SkippyError) -> None:
        """End the generation with ``exc`` for its client (from any thread)."""
        self._gone.set()
        self._post((0, exc))

    async def next(self) -> tuple[int, Piece | Finish] | None:
        """The next event of some choice; None once every choice has ended (or was cancelled)."""
        while True:
            index, item = await self._events.get()
            if item is _END:
                self._ended += 1
                if self._ended >= self.n:
                    return None
                continue
            if isinstance(item, BaseException):
                raise item
            return index, item  # type: ignore[return-value]

    async def watch(self, request: Request) -> None:
        """Cancel the generation when the client disconnects."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.cancel()
                return


async def begin(generator: Generator, spec: GenerateSpec, live: _Live, request: Request,
                n: int = 1) -> tuple[_Generation, asyncio.Task, tuple[int, object] | None]:
    """Start a generation for ``request``, its disconnect watcher, and wait for its first event:
    it comes before any byte is sent, so refusals (a full queue, a down chain, a prompt too long)
    get their own HTTP status, streaming or not. On any failure both are stopped and it raises."""
    generation = _Generation(generator, spec, live, n)
    watcher = asyncio.create_task(generation.watch(request))
    try:
        return generation, watcher, await generation.next()
    except BaseException:
        watcher.cancel()
        generation.cancel()
        raise


async def read_whole(generation: _Generation, watcher: asyncio.Task, first: tuple[int, object] | None,
                     on_text: Callable[[str], None]) -> Finish | None:
    """A generation's answer read whole (one choice): each piece's text to ``on_text``, then its
    Finish; None when the client went away first. The generation and its watcher end either way;
    a failure raises (SkippyError) for the caller to refuse."""
    try:
        item = first
        while item is not None:
            _, event = item
            if isinstance(event, Finish):
                return event
            if isinstance(event, Piece):
                on_text(event.text)
            item = await generation.next()
        return None
    finally:
        watcher.cancel()
        generation.cancel()


def sse_response(stream: AsyncIterator[bytes]) -> StreamingResponse:
    """Server-sent events, unbuffered by proxies on the way."""
    return StreamingResponse(stream, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
