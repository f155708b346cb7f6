"""The counters ``GET /metrics`` reports, in Prometheus' text format, through prometheus_client.

One worker: the metrics live in the app's own registry. Several (``brewnet serve --workers N``):
prometheus_client's multiprocess mode, in which every worker writes its values to files in
``PROMETHEUS_MULTIPROC_DIR`` (set by the parent before the workers start, as the mode requires)
and ``/metrics``, whichever worker answers it, sums them over all workers.
"""
from __future__ import annotations

import os

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    Summary,
    disable_created_metrics,
    generate_latest,
    multiprocess,
)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
disable_created_metrics()        # the *_created samples are noise to a scraper of one server


class Metrics:
    def __init__(self, max_batch: int):
        self.shared = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        # multiprocess mode: the values go to the files whatever the registry; a private one
        # keeps several apps in one process (the tests) from clashing over names
        own = CollectorRegistry()
        self._requests = Counter("brewnet_requests", "Responses to /predict, by status code.",
                                 ["code"], registry=own)
        self._errors = Counter("brewnet_errors", "Responses to /predict with a 4xx or 5xx code.",
                               registry=own)
        self._latency = Histogram("brewnet_request_seconds", "Time from request to response of "
                                  "/predict.", buckets=LATENCY_BUCKETS, registry=own)
        self._batch = Histogram("brewnet_batch_size", "Inputs per forward.",
                                buckets=tuple(range(1, max_batch + 1)), registry=own)
        self._forward = Summary("brewnet_forward_seconds", "Time spent in the net's forwards.",
                                registry=own)
        self.registry = own
        if self.shared:
            self.registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.registry, path=self.shared)

    def request(self, code: int, seconds: float) -> None:
        self._requests.labels(str(code)).inc()
        if code >= 400:
            self._errors.inc()
        self._latency.observe(seconds)

    def batch(self, n: int, seconds: float) -> None:
        self._batch.observe(n)
        self._forward.observe(seconds)

    def text(self) -> str:
        return generate_latest(self.registry).decode()
