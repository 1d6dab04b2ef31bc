"""The persistent cache store: keys, default paths, permissions, atomic writes, corrupt-entry recovery."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import multiprocessing
import os
import stat
import sys
import time
import types
import warnings
from pathlib import Path

import pytest

from cudnn_moe.cache import (
    ENV_VAR,
    KIND_CUDNN_PLAN,
    KIND_KERNEL,
    CacheWarning,
    DiskCache,
    EntryKey,
    Environment,
    cache_dir,
    current_environment,
    default_cache_dir,
)
from cudnn_moe.cache import store as store_module
from cudnn_moe.kernels import driver as driver_module
from cudnn_moe.kernels import loader as loader_module

ENV = Environment(
    gpu_name="NVIDIA H200", compute_capability=(9, 0), cudnn_backend=91900, cudnn_frontend="1.32.0",
    compiler=None, package_version="0.1.0",
)


def make_key(**changes) -> EntryKey:
    base = dict(kind=KIND_CUDNN_PLAN, name="gemm1", fields={"experts": 8, "n": 512, "k": 256, "bucket": 64}, environment=ENV)
    base.update(changes)
    return EntryKey(**base)


@pytest.fixture(autouse=True)
def fresh_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sees its own 'reported once' set."""
    monkeypatch.setattr(store_module, "_reported", set())


# ----------------------------------------------------------------------------- keys


def test_digest_is_stable_and_independent_of_field_order() -> None:
    key = make_key()
    assert key.digest() == make_key(fields={"bucket": 64, "k": 256, "n": 512, "experts": 8}).digest()
    assert key == make_key() and hash(key) == hash(make_key())
    assert len(key.digest()) == 64
    # The canonical JSON is part of the file format: pin it.
    assert key.to_json() == (
        '{"environment":{"compiler":null,"compute_capability":[9,0],"cudnn_backend":91900,'
        '"cudnn_frontend":"1.32.0","gpu_name":"NVIDIA H200","package_version":"0.1.0"},'
        '"fields":{"bucket":64,"experts":8,"k":256,"n":512},"kind":"cudnn-plan","name":"gemm1"}'
    )


@pytest.mark.parametrize(
    "change",
    [
        {"kind": KIND_KERNEL},
        {"name": "gemm2"},
        {"fields": {"experts": 8, "n": 512, "k": 256, "bucket": 128}},
        {"fields": {"experts": 8, "n": 512, "k": 256, "bucket": 64, "extra": None}},
        {"fields": {"experts": True, "n": 512, "k": 256, "bucket": 64}},  # not equal to 8, nor True to 1
        *({"environment": dataclasses.replace(ENV, **{f.name: value})} for f, value in zip(
            dataclasses.fields(Environment), ("NVIDIA B200", (10, 0), 92100, "1.33.0", "cupy 13.6.0, nvrtc 12.8", "0.2.0")
        )),
    ],
)
def test_digest_changes_with_every_field(change: dict) -> None:
    assert make_key(**change).digest() != make_key().digest()
    assert make_key(**change) != make_key()


def test_key_json_round_trip_and_bad_keys() -> None:
    key = make_key(fields={"shape": [1, (2, 3)], "ratio": 0.5, "tag": "x"})
    assert EntryKey.from_json(key.to_json()) == key
    assert key.field_dict()["shape"] == (1, (2, 3))
    with pytest.raises(ValueError, match="not a cache key"):
        EntryKey.from_json('{"kind": "x"}')
    with pytest.raises(ValueError, match="EntryKey.kind must be a non-empty str"):
        make_key(kind="")
    with pytest.raises(TypeError, match="key field 'f'"):
        make_key(fields={"f": {1: 2}})
    with pytest.raises(ValueError, match="key field 'f' must be finite"):
        make_key(fields={"f": float("nan")})
    with pytest.raises(TypeError, match="environment must be an Environment"):
        make_key(environment={"gpu_name": None})


def _no_distribution(name: str) -> str:
    raise importlib.metadata.PackageNotFoundError(name)


def test_kernel_compiler_version_reads_cupy_and_the_driver_without_importing_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda name: "13.6.0" if name == "cupy-cuda12x" else _no_distribution(name))
    monkeypatch.setattr(driver_module, "driver_version", lambda: 12080)
    monkeypatch.setitem(sys.modules, "cupy", None)  # read from the distribution, never imported
    assert loader_module.compiler_version() == "cupy 13.6.0, driver 12080"
    monkeypatch.setattr(importlib.metadata, "version", _no_distribution)
    assert loader_module.compiler_version() is None


def test_current_environment_without_gpu_cudnn_or_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import raises ImportError
    env = current_environment()
    assert (env.gpu_name, env.compute_capability, env.cudnn_backend, env.cudnn_frontend, env.compiler) == (None,) * 5
    import cudnn_moe

    assert env.package_version == cudnn_moe.__version__


def test_current_environment_reads_torch_cudnn_and_cupy(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"GPU{i}")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i: (10, i))
    monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(__version__="1.32.0", backend_version=lambda: 92100))
    env = current_environment(torch.device("cuda", 3))
    assert (env.gpu_name, env.compute_capability, env.cudnn_backend, env.cudnn_frontend) == ("GPU3", (10, 3), 92100, "1.32.0")
    assert current_environment(cudnn=False).cudnn_backend is None
    assert current_environment().gpu_name == "GPU1"


def test_import_does_not_load_cupy_or_cudnn() -> None:
    code = "import sys, cudnn_moe.cache; print('cupy' in sys.modules or 'cudnn' in sys.modules)"
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------- paths and permissions


def test_default_dir_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "cudnn_moe"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "cudnn_moe"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "cudnn_moe"
    monkeypatch.setenv(ENV_VAR, "")
    assert default_cache_dir() == tmp_path / "xdg" / "cudnn_moe"
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "env"))
    assert default_cache_dir() == tmp_path / "env"
    assert cache_dir(tmp_path / "arg") == tmp_path / "arg"
    assert cache_dir() == tmp_path / "env"


def test_created_directory_is_0700_even_under_a_permissive_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        root = cache_dir(tmp_path / "a" / "b", create=True)
    finally:
        os.umask(old)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    old = os.umask(0o077)
    try:
        assert stat.S_IMODE(cache_dir(tmp_path / "c").stat().st_mode) == 0o700
    finally:
        os.umask(old)


def test_existing_directory_keeps_its_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    DiskCache(shared).put(make_key(), b"x")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755


def test_create_false_and_a_file_in_the_way(tmp_path: Path) -> None:
    assert not cache_dir(tmp_path / "missing", create=False).exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match="not a directory"):
        cache_dir(tmp_path / "file")


def test_entry_files_are_private(tmp_path: Path) -> None:
    path = DiskCache(tmp_path).put(make_key(), b"payload")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


# ----------------------------------------------------------------------------- store


def test_put_get_round_trip_and_miss(tmp_path: Path) -> None:
    disk = DiskCache(tmp_path)
    assert disk.get(make_key()) is None
    path = disk.put(make_key(), b"\x00plan bytes\xff")
    assert path.name == make_key().digest() + ".entry"
    assert disk.get(make_key()) == b"\x00plan bytes\xff"
    assert disk.get(make_key(name="other")) is None
    disk.put(make_key(), b"")  # replace with an empty payload
    assert disk.get(make_key()) == b""
    with pytest.raises(TypeError, match="payload must be bytes"):
        disk.put(make_key(), "text")


def test_file_layout(tmp_path: Path) -> None:
    import hashlib
    import struct

    key = make_key()
    data = DiskCache(tmp_path).put(key, b"abc").read_bytes()
    key_bytes = key.to_json().encode()
    assert data[:8] == b"CUDNNMOE"
    assert struct.unpack_from("<HI", data, 8) == (1, len(key_bytes))
    assert data[14 : 14 + len(key_bytes)] == key_bytes
    length, checksum = struct.unpack_from("<Q32s", data, 14 + len(key_bytes))
    assert (length, checksum) == (3, hashlib.sha256(b"abc").digest())
    assert data.endswith(b"abc") and len(data) == 14 + len(key_bytes) + 40 + 3


def _corruptions(data: bytes, key: EntryKey) -> dict[str, bytes]:
    foreign = store_module.encode_entry(make_key(name="someone else").to_json(), b"their payload")
    flipped = bytearray(data)
    flipped[-1] ^= 1
    return {
        "truncated payload": data[:-1],
        "truncated header": data[:5],
        "empty file": b"",
        "wrong magic": b"NOTMOE!!" + data[8:],
        "future format": data[:8] + b"\x09\x00" + data[10:],
        "flipped payload bit": bytes(flipped),
        "padded": data + b"\x00",
        "foreign key": foreign,
    }


@pytest.mark.parametrize("case", list(_corruptions(b"x" * 400, make_key())))
def test_corrupt_entry_is_reported_once_removed_and_rebuilt(tmp_path: Path, case: str) -> None:
    disk = DiskCache(tmp_path)
    key = make_key()
    path = disk.put(key, b"good payload" * 10)
    path.write_bytes(_corruptions(path.read_bytes(), key)[case])
    with pytest.warns(CacheWarning, match=path.name):
        assert disk.get(key) is None
    assert not path.exists()
    # A second bad copy of the same file is not reported again in this process.
    path.write_bytes(b"garbage")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert disk.get(key) is None
    assert disk.put_or_report(key, b"rebuilt")
    assert disk.get(key) == b"rebuilt"


def test_unreadable_entry_is_reported_not_raised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = DiskCache(tmp_path)
    disk.put(make_key(), b"x")
    real_open = open

    def failing_open(path, *args, **kwargs):
        if str(path).endswith(".entry"):
            raise PermissionError("denied")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", failing_open)
    with pytest.warns(CacheWarning, match="cannot read"):
        assert disk.get(make_key()) is None


def test_leftover_temp_file_is_ignored_and_cleaned(tmp_path: Path) -> None:
    disk = DiskCache(tmp_path)
    key = make_key()
    # A writer that died mid-write leaves its temporary file: a prefix of a valid entry.
    partial = store_module.encode_entry(key.to_json(), b"p" * 1000)[:300]
    temp = tmp_path / f".{key.digest()}.deadbeef.tmp"
    temp.write_bytes(partial)
    young = tmp_path / f".{key.digest()}.alive.tmp"  # a writer still running
    young.write_bytes(partial)
    old = time.time() - 3600
    os.utime(temp, (old, old))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert disk.get(key) is None  # a missing entry is not a problem
    assert disk.entries() == [] and disk.verify() == []
    disk.put(key, b"complete")
    assert disk.get(key) == b"complete"
    assert not temp.exists() and young.exists()
    assert disk.clean_temporaries(max_age=0) == 1 and not young.exists()


def test_failed_write_leaves_no_temp_and_keeps_the_old_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = DiskCache(tmp_path)
    disk.put(make_key(), b"old")

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        disk.put(make_key(), b"new")
    monkeypatch.undo()
    assert disk.get(make_key()) == b"old"
    assert list(tmp_path.glob("*.tmp")) == []


def _writer(root: str, worker: int, rounds: int) -> None:
    disk = DiskCache(root)
    key = make_key()
    for i in range(rounds):
        disk.put(key, bytes([worker]) * (200_000 + i))
        payload = disk.get(key)
        assert payload is not None and len(set(payload)) == 1  # never a mix of two writers


def test_concurrent_writers_of_one_key(tmp_path: Path) -> None:
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    processes = [context.Process(target=_writer, args=(str(tmp_path), w, 20)) for w in range(4)]
    for p in processes:
        p.start()
    for p in processes:
        p.join(120)
    assert [p.exitcode for p in processes] == [0, 0, 0, 0]
    disk = DiskCache(tmp_path)
    payload = disk.get(make_key())
    assert payload is not None and len(set(payload)) == 1 and len(payload) >= 200_000
    assert [c.ok for c in disk.verify()] == [True]
    assert list(tmp_path.glob("*.tmp")) == []


def test_entries_verify_and_clear(tmp_path: Path) -> None:
    disk = DiskCache(tmp_path)
    keys = [make_key(name=f"g{i}") for i in range(3)]
    for i, key in enumerate(keys):
        disk.put(key, b"z" * (10 * (i + 1)))
    listed = disk.entries()
    assert sorted(e.key.name for e in listed) == ["g0", "g1", "g2"]
    assert sorted(e.payload_size for e in listed) == [10, 20, 30]
    assert all(e.problem is None and e.file_size > e.payload_size and e.mtime > 0 for e in listed)
    assert all(c.ok for c in disk.verify())

    bad = disk.path_for(keys[0])
    bad.write_bytes(bad.read_bytes()[:-3])
    renamed = disk.path_for(keys[1])
    renamed.rename(tmp_path / ("0" * 64 + ".entry"))
    (tmp_path / ("f" * 64 + ".entry")).write_bytes(b"junk")
    problems = {c.path.name[:4]: c.problem for c in disk.verify() if not c.ok}
    assert "truncated" in problems[bad.name[:4]]
    assert "file name does not match its key" in problems["0000"]
    assert "truncated header" in problems["ffff"]
    assert sum(c.ok for c in disk.verify()) == 1
    listed = {e.path.name[:4]: e for e in disk.entries()}
    assert listed["ffff"].key is None and "truncated header" in listed["ffff"].problem
    (tmp_path / f".{'1' * 64}.x.tmp").write_bytes(b"partial")
    assert disk.clear() == 5
    assert disk.entries() == [] and list(tmp_path.iterdir()) == [tmp_path / "CACHEDIR.TAG"]  # the marker stays


# ----------------------------------------------------------------------------- unwritable directory


def test_put_or_report_survives_a_read_only_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    disk = DiskCache(tmp_path)

    def refuse(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(store_module.tempfile, "mkstemp", refuse)
    with pytest.warns(CacheWarning, match="cannot write entries"):
        assert disk.put_or_report(make_key(), b"p") is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once
        assert disk.put_or_report(make_key(name="x"), b"q") is False
    with pytest.raises(PermissionError):
        disk.put(make_key(), b"p")  # put itself raises