"""The key-value databases behind Caffe's ``Data`` layer: LMDB (py-lmdb) and LevelDB (plyvel).

``open_db(path)`` gives a read-only database whose ``cursor()`` walks the records in key order
and wraps around at the end, as Caffe's ``DataLayer`` does; every cursor has its own read
transaction (a snapshot), so several nets reading one source each keep their own position. A
small LMDB (``MEMORY_BYTES``) is read into memory when a cursor opens it; ``take(n)`` hands a
batch's records over at once. ``open_writer`` gives a writer that commits every 1000 records
(Caffe's converters) and grows the LMDB map as needed. Records are raw bytes;
``decode_datum`` parses a serialized ``Datum``.
"""
from __future__ import annotations

import bisect
import contextlib
import logging
import os
import threading
import weakref
from pathlib import Path

from google.protobuf.message import DecodeError

from ..proto import caffe_pb2 as pb

log = logging.getLogger("brewnet")

LEVELDB_HELP = ("LevelDB support needs the 'plyvel' package: pip install plyvel "
                "(or pip install brewnet[leveldb]); or convert the data to LMDB, the default")


class DBError(ValueError):
    """A database is missing, empty, unreadable or holds a corrupt record (the message names
    the path, and the key where one is at fault)."""


def detect_backend(path) -> str | None:
    """'lmdb' or 'leveldb' from what the path holds on disk; None if it is neither."""
    p = Path(path)
    if p.is_file():
        return "lmdb"          # a single-file LMDB (subdir=False)
    if (p / "data.mdb").is_file():
        return "lmdb"
    if (p / "CURRENT").is_file() or any(p.glob("MANIFEST-*")):
        return "leveldb"
    return None


def _backend_name(backend) -> str | None:
    if backend is None:
        return None
    if isinstance(backend, int):   # DataParameter.DB enum
        return {pb.DataParameter.LMDB: "lmdb", pb.DataParameter.LEVELDB: "leveldb"}[backend]
    name = str(backend).lower()
    if name not in ("lmdb", "leveldb"):
        raise DBError(f"unknown database backend '{backend}'; known: lmdb, leveldb")
    return name


def open_db(path, backend=None) -> "LMDB | LevelDB":
    """Open ``path`` read-only. ``backend`` ('lmdb', 'leveldb' or the DataParameter enum) is
    what the caller declared; what is on disk wins, since Caffe's default (LEVELDB) is often
    left in prototxts whose source is an LMDB."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DBError(f"{path}: no such database (expected an LMDB directory holding data.mdb)")
    declared, found = _backend_name(backend), detect_backend(path)
    if declared and found and declared != found:
        log.warning("%s holds a %s database; reading it as such (the layer declares %s)",
                    path, found, declared)
    found = found or declared
    if found is None:
        raise DBError(f"{path}: not an LMDB or LevelDB database (no data.mdb, no CURRENT file)")
    db = LMDB(path) if found == "lmdb" else LevelDB(path)
    if db.empty():
        raise DBError(f"{path}: the {found.upper() if found == 'lmdb' else 'LevelDB'} database "
                      "is empty (no records)")
    return db


def open_writer(path, backend="lmdb") -> "LMDBWriter | LevelDBWriter":
    """A new database at ``path`` (Caffe's ``db->Open(path, NEW)``: it must not exist yet)."""
    path = os.fspath(path)
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise DBError(f"{path}: already exists; remove it or choose another path")
    name = _backend_name(backend) or "lmdb"
    return LMDBWriter(path) if name == "lmdb" else LevelDBWriter(path)


def parse_record(message, value: bytes, key=b"", source=""):
    """``message`` parsed from a record; a corrupt one raises DBError naming key and source."""
    try:
        message.ParseFromString(value)
    except DecodeError as e:
        raise DBError(f"{source}: record {_show(key)} is not a valid {type(message).__name__} "
                      f"({len(value)} bytes): {e}") from None
    return message


def decode_datum(value: bytes, key=b"", source="") -> "pb.Datum":
    """Parse a serialized Datum; a corrupt record raises DBError naming key and source."""
    datum = parse_record(pb.Datum(), value, key, source)
    if not datum.encoded:
        need = datum.channels * datum.height * datum.width
        have = len(datum.data) or len(datum.float_data)
        if need <= 0 or have != need:
            raise DBError(f"{source}: record {_show(key)} is a corrupt Datum: shape "
                          f"{datum.channels}x{datum.height}x{datum.width} needs {need} values, "
                          f"it holds {have}")
    return datum


def _show(key) -> str:
    return repr(key.decode("utf-8", "replace")) if isinstance(key, bytes) else repr(key)


# ------------------------------------------------------------------------------------ LMDB

_ENVS: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()
_ENVS_LOCK = threading.Lock()


class _Env:
    """One read-only lmdb.Environment per file per process (LMDB forbids opening a file twice
    in one process: closing either would drop the other's locks)."""

    def __init__(self, path: str):
        import lmdb

        subdir = os.path.isdir(path)
        kw = dict(subdir=subdir, readonly=True, readahead=False, max_readers=512)
        try:
            self.env = lmdb.open(path, lock=True, **kw)
        except lmdb.Error:
            # A read-only copy (no write access to lock.mdb): read it without the lock table,
            # as Caffe's ALLOW_LMDB_NOLOCK build does.
            try:
                self.env = lmdb.open(path, lock=False, **kw)
            except lmdb.Error as e:
                raise DBError(f"{path}: cannot open LMDB: {e}") from None
        _check_size(path, subdir, self.env)


def _check_size(path: str, subdir: bool, env) -> None:
    """LMDB maps its file: reading a page past the end of a truncated file (a copy cut short,
    a full disk) kills the process with SIGBUS. The meta page says how many pages the last
    commit used; a file shorter than that is a DBError before any record is read."""
    file = os.path.join(path, "data.mdb") if subdir else path
    need = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    have = os.path.getsize(file)
    if have < need:
        env.close()
        raise DBError(f"{file}: the LMDB is truncated: its last commit uses {need} bytes, the "
                      f"file holds {have} (an incomplete copy or a full disk?)")


def _env(path: str):
    key = os.path.realpath(path)
    with _ENVS_LOCK:
        env = _ENVS.get(key)
        if env is None:
            env = _Env(path)
            _ENVS[key] = env
        return env


class LMDB:
    """A read-only LMDB; ``len(db)`` records, ``db.cursor()`` independent wrapping cursors."""

    backend = "lmdb"

    def __init__(self, path: str):
        self.path = path
        self._env = _env(path)      # keeps the shared environment alive

    def __len__(self) -> int:
        with _lmdb_errors(self.path):
            return self._env.env.stat()["entries"]

    def empty(self) -> bool:
        return len(self) == 0

    def cursor(self) -> "Cursor":
        with _lmdb_errors(self.path):
            txn = self._env.env.begin(buffers=False)
            st = self._env.env.stat()
            pages = st["branch_pages"] + st["leaf_pages"] + st["overflow_pages"]
        if pages * st["psize"] > MEMORY_BYTES:
            return Cursor(self, _LmdbIter(txn, self.path))
        return Cursor(self, _MemIter(_records(self.path, txn)))

    def get(self, key: bytes) -> bytes | None:
        with _lmdb_errors(self.path, key), self._env.env.begin() as txn:
            return txn.get(key)

    def items(self):
        """Every (key, value) once, in key order."""
        with _lmdb_errors(self.path), self._env.env.begin(buffers=False) as txn:
            yield from txn.cursor()


@contextlib.contextmanager
def _lmdb_errors(path: str, key=None):
    """lmdb.Error (a damaged page: CorruptedError, PageNotFoundError...) as a DBError naming
    the database and the last good key. Some damage trips LMDB's own assert(), which aborts
    the process before Python sees anything."""
    import lmdb

    try:
        yield
    except lmdb.Error as e:
        raise _damaged(path, key, e) from None


def _damaged(path: str, key, e: BaseException) -> DBError:
    where = "" if key is None else f" (after record {_show(key)})"
    return DBError(f"{path}: the LMDB is damaged{where}: {type(e).__name__}: {e}")


# A cursor on an LMDB of up to this many bytes reads it into memory once (its read transaction
# is a snapshot, so nothing is lost): in Python a record costs ~1 us to fetch, a batch of 100
# more than a tiny net's whole step; from memory a batch is a slice. Cursors on one snapshot
# share the copy.
MEMORY_BYTES = 64 << 20
_RECORDS: "weakref.WeakValueDictionary[tuple, _Records]" = weakref.WeakValueDictionary()


class _Records:
    """Every key and value of one LMDB snapshot, in key order."""

    def __init__(self, txn, path: str):
        import lmdb

        self.keys, self.values = [], []
        self.derived: dict = {}
        try:
            for k, v in txn.cursor().iternext():
                self.keys.append(k)
                self.values.append(v)
        except lmdb.Error as e:
            raise _damaged(path, self.keys[-1] if self.keys else None, e) from None


def _records(path: str, txn) -> _Records:
    key = (os.path.realpath(path), txn.id())
    try:
        with _ENVS_LOCK:
            records = _RECORDS.get(key)
            if records is None:
                records = _RECORDS[key] = _Records(txn, path)
    finally:
        txn.abort()              # the copy is the snapshot; free the reader slot
    return records


class _MemIter:
    """A position in records held in memory (``_Records``)."""

    def __init__(self, records: _Records):
        self.records, self.i = records, 0

    def first(self) -> bool:
        self.i = 0
        return bool(self.records.keys)

    def next(self) -> bool:
        self.i += 1
        return self.i < len(self.records.keys)

    def item(self) -> tuple[bytes, bytes]:
        return self.records.keys[self.i], self.records.values[self.i]

    def seek(self, key: bytes) -> bool:
        keys = self.records.keys
        i = bisect.bisect_left(keys, key)      # LMDB's order: bytewise, as Python's
        if i < len(keys) and keys[i] == key:
            self.i = i
            return True
        return False

    def take(self, n: int) -> tuple[list, list, int]:
        keys, values = self.records.keys, self.records.values
        out_k, out_v, wraps, i = [], [], 0, self.i
        while n > 0:
            m = min(n, len(keys) - i)
            out_k += keys[i:i + m]
            out_v += values[i:i + m]
            i, n = i + m, n - m
            if i == len(keys):
                i, wraps = 0, wraps + 1
        self.i = i
        return out_k, out_v, wraps


class _LmdbIter:
    def __init__(self, txn, path: str = ""):
        self.txn, self.cur, self.path = txn, txn.cursor(), path
        self.key = None           # the last record read, for the error message

    def first(self) -> bool:
        with _lmdb_errors(self.path, self.key):
            return self.cur.first()

    def next(self) -> bool:
        with _lmdb_errors(self.path, self.key):
            return self.cur.next()

    def item(self) -> tuple[bytes, bytes]:
        with _lmdb_errors(self.path, self.key):
            item = self.cur.item()
        self.key = item[0]
        return item

    def seek(self, key: bytes) -> bool:
        with _lmdb_errors(self.path, self.key):
            return self.cur.set_key(key)

    def take(self, n: int) -> tuple[list, list, int]:
        """The next ``n`` keys and values from the current record on (wrapping), and the number
        of wraps. One error scope for them all: per record it cost more than the read."""
        import lmdb

        keys, values, wraps = [], [], 0
        item, step, first = self.cur.item, self.cur.next, self.cur.first
        try:
            for _ in range(n):
                k, v = item()
                keys.append(k)
                values.append(v)
                if not step():
                    first()
                    wraps += 1
        except lmdb.Error as e:
            raise _damaged(self.path, keys[-1] if keys else self.key, e) from None
        self.key = keys[-1] if keys else self.key
        return keys, values, wraps


class Cursor:
    """Walks the records in key order and wraps around at the end (``epochs`` counts wraps).

    ``next()`` returns the current (key, value) and advances; ``peek()`` does not advance.
    A cursor is used by one thread at a time (it may move between threads).
    """

    def __init__(self, db, it):
        self.db, self._it = db, it
        self.epochs = 0
        if not it.first():
            raise DBError(f"{db.path}: the database is empty (no records)")

    def peek(self) -> tuple[bytes, bytes]:
        return self._it.item()

    def next(self) -> tuple[bytes, bytes]:
        item = self._it.item()
        self.advance()
        return item

    def take(self, n: int) -> tuple[list, list, tuple | None]:
        """The keys and values of the next ``n`` records, advancing past them (a batch), and
        where they lie in a database held in memory: (its records, the first's index), else
        None (a reader may keep arrays made once from ``records.values`` in ``records.derived``)."""
        where = (self._it.records, self._it.i) if isinstance(self._it, _MemIter) else None
        keys, values, wraps = self._it.take(n)
        self.epochs += wraps
        return keys, values, where

    def advance(self, n: int = 1) -> None:
        """Move ``n`` records on without reading their values (a worker skipping other shards)."""
        for _ in range(n):
            if not self._it.next():
                self._it.first()
                self.epochs += 1

    def seek(self, key: bytes) -> None:
        """Stand on record ``key`` (a resumed run's position); DBError when it is not there."""
        if hasattr(self._it, "seek"):
            found = self._it.seek(key)
        else:       # LevelDB: walk from the first record
            found = self._it.first()
            while found and self._it.item()[0] != key:
                found = self._it.next()
        if not found:
            self._it.first()
            raise DBError(f"{self.db.path}: record {_show(key)} (where the snapshot's data cursor "
                          "stood) is not in the database; was it rebuilt?")


class LMDBWriter:
    """Writes records to a new LMDB, committing every ``commit_every`` puts; the memory map
    doubles whenever it fills (Caffe's ``LMDBTransaction::DoubleMapSize``)."""

    def __init__(self, path: str, commit_every: int = 1000, map_size: int = 1 << 26):
        import lmdb

        os.makedirs(path, exist_ok=True)
        self.path, self.commit_every = path, commit_every
        self.env = lmdb.open(path, map_size=map_size, subdir=True, readahead=False)
        self._pending: list[tuple[bytes, bytes]] = []
        self.count = 0

    def put(self, key, value: bytes) -> None:
        self._pending.append((key.encode() if isinstance(key, str) else key, value))
        self.count += 1
        if len(self._pending) >= self.commit_every:
            self.commit()

    def commit(self) -> None:
        import lmdb

        while self._pending:
            try:
                with self.env.begin(write=True) as txn:
                    for k, v in self._pending:
                        txn.put(k, v)
                self._pending.clear()
            except lmdb.MapFullError:
                self.env.set_mapsize(self.env.info()["map_size"] * 2)

    def close(self) -> None:
        if self.env is not None:
            self.commit()
            self.env.close()
            self.env = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --------------------------------------------------------------------------------- LevelDB

def _plyvel():
    try:
        import plyvel
    except ImportError:
        raise DBError(LEVELDB_HELP) from None
    return plyvel


_LEVELDBS: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()


class _LevelHandle:
    def __init__(self, path: str):
        try:
            self.db = _plyvel().DB(path, create_if_missing=False)
        except DBError:
            raise
        except Exception as e:   # plyvel.Error, IOError (lock held by another process)
            raise DBError(f"{path}: cannot open LevelDB: {e}") from None


class LevelDB:
    """A LevelDB opened through plyvel; one handle per file per process (LevelDB locks it)."""

    backend = "leveldb"

    def __init__(self, path: str):
        self.path = path
        key = os.path.realpath(path)
        with _ENVS_LOCK:
            handle = _LEVELDBS.get(key)
            if handle is None:
                handle = _LevelHandle(path)
                _LEVELDBS[key] = handle
        self._handle = handle

    def __len__(self) -> int:
        return sum(1 for _ in self._handle.db.iterator(include_value=False))

    def empty(self) -> bool:
        return next(self._handle.db.iterator(include_value=False), None) is None

    def cursor(self) -> Cursor:
        return Cursor(self, _LevelIter(self._handle.db))

    def get(self, key: bytes) -> bytes | None:
        return self._handle.db.get(key)

    def items(self):
        """Every (key, value) once, in key order."""
        with self._handle.db.snapshot() as snap:
            yield from snap.iterator()


class _LevelIter:
    def __init__(self, db):
        self.snapshot = db.snapshot()
        self.it = None

    def first(self) -> bool:
        self.it = self.snapshot.iterator()
        self._item = next(self.it, None)
        return self._item is not None

    def next(self) -> bool:
        self._item = next(self.it, None)
        return self._item is not None

    def item(self) -> tuple[bytes, bytes]:
        return self._item

    def take(self, n: int) -> tuple[list, list, int]:
        keys, values, wraps = [], [], 0
        for _ in range(n):
            k, v = self._item
            keys.append(k)
            values.append(v)
            if not self.next():
                self.first()
                wraps += 1
        return keys, values, wraps


class LevelDBWriter:
    """Writes records to a new LevelDB in batches of ``commit_every``."""

    def __init__(self, path: str, commit_every: int = 1000):
        plyvel = _plyvel()
        self.path, self.commit_every = path, commit_every
        self.db = plyvel.DB(path, create_if_missing=True, error_if_exists=True)
        self._batch = self.db.write_batch()
        self._n = self.count = 0

    def put(self, key, value: bytes) -> None:
        self._batch.put(key.encode() if isinstance(key, str) else key, value)
        self._n += 1
        self.count += 1
        if self._n >= self.commit_every:
            self.commit()

    def commit(self) -> None:
        self._batch.write()
        self._batch, self._n = self.db.write_batch(), 0

    def close(self) -> None:
        if self.db is not None:
            self.commit()
            self.db.close()
            self.db = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
