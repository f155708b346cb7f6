"""Weights in and out of a Net: ``.caffemodel`` (binary NetParameter, any legacy version) and
Caffe's HDF5 format (``/data/<layer>/<i>``). Layers are matched by name, as Caffe does; a layer's
``blobs`` are in file order, so loading is one loop with a count and shape check."""
from __future__ import annotations

import logging
import os

import numpy as np
import torch

from .errors import NetError
from .proto import caffe_pb2 as pb

log = logging.getLogger("brewnet")


def _shape_fits(src_shape, blob_proto, dst_shape) -> bool:
    """Caffe's ``Blob::ShapeEquals``: legacy 4-D num/channels/height/width match an N-D shape
    (at most 4 axes) left-padded with 1s."""
    if blob_proto is not None and not blob_proto.HasField("shape") and any(
            blob_proto.HasField(f) for f in ("num", "channels", "height", "width")):
        if len(dst_shape) > 4:
            return False
        padded = (1,) * (4 - len(dst_shape)) + tuple(dst_shape)
        return tuple(src_shape) == padded
    return tuple(src_shape) == tuple(dst_shape)


def _check_layer(net, name: str, arrays: list, protos: list | None, source: str) -> None:
    layer = net.layer_by_name[name]
    if len(arrays) != len(layer.blobs):
        raise NetError(f"{source}: layer '{name}' has {len(arrays)} blobs in the file but "
                         f"{len(layer.blobs)} in the net (type {layer.type})")
    for i, arr in enumerate(arrays):
        dst = tuple(layer.blobs[i].shape)
        if not _shape_fits(arr.shape, protos[i] if protos else None, dst):
            raise NetError(f"{source}: cannot copy param {i} weights from layer '{name}'; shape "
                             f"mismatch. Source param shape is {tuple(arr.shape)}; target param shape is "
                             f"{dst}. To learn this layer's parameters from scratch rather than "
                             f"copying from a saved net, rename the layer.")


def _copy_all(net, found: list, source: str) -> None:
    """Check every layer first, then copy: a bad file leaves the net as it was."""
    for name, arrays, protos in found:
        _check_layer(net, name, arrays, protos, source)
    with torch.no_grad():
        for name, arrays, _ in found:
            for dst, arr in zip(net.layer_by_name[name].blobs, arrays):
                dst.copy_(torch.from_numpy(np.ascontiguousarray(arr)).reshape(dst.shape))


def _fits(net, found_layer, source: str) -> bool:
    try:
        _check_layer(net, *found_layer, source)
        return True
    except NetError as e:
        log.warning("%s; it keeps its filler values", e)
        return False


def load_weights(net, path, require_match: bool = False, reinit_mismatched: bool = False) -> list[str]:
    """Copy the layers of ``path`` whose names are in ``net`` (Caffe's ``CopyTrainedLayersFrom``).

    Layers of the net with parameters that the file does not hold keep their filler values,
    as in Caffe, with a warning naming them; with ``require_match`` a file that gives no such
    layer any weights (another net's file) is a NetError. A layer whose params differ from the
    file's in count or shape is a NetError, or with ``reinit_mismatched`` (owl's finetuning
    rule) keeps its filler values too. Returns the layers left unloaded."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"weights file not found: {path}")
    with open(path, "rb") as f:
        is_h5 = f.read(8) == b"\x89HDF\r\n\x1a\n"
    found = _read_h5(net, path) if is_h5 else _read_caffemodel(net, path)
    if reinit_mismatched:
        found = [f for f in found if _fits(net, f, path)]
    loaded = {name for name, arrays, _ in found if arrays}
    with_params = [l.name for l in net.layer_list if l.blobs]
    left = [name for name in with_params if name not in loaded]
    if require_match and left and len(left) == len(with_params):

        raise NetError(f"{path}: no layer with parameters of net '{net.name}' is in this weights "
                       f"file (layers are matched by name; the net's are "
                       f"{', '.join(left[:8])}{', ...' if len(left) > 8 else ''}); is it the "
                       "weights of another net?")
    _copy_all(net, found, path)
    if left:
        log.warning("%s: %d of %d layers with parameters are not in the file and keep their "
                    "filler values: %s", path, len(left), len(with_params), ", ".join(left))
    return left


def _read_caffemodel(net, path: str) -> list:
    from .proto.io import blob_to_array, read_binary
    from .proto.upgrade import upgrade_net

    src = upgrade_net(read_binary(path, pb.NetParameter()), path)
    found = []
    for lp in src.layer:
        if lp.name not in net.layer_by_name:
            log.info("Ignoring source layer %s", lp.name)
            continue
        found.append((lp.name, [blob_to_array(b) for b in lp.blobs], list(lp.blobs)))
    return found


def _read_h5(net, path: str) -> list:
    """``/data/<layer>/<0..n-1>`` numeric datasets; anything else is a ProtoError naming the
    file (h5py's own KeyError/TypeError/OSError name neither file nor layer)."""
    import h5py

    from .proto.errors import ProtoError

    found = []
    try:
        with h5py.File(path, "r") as f:
            data = f.get("data")
            if not isinstance(data, h5py.Group):
                raise ProtoError(f"{path}: not a Caffe HDF5 weights file: no /data group "
                                 f"(top-level entries: {sorted(f)[:8]})")
            for name in data:
                if name not in net.layer_by_name:
                    log.info("Ignoring source layer %s", name)
                    continue
                group = data[name]
                if not isinstance(group, h5py.Group):
                    raise ProtoError(f"{path}: /data/{name} should be a group of datasets 0..n-1")
                n = len(group)
                if set(group) != {str(i) for i in range(n)}:
                    raise ProtoError(f"{path}: layer '{name}': datasets must be named 0..{n - 1}, "
                                     f"got {sorted(group, key=lambda k: (len(k), k))}")
                arrays = []
                for i in range(n):
                    ds = group[str(i)]
                    if not isinstance(ds, h5py.Dataset) or ds.dtype.kind not in "fiub":
                        what = ds.dtype if isinstance(ds, h5py.Dataset) else type(ds).__name__
                        raise ProtoError(f"{path}: layer '{name}': /data/{name}/{i} is not a "
                                         f"numeric dataset ({what})")
                    arrays.append(np.asarray(ds, dtype=np.float32))
                found.append((name, arrays, None))
    except ProtoError:
        raise
    except Exception as e:    # h5py: OSError (truncated), RuntimeError/KeyError (damaged tree)
        raise ProtoError(f"{path}: truncated or corrupt HDF5 weights file: "
                         f"{type(e).__name__}: {e}") from None
    return found


def net_to_proto(net, with_diff: bool = False) -> "pb.NetParameter":
    """The net's (filtered) definition with each layer's blobs attached (Caffe's ``ToProto``)."""
    from .proto.io import array_to_blob

    out = pb.NetParameter()
    out.CopyFrom(net.param)
    for lp, layer in zip(out.layer, net.layer_list):
        del lp.blobs[:]
        for b in layer.blobs:
            double = b.dtype == torch.float64    # Caffe's Blob<double>: double_data
            dt = torch.float64 if double else torch.float32
            t = b.detach().to(dt).cpu()
            diff = b.grad.detach().to(dt).cpu().numpy() if with_diff and b.grad is not None else None
            lp.blobs.append(array_to_blob(t.numpy(), diff, double=double))
    return out


def save_weights(net, path) -> None:
    from .proto.io import write_binary

    write_binary(os.fspath(path), net_to_proto(net))


def save_weights_h5(net, path, with_diff: bool = False) -> None:
    """Caffe's HDF5 layout: ``/data/<layer>/<i>`` (and ``/diff/...``), written atomically."""
    import h5py

    from .proto.io import fsync_dir, fsync_path, temp_for

    path = os.fspath(path)
    fd, tmp = temp_for(path)      # unique: a fixed "<path>.tmp" is shared by every writer
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            for kind in ("data", "diff") if with_diff else ("data",):
                g = f.create_group(kind)
                for layer in net.layer_list:
                    if not layer.blobs:
                        continue
                    lg = g.create_group(layer.name)
                    for i, b in enumerate(layer.blobs):
                        t = b if kind == "data" else (b.grad if b.grad is not None else torch.zeros_like(b))
                        lg.create_dataset(str(i), data=t.detach().float().cpu().numpy())
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path))
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
