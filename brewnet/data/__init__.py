"""Real data for Caffe nets: databases (``db``), Caffe's DataTransformer (``transform``),
background prefetch (``prefetch``), the disk-reading data layers (``layers``, registered with
``brewnet.layers``) and Caffe's converters (``convert``: convert_mnist, convert_imageset,
compute_mean). ``idx`` reads MNIST-style idx files."""
from .convert import compute_mean, convert_imageset, convert_mnist  # noqa: F401
from .db import DBError, open_db, open_writer  # noqa: F401
from .prefetch import Prefetcher, plan_threads  # noqa: F401
from .transform import DataTransformer  # noqa: F401

# The disk-reading layer types, registered with brewnet.layers: Data, ImageData, AnnotatedData,
# HDF5Data, HDF5Output, WindowData, DenseImageData (SegNet).
from . import annotated, dense, hdf5, layers, window  # noqa: E402,F401
