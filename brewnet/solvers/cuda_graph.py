"""A recorded graph of aten ops captured as a CUDA graph: one launch replays a whole step.

A small net's step on a GPU is launch-bound: LeNet's forward-backward is ~60 kernels of a few
microseconds each, and the CPU that queues them (Python per layer, autograd, one launch per
kernel) is slower than the GPU that runs them. The CPU step graph (``step_graph.py``) already
removes the Python; here its recorded graph is captured once more with ``torch.cuda.graphs``
and the whole forward-backward is one ``CUDAGraph.replay()``:
- the graph reads fixed memory: each step the inputs (the data layers' tops, made eagerly as
  on the CPU, so readers, transforms and their RNGs are untouched) are copied into static
  input buffers, and the outputs (loss, tops, param gradients) come back in the graph's own
  memory, rewritten by the next replay, as a Caffe blob's memory is by the next forward;
- the params are read where they live: the solver updates them in place, so a replay sees the
  new values; a new param tensor (``copy_from``, surgery) changes the step graph's key and
  re-captures, as on the CPU;
- before capture the graph runs three times on a side stream (cuBLAS/cuDNN workspaces and
  lazy initialisation happen there, not inside the capture), as torch's documentation asks;
- K nets trained together (``brewnet.many.TrainTogether``) each get their own step graph on
  their worker thread: K captures, one at a time, each on its own stream, replayed side by side;
- the capture is checked as the CPU one is: its first replay must give the eager step's bits
  (loss, every top, every gradient) or the eager step is kept, with a warning.
The update (a rate that changes every iteration under most lr policies) stays eager.
``CapturedGraph`` is the generic part, also used by lean inference on CUDA (``lean.py``).
"""
from __future__ import annotations

import logging
import threading

import torch

from .step_graph import DEVICE_GRAPHS, StepGraph

log = logging.getLogger("brewnet")
WARMUP = 3      # eager runs on a side stream before capture (torch's docs use 3 for DDP/AMP)
# No GPU was at hand when this was written: until benchmarks/gpu.sh has passed on one, CUDA
# graphs are used only when asked for (BREWNET_STEP_GRAPH=1, BREWNET_LEAN=1), then by default
# as on the CPU (set this True with the run's figures).
DEFAULT_ON_CUDA = False
_CAPTURING = threading.Lock()   # one capture at a time (torch.cuda.graph synchronizes the device)


def device_refusal(device: torch.device, asked: bool = True) -> str | None:
    """Why a graph cannot be recorded for a net on ``device`` (None: it can); ``asked``: the
    user's switch asks for graphs explicitly."""
    if device.type == "cpu":
        return None
    if device.type == "cuda" and torch.cuda.is_available() and hasattr(torch.cuda, "CUDAGraph"):
        if not (asked or DEFAULT_ON_CUDA):
            return (f"device {device}: CUDA graphs only when asked for (BREWNET_STEP_GRAPH=1, "
                    "BREWNET_LEAN=1) until benchmarks/gpu.sh has passed on a GPU")
        return None
    return f"device {device}: no CUDA graphs there"


class CapturedGraph:
    """``fn(*xs)`` (a function of tensors returning a tuple of tensors, with no side effects
    and no host reads) captured as a CUDA graph on inputs shaped like ``xs``. Calling it copies
    new inputs into the static buffers and replays; the outputs are the graph's own tensors."""

    def __init__(self, fn, xs):
        self.device = next((x.device for x in xs if x.is_cuda), torch.device("cuda", torch.cuda.current_device()))
        with _CAPTURING, torch.cuda.device(self.device):
            self._capture(fn, [x.detach().clone() for x in xs])

    def _capture(self, fn, static) -> None:
        self.static = static
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(WARMUP):
                fn(*self.static)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # on this graph's own stream (torch's default capture stream is one per process);
        # thread_local: another thread's CUDA work (a prefetcher, another net's step) during
        # the capture is not an error
        with torch.no_grad(), torch.cuda.graph(self.graph, stream=side, capture_error_mode="thread_local"):
            out = fn(*self.static)
        self.outs = out if isinstance(out, tuple) else (out,)

    def __call__(self, xs) -> tuple:
        for s, x in zip(self.static, xs):
            if s.data_ptr() != x.data_ptr():
                s.copy_(x, non_blocking=True)
        if self.device.index == torch.cuda.current_device():
            self.graph.replay()
        else:
            with torch.cuda.device(self.device):
                self.graph.replay()
        return self.outs


class CudaStepGraph(StepGraph):
    """The step graph of a net on CUDA: recorded as on the CPU, then captured (see above)."""

    KIND = "CUDA graph"

    def _prepare(self, xs) -> bool:
        try:
            self.captured = CapturedGraph(self.gm.forward, xs)
        except RuntimeError as e:          # an op that cannot be captured (a host sync, ...)
            log.warning("step graph: CUDA graph capture failed (%s); net '%s' keeps the eager "
                        "step", str(e).splitlines()[0][:200], self.net.name)
            return False
        return True

    def _run(self, xs) -> tuple:
        return self.captured(xs)


DEVICE_GRAPHS["cuda"] = (CudaStepGraph, device_refusal)
