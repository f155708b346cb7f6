"""uvicorn's Server, stopping in two steps on SIGTERM: stop listening, let the connections
already accepted deliver their requests, then uvicorn's own shutdown, which finishes every request
it has read and closes the rest. Without the pause, a request sent on a just-accepted connection
and not yet read was dropped (seen under load in tests/test_serve.py). A fixed pause was not
enough when forwards kept the event loop busy, so the server waits until no request has come in
for ``DRAIN_S`` (at most ``MAX_DRAIN_S``)."""
from __future__ import annotations

import asyncio

import uvicorn

DRAIN_S = 0.25      # quiet time, after closing the listener, before closing idle connections
MAX_DRAIN_S = 10.0


class DrainingServer(uvicorn.Server):
    async def shutdown(self, sockets=None):
        await asyncio.sleep(0)            # accept what the kernel has queued
        for server in self.servers:
            server.close()
        loop = asyncio.get_running_loop()
        deadline, seen = loop.time() + MAX_DRAIN_S, self.server_state.total_requests
        while loop.time() < deadline:
            await asyncio.sleep(DRAIN_S)
            if self.server_state.total_requests == seen:
                break                     # every accepted connection has said what it wanted
            seen = self.server_state.total_requests
        await super().shutdown(sockets)


def serve(app, host: str, port: int, access_log: bool) -> None:
    # log_config=None: uvicorn's lines go through brewnet's log format.
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=access_log,
                            timeout_graceful_shutdown=30)
    DrainingServer(config).run()
