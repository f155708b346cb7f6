"""Reading and writing Caffe's protobuf files, and BlobProto <-> numpy conversion.

Text (``.prototxt``) errors name file, line, column and field; binary files (``.caffemodel``,
``.binaryproto``, ``.solverstate``) that are truncated or corrupt say so and name the file.
Writes are atomic: a temporary file in the target directory is renamed over the target.
"""
from __future__ import annotations

import logging
import os
import re
import tempfile
from pathlib import Path

import numpy as np
from google.protobuf import text_format
from google.protobuf.message import DecodeError, EncodeError, Message

from . import caffe_pb2 as pb
from . import schema
from .errors import ProtoError
from .upgrade import needs_upgrade, upgrade_net, upgrade_solver
from .wire import varint as _varint

log = logging.getLogger("brewnet")

__all__ = [
    "ProtoError", "parse_text", "read_text", "write_text", "read_binary", "write_binary",
    "read_net", "read_solver", "blob_to_array", "array_to_blob", "read_binaryproto",
    "write_binaryproto", "upgrade_net_file", "upgrade_solver_file",
]

_BINARY_SUFFIXES = (".caffemodel", ".binaryproto", ".solverstate", ".pb")
_TEXT_SUFFIXES = (".prototxt", ".pbtxt", ".txt")


# ----------------------------------------------------------------------------------- text

def parse_text(text: str, message: Message, filename: str = "<string>") -> Message:
    """Merge text-format ``text`` into ``message`` and return it; errors raise ProtoError.
    With a fork's schema active (``schema.active``) the text is parsed in the fork's messages."""
    fork = schema.active()
    if fork is not None and fork.parse_text(text, message, filename, _describe_parse_error) is not None:
        return message
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as e:
        raise ProtoError(_describe_parse_error(e, text, filename, message)) from None
    return message


def _describe_parse_error(err, text: str, filename: str, message: Message) -> str:
    line, col = err.GetLine(), err.GetColumn()
    # protobuf's text is "L:C : 'source line': reason" or "L:C : reason"
    reason = re.sub(r"^\d+:\d+\s*:\s*", "", str(err))
    lines = text.splitlines()
    src = lines[line - 1] if line and 0 < line <= len(lines) else ""
    if src and reason.startswith(f"'{src}': "):
        reason = reason[len(src) + 4:]
    field = None
    m = re.search(r'no field named "([^"]+)"', reason)
    if m:
        field = m.group(1)
    elif src and col:
        m = re.search(r"([A-Za-z_]\w*)\s*:\s*$", src[:col - 1])
        field = m.group(1) if m else None
    where = f"{filename}:{line}:{col}" if line else filename
    if field and "no field named" in reason and message.DESCRIPTOR.file is pb.DESCRIPTOR:
        # a field of a Caffe fork, most likely: one line, with the way forward
        layer = _enclosing_layer(lines, line, col)
        return (f"{where}: {layer}unknown field '{field}' (brewnet's schema has no such field in "
                f"{_message_at(reason, message)}); if the net comes from a Caffe fork, pass the "
                "fork's caffe.proto: --proto PATH, caffe.Net(..., proto=PATH) or BREWNET_PROTO=PATH")
    msg = f"{where}: cannot parse {message.DESCRIPTOR.name}"
    msg += f", field '{field}': {reason}" if field else f": {reason}"
    if src:
        msg += f"\n    {src}\n    {' ' * max(col - 1, 0)}^"
    return msg


def _message_at(reason: str, message: Message) -> str:
    m = re.search(r'Message type "(?:\w+\.)?(\w+)"', reason)
    return m.group(1) if m else message.DESCRIPTOR.name


def _enclosing_layer(lines: list[str], line: int, col: int) -> str:
    """"layer 'name' (type T): " for the layer { } block around line:col, or ""."""
    text = "\n".join(re.sub(r"#.*", lambda m: " " * len(m.group()), ln) for ln in lines)
    at = sum(len(ln) + 1 for ln in lines[:line - 1]) + max(col - 1, 0)
    for m in reversed(list(re.finditer(r"\blayers?\s*\{", text[:at]))):
        depth = 0
        for i in range(m.end() - 1, len(text)):
            depth += (text[i] == "{") - (text[i] == "}")
            if depth == 0:
                break
        if i < at:          # this block closed before the error
            continue
        body = text[m.start():i]
        name = re.search(r'\bname\s*:\s*"([^"]*)"', body)
        kind = re.search(r'\btype\s*:\s*"?(\w+)', body)
        return f"layer '{name.group(1) if name else '?'}'{f' (type {kind.group(1)})' if kind else ''}: "
    return ""


def read_text(path, message: Message) -> Message:
    """Parse the text-format file ``path`` into ``message`` (returned)."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ProtoError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("latin-1")   # stray bytes in comments of old files
    return parse_text(text, message, str(path))


def write_text(path, message: Message) -> None:
    """Write ``message`` in text format, atomically (in the active fork schema's messages)."""
    _atomic_write(path, text_format.MessageToString(_in_schema(message)).encode("utf-8"))


def _in_schema(message: Message) -> Message:
    fork = schema.active()
    theirs = fork.to_fork(message) if fork is not None else None
    return message if theirs is None else theirs


# ----------------------------------------------------------------------------------- binary

def read_binary(path, message: Message) -> Message:
    """Parse the binary protobuf file ``path`` into ``message`` (returned).

    A file that does not decode, or a NetParameter whose content is implausible (no layers,
    fields unknown at the top level, blobs whose data do not fill their shape), raises a
    ProtoError saying the file is truncated or corrupt.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ProtoError(f"{path}: cannot read: {e.strerror or e}") from None
    kind = message.DESCRIPTOR.name
    if not data:
        raise ProtoError(f"{path}: empty file, expected a binary {kind}")
    try:
        fork = schema.active()
        if fork is None or fork.parse_binary(data, message, str(path)) is None:
            message.ParseFromString(data)
    except DecodeError as e:
        hint = ""
        if data[:4096].isascii() and not any(b < 9 for b in data[:4096]):
            hint = " (it looks like a text file: use read_text for prototxt)"
        raise ProtoError(f"{path}: truncated or corrupt binary {kind} "
                         f"({len(data)} bytes): {e}{hint}") from None
    problem = _implausible(message)
    if problem:
        raise ProtoError(f"{path}: truncated or corrupt binary {kind} ({len(data)} bytes): "
                         f"{problem}")
    return message


def _implausible(message: Message) -> str | None:
    from google.protobuf.unknown_fields import UnknownFieldSet
    unknown = UnknownFieldSet(message)
    if len(unknown):
        nums = sorted({f.field_number for f in unknown})
        return f"field numbers {nums} are not part of {message.DESCRIPTOR.name}"
    if isinstance(message, pb.NetParameter):
        if not message.layer and not message.layers:
            return "it contains no layers"
        v0 = [(v1.layer.name, v1.layer.blobs) for v1 in message.layers if v1.HasField("layer")]
        for name, blobs in [(l.name, l.blobs) for l in (*message.layer, *message.layers)] + v0:
            for i, blob in enumerate(blobs):
                bad = _blob_problem(blob)
                if bad:
                    return f"layer '{name}' blob {i}: {bad}"
    elif isinstance(message, pb.SolverState):
        for i, blob in enumerate(message.history):
            bad = _blob_problem(blob)
            if bad:
                return f"history blob {i}: {bad}"
    elif isinstance(message, pb.BlobProto):
        return _blob_problem(message)
    return None


def _blob_problem(blob) -> str | None:
    count = int(np.prod(_blob_shape(blob), dtype=np.int64))
    for name in ("data", "double_data"):
        n = len(getattr(blob, name))
        if n and n != count:
            return f"{n} {name} values for shape {_blob_shape(blob)} ({count} values)"
    return None


def write_binary(path, message: Message) -> None:
    """Serialize ``message`` to ``path``, atomically (in the active fork schema's numbers)."""
    try:
        data = _in_schema(message).SerializeToString()
    except EncodeError as e:
        raise ProtoError(f"{path}: cannot serialize {message.DESCRIPTOR.name}: {e}") from None
    _atomic_write(path, data)


def _atomic_write(path, data: bytes) -> None:
    path = Path(path)
    fd, tmp = temp_for(path)
    try:
        os.chmod(tmp, _new_file_mode(path))   # mkstemp makes 0600; match a plain open()
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# Atomic files: a unique temporary next to the target (the rename stays in one directory),
# fsync'd, renamed, and the directory fsync'd so the rename survives a power cut. The pid in
# the name lets the next snapshot tell a killed writer's leftover from a live writer's file.
_TEMP = re.compile(r"^\.(?P<target>.+?)\.(?:(?P<pid>\d+)\.)?[^.]+\.tmp$")


def temp_for(path) -> tuple[int, str]:
    """(fd, name) of a new temporary file for ``path``: ``.<name>.<pid>.<random>.tmp``."""
    path = Path(path)
    return tempfile.mkstemp(dir=path.parent or ".", prefix=f".{path.name}.{os.getpid()}.",
                            suffix=".tmp")


def fsync_path(path) -> None:
    """fsync a file or directory by name (a directory: make a rename in it durable)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:       # some file systems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def fsync_dir(directory) -> None:
    fsync_path(os.fspath(directory) or ".")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(prefix) -> list[str]:
    """Remove temporary files that killed snapshot writers left for files named
    ``<prefix>*``: ours, those of processes no longer running, and the fixed ``<file>.tmp``
    names older brewnet used. Returns the paths removed."""
    prefix = Path(prefix)
    folder, base = prefix.parent, prefix.name
    removed = []
    try:
        names = os.listdir(folder or ".")
    except OSError:
        return removed
    for name in names:
        m = _TEMP.match(name)
        if m and m.group("target").startswith(base):
            pid = m.group("pid")
            if pid is not None and int(pid) != os.getpid() and _pid_alive(int(pid)):
                continue       # a live writer's file
        elif not (name.startswith(base) and name.endswith(".tmp")):
            continue
        try:
            os.unlink(folder / name)
        except OSError:
            continue
        removed.append(str(folder / name))
        log.info("Removed %s, left by an interrupted snapshot", folder / name)
    return removed


def _new_file_mode(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o777
    except OSError:
        pass
    umask = 0o022
    try:   # read without os.umask(), which would briefly change it for every thread
        for line in open("/proc/self/status"):
            if line.startswith("Umask:"):
                umask = int(line.split()[1], 8)
    except OSError:
        pass
    return 0o666 & ~umask


# ----------------------------------------------------------------------------------- nets

def read_net(path_or_text, upgrade: bool = True) -> "pb.NetParameter":
    """A NetParameter from a prototxt path, a caffemodel path, prototxt text or a message.

    Binary is chosen by suffix (``.caffemodel``, ``.binaryproto``, ``.pb``), or when a file
    without a known suffix is not valid UTF-8. Legacy formats are upgraded (see upgrade.py).
    """
    if isinstance(path_or_text, pb.NetParameter):
        net, source = path_or_text, "<NetParameter>"
    elif isinstance(path_or_text, str) and not _looks_like_path(path_or_text):
        net, source = parse_text(path_or_text, pb.NetParameter()), "<string>"
    else:
        path = Path(path_or_text)
        source = str(path)
        if _is_binary_file(path):
            net = read_binary(path, pb.NetParameter())
        else:
            net = read_text(path, pb.NetParameter())
    return upgrade_net(net, source) if upgrade else net


def read_net_and_source(net) -> tuple["pb.NetParameter", str | None]:
    """``read_net`` of a path, text or message (upgraded), and the file it came from (None for
    text or a message): errors about the net name it."""
    if isinstance(net, pb.NetParameter):
        return upgrade_net(net), None
    path = os.fspath(net)
    source = path if isinstance(net, os.PathLike) or _looks_like_path(path) else None
    return read_net(path), source


def _looks_like_path(s: str) -> bool:
    return "\n" not in s and "{" not in s and (":" not in s or os.path.exists(s))


def _is_binary_file(path: Path) -> bool:
    name = path.name.lower()
    if name.endswith(_BINARY_SUFFIXES):
        return True
    if name.endswith(_TEXT_SUFFIXES):
        return False
    try:
        with open(path, "rb") as f:
            f.read(1 << 16).decode("utf-8")
    except UnicodeDecodeError:
        return True
    except OSError as e:
        raise ProtoError(f"{path}: cannot read: {e.strerror or e}") from None
    return False


def read_solver(path, upgrade: bool = True) -> "pb.SolverParameter":
    """A SolverParameter from a text file, with ``solver_type`` upgraded to ``type``."""
    solver = read_text(path, pb.SolverParameter())
    return upgrade_solver(solver, str(path)) if upgrade else solver


# ----------------------------------------------------------------------------------- blobs

def _blob_shape(blob) -> tuple:
    # Legacy 4-d fields win when any is present, as in pycaffe's blobproto_to_array.
    if any(blob.HasField(f) for f in ("num", "channels", "height", "width")):
        return (blob.num, blob.channels, blob.height, blob.width)
    return tuple(blob.shape.dim)


def blob_to_array(blob, return_diff: bool = False, dtype=np.float32) -> np.ndarray:
    """The values (or diffs) of a BlobProto as an array of the blob's shape.

    Uses ``double_data``/``double_diff`` when the float fields are empty. An empty blob of
    non-zero count gives zeros only if it holds no values at all (Caffe's diff-less blobs).
    """
    shape = _blob_shape(blob)
    single, double = ("diff", "double_diff") if return_diff else ("data", "double_data")
    values = getattr(blob, single)
    if not len(values) and len(getattr(blob, double)):
        values = getattr(blob, double)
    arr = np.asarray(values, dtype=dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if arr.size != count:
        if arr.size == 0 and return_diff:
            return np.zeros(shape, dtype=dtype)
        raise ProtoError(f"BlobProto holds {arr.size} {single} values but its shape "
                         f"{shape} needs {count}")
    return arr.reshape(shape)


def _packed(field_number: int, values: np.ndarray) -> bytes:
    # Building the packed field by hand is ~30x faster than RepeatedContainer.extend.
    raw = values.tobytes()
    return _varint(field_number << 3 | 2) + _varint(len(raw)) + raw


_FIELD = {"data": 5, "diff": 6, "double_data": 8, "double_diff": 9}


def array_to_blob(arr, diff=None, double: bool = False) -> "pb.BlobProto":
    """A BlobProto (``shape.dim`` form) holding ``arr`` and optionally ``diff``.

    Values are stored as float32 (``data``/``diff``), or float64 in ``double_data``/
    ``double_diff`` when ``double`` is true.
    """
    arr = np.asarray(arr)
    blob = pb.BlobProto()
    blob.shape.dim.extend(int(d) for d in arr.shape)
    dt, names = ("<f8", ("double_data", "double_diff")) if double else ("<f4", ("data", "diff"))
    payload = _packed(_FIELD[names[0]], np.ascontiguousarray(arr, dtype=dt))
    if diff is not None:
        diff = np.asarray(diff)
        if diff.shape != arr.shape:
            raise ProtoError(f"diff shape {diff.shape} differs from data shape {arr.shape}")
        payload += _packed(_FIELD[names[1]], np.ascontiguousarray(diff, dtype=dt))
    blob.MergeFromString(payload)
    return blob


def read_binaryproto(path) -> np.ndarray:
    """The array in a binary BlobProto file (e.g. a mean file), float32."""
    return blob_to_array(read_binary(path, pb.BlobProto()))


def write_binaryproto(path, arr, legacy: bool = False) -> None:
    """Write ``arr`` as a binary BlobProto; ``legacy`` uses num/channels/height/width (4-d)."""
    arr = np.asarray(arr)
    blob = array_to_blob(arr)
    if legacy:
        if arr.ndim > 4:
            raise ProtoError(f"{path}: legacy BlobProto needs <= 4 axes, got shape {arr.shape}")
        n, c, h, w = (1,) * (4 - arr.ndim) + tuple(arr.shape)
        blob.ClearField("shape")
        blob.num, blob.channels, blob.height, blob.width = n, c, h, w
    write_binary(path, blob)


# ----------------------------------------------------------------------------------- tools

def upgrade_net_file(src, dst, binary: bool = False) -> bool:
    """Read a net (text, or binary caffemodel), upgrade it and write it in the same form.

    Returns False when the input was already current (it is still written, as Caffe's
    upgrade_net_proto_* tools do).
    """
    net = read_binary(src, pb.NetParameter()) if binary else read_text(src, pb.NetParameter())
    needed = needs_upgrade(net)
    if needed:
        net = upgrade_net(net, str(src))
    else:
        log.warning("File already in latest proto format: %s", src)
    (write_binary if binary else write_text)(dst, net)
    return needed


def upgrade_solver_file(src, dst) -> bool:
    """Read a solver prototxt, upgrade it and write it; False if it was already current."""
    solver = read_text(src, pb.SolverParameter())
    upgraded = upgrade_solver(solver, str(src))
    needed = upgraded != solver
    if not needed:
        log.warning("File already in latest proto format: %s", src)
    write_text(dst, upgraded)
    return needed
