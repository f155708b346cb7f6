"""uvicorn's Server, stopping in two steps on SIGTERM: stop listening, let the connections
already accepted deliver their requests, then uvicorn's own shutdown, which finishes every request
it has read and closes the rest. Without the pause, a request sent on a just-accepted connection
and not yet read was dropped (seen under load in tests/test_serve.py)."""
from __future__ import annotations

import asyncio

import uvicorn

DRAIN_S = 0.25      # between closing the listener and closing the idle connections


class DrainingServer(uvicorn.Server):
    async def shutdown(self, sockets=None):
        await asyncio.sleep(0)            # accept what the kernel has queued
        for server in self.servers:
            server.close()
        await asyncio.sleep(DRAIN_S)
        await super().shutdown(sockets)


def serve(app, host: str, port: int, access_log: bool) -> None:
    # log_config=None: uvicorn's lines go through brewnet's log format.
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=access_log,
                            timeout_graceful_shutdown=30)
    DrainingServer(config).run()
