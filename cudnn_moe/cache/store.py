"""DiskCache: one file per entry under the cache directory, written atomically, checked on every read.

Entry file ``<sha256 of the key JSON>.entry``, little-endian:

    magic  b"CUDNNMOE"         8 bytes
    format version             uint16 (FORMAT_VERSION)
    key length                 uint32, then the key's canonical JSON (ASCII)
    payload length             uint64
    payload sha256             32 bytes
    payload

The directory carries a marker, ``CACHEDIR.TAG`` (the cache-directory tag standard, naming cudnn_moe),
written when the cache creates the directory or first stores an entry in it. Only files the cache
itself names are ever listed, checked or removed: regular files called ``<64 hex digits>.entry`` (in an
unmarked directory also starting with the entry magic) and ``.<64 hex digits>.<random>.tmp``; every
other file or directory in it is left alone, and ``clear`` refuses a directory that is not a cache.

Writes go to a temporary file in the same directory (``.<digest>.<random>.tmp``), are fsynced
and renamed over the entry with os.replace, so a reader sees the old entry, the new one or
none, never a partial file; several processes may write one key at once and the last rename
wins. A read that finds a corrupt, truncated or foreign entry (wrong magic or version, bad
checksum, another key) warns once per file per process (CacheWarning), removes the file and
returns None so the caller rebuilds: nothing unchecked is ever returned.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from .keys import EntryKey
from .paths import cache_dir

MAGIC = b"CUDNNMOE"
FORMAT_VERSION = 1
SUFFIX = ".entry"
TEMP_SUFFIX = ".tmp"
STALE_TEMP_SECONDS = 600.0  # a temporary file this old belongs to a writer that died
MARKER = "CACHEDIR.TAG"
MARKER_TEXT = (
    "Signature: 8a477f597d28d172789f06886806bc55\n"
    "# This file is a cache directory tag created by cudnn_moe (kernel binaries and cuDNN plans).\n"
    "# For information about cache directory tags see https://bford.info/cachedir/\n"
)
_ENTRY_NAME = re.compile(r"[0-9a-f]{64}\.entry")
_TEMP_NAME = re.compile(r"\.[0-9a-f]{64}\.[A-Za-z0-9_]+\.tmp")
_HEAD = struct.Struct("<8sHI")  # magic, format version, key length
_PAYLOAD_HEAD = struct.Struct("<Q32s")  # payload length, payload sha256


class CacheWarning(UserWarning):
    """A cache entry was unreadable or invalid and is being rebuilt, or an entry could not be stored."""


class CorruptEntry(ValueError):
    """An entry file that does not parse or whose checksum does not match."""


class NotACacheError(ValueError):
    """A directory that holds files but neither the cache's marker nor any of its entries."""


_reported: set[str] = set()
_reported_lock = threading.Lock()


def report_once(subject: str, message: str) -> None:
    """warnings.warn(CacheWarning) the first time ``subject`` (a file path) has a problem in this process."""
    with _reported_lock:
        if subject in _reported:
            return
        _reported.add(subject)
    warnings.warn(f"cudnn_moe cache: {message}", CacheWarning, stacklevel=3)


def _starts_with_magic(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def encode_entry(key_json: str, payload: bytes) -> bytes:
    """The bytes of an entry file holding ``payload`` under ``key_json``."""
    key_bytes = key_json.encode("ascii")
    return b"".join((
        _HEAD.pack(MAGIC, FORMAT_VERSION, len(key_bytes)),
        key_bytes,
        _PAYLOAD_HEAD.pack(len(payload), hashlib.sha256(payload).digest()),
        payload,
    ))


def _decode_head(data: bytes) -> tuple[str, int, bytes, int]:
    """(key JSON, payload length, payload sha256, payload offset); raises CorruptEntry."""
    if len(data) < _HEAD.size:
        raise CorruptEntry(f"truncated header ({len(data)} bytes)")
    magic, version, key_length = _HEAD.unpack_from(data)
    if magic != MAGIC:
        raise CorruptEntry("not a cudnn_moe cache entry (wrong magic)")
    if version != FORMAT_VERSION:
        raise CorruptEntry(f"entry format {version}, this package reads {FORMAT_VERSION}")
    key_end = _HEAD.size + key_length
    if len(data) < key_end + _PAYLOAD_HEAD.size:
        raise CorruptEntry("truncated key")
    try:
        key_json = data[_HEAD.size:key_end].decode("ascii")
    except UnicodeDecodeError as exc:
        raise CorruptEntry("key is not ASCII JSON") from exc
    length, checksum = _PAYLOAD_HEAD.unpack_from(data, key_end)
    return key_json, length, checksum, key_end + _PAYLOAD_HEAD.size


def decode_entry(data: bytes) -> tuple[str, bytes]:
    """(key JSON, payload) of an entry file's bytes, payload checksum verified; raises CorruptEntry."""
    key_json, length, checksum, start = _decode_head(data)
    payload = data[start:]
    if len(payload) != length:
        raise CorruptEntry(f"payload is {len(payload)} bytes, header says {length} (truncated or padded)")
    if hashlib.sha256(payload).digest() != checksum:
        raise CorruptEntry("payload checksum mismatch")
    return key_json, payload


@dataclass(frozen=True)
class CacheEntry:
    """One entry file as listed: key JSON (None if the header is unreadable), sizes, mtime."""

    path: Path
    key_json: str | None
    file_size: int
    payload_size: int | None
    mtime: float
    problem: str | None = None

    @property
    def key(self) -> EntryKey | None:
        if self.key_json is None:
            return None
        try:
            return EntryKey.from_json(self.key_json)
        except ValueError:
            return None


@dataclass(frozen=True)
class EntryCheck:
    """verify()'s finding for one entry file: ok, or the problem."""

    path: Path
    ok: bool
    problem: str | None
    key_json: str | None


class DiskCache:
    """Entries under one cache directory (see cache_dir for the default and its 0700 mode)."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        existed = cache_dir(root, create=False).is_dir()
        self.root = cache_dir(root)
        self._marked = False
        if not existed:
            self._mark()

    def is_marked(self) -> bool:
        """Whether the directory carries this cache's marker file (CACHEDIR.TAG naming cudnn_moe)."""
        try:
            text = (self.root / MARKER).read_text(encoding="ascii", errors="replace")
        except OSError:
            return False
        return text.startswith(MARKER_TEXT.splitlines()[0]) and "cudnn_moe" in text

    def _mark(self) -> None:
        """Write the marker file once per instance (an existing one, or an unwritable directory, is left as it is)."""
        if self._marked:
            return
        self._marked = True
        try:
            with open(self.root / MARKER, "x", encoding="ascii") as f:
                f.write(MARKER_TEXT)
        except OSError:
            pass

    def path_for(self, key: EntryKey) -> Path:
        return self.root / f"{key.digest()}{SUFFIX}"

    def get(self, key: EntryKey) -> bytes | None:
        """The payload stored under ``key``, or None when absent, unreadable or invalid (reported once, removed)."""
        path = self.path_for(key)
        try:
            with open(path, "rb") as f:
                stat = os.fstat(f.fileno())
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            report_once(str(path), f"cannot read {path} ({exc}); rebuilding")
            return None
        try:
            key_json, payload = decode_entry(data)
            if key_json != key.to_json():
                raise CorruptEntry("it holds another key (foreign or renamed entry)")
        except CorruptEntry as exc:
            self._discard(path, stat, str(exc))
            return None
        return payload

    def put(self, key: EntryKey, payload: bytes) -> Path:
        """Store ``payload`` under ``key`` atomically; returns the entry's path. Raises OSError when
        the directory cannot be written."""
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"payload must be bytes, got {type(payload).__name__}")
        digest = key.digest()
        self._mark()
        self.clean_temporaries(prefix=f".{digest}.")
        data = encode_entry(key.to_json(), bytes(payload))
        fd, temp = tempfile.mkstemp(prefix=f".{digest}.", suffix=TEMP_SUFFIX, dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(temp, self.path_for(key))
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise
        self._sync_directory()
        return self.path_for(key)

    def put_or_report(self, key: EntryKey, payload: bytes) -> bool:
        """put(), but a directory that cannot be written is reported once (CacheWarning) instead of
        raising: the artifact is then rebuilt by the next process. Returns whether it was stored."""
        try:
            self.put(key, payload)
        except OSError as exc:
            report_once(str(self.root), f"cannot write entries under {self.root} ({exc}); continuing without storing")
            return False
        return True

    def entries(self) -> list[CacheEntry]:
        """Every entry file, sorted by path, from its header only (no checksum)."""
        found = []
        for path in self._entry_paths():
            try:
                stat = path.stat()
                with open(path, "rb") as f:
                    head = f.read(_HEAD.size)
                    key_length = _HEAD.unpack_from(head)[2] if len(head) == _HEAD.size else 0
                    head += f.read(key_length + _PAYLOAD_HEAD.size)
            except FileNotFoundError:
                continue  # removed while listing
            except OSError as exc:
                found.append(CacheEntry(path, None, 0, None, 0.0, problem=str(exc)))
                continue
            try:
                key_json, length, _, _ = _decode_head(head)
            except CorruptEntry as exc:
                found.append(CacheEntry(path, None, stat.st_size, None, stat.st_mtime, problem=str(exc)))
                continue
            found.append(CacheEntry(path, key_json, stat.st_size, length, stat.st_mtime))
        return found

    def verify(self) -> list[EntryCheck]:
        """Read every entry fully: header, payload checksum, and the file name against the key's digest.

        Reports, removes nothing (a bad entry is replaced on its next get)."""
        checks = []
        for path in self._entry_paths():
            key_json = None
            try:
                key_json, _ = decode_entry(path.read_bytes())
                digest = hashlib.sha256(key_json.encode("ascii")).hexdigest()
                if path.name != f"{digest}{SUFFIX}":
                    raise CorruptEntry(f"file name does not match its key (key digest {digest[:12]}...)")
                EntryKey.from_json(key_json)
            except FileNotFoundError:
                continue
            except (OSError, ValueError) as exc:  # CorruptEntry is a ValueError
                checks.append(EntryCheck(path, False, str(exc), key_json))
                continue
            checks.append(EntryCheck(path, True, None, key_json))
        return checks

    def clean_temporaries(self, prefix: str = ".", max_age: float = STALE_TEMP_SECONDS) -> int:
        """Remove temporary files (``prefix*.tmp``) older than ``max_age`` seconds, left by writers
        that died mid-write; returns how many. Younger ones may belong to a live writer."""
        removed = 0
        now = time.time()
        for path in self._temp_paths(prefix):
            try:
                if now - path.stat().st_mtime >= max_age:
                    path.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    def is_cache(self) -> bool:
        """Whether the directory is this cache's: marked, holding at least one of its entries, or empty."""
        if self.is_marked() or self._entry_paths():
            return True
        try:
            return next(os.scandir(self.root), None) is None
        except OSError:
            return False

    def clear(self) -> int:
        """Remove every entry and temporary file of this cache (see the module docstring for which files
        those are; nothing else is touched, the marker stays); returns how many files went.

        Raises NotACacheError, removing nothing, when the directory is not a cache (``is_cache``)."""
        if not self.is_cache():
            raise NotACacheError(
                f"{self.root} is not a cudnn_moe cache directory (it holds files but no {MARKER} written by "
                "cudnn_moe and no cache entries); refusing to remove anything from it"
            )
        removed = 0
        for path in [*self._entry_paths(), *self._temp_paths(".")]:
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                continue
        return removed

    def _own_files(self, pattern: re.Pattern[str], prefix: str = "") -> list[Path]:
        """Regular files (not links, not directories) directly in the directory whose whole name matches
        ``pattern`` and starts with ``prefix``, sorted by name."""
        try:
            with os.scandir(self.root) as found:
                return sorted(
                    Path(e.path) for e in found
                    if e.name.startswith(prefix) and pattern.fullmatch(e.name) and e.is_file(follow_symlinks=False)
                )
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _entry_paths(self) -> list[Path]:
        """The entry files: named as entries and, unless the directory is marked, starting with the magic."""
        paths = self._own_files(_ENTRY_NAME)
        if not paths or self.is_marked():
            return paths
        return [p for p in paths if _starts_with_magic(p)]

    def _temp_paths(self, prefix: str) -> list[Path]:
        return self._own_files(_TEMP_NAME, prefix)

    def _discard(self, path: Path, seen: os.stat_result, problem: str) -> None:
        """Report ``path`` once and remove it, unless a writer has replaced it since it was read."""
        report_once(str(path), f"ignoring invalid entry {path}: {problem}; it will be rebuilt")
        try:
            now = os.stat(path)
            if (now.st_ino, now.st_mtime_ns, now.st_size) == (seen.st_ino, seen.st_mtime_ns, seen.st_size):
                path.unlink()
        except OSError:
            pass  # already gone, or not ours to remove: the caller rebuilds either way

    def _sync_directory(self) -> None:
        """fsync the directory so the rename survives a power loss (where the OS allows it)."""
        try:
            fd = os.open(self.root, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
