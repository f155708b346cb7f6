"""The counters ``GET /metrics`` reports, in Prometheus' text format (version 0.0.4)."""
from __future__ import annotations

import threading
from collections import Counter

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self, max_batch: int):
        self.lock = threading.Lock()
        self.codes: Counter = Counter()           # responses of /predict by status code
        self.latency = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        self.batches: Counter = Counter()         # batch size -> forwards
        self.forward_seconds = 0.0                # wall time inside forwards
        self.max_batch = max_batch

    def request(self, code: int, seconds: float) -> None:
        with self.lock:
            self.codes[code] += 1
            k = next((i for i, b in enumerate(LATENCY_BUCKETS) if seconds <= b), len(LATENCY_BUCKETS))
            self.latency[k] += 1
            self.latency_sum += seconds

    def batch(self, n: int, seconds: float) -> None:
        with self.lock:
            self.batches[n] += 1
            self.forward_seconds += seconds

    def text(self) -> str:
        with self.lock:
            out = ["# HELP brewnet_requests_total Responses to /predict, by status code.",
                   "# TYPE brewnet_requests_total counter"]
            out += [f'brewnet_requests_total{{code="{c}"}} {n}' for c, n in sorted(self.codes.items())]
            out += ["# HELP brewnet_errors_total Responses to /predict with a 4xx or 5xx code.",
                    "# TYPE brewnet_errors_total counter",
                    f"brewnet_errors_total {sum(n for c, n in self.codes.items() if c >= 400)}",
                    "# HELP brewnet_request_seconds Time from request to response of /predict.",
                    "# TYPE brewnet_request_seconds histogram"]
            acc = 0
            for b, n in zip(LATENCY_BUCKETS + (float("inf"),), self.latency):
                acc += n
                out.append(f'brewnet_request_seconds_bucket{{le="{"+Inf" if b == float("inf") else b}"}} {acc}')
            out += [f"brewnet_request_seconds_sum {self.latency_sum:.6f}",
                    f"brewnet_request_seconds_count {acc}",
                    "# HELP brewnet_batch_size Inputs per forward.",
                    "# TYPE brewnet_batch_size histogram"]
            acc, total = 0, 0
            for b in range(1, self.max_batch + 1):
                acc += self.batches.get(b, 0)
                total += b * self.batches.get(b, 0)
                out.append(f'brewnet_batch_size_bucket{{le="{b}"}} {acc}')
            out += [f'brewnet_batch_size_bucket{{le="+Inf"}} {acc}',
                    f"brewnet_batch_size_sum {total}", f"brewnet_batch_size_count {acc}",
                    "# HELP brewnet_forward_seconds Time spent in the net's forwards.",
                    "# TYPE brewnet_forward_seconds summary",
                    f"brewnet_forward_seconds_sum {self.forward_seconds:.6f}",
                    f"brewnet_forward_seconds_count {acc}"]
        return "\n".join(out) + "\n"
