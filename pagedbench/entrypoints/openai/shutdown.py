"""A clean stop for `pagedbench serve`: on Ctrl-C or SIGTERM the server takes no new request, says
so in one line and lets those in flight finish for up to a grace period; it then answers the rest
503 (a stream ends with the error event) and stops. A second Ctrl-C ends them so at once.

The stop is uvicorn's (connections closed, lifespan shut down) with the draining before it, and
without uvicorn's raising the signal again once it has stopped (a KeyboardInterrupt traceback):
`serve` reports how the stop went (`outcome`) and exits 130."""

import asyncio
import sys

import uvicorn

from pagedbench.entrypoints.async_llm import AsyncLLM

FLUSH_S = 2.0  # for the last answers (503s, streams' ends) to reach their clients


def requests_word(n: int) -> str:
    return f"{n} request{'' if n == 1 else 's'}"


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, llm: AsyncLLM, grace_s: float):
        super().__init__(config)
        self.llm, self.grace_s = llm, grace_s
        self.signalled = False
        self.outcome: str | None = None  # how a signalled stop went, for the command's last line

    def handle_exit(self, sig, frame) -> None:
        """The first signal starts the stop, the next one hurries it (whichever signals they are)."""
        if self.signalled:
            self.force_exit = True
        self.signalled = self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        if self.signalled:
            await self._drain()
            self.force_exit = False  # drained: uvicorn's own stop is quick, and shuts the engine's loop down
        await super().shutdown(sockets)

    async def _drain(self) -> None:
        llm, loop = self.llm, asyncio.get_running_loop()
        for server in self.servers:
            server.close()  # no new connection
        for connection in list(self.server_state.connections):
            connection.shutdown()  # an idle keep-alive one closes now, a busy one after its response
        llm.close("the server is shutting down")  # a request on an open connection: 503
        print(
            f"pagedbench: stopping: {requests_word(llm.num_requests)} in flight, up to {self.grace_s:g} s to finish "
            "(Ctrl-C again to stop now)",
            file=sys.stderr,
            flush=True,
        )
        deadline = loop.time() + self.grace_s
        while llm.num_requests and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(0.05)
        hurried = self.force_exit
        ended = llm.end_all("the server is shutting down" + ("" if hurried else f": its {self.grace_s:g} s are over"))
        if not ended:
            self.outcome = "stopped; every request in flight finished"
        elif hurried:
            self.outcome = f"stopped at once (a second Ctrl-C): {requests_word(ended)} answered 503"
        else:
            self.outcome = f"stopped: {requests_word(ended)} still running after {self.grace_s:g} s answered 503"
        flushed = loop.time() + FLUSH_S
        while self.server_state.connections and loop.time() < flushed:
            await asyncio.sleep(0.05)
