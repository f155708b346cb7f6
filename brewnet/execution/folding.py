"""Inference-time folding of BatchNorm (global stats) and Scale into the convolution before them.

Deploy nets (ResNet, MobileNet, DenseNet...) write ``Convolution -> BatchNorm -> Scale`` in place
on one blob. When no gradient is needed and a forward covers the whole chain, the three become
one convolution whose weights and bias absorb the normalisation, as OpenCV and TensorRT do:

    y = ((W*x + b) - mean) / sqrt(var + eps) * s + t
      = (W * k) * x + ((b - mean) * k + t),   k = s / sqrt(var + eps)

The folded tensors are computed in float64, cached, and recomputed whenever a source tensor
changes (torch's version counter) or a numpy view of any parameter was handed out (writes through
numpy are invisible to torch). The blob's final value equals the unfolded chain's to float32
rounding (~1e-6 relative); ``forward(end=...)`` inside a chain runs the layers one by one.
"""
from __future__ import annotations

import torch

from .. import blob as _blob
from ..layers import functional as Fn


def _in_place(net, i: int, name: str) -> bool:
    return net.bottom_lists[i] == [name] and net.top_lists[i] == [name]


def find_chains(net) -> dict[int, int]:
    """{index of a foldable Convolution: index of the chain's last layer}."""
    chains, layers = {}, net.layer_list
    for i, conv in enumerate(layers[:-1]):
        if (conv.type != "Convolution" or len(conv.param.bottom) != 1 or len(conv.param.top) != 1
                or conv.axis != 1 or conv.num_spatial != 2):
            continue
        name = conv.param.top[0]
        bn = layers[i + 1]
        if bn.type != "BatchNorm" or not _in_place(net, i + 1, name) or not bn.use_global_stats:
            continue
        last = i + 1
        if i + 2 < len(layers):
            sc = layers[i + 2]
            if (sc.type == "Scale" and _in_place(net, i + 2, name) and sc.learned_scale
                    and tuple(sc.blobs[0].shape) == (conv.num_output,)
                    and sc.param.scale_param.axis in (1, -3)):
                last = i + 2
        chains[i] = last
    return chains


class Folder:
    """Folded (weight, bias) per chain, cached against the source tensors' versions."""

    def __init__(self, net):
        self.net = net
        self.chains = find_chains(net)
        self._cache: dict[int, tuple] = {}

    def _sources(self, i: int) -> list[torch.Tensor]:
        return [b for l in self.net.layer_list[i:self.chains[i] + 1] for b in l.blobs]

    def weights(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        src = self._sources(i)
        key = (_blob.param_views(), tuple((id(t), t._version) for t in src))
        hit = self._cache.get(i)
        if hit is not None and hit[0] == key:
            return hit[1]
        conv, bn = self.net.layer_list[i], self.net.layer_list[i + 1]
        d = torch.float64
        w = conv.blobs[0].detach().to(d)
        b = conv.blobs[1].detach().to(d) if conv.bias_term else torch.zeros(w.shape[0], dtype=d, device=w.device)
        mean, var, factor = (t.detach().to(d).reshape(-1) for t in bn.blobs)
        f = 0.0 if float(factor[0]) == 0 else 1.0 / float(factor[0])
        k = 1.0 / torch.sqrt(var * f + bn.eps)
        shift = -mean * f * k
        if self.chains[i] == i + 2:
            sc = self.net.layer_list[i + 2]
            s = sc.blobs[0].detach().to(d)
            k, shift = k * s, shift * s
            if sc.param.scale_param.bias_term:
                shift = shift + sc.blobs[1].detach().to(d)
        dtype = conv.blobs[0].dtype
        folded = ((w * k.view(-1, 1, 1, 1)).to(dtype), (b * k + shift).to(dtype))
        self._cache[i] = (key, folded)
        return folded

    def run(self, i: int, x: torch.Tensor) -> torch.Tensor:
        conv = self.net.layer_list[i]
        w, b = self.weights(i)
        return Fn.conv_nd(x, w, b, conv.stride, conv.pad, conv.dilation, conv.group)
