"""The runners behind each inference engine: what runs a net's whole forward on ONNX Runtime,
OpenCV's dnn, ``torch.compile`` or in bfloat16, built from the net's current weights
(``WeightsWatch`` tells a runner its weights changed). Which one a net runs, and when, is
engines.py's choice."""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import operator
import os
import time
import warnings

import torch

from ..blob import param_views
from ..errors import NetError
from . import engine_cache

log = logging.getLogger("brewnet")
ONE_THREAD = "onnxruntime-1thread"      # ONNX Runtime on one thread: auto's pick for tiny nets
# ONNX Runtime whose pool sleeps as a run ends: the cores are free at once for what runs next
# (a cut net's eager tail, auto's candidate there; a user's own code between calls)
NO_SPIN = "onnxruntime-nospin"
ORT_ENGINES = ("onnxruntime", ONE_THREAD, NO_SPIN)      # the engines that need ONNX Runtime
OPSET = 18


def _need(module: str, engine: str, runtime: str, extra: str):
    """``module`` imported, or a one-line error naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise NetError(f"engine '{engine}' needs {runtime}: pip install 'brewnet[{extra}]'") from None


def need_onnxruntime():
    return _need("onnxruntime", "onnxruntime", "ONNX Runtime", "onnx")


_VERSION = operator.attrgetter("_version")


class WeightsWatch:
    """The weights a runner was built from: ``holds()`` while no parameter tensor of ``net`` was
    replaced, written in place (torch's version counters) or through a numpy view (blob.py).
    Checked at every steady call, so it makes no list of ids or of versions."""

    __slots__ = ("net", "views", "params", "total")

    def __init__(self, net):
        self.net, self.views = net, param_views()
        self.params = [t for layer in net.layer_list for t in layer.blobs]
        self.total = sum(map(_VERSION, self.params))

    def holds(self) -> bool:
        now = [t for layer in self.net.layer_list for t in layer.blobs]
        # the same tensor objects, by identity (== would ask a replaced tensor for its values),
        # then their versions: each counter only grows, so an equal sum is an equal list
        return (param_views() == self.views and len(now) == len(self.params)
                and all(map(operator.is_, now, self.params))
                and sum(map(_VERSION, now)) == self.total)


@contextlib.contextmanager
def quiet_exporter():
    """The ONNX exporter's progress notes (its passes log at INFO, torch warns of torchvision)
    are not the user's business while a forward picks an engine."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "onnxscript", "onnx_ir", "torch._export",
                                               "torch.export", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lvl in zip(loggers, levels):
            lg.setLevel(lvl)


def session_options(ort, threads: int, fixed: bool = False, spin: bool = True):
    """ONNX Runtime's defaults (one thread per physical core), but ``threads`` where the user
    fixed a thread count or ``fixed`` asks, no spin-wait of its pool after a run where ``spin``
    is False, and its notes kept out of the log."""
    from .threads import user_threads

    opts = ort.SessionOptions()
    if fixed or user_threads():
        opts.intra_op_num_threads = threads
    if not spin:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.log_severity_level = 3
    return opts


def from_onnx_file(net, cut, load):
    """``load(path)`` of the net's folded graph (its trunk: ``cut``) as ONNX, the file cached
    per weights (engine_cache.onnx_path), exported first where absent; a cached file that does
    not load (damaged) is exported again."""
    shapes = [tuple(net.shapes[n]) for n in net.inputs]
    path = engine_cache.onnx_path(net, shapes, OPSET, list(cut.outputs) if cut is not None else None)
    if not path.exists():
        _export(net, cut, path)
    try:
        return load(path)
    except Exception as e:   # noqa: BLE001 - a damaged cache file: export it again
        log.warning("engine cache: %s does not load (%s): written again", path, str(e)[:200])
        _export(net, cut, path)
        return load(path)


def _export(net, cut, path) -> None:
    from ..deploy import export_onnx, to_torch

    t0 = time.perf_counter()
    gm = to_torch(net, fold=True, dynamic_batch=False, cut=cut)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with quiet_exporter():
        export_onnx(gm, tmp, dynamic_batch=False, opset=OPSET)
    os.replace(tmp, path)
    log.debug("Net '%s': ONNX written in %.1f s", net.name, time.perf_counter() - t0)


class OnnxRuntimeEngine:
    """The net's folded graph as ONNX in an ONNX Runtime session (the file cached per weights)."""

    name = "onnxruntime"
    fresh = owned = True              # session.run returns new arrays each call

    def __init__(self, net, threads: int, cut=None, one_thread: bool = False, spin: bool = True):
        ort = need_onnxruntime()
        if one_thread:
            self.name, threads = ONE_THREAD, 1
        elif not spin:
            self.name = NO_SPIN
        self.net, self.state = net, WeightsWatch(net)
        self.outputs = list(cut.outputs if cut is not None else net.outputs)
        opts = session_options(ort, threads, fixed=one_thread, spin=spin)
        self.session = from_onnx_file(net, cut, lambda path: ort.InferenceSession(
            str(path), opts, providers=["CPUExecutionProvider"]))
        self.inputs = [i.name for i in self.session.get_inputs()]

    def __call__(self, xs):
        return tuple(map(torch.from_numpy, self.arrays([x.detach().contiguous().numpy() for x in xs])))

    def arrays(self, xs: list) -> list:
        """The outputs on C-contiguous float arrays ``xs``, as new arrays."""
        return self.session.run(self.outputs, dict(zip(self.inputs, xs)))


def need_openvino():
    return _need("openvino", "openvino", "OpenVINO", "openvino")


@functools.cache
def _ov_core():
    return need_openvino().Core()


def ov_config(threads: int) -> dict:
    """OpenVINO's CPU plugin set for one caller's latency, in float32 always (on a CPU with AMX
    or AVX512-BF16 it would otherwise run in bfloat16: not Caffe's numbers), on ``threads``
    where the user fixed a thread count, else its default (the cores)."""
    from .threads import user_threads

    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    if user_threads():
        config["INFERENCE_NUM_THREADS"] = threads
    return config


class OpenVinoEngine:
    """The net's folded graph (the ONNX file ONNX Runtime runs) compiled by OpenVINO's CPU
    plugin. One infer request, its inputs bound to the caller's arrays (shared memory, bound
    again only when other arrays come): cheaper than ``request.infer(dict)``, which builds a
    dict in and one out each call."""

    name = "openvino"
    fresh = True                      # __call__'s outputs (arrays' are not: owned False)
    owned = False

    def __init__(self, net, threads: int, cut=None):
        ov = need_openvino()
        self.net, self.state, self._tensor = net, WeightsWatch(net), ov.Tensor
        config = ov_config(threads)
        model = from_onnx_file(net, cut, lambda path: _ov_core().compile_model(str(path), "CPU", config))
        self.request = model.create_infer_request()
        self.inputs = _ports(model.inputs, net.inputs)
        self.outputs = _ports(model.outputs, cut.outputs if cut is not None else net.outputs)
        self._bound: list = []

    def __call__(self, xs):
        return tuple(torch.from_numpy(a.copy()) for a in self.arrays([x.detach().contiguous().numpy() for x in xs]))

    def arrays(self, xs: list) -> list:
        """The outputs on C-contiguous float arrays ``xs``: OpenVINO's own output buffers
        (``owned`` False: a blob copies them), rewritten by the next run."""
        request = self.request
        if len(xs) != len(self._bound) or not all(map(operator.is_, xs, self._bound)):
            for i, x in zip(self.inputs, xs):
                request.set_input_tensor(i, self._tensor(x, shared_memory=True))
            self._bound = list(xs)            # (kept alive: the request reads their memory)
        request.infer()
        return [request.get_output_tensor(i).data for i in self.outputs]


def _ports(ports, names) -> list[int]:
    """The index of each of ``names`` among a compiled model's ``ports`` (by tensor name)."""
    where = {n: i for i, port in enumerate(ports) for n in port.get_names()}
    missing = [n for n in names if n not in where]
    if missing:
        raise NetError(f"OpenVINO's model has no tensor named {missing[0]!r}")
    return [where[n] for n in names]


def compiled(gm, example: list, dynamic: bool):
    """``torch.compile`` of ``gm`` with inductor's freezing (weights as constants), compiled
    here on ``example``."""
    from torch._inductor import config

    with config.patch(freezing=True), torch.no_grad():
        fn = torch.compile(gm, dynamic=dynamic)
        fn(*example)
    return fn


class CompiledEngine:
    """``torch.compile`` (inductor, freezing: weights are constants) of the folded graph."""

    name = "compiled"

    def __init__(self, net, threads: int, cut=None):
        from ..deploy import to_torch

        self.net, self.state = net, WeightsWatch(net)
        gm = to_torch(net, fold=True, dynamic_batch=False, cut=cut).eval()
        t0 = time.perf_counter()
        self.fn = compiled(gm, [torch.randn(net.shapes[n]) for n in net.inputs], dynamic=False)
        log.info("Net '%s': compiled by torch.compile in %.1f s", net.name, time.perf_counter() - t0)

    def __call__(self, xs):
        with torch.no_grad():
            out = self.fn(*[x.contiguous() for x in xs])
        return out if isinstance(out, tuple) else (out,)


class OpenCVEngine:
    """OpenCV's dnn on the net's prototxt and current weights (the runtime many Caffe users
    deploy with; an independent importer: a net it reads otherwise fails the output check)."""

    name = "opencv"
    fresh = True                      # __call__'s outputs (arrays' are not: owned False)
    owned = False

    def __init__(self, net, threads: int, cut=None):
        import tempfile

        import cv2
        from google.protobuf import text_format

        self.net, self.state = net, WeightsWatch(net)
        param, keep = net.param, range(len(net.layer_list))
        if cut is not None:          # the trunk's layers only (the caffemodel's others are unread)
            keep = [i for i, layer in enumerate(net.layer_list) if layer.type == "Input" or i in set(cut.trunk)]
            param = type(net.param)()
            param.CopyFrom(net.param)
            del param.layer[:]
            param.layer.extend(net.param.layer[i] for i in keep)
        with tempfile.TemporaryDirectory(prefix="brewnet-opencv-") as d:
            proto, model = os.path.join(d, "net.prototxt"), os.path.join(d, "net.caffemodel")
            with open(proto, "w", encoding="utf-8") as f:
                f.write(text_format.MessageToString(param))
            net.save(model)
            self.cv = cv2.dnn.readNetFromCaffe(proto, model)
        cv2.setNumThreads(threads)
        # OpenCV names outputs by layer: the last layer writing each output blob
        producer = {t: net.layer_list[i].name for i in keep for t in net.top_lists[i]}
        self.layers = [producer[n] for n in (cut.outputs if cut is not None else net.outputs)]
        self.inputs = list(net.inputs)

    def __call__(self, xs):
        # its arrays may be the dnn's own buffers: copied (numpy, this thread), then fresh
        return tuple(torch.from_numpy(a.copy()) for a in self.arrays([x.detach().contiguous().numpy() for x in xs]))

    def arrays(self, xs: list) -> list:
        """The outputs on C-contiguous float arrays ``xs``: the dnn's own buffers (``owned``
        False: a blob copies them)."""
        for name, x in zip(self.inputs, xs):
            self.cv.setInput(x, name)
        return self.cv.forward(self.layers)


class Bf16Engine:
    """The folded graph in bfloat16 throughout, channels-last (``precision="bf16"``): oneDNN's
    AMX / AVX512-BF16 kernels; the outputs returned as float32. (Measured against autocast,
    which keeps some ops in fp32 and casts at every convolution: 1.4-2.3x slower here.)"""

    name = "bf16"
    fresh = True                      # .float() makes new tensors

    def __init__(self, net, threads: int, cut=None):
        from ..deploy import to_torch

        self.net, self.state = net, WeightsWatch(net)
        gm = to_torch(net, fold=True, dynamic_batch=False, cut=cut).eval().to(torch.bfloat16)
        self.gm = gm.to(memory_format=torch.channels_last)

    def __call__(self, xs):
        xs = [x.to(torch.bfloat16).contiguous(memory_format=torch.channels_last) if x.dim() == 4
              else x.to(torch.bfloat16) for x in xs]
        with torch.no_grad():
            out = self.gm(*xs)
        return tuple(o.float() for o in (out if isinstance(out, tuple) else (out,)))


def bf16_refusal() -> str | None:
    """Why this CPU cannot run ``precision="bf16"`` fast (None: it can)."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return (f"precision bf16 needs a CPU with AMX or AVX512-BF16 (this one: "
                f"{engine_cache.cpu_model()}); leave it at fp32")
    return None


def module_onnx(gm, folder):
    """``to_torch``'s module ``gm`` exported to ``folder``/net.onnx (its batch dynamic where
    the module's is), the path returned."""
    import pathlib

    from ..deploy import export_onnx

    path = pathlib.Path(folder) / "net.onnx"
    with quiet_exporter():
        export_onnx(gm, path, dynamic_batch=gm.dynamic_batch, opset=OPSET)
    return path


class ModuleOnnx:
    """``to_torch``'s module (any batch) as ONNX in ONNX Runtime, called as the module is."""

    name = "onnxruntime"

    def __init__(self, gm, threads: int, folder, one_thread: bool = False, spin: bool = True):
        ort = need_onnxruntime()
        path = module_onnx(gm, folder)
        self.session = ort.InferenceSession(str(path), session_options(ort, 1 if one_thread else threads,
                                                                       fixed=one_thread, spin=spin),
                                            providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name
        self.single = len(gm.output_names) == 1

    def __call__(self, x):
        outs = [torch.from_numpy(a) for a in self.session.run(None, {self.input: x.detach().contiguous().numpy()})]
        return outs[0] if self.single else tuple(outs)


class ModuleOpenVino:
    """``to_torch``'s module (any batch) as ONNX compiled by OpenVINO, called as the module is
    (one caller at a time: its infer request is locked)."""

    name = "openvino"

    def __init__(self, gm, threads: int, folder):
        import threading

        ov = need_openvino()
        path = module_onnx(gm, folder)
        self.request = _ov_core().compile_model(str(path), "CPU", ov_config(threads)).create_infer_request()
        self.tensor, self.lock = ov.Tensor, threading.Lock()
        self.single = len(gm.output_names) == 1

    def __call__(self, x):
        x = x.detach().contiguous().numpy()
        with self.lock:
            self.request.set_input_tensor(0, self.tensor(x, shared_memory=True))
            self.request.infer()
            outs = [torch.from_numpy(t.data.copy()) for t in self.request.output_tensors]
        return outs[0] if self.single else tuple(outs)
