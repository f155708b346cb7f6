"""uvicorn's Server, stopping in two steps on SIGTERM: stop listening (serving the connections the
listener's queue holds), let the connections already accepted deliver their requests (until none
has come in for ``DRAIN_S`` and every connection has sent its first one, at most
``MAX_DRAIN_S``), then uvicorn's own shutdown, which finishes every request it has read and
closes the rest.

Several workers (``serve_workers``): uvicorn's own supervisor, whose worker processes are
health-checked and restarted when they die, and get SIGTERM from it when the parent gets SIGTERM
or SIGINT; each worker is a ``DrainingServer`` that builds its app from ``factory`` in the new
process. Where the system has ``SO_REUSEPORT`` (Linux, the BSDs) each worker listens on a socket
of its own and the kernel spreads new connections over them by a hash of the addresses; elsewhere
they share one socket (uvicorn's way). Why: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn
from uvicorn.supervisors import multiprocess

log = logging.getLogger("brewnet")
REUSE_PORT = hasattr(socket, "SO_REUSEPORT")
DRAIN_S = 0.25      # quiet time, after closing the listener, before closing idle connections
MAX_DRAIN_S = 10.0
# uvicorn's supervisor pings each worker and kills one that does not answer within 5 s (its
# default); a worker importing torch holds the GIL for seconds, and on a loaded machine it never
# answered in time: killed and restarted over and over, it never served (seen in a CI run)
HEALTHCHECK_S = 120


class DrainingServer(uvicorn.Server):
    async def shutdown(self, sockets=None):
        loop = asyncio.get_running_loop()
        await self.stop_listening(loop)
        deadline, seen = loop.time() + MAX_DRAIN_S, self.server_state.total_requests
        while loop.time() < deadline:
            await asyncio.sleep(DRAIN_S)
            if self.server_state.total_requests == seen and not self._unheard():
                break                     # every accepted connection has said what it wanted
            seen = self.server_state.total_requests
        await super().shutdown(sockets)

    async def stop_listening(self, loop) -> None:
        """Close the listening sockets, serving every connection their queues hold: one still
        queued when its socket closes is reset (the client's connect had succeeded). Each queue
        is emptied right before and right after the event loop lets go of the socket, through a
        second descriptor that keeps it listening until then (the window left: microseconds)."""
        config = self.config

        def protocol():                   # as uvicorn's Server.startup makes them
            return config.http_protocol_class(config=config, server_state=self.server_state,
                                              app_state=self.lifespan.state, _loop=loop)

        spares = [socket.fromfd(s.fileno(), s.family, s.type) for server in self.servers
                  for s in server.sockets or ()]
        queued = [c for spare in spares for c in _accept_all(spare)]
        for server in self.servers:
            server.close()
        queued += [c for spare in spares for c in _accept_all(spare)]
        for spare in spares:
            spare.close()
        for conn in queued:
            await loop.connect_accepted_socket(protocol, conn, ssl=config.ssl)

    def _unheard(self) -> int:
        """Connections accepted whose first request has not been read yet: uvicorn's shutdown
        closes a connection with no request (``cycle`` None), so such a client's request is lost."""
        return sum(getattr(c, "cycle", False) is None for c in self.server_state.connections)


def _accept_all(listener: socket.socket) -> list[socket.socket]:
    listener.setblocking(False)
    out = []
    while True:
        try:
            out.append(listener.accept()[0])
        except (BlockingIOError, InterruptedError):
            return out


class DrainingProcess(multiprocess.Process):
    """A supervised worker running a DrainingServer (uvicorn's Process runs a plain Server)."""

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            self._server = DrainingServer(config=self.config)
        return self._server

    def target(self, sockets=None) -> None:  # in the worker process
        super().target(sockets or [_listener(self.config.host, self.config.port, REUSE_PORT)])


def _listener(host: str, port: int, reuse_port: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class Supervisor(multiprocess.Multiprocess):
    """uvicorn's supervisor, letting go of the listening socket before it stops the workers: the
    socket then closes with the last worker's listener, and a connection that comes after is
    refused; held here, it would queue (the client's connect succeeding) and be reset unread."""

    def terminate_all(self) -> None:
        for sock in self.sockets:
            sock.close()
        super().terminate_all()


def _config(app, host: str, port: int, access_log: bool, **kw) -> uvicorn.Config:
    # log_config=None: uvicorn's lines go through brewnet's log format.
    return uvicorn.Config(app, host=host, port=port, log_config=None, access_log=access_log,
                          timeout_graceful_shutdown=30, **kw)


def serve(app, host: str, port: int, access_log: bool) -> None:
    DrainingServer(_config(app, host, port, access_log)).run()


def serve_workers(factory: str, workers: int, host: str, port: int, access_log: bool) -> None:
    """``workers`` processes, each serving ``factory()`` (an import string "module:function")."""
    try:
        # without SO_REUSEPORT: fails if anything holds the port, so the workers' sockets never
        # join another server's; it also fixes port 0 to one port for all of them
        probe = _listener(host, port, reuse_port=False)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    port = probe.getsockname()[1]
    if REUSE_PORT:
        probe.close()                # each worker binds its own (DrainingProcess.target)
        sockets = []
    else:
        probe.listen(2048)
        probe.set_inheritable(True)
        sockets = [probe]
    config = _config(factory, host, port, access_log, factory=True, workers=workers,
                     timeout_worker_healthcheck=HEALTHCHECK_S)
    log.info("Serving on http://%s:%d with %d workers (%s)", host, port, workers,
             "a socket each, SO_REUSEPORT" if REUSE_PORT else "one shared socket")
    # the supervisor makes (and remakes) its workers through this module-level name
    multiprocess.Process = DrainingProcess
    try:
        Supervisor(config, sockets=sockets).run()
    finally:
        for sock in sockets:
            sock.close()
        multiprocess.Process = DrainingProcess.__base__
