"""Caffe's file formats: the protobuf schema (``caffe_pb2``), text/binary I/O and upgrades.

``caffe_pb2`` is generated from ``caffe.proto`` (``scripts/gen_proto.sh``) and committed, so no
protoc is needed at install time. Field names, numbers and defaults are Caffe's.
"""
from . import caffe_pb2

TRAIN = caffe_pb2.TRAIN
TEST = caffe_pb2.TEST

__all__ = ["caffe_pb2", "TRAIN", "TEST"]
