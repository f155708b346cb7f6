"""The Caffe side of a conversion: a ``Writer`` walks a ``Graph`` and appends layers (with their
weights as blobs) to one NetParameter, op by op (``ops.HANDLERS``), and provides the
compositions several ops share (clip, explicit padding, slicing, broadcasting)."""
from __future__ import annotations

import numpy as np

from ..proto import caffe_pb2 as pb
from ..proto.io import array_to_blob
from .dialects import check_layer_type
from .graph import DIALECTS, ConversionError, Graph, Node, Unsupported


class Writer:
    def __init__(self, g: Graph, dialect: str = "bvlc", fold_bn: bool = False,
                 input_names=None, name: str = "net", check_only: bool = False):
        if dialect not in DIALECTS:
            raise ConversionError(f"dialect '{dialect}': expected one of {', '.join(DIALECTS)}")
        self.g, self.dialect, self.fold_bn, self.check_only = g, dialect, fold_bn, check_only
        self.net = pb.NetParameter(name=name)
        self.blob: dict = {}            # graph value -> Caffe blob
        self.shape: dict = {}           # Caffe blob -> shape
        self.producer: dict = {}        # Caffe blob -> LayerParameter
        self.names: set = set()
        self.mapped: list = []          # (graph value, Caffe blob, layer name), in order
        self.problems: list = []        # (op, why, could, source) in check mode
        self.use = g.consumers()
        self.node: Node | None = None
        if input_names is None:
            input_names = ["data"] if len(g.inputs) == 1 else [f"data{i}" for i in range(len(g.inputs))]
        if len(input_names) != len(g.inputs):
            raise ConversionError(f"{len(input_names)} input names for {len(g.inputs)} inputs")
        for v, nm in zip(g.inputs, input_names):
            top = self.layer("Input", [], nm, input_param={"shape": [{"dim": list(g.shapes[v])}]},
                             shape=g.shapes[v], exact=True)
            self.bind(v, top, record=False)

    # -- bookkeeping ---------------------------------------------------------------------------
    def uniq(self, name: str) -> str:
        name = name or "layer"
        out, i = name, 1
        while out in self.names:
            out, i = f"{name}_{i}", i + 1
        self.names.add(out)
        return out

    def base(self) -> str:
        n = self.node
        return n.path if n.path and n.path not in self.names else \
            (f"{n.path}.{n.op}" if n.path else n.outs[0])

    def layer(self, type_: str, bottoms, name: str, tops=None, blobs=(), shape=None,
              exact: bool = False, **params):
        """Append a layer; returns its top (or tops when ``tops`` is a count)."""
        check_layer_type(self.dialect, type_)
        lp = self.net.layer.add()
        lp.name = name if exact else self.uniq(name)
        if exact:
            self.names.add(name)
        lp.type = type_
        lp.bottom.extend(bottoms)
        n_tops = 1 if tops is None else tops
        names = [lp.name] if n_tops == 1 else [f"{lp.name}_{i}" for i in range(n_tops)]
        lp.top.extend(names)
        for k, v in params.items():
            _fill(getattr(lp, k), v)
        for b in blobs:
            lp.blobs.append(array_to_blob(np.asarray(b, dtype=np.float32)))
        for t in names:
            self.producer[t] = lp
        if shape is not None:
            shapes = shape if n_tops != 1 else [shape]
            for t, s in zip(names, shapes):
                self.shape[t] = tuple(s)
        return names[0] if tops is None else names

    def bind(self, value: str, top: str, record: bool = True) -> None:
        self.blob[value] = top
        if top not in self.shape and value in self.g.shapes:
            self.shape[top] = tuple(self.g.shapes[value])
        if record:
            self.mapped.append((value, top, self.producer[top].name if top in self.producer else top))

    def x(self, v) -> str:
        """The Caffe blob of graph value ``v``; a constant becomes a Parameter layer."""
        if v in self.blob:
            return self.blob[v]
        if self.g.is_const(v):
            arr = self.g.consts[v]
            top = self.layer("Parameter", [], f"const.{v}", blobs=[arr], shape=arr.shape,
                             parameter_param={"shape": {"dim": list(arr.shape)}})
            self.blob[v] = top
            return top
        raise ConversionError(f"internal: value '{v}' used before it is written")

    def shp(self, v) -> tuple:
        return tuple(self.g.shapes[v])

    # -- the walk ------------------------------------------------------------------------------
    def run(self):
        from . import ops_more  # noqa: F401  (registers the rest of the ops)
        from .ops import HANDLERS

        for n in self.g.nodes:
            self.node = n
            if n.op == "identity":
                src = n.ins[0] if n.ins else None
                if src is not None:
                    self.blob[n.outs[0]] = self.x(src)
                continue
            try:
                handler = HANDLERS.get(n.op)
                if handler is None:
                    raise Unsupported("has no Caffe mapping in brewnet")
                handler(self, n)
            except Unsupported as e:
                if not self.check_only:
                    raise ConversionError(describe(n, e, self.dialect)) from None
                self.problems.append((n.target or n.op, e.why, e.could, n.source))
                for o in n.outs:
                    self.blob[o] = f"?{o}"
                    self.shape[f"?{o}"] = self.g.shapes.get(o)
        self._silence_unused()
        return self.net

    def _silence_unused(self) -> None:
        used = {b for lp in self.net.layer for b in lp.bottom}
        outs = {self.blob.get(v) for v in self.g.outputs}
        if not any(t not in used and t not in outs for lp in self.net.layer for t in lp.top):
            return
        layers = list(self.net.layer)
        del self.net.layer[:]
        for lp in layers:      # a Silence right after the layer, so the last layer is an output's
            self.net.layer.add().CopyFrom(lp)
            dangling = [t for t in lp.top if t not in used and t not in outs]
            if dangling:
                self.layer("Silence", dangling, f"{lp.name}/silence", tops=0)

    def outputs(self) -> list:
        return [self.blob[v] for v in self.g.outputs]

    # -- shared compositions -------------------------------------------------------------------
    def power(self, x, name, power=1.0, scale=1.0, shift=0.0):
        p = {k: float(v) for k, v, d in (("power", power, 1), ("scale", scale, 1), ("shift", shift, 0))
             if v != d}
        return self.layer("Power", [x], name, shape=self.shape[x], power_param=p)

    def relu(self, x, name, slope=0.0):
        return self.layer("ReLU", [x], name, shape=self.shape[x],
                          **({"relu_param": {"negative_slope": float(slope)}} if slope else {}))

    def eltwise(self, bottoms, name, op="SUM", coeff=None):
        p = {"operation": getattr(pb.EltwiseParameter, op)}
        if coeff is not None:
            p["coeff"] = [float(c) for c in coeff]
        return self.layer("Eltwise", list(bottoms), name, shape=self.shape[bottoms[0]], eltwise_param=p)

    def clip(self, x, name, lo=None, hi=None):
        """min(max(x, lo), hi): ReLU6/Clip in forks; in BVLC, ReLUs and Power shifts:
        t = relu(x - lo); y = t - relu(t - (hi - lo)) + lo (exact wherever x is in range)."""
        lo = None if lo is not None and lo <= -1e30 else lo     # -FLT_MAX guards: no bound
        hi = None if hi is not None and hi >= 1e30 else hi
        if lo is None and hi is None:
            return x
        if self.dialect == "forks" and lo is not None and hi is not None:
            if (lo, hi) == (0, 6):
                return self.layer("ReLU6", [x], name, shape=self.shape[x])
            return self.layer("Clip", [x], name, shape=self.shape[x], clip_param={"min": lo, "max": hi})
        if lo is None:       # min(x, hi) = hi - relu(hi - x)
            t = self.power(x, f"{name}/neg", scale=-1.0, shift=hi)
            t = self.relu(t, f"{name}/relu")
            return self.power(t, name, scale=-1.0, shift=hi)
        t = self.power(x, f"{name}/shift", shift=-lo) if lo else x
        t = self.relu(t, f"{name}/relu" if hi is not None or lo else name)
        if hi is not None:
            u = self.power(t, f"{name}/over", shift=-(hi - lo))
            u = self.relu(u, f"{name}/relu_over")
            t = self.eltwise([t, u], f"{name}/clip" if lo else name, coeff=[1, -1])
        if lo:
            t = self.power(t, name, shift=lo)
        return t

    def slice(self, x, axis: int, points, name):
        """Caffe Slice at ``points`` along ``axis``: the pieces' tops (unused ones are silenced
        at the end)."""
        s = list(self.shape[x])
        edges = [0] + list(points) + [s[axis]]
        shapes = [tuple(s[:axis] + [b - a] + s[axis + 1:]) for a, b in zip(edges, edges[1:])]
        if not points:
            return [x]
        return self.layer("Slice", [x], name, tops=len(shapes), shape=shapes,
                          slice_param={"axis": axis, "slice_point": list(points)})

    def crop_to(self, x, out_shape, name):
        """Keep the leading ``out_shape`` of every axis (the extra rows Caffe's ceil adds)."""
        for axis in range(len(out_shape)):
            if self.shape[x][axis] > out_shape[axis]:
                x = self.slice(x, axis, [out_shape[axis]], f"{name}/crop{axis}")[0]
        return x

    def pad(self, x, pads, value, name):
        """Explicit constant padding of H and W (``pads`` top, left, bottom, right): rows of
        ``value`` made from a row of x by Power(scale=0) and Tile, then Concat."""
        for axis, (a, b) in ((2, (pads[0], pads[2])), (3, (pads[1], pads[3]))):
            if not a and not b:
                continue
            row = self.slice(x, axis, [1] if self.shape[x][axis] > 1 else [], f"{name}/row{axis}")[0]
            const = self.power(row, f"{name}/fill{axis}", scale=0.0, shift=value)
            parts = []
            for k, side in ((a, "before"), (b, "after")):
                if k == 0:
                    parts.append(None)
                    continue
                t = const
                if k > 1:
                    s = list(self.shape[const])
                    s[axis] = k
                    t = self.layer("Tile", [const], f"{name}/{side}{axis}", shape=s,
                                   tile_param={"axis": axis, "tiles": k})
                parts.append(t)
            bottoms = [p for p in (parts[0], x, parts[1]) if p is not None]
            s = list(self.shape[x])
            s[axis] += a + b
            x = self.layer("Concat", bottoms, f"{name}/pad{axis}", shape=s, concat_param={"axis": axis})
        return x

    def reshape(self, x, shape, name):
        shape = tuple(shape)
        if self.shape[x] == shape:
            return x
        dims = [0 if i == 0 and self.shape[x] and d == self.shape[x][0] else d for i, d in enumerate(shape)]
        return self.layer("Reshape", [x], name, shape=shape, reshape_param={"shape": {"dim": dims}})


def describe(n: Node, e: Unsupported, dialect: str) -> str:
    where = f" at {n.source}" if n.source else ""
    could = [d for d in e.could if d != dialect]
    alt = (f"; the {'/'.join(could)} dialect{'s' if len(could) > 1 else ''} can write it "
           f"(--dialect {could[0]})") if could else "; no dialect writes it"
    return f"{n.target or n.op} {e.why} in the {dialect} dialect{where}{alt}"


def _fill(msg, value) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            f = getattr(msg, k)
            if isinstance(v, dict):
                _fill(f, v)
            elif isinstance(v, list):
                if v and isinstance(v[0], dict):
                    for item in v:
                        _fill(f.add(), item)
                else:
                    f.extend(v)
            elif msg.DESCRIPTOR.fields_by_name[k].is_repeated:     # repeated scalar
                f.append(v)
            else:
                setattr(msg, k, v)
    else:
        raise TypeError(value)


__all__ = ["Writer", "describe"]
