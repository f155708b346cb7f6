"""A Caffe fork's own ``caffe.proto``, compiled at run time, to read and write that fork's files.

Forks add fields to Caffe's messages and some reuse a field number another fork gives to another
message. With the fork's schema (``caffe.Net(..., proto=...)``, ``--proto``, ``BREWNET_PROTO``,
``brewnet.use_proto``) brewnet parses text and binary files with the fork's own descriptors,
then maps the fork's messages onto its own by field name: every field the fork declares parses
at the fork's number, and the fields brewnet's layers read keep their meaning. A fork field
brewnet's schema lacks rides along as an unknown field and is written back when the message is
written with the same schema (round trips keep it); it is named once, as no built-in layer
reads it.

protoc compiles the ``.proto``: grpcio-tools ships it as a wheel (``brewnet[forks]``), and it is
the reference parser of the language. protobuf's Python runtime has no ``.proto`` parser.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from . import wire
from .errors import ProtoError

log = logging.getLogger("brewnet")

__all__ = ["Schema", "use_proto", "active", "using", "load"]

ENV = "BREWNET_PROTO"
# A fork field brewnet lacks whose number brewnet uses for another field is kept as an unknown
# field at this offset + its number, so it cannot be read as brewnet's field (forks' numbers
# are far below it; protobuf allows up to 2**29 - 1).
SHIFT = 1 << 28
_warned: set[tuple[str, str]] = set()


class Schema:
    """The message classes of one fork's ``caffe.proto``; converts to and from brewnet's."""

    def __init__(self, path):
        self.path = Path(path)
        files = _compile(str(self.path.resolve()), _digest(self.path)).file
        pool = descriptor_pool.DescriptorPool()
        for f in files:
            pool.Add(f)
        self._pool = pool
        self._package = next((f.package for f in files if _has(pool, f.package, "NetParameter")), None)
        if self._package is None:
            raise ProtoError(f"{self.path}: declares no NetParameter message; is it a caffe.proto?")

    def __repr__(self) -> str:
        return f"Schema({str(self.path)!r})"

    def fork_class(self, ours: Message):
        """The fork's class for the message brewnet calls ``ours``' name; None when it has none."""
        name = f"{self._package}.{ours.DESCRIPTOR.name}" if self._package else ours.DESCRIPTOR.name
        try:
            return message_factory.GetMessageClass(self._pool.FindMessageTypeByName(name))
        except KeyError:
            return None

    # -- reading --------------------------------------------------------------------------
    def parse_text(self, text: str, message: Message, filename: str, describe) -> Message:
        cls = self.fork_class(message)
        if cls is None:
            return None
        theirs = cls()
        try:
            text_format.Parse(text, theirs)
        except text_format.ParseError as e:
            raise ProtoError(describe(e, text, filename, theirs) + f" (schema {self.path})") from None
        to_ours(theirs, message, source=filename)
        return message

    def parse_binary(self, data: bytes, message: Message, filename: str) -> Message:
        cls = self.fork_class(message)
        if cls is None:
            return None
        theirs = cls()
        try:
            theirs.ParseFromString(data)
        except DecodeError as e:
            raise ProtoError(f"{filename}: truncated or corrupt binary {message.DESCRIPTOR.name} "
                             f"in the schema {self.path} ({len(data)} bytes): {e}") from None
        to_ours(theirs, message, source=filename)
        return message

    # -- writing --------------------------------------------------------------------------
    def to_fork(self, message: Message):
        cls = self.fork_class(message)
        if cls is None:
            return None
        theirs = cls()
        to_fork(message, theirs, self.path)
        return theirs


def _has(pool, package: str, name: str) -> bool:
    try:
        pool.FindMessageTypeByName(f"{package}.{name}" if package else name)
        return True
    except KeyError:
        return False


def _digest(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as e:
        raise ProtoError(f"{path}: cannot read the schema: {e.strerror or e}") from None


@functools.lru_cache(maxsize=8)
def _compile(path: str, digest: str) -> descriptor_pb2.FileDescriptorSet:
    """protoc's FileDescriptorSet for the file (cached by its content)."""
    try:
        import grpc_tools  # noqa: F401
    except ImportError:
        raise ProtoError(f"{path}: reading a fork's schema needs protoc: "
                         'pip install "brewnet[forks]" (grpcio-tools)') from None
    src = Path(path)
    with tempfile.TemporaryDirectory(prefix="brewnet-proto-") as tmp:
        out = Path(tmp) / "set.pb"
        run = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{src.parent}",
                              f"--descriptor_set_out={out}", "--include_imports", src.name],
                             capture_output=True, text=True)
        if run.returncode != 0 or not out.exists():
            why = [ln for ln in run.stderr.splitlines() if ln.strip() and "warning" not in ln.lower()]
            raise ProtoError(f"{path}: protoc cannot compile the schema: "
                             + ("; ".join(why[:3]) or f"exit {run.returncode}"))
        return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


# ------------------------------------------------------------------ the active schema
_env_loaded: list = []        # [Schema | None] once BREWNET_PROTO was read
_global: list = [None]        # use_proto's
_local: contextvars.ContextVar = contextvars.ContextVar("brewnet_schema", default=None)


def load(proto) -> Schema | None:
    """A Schema for a path (a Schema passes through; None gives None)."""
    if proto is None or isinstance(proto, Schema):
        return proto
    return _cached(str(Path(proto).resolve()), _digest(Path(proto)))


@functools.lru_cache(maxsize=8)
def _cached(path: str, digest: str) -> Schema:
    return Schema(path)


def use_proto(proto) -> Schema | None:
    """Read and write every Caffe file of this process with a fork's ``caffe.proto`` (None: brewnet's own)."""
    _global[0] = load(proto)
    _env_loaded[:] = [None]       # an explicit choice overrides BREWNET_PROTO
    return _global[0]


def active() -> Schema | None:
    """The schema files are read with now: ``using``'s, else ``use_proto``'s, else ``BREWNET_PROTO``'s."""
    local = _local.get()
    if local is not None:
        return local
    if _global[0] is not None:
        return _global[0]
    if not _env_loaded:
        path = os.environ.get(ENV, "").strip()
        _env_loaded.append(load(path) if path else None)
    return _env_loaded[0]


@contextlib.contextmanager
def for_command(proto):
    """A command's ``--proto``: every file of the command, and of the worker processes it
    starts (``BREWNET_PROTO``), in the fork's schema; as before once it returns."""
    if not proto:
        yield
        return
    saved, env, loaded = _global[0], os.environ.get(ENV), list(_env_loaded)
    use_proto(proto)
    os.environ[ENV] = os.path.abspath(proto)
    try:
        yield
    finally:
        _global[0], _env_loaded[:] = saved, loaded
        if env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = env


@contextlib.contextmanager
def using(schema):
    """Within the block, files are read and written with ``schema`` (a Schema, a path or None: the active one)."""
    token = _local.set(load(schema)) if schema is not None else None
    try:
        yield
    finally:
        if token is not None:
            _local.reset(token)


# ------------------------------------------------------------------ mapping by name
@functools.lru_cache(maxsize=None)
def _same_wire(a, b) -> bool:
    """Two message descriptors whose fields agree in name, number and type, all the way down:
    copied by bytes (fast for BlobProto's floats)."""
    if len(a.fields) != len(b.fields):
        return False
    for fa in a.fields:
        fb = b.fields_by_name.get(fa.name)
        if fb is None or fb.number != fa.number or fb.type != fa.type or _repeated(fa) != _repeated(fb):
            return False
        if fa.type == FieldDescriptor.TYPE_MESSAGE and not _same_wire(fa.message_type, fb.message_type):
            return False
        if fa.type == FieldDescriptor.TYPE_ENUM and (
                {v.name: v.number for v in fa.enum_type.values}
                != {v.name: v.number for v in fb.enum_type.values}):
            return False
    return True


def _repeated(fd) -> bool:
    return fd.is_repeated


_NUMERIC = {FieldDescriptor.CPPTYPE_INT32, FieldDescriptor.CPPTYPE_INT64, FieldDescriptor.CPPTYPE_UINT32,
            FieldDescriptor.CPPTYPE_UINT64}
_REAL = {FieldDescriptor.CPPTYPE_FLOAT, FieldDescriptor.CPPTYPE_DOUBLE}


def _compatible(a, b) -> bool:
    if a.cpp_type == b.cpp_type:
        return True
    return (a.cpp_type in _NUMERIC and b.cpp_type in _NUMERIC) or (a.cpp_type in _REAL and b.cpp_type in _REAL)


def _enum_value(src_fd, dst_fd, number: int, where: str) -> int:
    name = src_fd.enum_type.values_by_number[number].name if number in src_fd.enum_type.values_by_number \
        else None
    ours = dst_fd.enum_type.values_by_name.get(name) if name else None
    if ours is None:
        raise ProtoError(f"{where}: {src_fd.name}: {name or number} is a value of the fork's "
                         f"{src_fd.enum_type.name} that brewnet's schema does not have")
    return ours.number


def to_ours(src: Message, dst: Message, source: str = "<message>", where: str = "",
            layer: tuple = ("", "")) -> None:
    """Merge the fork message ``src`` into brewnet's ``dst`` by field name."""
    if _same_wire(src.DESCRIPTOR, dst.DESCRIPTOR):
        dst.MergeFromString(src.SerializeToString())
        return
    if src.DESCRIPTOR.name in ("LayerParameter", "V1LayerParameter"):
        layer, where = (f"layer '{src.name}' (type {_type_name(src)}): ", _type_name(src)), ""
    leftover = []
    for fd, value in src.ListFields():
        ours = dst.DESCRIPTOR.fields_by_name.get(fd.name)
        if ours is None or not _compatible(fd, ours) or (_repeated(fd) and not _repeated(ours)
                                                          and len(value) != 1):
            leftover.append(fd)
            continue
        values = list(value) if _repeated(fd) else [value]
        if ours.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            for v in values:
                target = getattr(dst, ours.name).add() if _repeated(ours) else getattr(dst, ours.name)
                to_ours(v, target, source, f"{where}{fd.name}.", layer)
            continue
        if ours.cpp_type == FieldDescriptor.CPPTYPE_ENUM:
            values = [_enum_value(fd, ours, v, f"{source}: {layer[0]}".rstrip(": ")) for v in values]
        if _repeated(ours):
            getattr(dst, ours.name).extend(values)
        else:
            setattr(dst, ours.name, values[-1])
    if leftover:
        _keep(src, dst, leftover)
        for fd in leftover:
            _name_once(source, layer if layer[0] else (f"{src.DESCRIPTOR.name}: ", ""), f"{where}{fd.name}")
    _keep_unknown(src, dst)


def _type_name(layer: Message) -> str:
    t = layer.type
    if isinstance(t, int):          # V1's enum
        return layer.DESCRIPTOR.fields_by_name["type"].enum_type.values_by_number.get(t).name \
            if t in layer.DESCRIPTOR.fields_by_name["type"].enum_type.values_by_number else str(t)
    return t


def _name_once(source: str, who: tuple, field: str) -> None:
    """One warning per layer type and field (a net repeats its types)."""
    if (who[1], field) in _warned:
        return
    _warned.add((who[1], field))
    log.warning("%s: %sfield %s is parsed but no built-in layer reads it", source, who[0], field)


def _keep(src: Message, dst: Message, fields) -> None:
    """Carry ``fields`` of ``src`` into ``dst`` as unknown fields (fork numbers; shifted by
    SHIFT where brewnet's message uses the number)."""
    tmp = type(src)()
    tmp.CopyFrom(src)
    keep = {fd.name for fd in fields}
    for fd, _ in tmp.ListFields():
        if fd.name not in keep:
            tmp.ClearField(fd.name)
    tmp.DiscardUnknownFields()
    taken = set(dst.DESCRIPTOR.fields_by_number)
    dst.MergeFromString(_renumber(tmp.SerializeToString(), lambda n: n + SHIFT if n in taken else n))


def _keep_unknown(src: Message, dst: Message) -> None:
    """Unknown fields of the fork message itself (a file newer than the schema) ride along too."""
    data = _unknown_bytes(src)
    if data:
        taken = set(dst.DESCRIPTOR.fields_by_number)
        dst.MergeFromString(_renumber(data, lambda n: n + SHIFT if n in taken else n))


def _unknown_bytes(msg: Message) -> bytes:
    """The wire bytes of ``msg``'s unknown fields (its own level: nested ones stay in theirs)."""
    tmp = type(msg)()
    tmp.CopyFrom(msg)
    for fd, _ in tmp.ListFields():
        tmp.ClearField(fd.name)
    return tmp.SerializeToString()


def to_fork(src: Message, dst: Message, schema_path, where: str = "") -> None:
    """Merge brewnet's ``src`` into the fork message ``dst`` by field name; the unknown fields
    ``to_ours`` carried go back to their numbers."""
    if _same_wire(src.DESCRIPTOR, dst.DESCRIPTOR):
        dst.MergeFromString(src.SerializeToString())
        return
    for fd, value in src.ListFields():
        theirs = dst.DESCRIPTOR.fields_by_name.get(fd.name)
        if theirs is None or not _compatible(fd, theirs):
            raise ProtoError(f"{schema_path}: the fork's {dst.DESCRIPTOR.name} has no field "
                             f"'{where}{fd.name}' to write brewnet's into")
        values = list(value) if _repeated(fd) else [value]
        if theirs.cpp_type == FieldDescriptor.CPPTYPE_MESSAGE:
            for v in values:
                target = getattr(dst, theirs.name).add() if _repeated(theirs) else getattr(dst, theirs.name)
                to_fork(v, target, schema_path, f"{where}{fd.name}.")
            continue
        if theirs.cpp_type == FieldDescriptor.CPPTYPE_ENUM:
            values = [_enum_value(fd, theirs, v, str(schema_path)) for v in values]
        if _repeated(theirs):
            getattr(dst, theirs.name).extend(values)
        else:
            setattr(dst, theirs.name, values[-1])
    data = _unknown_bytes(src)
    if data:
        dst.MergeFromString(_renumber(data, lambda n: n - SHIFT if n >= SHIFT else n))


def _renumber(data: bytes, new) -> bytes:
    try:
        return wire.renumber(data, new)
    except ValueError as e:
        raise ProtoError(f"{e} in a fork's schema") from None
