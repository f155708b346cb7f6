"""A recording captured as a CUDA graph: one launch replays a whole step.

The recorded step (``recorded_step.py``) removes a small net's Python; here its recording is
captured with ``torch.cuda.graphs``, so the forward-backward, and with the recorded update
(``recorded_update.py``) the update too, is one ``CUDAGraph.replay()``. A CUDA graph reads fixed
memory: each step the inputs (the data layers' tops, made eagerly) are copied into static buffers,
and the outputs come back in the graph's own memory, rewritten by the next replay as a Caffe
blob's is by the next forward; params are read in place, and a new param tensor re-captures.
Invariant: a capture's first replay gives the eager step's bits (loss, tops, gradients), else the
eager step stays, with a warning; with the update, the bits of the recording and the recorded
update run one after the other, else those two stay. ``CapturedGraph`` is the generic part, also
used by lean inference (``execution/lean.py``). The details: docs/internals.md, *Design notes by module*.
"""
from __future__ import annotations

import logging
import threading

import torch

from .recorded_step import DEVICE_GRAPHS, StepGraph, as_param_grad
from .recording import same_bits

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
    """``fn(*xs)`` (a function of tensors returning a tuple of tensors, with no host reads)
    captured as a CUDA graph on inputs shaped like ``xs``. Calling it copies new inputs into
    the static buffers and replays; the outputs are the graph's own tensors. ``state``: tensors
    ``fn`` writes in place (a solver's params and history): put back after the warm-up runs,
    so only replays move them."""

    def __init__(self, fn, xs, state=()):
        self.device = next((x.device for x in xs if x.is_cuda), torch.device("cuda", torch.cuda.current_device()))
        with _CAPTURING, torch.cuda.device(self.device):
            self._capture(fn, [x.detach().clone() for x in xs], list(state))

    def _capture(self, fn, static, state) -> None:
        self.static = static
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(WARMUP):
                fn(*self.static)
            for t, v in zip(state, saved):
                t.copy_(v)
        torch.cuda.current_stream().wait_stream(side)
        del saved
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
    """The step graph of a net on CUDA: recorded as on the CPU, then captured (see above);
    with the solver's recorded update (recorded_update.py) forward, backward and update are
    captured as one graph (``_whole``), checked against the two run one after the other."""

    KIND = "CUDA graph"

    def __init__(self, net):
        super().__init__(net)
        self.whole, self.whole_key = None, None   # the step with the update, and what it fits
        self._checking = False

    def wants_update(self) -> bool:
        return True

    def capture(self, xs, eager) -> bool:
        self._checking = True       # the capture's check compares forward-backward alone
        try:
            return super().capture(xs, eager)
        finally:
            self._checking = False

    def _prepare(self, xs) -> bool:
        self.whole, self.whole_key = None, None
        # an op that cannot be captured (a host sync...) raises: the step graph's guard logs it
        # and keeps the eager step
        self.captured = CapturedGraph(self.gm.forward, xs)
        return True

    def _run(self, xs) -> tuple:
        upd = self.update
        if self._checking or not upd or self.whole is False or not upd.usable():
            return self.captured(xs)
        key = (upd.key, tuple(id(t) for t in upd.solver.net.learnable),
               tuple(id(h) for h in upd.solver.history))
        if self.whole is None or key != self.whole_key:
            self.whole_key = key
            return self._capture_whole(xs, upd)
        out = self.whole([*xs, upd.host_scalars()])
        return self._took(out, upd)

    # -- forward, backward and update as one graph ---------------------------------------
    def _whole_fn(self, upd):
        """The step with the update: the recorded forward-backward, each learnable param's
        gradient (a zero one where the net makes none, as the eager update's), the update."""
        solver, fb, ugm = upd.solver, self.gm.forward, upd.gm.forward
        slot, i = {}, 1 + len(self._core_tops)     # the gradients' places in fb's outputs
        for p, h in zip(self.params, self.has_grad):
            if h:
                slot[id(p)] = i
                i += 1
        where = [slot.get(id(t)) for t in solver.net.learnable]
        learn = [t.detach() for t in solver.net.learnable]
        hist = list(solver.history)

        def step(*args):
            xs, scalars = args[:-1], args[-1]
            out = list(fb(*xs))
            return (*out, *with_update(out, ugm, scalars))

        def with_update(out, ugm, scalars) -> list:
            """The update on fb's outputs ``out`` (its gradients put in the params' layout, in
            place in ``out``: they hold the steps after); the made zero gradients and the
            update's outputs."""
            grads = []
            for j, t in zip(where, learn):
                if j is not None:
                    out[j] = as_param_grad(out[j], t)
                grads.append(out[j] if j is not None else torch.zeros_like(t))
            made = [g for g, j in zip(grads, where) if j is None]
            return [*made, *ugm(*grads, *learn, *hist, scalars)]
        self._with_update = with_update
        return step, learn + hist, where

    def _took(self, out, upd) -> tuple:
        """The forward-backward part of the whole step's outputs ``out``; the rest (the
        gradients the net makes none of, the update's outputs) where the loop finds them."""
        n = self._n_fb
        made = iter(out[n:n + self._n_made])
        for t, j in zip(upd.solver.net.learnable, self._where):
            if j is None:
                t.grad = next(made)
        self.updated_at, self.update_out = upd.solver.iter, out[n + self._n_made:]
        return out[:n]

    def _capture_whole(self, xs, upd):
        """Capture forward, backward and update as one graph and take this iteration's step
        with it, checked bit for bit against the forward-backward graph and the recorded update
        run one after the other on the same state. On a failure or a difference the step is the
        two's (``whole`` False: they stay two for this net)."""
        fn, state, where = self._whole_fn(upd)
        scalars = upd.host_scalars().to(self.net.device)   # its static buffer on the device
        before = [t.clone() for t in state]
        fb = [t.clone() for t in self.captured(xs)]
        rest = self._with_update(fb, lambda *a: upd.run(a[:-1 - len(state)], a[-1]), scalars)
        ref = (*fb, *[t.clone() for t in rest])
        ref_state = [t.clone() for t in state]
        for t, b in zip(state, before):
            t.copy_(b)
        try:
            self.whole = CapturedGraph(fn, [*xs, scalars], state=state)
            got = self.whole([*xs, scalars])
        except Exception as e:      # noqa: BLE001 - the step stays two graphs
            got, why = None, str(e).splitlines()[0][:200]
        if got is None or not (len(got) == len(ref) and all(same_bits(a, b) for a, b in zip(got, ref))
                               and all(same_bits(a, b) for a, b in zip(state, ref_state))):
            log.warning("step graph: the CUDA graph of forward, backward and update %s; net "
                        "'%s' keeps them as two", f"failed ({why})" if got is None else
                        "differs from the two", self.net.name)
            self.whole = False
            for t, r in zip(state, ref_state):      # the step as the two graphs took it
                t.copy_(r)
            got = ref
        self._n_fb, self._where = len(fb), where
        self._n_made = sum(j is None for j in where)
        if self.whole:
            log.info("Net '%s': forward, backward and the %s update replayed as one CUDA graph",
                     self.net.name, upd.solver.solver_type)
        return self._took(got, upd)


DEVICE_GRAPHS["cuda"] = (CudaStepGraph, device_refusal)
