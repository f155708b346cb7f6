"""``brewnet serve``'s server (FastAPI on uvicorn): imported by that command only, so the rest
of the CLI starts without the ``[serve]`` extra installed."""
