"""The cache removes only what it wrote: foreign files and directories survive --clear, a directory that is
not a cache is refused, an empty cache path is refused, and nothing is created before a no-GPU failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import run
from cudnn_moe.cache import (
    KIND_KERNEL,
    MARKER,
    DiskCache,
    EntryKey,
    Environment,
    NotACacheError,
    cache_dir,
    set_cache_dir,
)
from cudnn_moe.cache import store as store_module

ENV = Environment(gpu_name="NVIDIA H200", compute_capability=(9, 0), cudnn_backend=91900, cudnn_frontend="1.32.0")
FOREIGN_FILES = {"thesis.entry": b"my thesis", ".vim-swap.tmp": b"swap", "notes.txt": b"notes",
                 "a" * 63 + ".entry": b"almost a digest", ".x.tmp": b"short temp"}


def key(i: int) -> EntryKey:
    return EntryKey(KIND_KERNEL, f"k{i}", {"i": i}, ENV)


def add_foreign(root: Path) -> None:
    for name, data in FOREIGN_FILES.items():
        (root / name).write_bytes(data)
    (root / "sub.entry").mkdir()
    (root / "sub.entry" / "inner.entry").write_bytes(b"inner")
    digest_dir = root / ("b" * 64 + ".entry")  # a directory with an entry's name
    digest_dir.mkdir()
    (root / ("c" * 64 + ".entry")).symlink_to(root / "notes.txt")  # a link with an entry's name


def assert_foreign_intact(root: Path) -> None:
    for name, data in FOREIGN_FILES.items():
        assert (root / name).read_bytes() == data, name
    assert (root / "sub.entry" / "inner.entry").read_bytes() == b"inner"
    assert (root / ("b" * 64 + ".entry")).is_dir()
    assert (root / ("c" * 64 + ".entry")).is_symlink()


@pytest.fixture(autouse=True)
def fresh_reports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "_reported", set())


def test_created_directory_is_marked(tmp_path: Path) -> None:
    disk = DiskCache(tmp_path / "new")
    assert (disk.root / MARKER).read_text().startswith("Signature: 8a477f597d28d172789f06886806bc55")
    assert disk.is_marked() and disk.is_cache()


def test_an_existing_directory_is_marked_by_its_first_entry(tmp_path: Path) -> None:
    disk = DiskCache(tmp_path)
    assert not (tmp_path / MARKER).exists()
    disk.put(key(0), b"x")
    assert disk.is_marked()


def test_clear_keeps_foreign_files_and_directories(tmp_path: Path) -> None:
    disk = DiskCache(tmp_path / "c")
    for i in range(3):
        disk.put(key(i), b"payload")
    own_temp = disk.root / f".{'d' * 64}.ab12_x.tmp"
    own_temp.write_bytes(b"partial")
    add_foreign(disk.root)
    assert sorted(e.key.name for e in disk.entries()) == ["k0", "k1", "k2"]  # foreign files are not listed
    assert all(c.ok for c in disk.verify()) and len(disk.verify()) == 3
    assert disk.clear() == 4
    assert_foreign_intact(disk.root)
    assert not own_temp.exists() and disk.entries() == [] and (disk.root / MARKER).exists()


def test_clear_refuses_a_directory_that_is_not_a_cache(tmp_path: Path) -> None:
    add_foreign(tmp_path)
    disk = DiskCache(tmp_path)
    with pytest.raises(NotACacheError, match="not a cudnn_moe cache directory"):
        disk.clear()
    assert_foreign_intact(tmp_path)


def test_an_unmarked_cache_of_an_older_version_is_cleared_by_its_magic(tmp_path: Path) -> None:
    disk = DiskCache(tmp_path)
    disk.put(key(0), b"x")
    (tmp_path / MARKER).unlink()
    impostor = tmp_path / ("e" * 64 + ".entry")
    impostor.write_bytes(b"not ours, only named like ours")
    assert disk.is_cache()
    assert disk.clear() == 1
    assert impostor.exists() and list(tmp_path.glob("*.entry")) == [impostor]


def test_an_empty_directory_clears_to_nothing(tmp_path: Path) -> None:
    assert DiskCache(tmp_path).clear() == 0


@pytest.mark.parametrize("empty", ["", " ", Path("")])
def test_empty_cache_paths_are_refused(empty: str | Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    if isinstance(empty, Path):  # Path("") is Path("."): a real path, the current directory by name
        assert DiskCache(empty).root == Path(".")
        return
    with pytest.raises(ValueError, match="must not be empty"):
        DiskCache(empty)
    with pytest.raises(ValueError, match="must not be empty"):
        cache_dir(empty)
    with pytest.raises(ValueError, match="must not be empty"):
        set_cache_dir(empty)
    assert list(tmp_path.iterdir()) == []


def test_cli_clear_keeps_foreign_files(tmp_path: Path, capsys: pytest.CaptureFixture[str], no_gpu) -> None:
    disk = DiskCache(tmp_path / "c")
    disk.put(key(0), b"x")
    add_foreign(disk.root)
    code, out, err = run(["prebuild", "--clear", "--cache-dir", str(disk.root)], capsys)
    assert code == 0 and err == "" and "removed 1 files" in out
    assert_foreign_intact(disk.root)


def test_cli_clear_refuses_a_home_like_directory(tmp_path: Path, capsys, no_gpu, monkeypatch) -> None:
    add_foreign(tmp_path)
    monkeypatch.setenv("CUDNN_MOE_CACHE_DIR", str(tmp_path))
    code, out, err = run(["prebuild", "--clear"], capsys)
    assert code == 1 and out == ""
    assert "--clear" in err and "not a cudnn_moe cache directory" in err
    assert_foreign_intact(tmp_path)


def test_cli_empty_cache_dir_is_a_usage_error(tmp_path: Path, capsys, no_gpu, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "thesis.entry").write_bytes(b"mine")
    code, out, err = run(["prebuild", "--clear", "--cache-dir", ""], capsys)
    assert code == 2 and "--cache-dir" in err and "must not be empty" in err
    assert (tmp_path / "thesis.entry").read_bytes() == b"mine"


def test_cli_build_without_a_gpu_creates_no_directory(tmp_path: Path, capsys, no_gpu) -> None:
    code, _, err = run(["prebuild", "--preset", "qwen3-30b-a3b", "--cache-dir", str(tmp_path / "c"), "--quiet"], capsys)
    assert code == 1 and "needs a CUDA GPU" in err
    assert not (tmp_path / "c").exists()
