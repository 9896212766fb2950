"""An asyncio front over LLMEngine: requests join while the step loop runs, each gets an async
stream of its outputs, and a cancelled stream (a client that went away) aborts its request and
frees its blocks before the next step.

The engine is touched by one thread at a time: `engine.step()` runs in a worker thread (so the
event loop keeps serving), and requests are added or aborted by the event loop only between
steps, from a queue of pending commands.
"""

import asyncio
import uuid
from collections.abc import AsyncIterator

from pagedbench.engine.llm_engine import LLMEngine
from pagedbench.engine.outputs import RequestOutput
from pagedbench.sample.sampling_params import SamplingParams


class EngineFull(Exception):
    """Too many requests in flight (back-pressure): the client should retry later."""


class EngineDead(Exception):
    """The step loop stopped on an error; no request can complete."""


class EngineClosed(Exception):
    """The server is stopping: new requests are refused, and those still running when it stops end."""


_ABORTED = object()  # put on a stream by abort(): the generator ends


class AsyncLLM:
    def __init__(self, engine: LLMEngine, max_pending: int | None = None):
        self.engine = engine
        self.max_pending = max_pending or 4 * engine.config.max_num_seqs  # queued + running requests
        self._streams: dict[str, asyncio.Queue] = {}
        self._adds: list[tuple] = []
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self.error: BaseException | None = None
        self.closed: str | None = None  # why new requests are refused (the server is stopping)

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
            self._loop_task = None

    def close(self, reason: str) -> None:
        """Refuse new requests from now on (generate raises EngineClosed(reason)); those in flight run on."""
        self.closed = reason

    def end_all(self, reason: str) -> int:
        """End every request in flight with EngineClosed(reason) (their blocks freed before the
        next step); how many there were."""
        for stream in self._streams.values():
            stream.put_nowait(EngineClosed(reason))
        return len(self._streams)

    async def generate(
        self, prompt, params: SamplingParams, request_id: str | None = None, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs as the engine makes them (each step it progresses; what each
        holds is params.output_kind's: DELTA for a stream, FINAL_ONLY for one finished output), the
        last one finished (or stop quietly after `abort`). Raises ValueError/TypeError (bad request, nothing queued),
        EngineFull, EngineDead or EngineClosed."""
        if self.closed is not None:
            raise EngineClosed(self.closed)
        if self.error is not None:
            raise EngineDead(f"the engine stopped: {self.error}")
        if len(self._streams) >= self.max_pending:
            raise EngineFull(f"{len(self._streams)} requests in flight, the limit is {self.max_pending}")
        text, token_ids = self.engine.tokenize(prompt)
        self.engine.validate_request(token_ids, params)
        self.engine.validate_priority(priority)
        request_id = request_id or f"req-{uuid.uuid4().hex}"
        if request_id in self._streams or request_id in self.engine.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = stream
        self._adds.append(({"prompt": text, "prompt_token_ids": token_ids}, params, request_id, priority))
        self._wake.set()
        self.start()
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if item is _ABORTED:
                    return
                if isinstance(item, (ValueError, TypeError, EngineClosed)):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDead(f"the engine stopped: {item}") from item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # cancelled or abandoned: free its blocks before the next step
                self._aborts.append(request_id)
                self._wake.set()

    def abort(self, request_id: str) -> None:
        """Abort a request (vLLM's AsyncLLM.abort): its generator ends, its blocks are freed
        before the next step. Unknown or finished ids are ignored."""
        stream = self._streams.get(request_id)
        pending = any(add[2] == request_id for add in self._adds)
        if stream is not None and (pending or request_id in self.engine.requests):  # not finished already
            stream.put_nowait(_ABORTED)
            self._aborts.append(request_id)
            self._wake.set()

    async def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._apply_commands()
                if not engine.has_unfinished_requests():
                    self._wake.clear()
                    if not self._adds and not self._aborts:
                        await self._wake.wait()
                    continue
                outputs = await asyncio.to_thread(engine.step)
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        stream.put_nowait(out)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug or a device error: fail every waiting stream, loudly
            self.error = e
            for stream in self._streams.values():
                stream.put_nowait(e)
            raise

    def _apply_commands(self) -> None:
        adds, self._adds = self._adds, []
        for prompt, params, request_id, priority in adds:
            if request_id in self._streams:  # not cancelled meanwhile
                try:
                    self.engine.add_request(prompt, params, request_id=request_id, priority=priority)
                except (ValueError, TypeError) as e:  # validated already; never let one request stop the loop
                    self._streams[request_id].put_nowait(e)
        aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            self.engine.abort_request(request_id)
