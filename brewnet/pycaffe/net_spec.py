"""pycaffe's NetSpec: write a NetParameter in Python (``n.to_proto()`` gives it).

    from brewnet import layers as L, params as P, NetSpec
    n = NetSpec()
    n.data, n.label = L.DummyData(shape=[dict(dim=[8, 1, 28, 28]), dict(dim=[8])], ntop=2)
    n.conv = L.Convolution(n.data, num_output=20, kernel_size=5, weight_filler=dict(type="xavier"))
    n.pool = L.Pooling(n.conv, pool=P.Pooling.MAX, kernel_size=2, stride=2)
    n.loss = L.SoftmaxWithLoss(L.InnerProduct(n.pool, num_output=10), n.label)

Keyword arguments go to the layer's ``<type>_param`` message when it has that field, else to the
LayerParameter (``include``, ``loss_weight``...; names ending in ``param`` always). Lists fill
repeated fields, dicts messages; ``ntop`` and ``in_place`` shape the tops; unnamed tops: ``<Type><n>``.
"""
from __future__ import annotations

from collections import Counter, OrderedDict

from ..proto import caffe_pb2 as pb

# "Convolution" -> "convolution_param", from the LayerParameter schema itself.
_PARAM_FIELD = {f.message_type.name[:-len("Parameter")]: f.name
                for f in pb.LayerParameter.DESCRIPTOR.fields
                if f.name.endswith("_param") and f.message_type is not None}


def assign(msg, name: str, value) -> None:
    """Set ``msg.name`` from a Python value: list -> repeated, dict -> message, else scalar."""
    if isinstance(value, (list, tuple)):
        field = getattr(msg, name)
        for item in value:
            if isinstance(item, dict):
                sub = field.add()
                for k, v in item.items():
                    assign(sub, k, v)
            else:
                field.append(item)
    elif isinstance(value, dict):
        sub = getattr(msg, name)
        if hasattr(sub, "add"):      # one dict for a repeated message: one element
            sub = sub.add()
        for k, v in value.items():
            assign(sub, k, v)
    else:
        field = msg.DESCRIPTOR.fields_by_name.get(name)
        if isinstance(value, bool) and field is not None and field.enum_type is not None:
            value = int(value)   # brewnet's bool-like enums (pad_out_h, reverse) take True/False
        try:
            setattr(msg, name, value)
        except AttributeError:   # a repeated scalar given one value
            getattr(msg, name).append(value)


class Top:
    """One output of a Function; pass it as a bottom to other layers."""

    def __init__(self, fn: "Function", n: int):
        self.fn, self.n = fn, n

    def to_proto(self) -> "pb.NetParameter":
        """The NetParameter that computes this top."""
        return to_proto(self)


class Function:
    """A layer call ``L.Type(*bottoms, **params)`` waiting to be written out."""

    def __init__(self, type_name: str, inputs, params: dict):
        for i, inp in enumerate(inputs):
            if not isinstance(inp, Top):
                raise TypeError(f"{type_name} input {i} is not a Top (type is {type(inp)})")
        self.type_name, self.inputs = type_name, list(inputs)
        self.params = dict(params)
        self.ntop = self.params.pop("ntop", 1)
        self.in_place = self.params.pop("in_place", False)
        self.tops = tuple(Top(self, i) for i in range(self.ntop))

    def _auto(self, autonames: Counter) -> str:
        autonames[self.type_name] += 1
        return f"{self.type_name}{autonames[self.type_name]}"

    def _top_name(self, top: Top, names: dict, autonames: Counter) -> str:
        if top not in names:
            names[top] = self._auto(autonames)
        return names[top]

    def _layer_name(self, names: dict, autonames: Counter) -> str:
        if self not in names:
            names[self] = self._top_name(self.tops[0], names, autonames) if self.tops \
                else self._auto(autonames)
        return names[self]

    def write(self, layers: OrderedDict, names: dict, autonames: Counter) -> None:
        """Add this layer's LayerParameter to ``layers`` (its inputs' first), naming tops and layer
        from ``names`` or automatically (``<Type><n>``)."""
        if self in layers:
            return
        bottoms = []
        for inp in self.inputs:
            inp.fn.write(layers, names, autonames)
            bottoms.append(layers[inp.fn].top[inp.n])
        lp = pb.LayerParameter(type=self.type_name, bottom=bottoms)
        lp.top.extend(bottoms if self.in_place else
                      [self._top_name(t, names, autonames) for t in self.tops])
        lp.name = self._layer_name(names, autonames)
        field = _PARAM_FIELD.get(self.type_name)
        for k, v in self.params.items():
            if k.endswith("param") or field is None or not hasattr(getattr(lp, field), k):
                assign(lp, k, v)
            else:
                assign(getattr(lp, field), k, v)
        layers[self] = lp


class NetSpec:
    """Tops assigned as attributes (or items) name the layers and blobs that make them."""

    def __init__(self):
        super().__setattr__("tops", OrderedDict())

    def __setattr__(self, name, value):
        self.tops[name] = value

    def __getattr__(self, name):
        try:
            return self.tops[name]
        except KeyError:
            raise AttributeError(name) from None

    __setitem__ = __setattr__
    __getitem__ = __getattr__

    def keys(self):
        """The names of the assigned tops, in assignment order."""
        return list(self.tops)

    def to_proto(self) -> "pb.NetParameter":
        """The NetParameter of every assigned top, layers and blobs named as assigned."""
        names = {top: name for name, top in self.tops.items()}
        autonames, layers = Counter(), OrderedDict()
        for top in self.tops.values():   # a Top, or the Function of an ntop=0 layer
            (top.fn if isinstance(top, Top) else top).write(layers, names, autonames)
        net = pb.NetParameter()
        net.layer.extend(layers.values())
        return net


def to_proto(*tops: Top) -> "pb.NetParameter":
    """The NetParameter that computes ``tops`` (pycaffe's ``caffe.to_proto``)."""
    layers, autonames = OrderedDict(), Counter()
    for top in tops:
        top.fn.write(layers, {}, autonames)
    net = pb.NetParameter()
    net.layer.extend(layers.values())
    return net


def layer_fn(type_name: str):
    """``L.<type_name>``: a function of bottoms and params giving its top(s)."""

    def make(*bottoms, **params):
        fn = Function(type_name, bottoms, params)
        return fn if fn.ntop == 0 else fn.tops[0] if fn.ntop == 1 else fn.tops

    make.__name__ = type_name
    return make


class Parameters:
    """``P.Pooling.MAX`` is ``caffe_pb2.PoolingParameter.MAX``."""

    def __getattr__(self, name):
        class Param:
            def __getattr__(_, enum):
                return getattr(getattr(pb, name + "Parameter"), enum)

        return Param()


params = Parameters()
