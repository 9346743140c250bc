"""The ``file://`` backend: a bucket in a local folder, the embedded default for one machine.

Writes are atomic (temp file in the same folder, then ``os.replace``); create-only writes use ``os.link``,
which fails if the name exists, so of two racing writers exactly one wins.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from asyncgrpo.bucket.interface import (
    TEMP_PREFIX,
    Bucket,
    BucketError,
    ObjectExists,
    ObjectInfo,
    ObjectNotFound,
    check_key,
    temp_sibling,
)

_COPY_CHUNK = 1024 * 1024


def _publish_temp(temp: Path, final: Path, *, if_absent: bool, key: str) -> None:
    """Move a fully written temp file to its final name; create-only via link, which fails if it exists."""
    try:
        if if_absent:
            try:
                os.link(temp, final)
            except FileExistsError:
                raise ObjectExists(f"bucket key {key!r} already exists; create-only write refused") from None
        else:
            os.replace(temp, final)
    finally:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()


class FileBucket(Bucket):
    """A bucket in a local folder: ``<root>/<key>``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _make_parent(self, path: Path, key: str) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError) as error:
            raise BucketError(
                f"cannot store bucket key {key!r}: a part of its path is already a stored object"
            ) from error

    def _write_atomically(self, key: str, fill: Callable[[IO[bytes]], Any], *, if_absent: bool) -> None:
        path = self._path(key)
        if path.is_dir():
            raise BucketError(f"cannot store bucket key {key!r}: it is a folder of other keys")
        # A concurrent delete may prune the freshly made (empty) parent folder; make it again then.
        for attempt in range(3):
            self._make_parent(path, key)
            temp = temp_sibling(path)
            try:
                handle = open(temp, "xb")  # noqa: SIM115 - closed by the with below, before the rename
            except FileNotFoundError:
                if attempt == 2:
                    raise
                continue
            try:
                with handle:
                    fill(handle)
                    handle.flush()
                    os.fsync(handle.fileno())
            except BaseException:
                with contextlib.suppress(FileNotFoundError):
                    temp.unlink()
                raise
            _publish_temp(temp, path, if_absent=if_absent, key=key)
            return

    def put(self, key: str, data: bytes, *, if_absent: bool = False) -> None:
        self._write_atomically(key, lambda handle: handle.write(data), if_absent=if_absent)

    def put_file(self, key: str, path: Path, *, if_absent: bool = False) -> None:
        if not Path(path).is_file():
            raise FileNotFoundError(f"cannot upload {path} to bucket key {key!r}: no such file")

        def copy(handle: IO[bytes]) -> None:
            with open(path, "rb") as source:
                shutil.copyfileobj(source, handle, _COPY_CHUNK)

        self._write_atomically(key, copy, if_absent=if_absent)

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise ObjectNotFound(f"bucket key {key!r} does not exist in {self.url}") from None

    def get_file(self, key: str, path: Path) -> None:
        source = self._path(key)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = temp_sibling(path)
        try:
            shutil.copyfile(source, temp)
            os.replace(temp, path)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            if not source.is_file():
                raise ObjectNotFound(f"bucket key {key!r} does not exist in {self.url}") from None
            raise
        finally:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()

    def head(self, key: str) -> ObjectInfo | None:
        path = self._path(key)
        try:
            stat = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not path.is_file():
            return None
        return ObjectInfo(key=key, size=stat.st_size, etag=None)

    def _walk_files(self, start: Path) -> Iterator[str]:
        for folder, _dirs, files in os.walk(start):
            relative = Path(folder).relative_to(self.root).as_posix()
            for name in files:
                if not name.startswith(TEMP_PREFIX):
                    yield name if relative == "." else f"{relative}/{name}"

    def list(self, prefix: str) -> list[str]:
        # Walk only the deepest folder the prefix fully names, then filter by the whole prefix.
        folder = prefix.rpartition("/")[0]
        start = self.root / folder if folder else self.root
        if not start.is_dir():
            return []
        return sorted(key for key in self._walk_files(start) if key.startswith(prefix))

    def list_dirs(self, prefix: str) -> list[str]:
        folder, _, stem = prefix.rpartition("/")
        start = self.root / folder if folder else self.root
        if not start.is_dir():
            return []
        found = []
        for entry in os.scandir(start):
            # An empty folder (left by a racing delete) is no "sub-folder" on S3 either.
            if (
                entry.is_dir()
                and entry.name.startswith(stem)
                and next(self._walk_files(Path(entry.path)), None) is not None
            ):
                found.append(f"{folder}/{entry.name}/" if folder else f"{entry.name}/")
        return sorted(found)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink()
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return  # nothing stored under exactly this key
        # Prune now-empty folders so the tree does not fill with empty version directories.
        parent = path.parent
        while parent != self.root:
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent
