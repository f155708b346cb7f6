"""The core's error for nets (``brewnet.net`` re-exports it; pycaffe's ``caffe.NetError``)."""


class NetError(ValueError):
    """A net cannot be built or run as asked; the message names the layer, blob and shapes."""
