"""Byte-level I/O over local paths and fsspec URIs, and outputs that appear atomically.

Reads are explicit byte ranges (`os.pread` on local files, ranged `cat_file` elsewhere); no file
is mmapped or read whole unless it is small metadata, and then never past a size cap.

Every byte the engine reads from a checkpoint goes through this module, which confines it:

- `member(base, name, where)` turns a file name that checkpoint metadata names (an index's `weight_map`, a
  DCP `relative_path`) into a path inside the checkpoint's folder, refusing names that leave it
  (absolute paths, `..`, backslashes, percent-escapes and their Unicode-normalised forms);
- local files are opened only when they are regular files (never a FIFO, device or socket: checked
  before opening, and again on the open descriptor, which is opened non-blocking);
- with read roots set (the engine config's `read_roots`, or `confine_reads(roots)`: a JSON
  list of roots, or one root; every service process (API, scheduler, worker, job, inspection) sets it to
  its read roots plus its write roots, since it reads back what it writes), every local file and every
  folder listed must resolve, symlinks followed, inside one of them, files checked before opening and
  again on the opened descriptor; remote URIs must lie below one of the roots given as URIs. Without
  roots (offline), member symlinks are followed;
- whole-file reads (`read_all`) stop at `max_metadata_bytes()` (`CKPT_MAX_METADATA_BYTES`), checked
  against the file's real size first; ranged reads are checked against the real size before any
  buffer is allocated.
"""

from __future__ import annotations

import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from functools import lru_cache, partial, wraps
from typing import Any, Concatenate, Literal, ParamSpec, TypeVar

from .config import current
from .errors import CkptError, FormatError, SourceError, TargetError
from .names import MANIFEST, WRITING, tmp_prefix
from .pathsafety import bad_name, inside, inside_any, overlap

#: Remote reads smaller than this fetch the whole aligned block (cached), so many small header reads
#: cost few requests; larger reads fetch their own range, taking the ends that cached blocks hold from them.
MIN_REQUEST = 256 * 1024
#: Larger remote reads are split into about this many bytes per request, fetched `REMOTE_PARALLEL` at a time
#: (one pool per reader, shared by its threads), straight into the caller's buffer.
READ_CHUNK = 8 * 1024 * 1024
REMOTE_PARALLEL = 4
#: Index reads of many small remote pieces (a DCP record's header each) run this many at a time: each waits
#: on a round trip, not on the CPU.
INDEX_PARALLEL = 16
_CACHE_BLOCKS = 256  # 64 MiB at most
#: Bytes fetched ahead with a record's header (`RangeReader.prefetch`) and not yet read, at most.
_SPAN_BYTES = 128 * 1024 * 1024
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs (pip install gcsfs)", "gcs": "gcs (pip install gcsfs)",
           "az": "azure (pip install adlfs)", "abfs": "azure (pip install adlfs)"}


_P = ParamSpec("_P")
_R = TypeVar("_R")
_T = TypeVar("_T")

_roots: list[str] | None = None


def max_metadata_bytes() -> int:
    """The cap on every whole-file read (metadata, index JSON, zip directory, pickles): the engine config's."""
    return current().max_metadata_bytes


def confine_reads(roots: list[str] | None) -> None:
    """Compatibility for callers that set roots process-wide (the service worker, Ray tasks): allow reads only
    inside `roots`; None: the engine config's `read_roots` decide."""
    global _roots
    _roots = None if roots is None else [_root(r) for r in roots]


def _root(text: str) -> str:
    return os.path.realpath(local_path(text)) if is_local(text) else text.rstrip("/")


def read_roots() -> list[str] | None:
    """The read roots in force: set by `confine_reads`, else the engine config's, else None (no check)."""
    if _roots is not None:
        return _roots
    roots = current().read_roots
    return None if roots is None else [_root(r) for r in roots if r.strip()]


def _check_roots(uri: str, real: str | None = None) -> None:
    roots = read_roots()
    if roots is None:
        return
    where = real if real is not None else (os.path.realpath(local_path(uri)) if is_local(uri) else uri)
    if not inside_any(where, roots):
        raise SourceError(f"{uri}: resolves outside the storage roots this process may read; refusing to read it",
                          uri=uri)


def member(base: str, name: object, where: str) -> str:
    """The path of file `name`, as the checkpoint metadata in `where` names it, inside the folder `base`.

    Names that would leave the folder are refused before anything is looked up."""
    if not isinstance(name, str) or not name:
        raise FormatError(f"{where}: names a data file {name!r}, which is not a file name; the metadata is damaged")
    why = bad_name(name)
    if why:
        raise FormatError(f"{where}: names the data file {name!r}, which {why}; a checkpoint may only name files "
                          "inside its own folder, so it was not read")
    return join(base, name)


def _kind(mode: int) -> str:
    return "a folder" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, device or socket)"


def _stat_local(uri: str, missing: str) -> os.stat_result:
    """stat() of a local file we are about to read: inside the read roots, existing, a regular file."""
    path = local_path(uri)
    _check_roots(uri)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SourceError(f"{uri}: {missing}", uri=uri) from None
    except NotADirectoryError:
        raise SourceError(f"{uri}: {missing}", uri=uri) from None
    except PermissionError:
        raise SourceError(f"{uri}: permission denied", uri=uri) from None
    if not stat.S_ISREG(st.st_mode):
        raise FormatError(f"{uri}: {_kind(st.st_mode)}; refusing to read it", uri=uri)
    return st


def open_file(uri: str, missing: str = "no such file") -> int:
    """A read-only descriptor of a local regular file inside the read roots; never blocks (a FIFO is refused)."""
    _stat_local(uri, missing)
    try:
        fd = os.open(local_path(uri), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SourceError(f"{uri}: {missing}", uri=uri) from None
    except OSError as exc:
        raise SourceError(f"{uri}: cannot open ({exc.strerror})", uri=uri) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # swapped between the stat and the open
            raise FormatError(f"{uri}: {_kind(st.st_mode)}; refusing to read it", uri=uri)
        if read_roots() is not None:
            try:
                real = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                real = os.path.realpath(local_path(uri))
            _check_roots(uri, real)
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_local(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file://")


def local_path(uri: str) -> str:
    return uri.removeprefix("file://")


@lru_cache(maxsize=64)
def _fs(protocol: str) -> Any:
    import fsspec

    try:
        try:  # listings must be fresh: another process may finish an upload while this one runs
            return fsspec.filesystem(protocol, use_listings_cache=False)
        except TypeError:
            return fsspec.filesystem(protocol)
    except ImportError:
        extra = _EXTRAS.get(protocol)
        hint = f"pip install 'ckpt-service[{extra}]'" if extra == "s3" else (f"install {extra}" if extra else
                                                                             "install its fsspec package")
        raise SourceError(f"{protocol}:// URIs need an extra package: {hint}") from None
    except ValueError:
        raise SourceError(f"{protocol}:// is not a storage protocol fsspec knows") from None


@contextmanager
def translate_errors(uri: str, writing: bool = False) -> Iterator[None]:
    """Turn storage exceptions into one-line errors that say what failed, in plain words."""
    kind = TargetError if writing else SourceError
    try:
        yield
    except CkptError:
        raise
    except FileNotFoundError as exc:
        text = str(exc)
        if "bucket" in text.lower() or "NoSuchBucket" in text:
            raise kind(f"{uri}: no such bucket; create it or fix the URI") from None
        raise kind(f"{uri}: no such file or prefix") from None
    except PermissionError:
        raise kind(f"{uri}: access denied; check the credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE) and the "
                   "bucket policy") from None
    except OSError as exc:
        text = f"{type(exc).__name__}: {exc}"
        if "Could not connect" in text or "EndpointConnectionError" in text or "Connect" in type(exc).__name__:
            raise kind(f"{uri}: storage endpoint unreachable ({_endpoint()}); check AWS_ENDPOINT_URL or the "
                       "network") from None
        if "SlowDown" in text or "Throttl" in text or "503" in text:
            raise kind(f"{uri}: the storage service kept throttling requests; retry later") from None
        raise kind(f"{uri}: storage error ({text})") from None
    except Exception as exc:  # botocore and aiohttp raise their own types
        name = type(exc).__name__
        if "Credential" in name:
            raise kind(f"{uri}: no credentials found; set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile") \
                from None
        if "Connect" in name or "Timeout" in name:
            raise kind(f"{uri}: storage endpoint unreachable ({_endpoint()}); check AWS_ENDPOINT_URL or the "
                       "network") from None
        raise


def _endpoint() -> str:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "the default AWS endpoint"


def filesystem(uri: str) -> tuple[Any, str]:
    """(fsspec filesystem, path) for a remote URI."""
    protocol = uri.split("://", 1)[0]
    return _fs(protocol), uri


def join(base: str, *names: str) -> str:
    out = base.rstrip("/")
    for name in names:
        out = f"{out}/{name}"
    return out


def basename(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[-1]


def parent(uri: str) -> str:
    return uri.rstrip("/").rsplit("/", 1)[0] if "/" in uri.rstrip("/") else "."


def _remote_call(uri: str, method: str, **kwargs: Any) -> Any:
    """`fs.<method>(uri)` on the URI's filesystem, with storage errors in plain words."""
    fs, path = filesystem(uri)
    with translate_errors(uri):
        return getattr(fs, method)(path, **kwargs)


_Listing = dict[str, tuple[bool, int]]  # name -> (is a folder, size)
_static_lock = threading.Lock()
_static: dict[str, tuple[list[int], dict[str, _Listing]]] = {}  # root -> ([users], folder -> its listing)


@contextmanager
def static_source(uri: str) -> Iterator[None]:
    """While a command reads the remote checkpoint `uri`, which does not change while it is read, each folder
    at or under it is listed once: `exists`, `isdir`, `listdir` and `size` of what lies there answer from that
    listing (a source of a few files costs one request instead of one or two per question, each a round trip
    on object storage). Elsewhere listings stay uncached (another process may be writing there)."""
    root = uri.rstrip("/")
    if is_local(uri):
        yield
        return
    with _static_lock:
        _static.setdefault(root, ([0], {}))[0][0] += 1
    try:
        yield
    finally:
        with _static_lock:
            users = _static[root][0]
            users[0] -= 1
            if not users[0]:
                del _static[root]


def _listed(uri: str) -> _Listing | None:
    """The listing of the remote folder `uri` when it lies in a `static_source` (listed now if need be; a file or
    a missing folder lists empty), else None."""
    key = uri.rstrip("/")
    with _static_lock:
        cache = next((c for root, (_, c) in _static.items() if inside(key, root)), None)
        if cache is None or key in cache:
            return None if cache is None else cache[key]
    own = key.split("://", 1)[-1]
    fs, path = filesystem(key)
    with translate_errors(key):
        try:
            entries = fs.ls(path, detail=True)
        except FileNotFoundError:
            entries = []
    listing = {basename(e["name"]): (e.get("type") == "directory", int(e.get("size") or 0))
               for e in entries if e["name"].rstrip("/") != own}
    with _static_lock:
        cache[key] = listing
    return listing


def _listed_entry(uri: str) -> tuple[bool, int] | Literal[False] | None:
    """(is a folder, size) of `uri` from the cached listing of its folder; False when that listing lacks it;
    None when its folder lies in no `static_source`."""
    listing = _listed(parent(uri))
    return None if listing is None else listing.get(basename(uri), False)


def exists(uri: str) -> bool:
    if is_local(uri):
        return os.path.exists(local_path(uri))
    entry = _listed_entry(uri)
    if entry is not None:
        return entry is not False
    return bool(_listed(uri)) or bool(_remote_call(uri, "exists"))


def lexists(uri: str) -> bool:
    """exists(), but true for a local symlink whose target is missing (so that reading it says why)."""
    return os.path.lexists(local_path(uri)) if is_local(uri) else exists(uri)


def isdir(uri: str) -> bool:
    if is_local(uri):
        return os.path.isdir(local_path(uri))
    entry = _listed_entry(uri)
    if entry is not None:
        return entry is not False and entry[0]
    return bool(_listed(uri)) or bool(_remote_call(uri, "isdir"))


def listdir(uri: str) -> list[str]:
    """Names (not paths) of the entries of a folder (inside the read roots, symlinks resolved), sorted."""
    _check_roots(uri)
    if is_local(uri):
        return sorted(os.listdir(local_path(uri)))
    listing = _listed(uri)
    if listing:
        return sorted(listing)
    own = uri.split("://", 1)[-1].rstrip("/")
    return sorted(basename(p) for p in _remote_call(uri, "ls", detail=False) if p.rstrip("/") != own)


def size(uri: str, missing: str = "no such file") -> int:
    """Size of a file we may read (local: a regular file inside the read roots)."""
    if is_local(uri):
        return _stat_local(uri, missing).st_size
    _check_roots(uri)
    entry = _listed_entry(uri)
    if entry and not entry[0]:
        return entry[1]
    fs, path = filesystem(uri)
    with translate_errors(uri):
        try:
            return int(fs.size(path))
        except FileNotFoundError:
            raise SourceError(f"{uri}: {missing}", uri=uri) from None


def _too_big(uri: str, cap: int) -> FormatError:
    return FormatError(f"{uri}: larger than the {cap}-byte limit for metadata files; the file is damaged or not "
                       f"what its name says (if it is genuine, raise CKPT_MAX_METADATA_BYTES)")


def read_all(uri: str, cap: int | None = None) -> bytes:
    """Read a whole metadata file, refusing one larger than `cap` (default `max_metadata_bytes()`).

    The real size is checked before reading, and at most cap+1 bytes are read (a growing file too)."""
    cap = max_metadata_bytes() if cap is None else cap
    if not is_local(uri):
        if size(uri) > cap:
            raise _too_big(uri, cap)
        _check_roots(uri)
        data = bytes(_remote_call(uri, "cat_file", start=0, end=cap + 1))
        if len(data) > cap:
            raise _too_big(uri, cap)
        return data
    fd = open_file(uri)
    try:
        if os.fstat(fd).st_size > cap:
            raise _too_big(uri, cap)
        parts: list[bytes] = []
        got = 0
        while got <= cap:
            piece = os.read(fd, min(cap + 1 - got, 1 << 24))
            if not piece:
                break
            parts.append(piece)
            got += len(piece)
        if got > cap:
            raise _too_big(uri, cap)
        return b"".join(parts)
    except OSError as exc:
        raise SourceError(f"{uri}: cannot read ({exc.strerror})", uri=uri) from None
    finally:
        os.close(fd)


def _gather(futures: list[Future[_T]]) -> list[_T]:
    """The futures' results in order; the first failure in order is raised. Either way, none is still running
    when this returns (never leave a request writing into a buffer the caller has given up on)."""
    try:
        return [future.result() for future in futures]
    finally:
        for future in futures:
            future.cancel()
        for future in futures:
            if not future.cancelled():
                future.exception()


@dataclass
class _Group:
    """The records of a prefetched group (`RangeReader.prefetch`): how many, and which were read."""

    count: int
    read: dict[int, int] = field(default_factory=dict)  # record -> bytes of its tensor read
    done: set[int] = field(default_factory=set)  # records read whole


@dataclass
class _Span:
    data: bytes
    group: int
    state: _Group


class RangeReader:
    """Reads byte ranges of files, keeping one descriptor per local file; safe across threads."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._blocks: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._done: dict[Hashable, Any] = {}  # `once` results
        self._pending: dict[Hashable, Future[Any]] = {}  # blocks being fetched, `once` values being computed
        self._spans: OrderedDict[tuple[str, int], _Span] = OrderedDict()  # prefetched, not yet read
        self._span_bytes = 0
        self._sizes: dict[str, int] = {}
        self._pool: ThreadPoolExecutor | None = None  # remote range requests in flight (lazily started)
        self._side_pool: ThreadPoolExecutor | None = None  # `map` calls (lazily started)
        self.requested = 0  # bytes asked for by the engine (remote files)
        self.fetched = 0  # bytes transferred from remote storage
        self.requests = 0

    def fd(self, path: str) -> int:
        """A shared read-only descriptor of a local file (kept open until `close`)."""
        fd = self._fds.get(path)
        if fd is None:
            with self._lock:
                fd = self._fds.get(path)
                if fd is None:
                    fd = self._fds[path] = self._open(path)
        return fd

    def file_size(self, uri: str) -> int:
        """The real size of a file being read (local: of the open descriptor), cached."""
        known = self._sizes.get(uri)
        if known is None:
            known = os.fstat(self.fd(local_path(uri))).st_size if is_local(uri) else size(uri)
            self._sizes[uri] = known
        return known

    def check_range(self, uri: str, offset: int, length: int) -> None:
        """Refuse a range that is negative or reaches past the end of the file, before allocating for it."""
        if offset < 0 or length < 0:
            raise FormatError(f"{uri}: the checkpoint metadata names bytes {offset}..{offset + length}, a negative "
                              "position or length; the metadata is damaged", uri=uri)
        if offset + length > self.file_size(uri):
            raise SourceError(f"{uri}: file is shorter than the checkpoint metadata says (wanted bytes "
                              f"{offset}..{offset + length}); it is truncated or damaged: re-copy or re-upload it",
                              uri=uri)

    def read(self, uri: str, offset: int, length: int) -> bytes:
        self.check_range(uri, offset, length)
        if length == 0:
            return b""
        if is_local(uri):
            try:
                data = os.pread(self.fd(local_path(uri)), length, offset)
            except OSError as exc:
                raise SourceError(f"{uri}: cannot read ({exc.strerror or exc})", uri=uri) from None
        else:
            data = self._remote(uri, offset, length)
        if len(data) != length:
            raise SourceError(f"{uri}: file is shorter than the checkpoint metadata says (wanted bytes "
                              f"{offset}..{offset + length}); it is truncated: re-copy or re-upload it", uri=uri)
        return data

    def _fetch(self, uri: str, start: int, end: int) -> bytes:
        fs, path = filesystem(uri)
        with translate_errors(uri):
            data = bytes(fs.cat_file(path, start=start, end=end))
        with self._lock:
            self.fetched += len(data)
            self.requests += 1
        return data

    def _remote(self, uri: str, offset: int, length: int) -> bytes:
        """Ranged read; small reads come from prefetched spans or an LRU of aligned `MIN_REQUEST` blocks."""
        if length >= MIN_REQUEST:
            out = bytearray(length)
            self._remote_into(uri, offset, memoryview(out))
            return bytes(out)
        with self._lock:
            self.requested += length
        out = bytearray()
        while len(out) < length:
            at = offset + len(out)
            piece = self._span_piece(uri, at, length - len(out))
            if not piece:
                block = at // MIN_REQUEST
                lo = at - block * MIN_REQUEST
                piece = memoryview(self._block(uri, block))[lo: lo + length - len(out)]
                if not piece:
                    break
            out += piece
        return bytes(out)

    def once(self, key: Hashable, compute: Callable[[], _T]) -> _T:
        """`compute()` once per `key` for this reader, kept; threads that want a key being computed wait for
        that computation instead of starting their own. A failure is raised to every waiter and not kept."""
        return self._once(self._done, key, compute)

    def _once(self, store: dict[Any, Any], key: Hashable, compute: Callable[[], _T]) -> _T:
        with self._lock:
            if key in store:
                if isinstance(store, OrderedDict):
                    store.move_to_end(key)
                return store[key]
            pending = self._pending.get(key)
            mine = pending is None
            if pending is None:
                pending = self._pending[key] = Future()
        if not mine:
            return pending.result()
        try:
            value = compute()
        except BaseException as exc:
            with self._lock:
                del self._pending[key]
            pending.set_exception(exc)
            raise
        with self._lock:
            del self._pending[key]
            store[key] = value
            while store is self._blocks and len(self._blocks) > _CACHE_BLOCKS:
                self._blocks.popitem(last=False)
        pending.set_result(value)
        return value

    def _block(self, uri: str, block: int) -> bytes:
        """One aligned `MIN_REQUEST` block, from the cache or fetched; threads that want a block being fetched
        wait for that request instead of sending their own (index reads run side by side, `map`)."""
        return self._once(self._blocks, (uri, block),
                          lambda: self._fetch(uri, block * MIN_REQUEST, (block + 1) * MIN_REQUEST))

    def prefetch(self, uri: str, ranges: list[tuple[int, int]], group: int, count: int) -> None:
        """Fetch remote (offset, length) ranges side by side, each in one request, and keep them for the reads
        that follow: the `count` DCP records of a group (those lying back to back at `group`), each record's
        header with its tensor's first bytes, so that locating a tensor and reading it cost one request, not
        two, and neighbouring small records none of their own. The spans are dropped once every record of
        the group was `release`d or, oldest first, beyond `_SPAN_BYTES`."""
        state = _Group(count)

        def fetch(offset: int, length: int) -> None:
            self.check_range(uri, offset, length)
            data = self._fetch(uri, offset, offset + length)
            with self._lock:
                self._spans[(uri, offset)] = _Span(data, group, state)
                self._span_bytes += len(data)
                while self._span_bytes > _SPAN_BYTES:
                    self._span_bytes -= len(self._spans.popitem(last=False)[1].data)

        self._run([partial(fetch, offset, length) for offset, length in ranges])

    def release(self, uri: str, group: int, record: int, nbytes: int, total: int) -> None:
        """`nbytes` of the `total` bytes of record `record` of the group at `group` have been read: once all of
        every record of the group are, the group's spans go (and a span fetched for that record alone)."""
        with self._lock:
            for key in [k for k, span in self._spans.items() if k[0] == uri and span.group in (group, record)]:
                span = self._spans[key]
                read = span.state.read[record] = span.state.read.get(record, 0) + nbytes
                if read >= total:
                    span.state.done.add(record)
                if len(span.state.done) >= span.state.count:
                    self._span_bytes -= len(self._spans.pop(key).data)

    def _span_piece(self, uri: str, at: int, length: int) -> memoryview:
        """Up to `length` bytes from `at` that a prefetched span holds (empty when none does), not copied."""
        with self._lock:
            start, data = self._span_at(uri, at)
            return data[at - start: at - start + length]

    def _span_at(self, uri: str, at: int) -> tuple[int, memoryview]:
        """(start, a view of the bytes) of a prefetched span of `uri` that holds byte `at`, or (at, an empty
        view); the lock is held. Views, so that taking a piece of a span copies nothing."""
        for (span_uri, start), span in self._spans.items():
            if span_uri == uri and start <= at < start + len(span.data):
                return start, memoryview(span.data)
        return at, memoryview(b"")

    def _remote_into(self, uri: str, offset: int, view: memoryview) -> None:
        """Fill `view` with a large remote range (see `_fetches`)."""
        self._run(self._fetches(uri, offset, view))

    def _fetches(self, uri: str, offset: int, view: memoryview) -> list[Callable[[], None]]:
        """The requests that fill `view` with a large remote range, `READ_CHUNK` bytes or so each, every one
        copying its bytes into place as they arrive; the ends that blocks cached for small reads hold are
        copied at once."""
        length = len(view)
        with self._lock:
            self.requested += length
        start, end = self._from_cache(uri, offset, view)
        if start == end:
            return []
        count = -(-(end - start) // READ_CHUNK)
        step = -(-(end - start) // count)

        def fetch(lo: int) -> None:
            hi = min(lo + step, end)
            data = self._fetch(uri, offset + lo, offset + hi)
            if len(data) != hi - lo:
                raise SourceError(f"{uri}: file is shorter than the checkpoint metadata says (wanted bytes "
                                  f"{offset}..{offset + length}); it is truncated: re-copy or re-upload it", uri=uri)
            view[lo:hi] = data

        return [partial(fetch, lo) for lo in range(start, end, step)]

    def _run(self, fetches: list[Callable[[], None]]) -> None:
        """Run requests `REMOTE_PARALLEL` at a time (one pool per reader, shared by its threads); one runs
        in the calling thread. Returns when every request has finished, failed or not."""
        if len(fetches) <= 1:
            for fetch in fetches:
                fetch()
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(REMOTE_PARALLEL, thread_name_prefix="ckpt-fetch")
            pool = self._pool
        _gather([pool.submit(fetch) for fetch in fetches])

    def map(self, fn: Callable[[_T], _R], items: Sequence[_T], remote: bool = True) -> list[_R]:
        """`[fn(item) for item in items]`, with up to `INDEX_PARALLEL` calls side by side when their reads are
        `remote` (each is mostly a round trip), in this reader's own pool (apart from the range requests' pool,
        which `fn` may use); results in order, and the first failure in order is raised."""
        if not remote or len(items) < 2:
            return [fn(item) for item in items]
        with self._lock:
            if self._side_pool is None:
                self._side_pool = ThreadPoolExecutor(INDEX_PARALLEL, thread_name_prefix="ckpt-index")
            pool = self._side_pool
        return _gather([pool.submit(fn, item) for item in items])

    def readinto_many(self, reads: list[tuple[str, int, memoryview]]) -> None:
        """`readinto` for several (uri, offset, view) at once: the large remote ones are fetched side by side
        (a tensor's chunks in several rank files), the others one after another."""
        fetches: list[Callable[[], None]] = []
        for uri, offset, view in reads:
            if is_local(uri) or len(view) < MIN_REQUEST:
                self.readinto(uri, offset, view)
            else:
                self.check_range(uri, offset, len(view))
                fetches += self._fetches(uri, offset, view)
        self._run(fetches)

    def _from_cache(self, uri: str, offset: int, view: memoryview) -> tuple[int, int]:
        """Copy the ends of `view` that prefetched spans and blocks already fetched for small reads hold (a
        record's header and the zip directory after it share blocks or spans with its data), so no byte is
        fetched twice; returns the part of `view` still to fetch, as [start, end) offsets into it."""
        start, end = 0, len(view)
        while start < end and (piece := self._span_piece(uri, offset + start, end - start)):
            view[start: start + len(piece)] = piece
            start += len(piece)
        with self._lock:
            at, held = self._span_at(uri, offset + end - 1) if start < end else (0, memoryview(b""))
            if held:  # a span holding the view's last bytes
                lo = max(offset + start, at)
                view[lo - offset: end] = held[lo - at: offset + end - at]
                end = lo - offset
            while start < end:
                block = (offset + start) // MIN_REQUEST
                data = self._blocks.get((uri, block))
                lo = offset + start - block * MIN_REQUEST
                piece = memoryview(data)[lo: lo + end - start] if data is not None else memoryview(b"")
                if not piece:
                    break
                view[start: start + len(piece)] = piece
                start += len(piece)
            while start < end:
                block = (offset + end - 1) // MIN_REQUEST
                data = self._blocks.get((uri, block))
                lo = max(offset + start, block * MIN_REQUEST)
                if data is None or len(data) < offset + end - block * MIN_REQUEST:
                    break
                view[lo - offset: end] = memoryview(data)[lo - block * MIN_REQUEST: offset + end - block * MIN_REQUEST]
                end = lo - offset
        return start, end

    def fetch_note(self) -> list[str]:
        """A report line on remote traffic, when there was any."""
        if not self.fetched:
            return []
        return [f"fetched {self.fetched} bytes in {self.requests} requests for {self.requested} bytes needed "
                "from remote storage"]

    def readinto(self, uri: str, offset: int, view: memoryview) -> None:
        length = len(view)
        self.check_range(uri, offset, length)
        if length == 0:
            return
        if is_local(uri):
            fd = self.fd(local_path(uri))
            try:
                got = os.preadv(fd, [view], offset)
                while got < length:
                    more = os.preadv(fd, [view[got:]], offset + got)
                    if more == 0:
                        raise SourceError(f"{uri}: file is shorter than the checkpoint metadata says (wanted "
                                          f"bytes {offset}..{offset + length}); it is truncated: re-copy it", uri=uri)
                    got += more
            except OSError as exc:
                raise SourceError(f"{uri}: cannot read ({exc.strerror or exc})", uri=uri) from None
        elif length >= MIN_REQUEST:
            self._remote_into(uri, offset, view)
        else:
            view[:] = self.read(uri, offset, length)

    def _open(self, path: str) -> int:
        return open_file(path, "data file is missing; the checkpoint is incomplete (re-copy or re-upload it)")

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._sizes.clear()
            pools = [self._pool, self._side_pool]
            self._pool = self._side_pool = None
            self._spans.clear()
            self._span_bytes = 0
        for pool in pools:
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _on_target(path: str, target: str) -> bool:
    """Whether `path` (from an OSError) lies in `target` or in its temporary sibling `.NAME.tmp-...`."""
    if is_local(target):
        base = os.path.abspath(local_path(target))
        path = os.path.abspath(path)
        parent, name = os.path.split(base)
        return path == base or path.startswith(base + os.sep) or path.startswith(os.path.join(parent, tmp_prefix(name)))
    return path.startswith(target.split("://", 1)[-1])


def names_source(exc: OSError, target: str) -> bool:
    """Whether `exc` names a file outside `target` and its temporary sibling (a source file, when converting)."""
    return isinstance(exc.filename, str | bytes | os.PathLike) and not _on_target(os.fsdecode(exc.filename), target)


@contextmanager
def io_errors(source: str, target: str) -> Iterator[None]:
    """Name the side an OSError escaping a conversion came from: one naming a file outside `target` (and its
    temporary sibling) is a SourceError naming that file of `source`; any other is a TargetError naming `target`."""
    try:
        yield
    except OSError as exc:
        if names_source(exc, target):
            name = os.fsdecode(exc.filename)
            raise SourceError(f"{name}: cannot read ({exc.strerror or exc}); check the source {source}",
                              uri=name) from None
        raise TargetError(f"{target}: {exc.strerror or exc}", uri=target) from None


def with_io_errors(fn: Callable[Concatenate[str, str, _P], _R]) -> Callable[Concatenate[str, str, _P], _R]:
    """`io_errors` around a command `fn(source, target, ...)` (convert, reshard), its source `static_source`
    (unless the target lies in it: that one changes)."""
    @wraps(fn)
    def run(source: str, target: str, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        static = not overlap(source, target)
        with io_errors(source, target), (static_source(source) if static else nullcontext()):
            return fn(source, target, *args, **kwargs)
    return run


def check_target(uri: str, overwrite: bool) -> bool:
    """Refuse to write over an existing output, unless asked, or unless it is one we never finished; return
    whether there is one (to be replaced)."""
    if not exists(uri):
        return False
    if not overwrite and not is_incomplete(uri):
        raise TargetError(f"{uri}: already exists; pass --overwrite to replace it, or choose another target", uri=uri)
    return True


def is_incomplete(uri: str) -> bool:
    """True for an output prefix that ckpt-service started and did not finish (marker, no manifest)."""
    if is_local(uri) or not isdir(uri):
        return False
    names = listdir(uri)
    return WRITING in names and MANIFEST not in names

