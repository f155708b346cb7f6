"""Caffe's file formats: the protobuf schema (``caffe_pb2``), text/binary I/O and upgrades.

``caffe_pb2`` is generated from ``caffe.proto`` (``scripts/gen_proto.sh``) and committed, so no
protoc is needed at install time. Field names, numbers and defaults are Caffe's.
"""
from . import caffe_pb2
from .errors import ProtoError
from .io import (array_to_blob, blob_to_array, parse_text, read_binary, read_binaryproto,
                 read_net, read_solver, read_text, write_binary, write_binaryproto, write_text)
from .upgrade import needs_upgrade, upgrade_net, upgrade_solver

TRAIN = caffe_pb2.TRAIN
TEST = caffe_pb2.TEST

__all__ = [
    "caffe_pb2", "TRAIN", "TEST", "ProtoError", "parse_text", "read_text", "write_text",
    "read_binary", "write_binary", "read_net", "read_solver", "blob_to_array",
    "array_to_blob", "read_binaryproto", "write_binaryproto", "needs_upgrade", "upgrade_net",
    "upgrade_solver",
]
