"""The Layer base class (the registry keyed by Caffe's type strings is ``registry.py``).

Lifecycle, owned by the base (``set_up``, Caffe's ``SetUp``): check the bottom/top counts,
``setup`` (Caffe's ``LayerSetUp``: read params, create ``blobs``, the learnable tensors in
``.caffemodel`` order), then ``reshape`` (top shapes for given bottom shapes; again whenever
inputs change, through ``top_shapes``). ``forward`` maps bottom tensors to top tensors with torch
ops; autograd gives backward unless Caffe's gradient deliberately differs (then the layer uses an
autograd.Function). What tools need to know of a layer it declares here too: ``routing`` (moves
values, computes nothing), ``flops``, and ``allow_backward`` (bottoms that take no gradient).

Adding a built-in layer: one subclass with ``@register("Type")`` and one reference test row;
a plugin (user code, installed packages): ``@brewnet.register_layer("Type")``, see ``registry``.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import ClassVar, Sequence

import torch

from .param_str import parse_params

Shape = tuple[int, ...]
_TRACING = contextvars.ContextVar("brewnet_tracing", default=False)


def tracing() -> bool:
    """Whether the layers run to be traced into a graph (``deploy.fx_export``), not computed: a
    check that reads values into Python (an index range) is left to the eager path there."""
    return _TRACING.get()


@contextlib.contextmanager
def traced():
    """The layers' forwards inside run to be traced (``tracing()`` is True)."""
    token = _TRACING.set(True)
    try:
        yield
    finally:
        _TRACING.reset(token)


class LayerError(ValueError):
    """A layer cannot be set up for the shapes it was given; the message names the layer."""


class Layer:
    """One Caffe layer.

    Subclasses set the class attributes below and override ``setup``/``reshape``/``forward``.
    ``self.blobs`` is the ordered list of parameter tensors (Caffe's ``layer.blobs``).
    """

    type: ClassVar[str] = ""
    # Bottom/top counts as Caffe checks them (None: not checked).
    exact_bottoms: ClassVar[int | None] = None
    min_bottoms: ClassVar[int | None] = None
    max_bottoms: ClassVar[int | None] = None
    exact_tops: ClassVar[int | None] = None
    min_tops: ClassVar[int | None] = None
    max_tops: ClassVar[int | None] = None
    # Loss layers: top[0] gets loss_weight 1 unless the prototxt says otherwise.
    is_loss: ClassVar[bool] = False
    # Layers whose top may be the same blob as their bottom without copying (ReLU, BatchNorm...).
    in_place_ok: ClassVar[bool] = True
    # set_up names the layer in any setup error; user code (Python layers) raises as it is.
    wrap_errors: ClassVar[bool] = True
    # Data and routing layers move or select values: no arithmetic (0 FLOPs).
    routing: ClassVar[bool] = False
    # How a float32 result relates to Caffe's: "exact" (integer-valued: indices, counts),
    # "elementwise" (each output from a few inputs: an ulp apart at most), or "reduction" (sums
    # over many inputs in another order than OpenBLAS: relative 1e-5-ish). Routing is elementwise.
    arithmetic: ClassVar[str] = "reduction"
    # Plugins: a dataclass that ``python_param.param_str`` is parsed into, as ``self.params``,
    # before ``setup`` (see param_str.py). None: no parsing (built-ins read their *_param).
    Params: ClassVar[type | None] = None

    def __init__(self, param, phase: int):
        self.param = param            # caffe_pb2.LayerParameter
        self.name: str = param.name
        self.phase: int = phase       # caffe_pb2.TRAIN (0) or TEST (1)
        self.blobs: list[torch.Tensor] = []
        self.params = None            # a Params instance once set up, when the class has Params

    # -- lifecycle -------------------------------------------------------------------------
    def set_up(self, bottom_shapes: Sequence[Shape]) -> list[Shape]:
        """Caffe's ``SetUp``: check counts, ``setup``, ``reshape``; returns the top shapes. An
        unexpected exception becomes a LayerError naming the layer and the bottom shapes (a
        NotImplementedError, which names the missing feature, passes as it is)."""
        shapes = [tuple(int(d) for d in s) for s in bottom_shapes]
        try:
            self.check_counts(len(shapes), self.num_tops)
            if self.Params is not None:
                self.params = self._parse_params()
            self.setup(shapes)
            return self.top_shapes(shapes)
        except (LayerError, NotImplementedError):
            raise
        except Exception as e:
            if not self.wrap_errors:
                raise
            raise LayerError(f"Layer '{self.name}' (type {self.type}) failed to set up for bottom "
                             f"shapes {shapes}: {e}") from e

    def top_shapes(self, bottom_shapes: Sequence[Shape]) -> list[Shape]:
        """``reshape`` with its result checked: one shape per top, as tuples of ints."""
        tops = [tuple(int(d) for d in s) for s in self.reshape(bottom_shapes)]
        if len(tops) != self.num_tops:
            raise self.fail(f"produced {len(tops)} top shapes for {self.num_tops} tops")
        return tops

    def setup(self, bottom_shapes: Sequence[Shape]) -> None:
        """Read params and create ``self.blobs`` (Caffe's LayerSetUp)."""

    def reshape(self, bottom_shapes: Sequence[Shape]) -> list[Shape]:
        """Return the top shapes for these bottom shapes; default: tops shaped as bottom 0."""
        return [tuple(bottom_shapes[0])] * self.num_tops

    def forward(self, bottoms: list[torch.Tensor]) -> list[torch.Tensor]:
        """The top tensors computed from the bottom tensors (Caffe's Forward); every layer overrides it."""
        raise NotImplementedError(f"{self.type} has no forward")

    # -- backward control ------------------------------------------------------------------
    def allow_backward(self, bottom_index: int) -> bool:
        """False for bottoms Caffe never differentiates (labels, indices): Caffe's
        ``AllowForceBackward``. The net detaches those bottoms."""
        return True

    def flops(self, bottom_shapes: Sequence[Shape], top_shapes: Sequence[Shape]) -> int:
        """FLOPs of one forward pass (a multiply-add counts 2). Default: one per output element
        (elementwise work), none for routing layers; layers with real arithmetic override."""
        return 0 if self.routing else sum(count(s) for s in top_shapes)

    # -- helpers ---------------------------------------------------------------------------
    def _parse_params(self):
        try:
            return parse_params(self.Params, self.param.python_param.param_str)
        except ValueError as e:
            raise self.fail(f"python_param.param_str: {e}") from None

    @property
    def num_tops(self) -> int:
        """The number of tops the LayerParameter names."""
        return len(self.param.top)

    def fail(self, msg: str) -> LayerError:
        """An error naming this layer: ``raise self.fail("...")``."""
        return LayerError(f"Layer '{self.name}' (type {self.type}): {msg}")

    def check_counts(self, n_bottoms: int, n_tops: int) -> None:
        """Raise a LayerError when the bottom or top count is outside the class's limits
        (``exact_*``/``min_*``/``max_*``)."""
        def check(what, n, exact, lo, hi):
            if exact is not None and n != exact:
                raise self.fail(f"takes {exact} {what} blob(s), got {n}")
            if lo is not None and n < lo:
                raise self.fail(f"takes at least {lo} {what} blob(s), got {n}")
            if hi is not None and n > hi:
                raise self.fail(f"takes at most {hi} {what} blob(s), got {n}")

        check("bottom", n_bottoms, self.exact_bottoms, self.min_bottoms, self.max_bottoms)
        check("top", n_tops, self.exact_tops, self.min_tops, self.max_tops)

    def new_blob(self, shape: Sequence[int], filler=None) -> torch.Tensor:
        """A float32 parameter tensor filled by a FillerParameter (None: zeros)."""
        from ..fillers import fill

        t = torch.zeros(tuple(int(d) for d in shape), dtype=torch.float32)
        if filler is not None:
            fill(t, filler)
        return t.requires_grad_(True)

    def extra_repr(self) -> str:
        """Extra ``key=value`` text for ``repr``; empty by default."""
        return ""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}{', ' + self.extra_repr() if self.extra_repr() else ''})"


def canonical_axis(axis: int, num_axes: int, who: Layer | None = None) -> int:
    """Caffe's ``Blob::CanonicalAxisIndex``: negative axes count from the end."""
    if not -num_axes <= axis < num_axes:
        msg = f"axis {axis} out of range for a {num_axes}-D blob"
        raise who.fail(msg) if who is not None else LayerError(msg)
    return axis + num_axes if axis < 0 else axis


def count(shape: Sequence[int], start: int = 0, end: int | None = None) -> int:
    """Product of ``shape[start:end]`` (Caffe's ``Blob::count``)."""
    n = 1
    for d in shape[start:end]:
        n *= int(d)
    return n
