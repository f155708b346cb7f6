"""Lean inference: a TEST net's repeated whole forward as one graph of plain torch ops.

pycaffe scripts call ``net.forward()`` in a loop and read the outputs. After ``AFTER`` such
calls with the same input shapes, the net is traced once into ``to_torch``'s graph (BatchNorm
and Scale folded into the convolutions) and later whole forwards run that graph: no per-layer
dispatch, no blob bookkeeping for the blobs between input and output. Pycaffe's semantics are
kept by a transparent fallback:
- Intermediate blobs are not written by the graph; they are marked stale, and the first read
  of one (``.data``, ``.tensor``) re-runs the plain forward on the inputs the graph saw, so
  ``net.blobs['conv1'].data`` after a forward is what Caffe would show.
- A forward with ``start``/``end``/``blobs=``, a net that needs a backward (a loss or
  ``force_backward``), a live numpy view of an intermediate blob (it must follow each forward,
  as Caffe's memory does), other input shapes, or a net the trace refuses: the plain path.
- The graph reads the layers' own parameter tensors (the folded ones through ``Folder``'s cache,
  which watches numpy views and versions), so net surgery between calls is seen.
Numbers: the graph runs the same torch ops, but torch may pick other kernels for them (an addmm
where the layer used oneDNN's packed linear; NCHW where the CPU path uses channels_last), so
outputs agree with the plain path to float32 rounding (tests: within 1e-5 relative), not bit for
bit. The trace costs seconds once (torch.export, logged; ~14 s for LeNet on the loaded 2-core
machine it was measured on).

Off unless ``BREWNET_LEAN=1``: measured through ``Net.forward`` on LeNet at batch 1, the graph
took 1.9 ms of CPU per call against the layer-by-layer path's 2.0 ms (the kernels dominate; the
Python the graph saves is small there), which does not pay for the trace and the 1e-7 changes.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from .errors import NetError

log = logging.getLogger("brewnet")
AFTER = 10      # whole forwards with the same input shapes before the net is traced


class LeanForward:
    def __init__(self, net):
        self.net = net
        self.calls, self._key = 0, None
        self.gm, self.steps, self.failed = None, [], False
        self._saved: list[torch.Tensor] = []       # the inputs the graph last ran on
        self._stale: list = []                     # intermediate blobs not written by the graph
        io = set(net.inputs) | set(net.outputs)
        self._middle = [b for n, b in net.blobs.items() if n not in io]

    def eligible(self) -> bool:
        net = self.net
        return (not self.failed and os.environ.get("BREWNET_LEAN", "0") == "1" and net.inputs
                and not net._needs_backward and net.device.type == "cpu"
                and not any(b._viewed("data") for b in self._middle))

    def run(self) -> bool:
        """One whole forward through the graph when it is ready (else count towards it); False:
        the caller runs the plain path."""
        if not self.eligible():
            return False
        net = self.net
        key = tuple(tuple(net.blobs[n].shape) for n in net.inputs)
        if key != self._key:
            self._key, self.calls, self.gm = key, 0, None
        self.calls += 1
        if self.gm is None:
            if self.calls <= AFTER:
                return False
            self._build()
            if self.gm is None:
                return False
        self.drop()                        # re-marked below, against this call's inputs
        if net._current_input_shapes() != net._input_shapes:
            net.reshape()
        self._bind()
        xs = [net.blobs[n].tensor.detach() for n in net.inputs]
        with torch.no_grad():
            out = self.gm(*xs)
        outs = out if isinstance(out, tuple) else (out,)
        for name, t in zip(net.outputs, outs):
            net.blobs[name].write(t)
        self._saved = [x.clone() for x in xs]
        self._stale = list(self._middle)
        for b in self._stale:
            b._pending = self.settle
        return True

    def settle(self) -> None:
        """Bring the stale intermediate blobs up to date: the plain forward on the saved inputs
        (the inputs and outputs the user sees are left as the graph's run left them)."""
        if not self._stale:
            return
        for b in self._stale:
            b._pending = None
        self._stale = []
        net = self.net
        blobs = [net.blobs[n] for n in net.inputs]
        now = [b._t for b in blobs]
        outs = [net.blobs[n].tensor.detach().clone() for n in net.outputs]
        try:
            for b, x in zip(blobs, self._saved):
                b._t = x
            with torch.no_grad():
                net.forward_tensors()
        finally:
            for b, t in zip(blobs, now):
                b._t = t
            for name, t in zip(net.outputs, outs):
                net.blobs[name].write(t)

    def drop(self) -> None:
        """Forget the stale marks (a plain whole forward is about to rewrite every blob)."""
        for b in self._stale:
            b._pending = None
        self._stale = []

    def _build(self) -> None:
        from .deploy.graph import _graph_module, traced_program

        net = self.net
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                ep, tracee, _ = traced_program(net, fold=True, dynamic_batch=False)
            self.gm = _graph_module(ep, tracee)
        except (NetError, RuntimeError, ValueError, TypeError, NotImplementedError) as e:
            self.failed = True
            log.info("Net '%s': repeated inference stays layer by layer (no graph: %s)", net.name,
                     str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
            return
        self.steps = [(i, end, getattr(self.gm, attr), names) for i, end, attr, names in tracee.steps
                      if attr is not None]
        log.info("Net '%s': repeated inference runs as one graph of torch ops (traced in %.2g s)",
                 net.name, time.perf_counter() - t0)

    def _bind(self) -> None:
        """Point the graph at the layers' current parameters (folded ones from the cache)."""
        net = self.net
        for i, end, sub, names in self.steps:
            blobs = net._folder.weights(i) if end != i else net.layer_list[i].blobs
            for name, t in zip(names, blobs):
                (sub._buffers if name in sub._buffers else sub._parameters)[name] = t
