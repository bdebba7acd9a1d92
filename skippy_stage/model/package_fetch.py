"""Fetching a layer package's manifest and parts into this host's cache.

A package is read from a directory, a ``file://`` URL or an ``http(s)://`` URL (:func:`open_package`:
the one place that knows the difference; urllib, no other client). Every fetch lands in the cache
that the stages of one host share, under the sha256 the manifest gives it, so no part is fetched
twice on one host and nothing is used before its sha256 is checked::

    <cache>/package-manifests/<sha256>.json     manifests, by their own sha256
    <cache>/package-parts/<sha256>.gguf          parts, by theirs
    <cache>/package-parts/<sha256>.gguf.part     a fetch under way: resumed from its length
    <cache>/package-parts/<sha256>.lock          held while one process fetches the part

A fetch cut short (a connection reset, a timeout, a server closing early) resumes where it stopped:
over HTTP with a ``Range`` request, which a server that ignores it answers with the whole file (then
the fetch starts over). It gives up after ``FETCH_ATTEMPTS`` tries in a row that brought no byte.
A part whose bytes do not hash to the manifest's sha256 is deleted and refused, naming it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import http.client
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Protocol

import structlog

from skippy_stage import __version__
from skippy_stage.errors import ConfigError, ModelFileError
from skippy_stage.model.package import MANIFEST_NAME, MAX_MANIFEST_BYTES, Manifest, Part, sha256_file
from skippy_stage.model.slicing import default_cache_dir

log = structlog.get_logger("skippy_stage.package")

# Tries in a row that bring no new byte before a fetch gives up.
FETCH_ATTEMPTS = 5
# One socket operation of an HTTP fetch (connect, or one read).
FETCH_TIMEOUT_S = 60.0
_CHUNK = 1 << 20


class _Interrupted(Exception):
    """The bytes stopped before the part's end: resume."""


class PackageSource(Protocol):
    """Where a package's files are read from."""

    ref: str

    def location(self, name: str) -> str:
        """The file's path or URL, for messages."""
        ...

    def open(self, name: str, offset: int) -> tuple[BinaryIO, int]:
        """The file's bytes from ``offset`` on, and the offset they really start at (0 when the
        source could not start there). A missing file is a :class:`ModelFileError`; an
        interrupted or failed transfer an ``OSError`` or ``http.client.HTTPException``."""
        ...


@dataclass(frozen=True)
class LocalPackage:
    """A package in a directory (or mounted share) of this host."""

    ref: str
    root: Path

    def location(self, name: str) -> str:
        return str(self.root / name)

    def open(self, name: str, offset: int) -> tuple[BinaryIO, int]:
        try:
            f = (self.root / name).open("rb")
        except FileNotFoundError:
            raise ModelFileError(f"package file {name} is missing: {self.root / name} does not exist") from None
        except IsADirectoryError:
            raise ModelFileError(f"package file {name} is not a file: {self.root / name} is a directory") from None
        f.seek(offset)
        return f, offset


@dataclass(frozen=True)
class HttpPackage:
    """A package served over HTTP(S): ``base`` ends with ``/`` and part paths are relative to it."""

    ref: str
    base: str
    who: str = ""  # the stage fetching, in the User-Agent: a server's log then says which stage read what

    def location(self, name: str) -> str:
        return urllib.parse.urljoin(self.base, urllib.parse.quote(name))

    def open(self, name: str, offset: int) -> tuple[BinaryIO, int]:
        url = self.location(name)
        agent = f"skippy-stage/{__version__}" + (f" ({self.who})" if self.who else "")
        headers = {"User-Agent": agent}
        if offset:
            headers["Range"] = f"bytes={offset}-"
        try:
            response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=FETCH_TIMEOUT_S)
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code in (404, 410):
                raise ModelFileError(f"package file {name} is missing: {url} answers HTTP {exc.code}") from None
            if exc.code >= 500 or exc.code in (408, 429):
                raise OSError(f"{url} answers HTTP {exc.code} {exc.reason}") from None  # worth another try
            raise ModelFileError(f"package file {name} cannot be fetched: {url} answers HTTP {exc.code} "
                                 f"{exc.reason}") from None
        if response.status == 206:
            start = _content_range_start(response.headers.get("Content-Range", ""))
            if start != offset:
                response.close()
                raise OSError(f"{url} answered a Range request for bytes {offset}- with "
                              f"{response.headers.get('Content-Range')!r}")
            return response, offset
        return response, 0  # the whole file (a server that ignores Range)


def _content_range_start(header: str) -> int | None:
    """The first byte of ``bytes START-END/TOTAL``."""
    unit, _, rest = header.partition(" ")
    first = rest.partition("-")[0]
    return int(first) if unit == "bytes" and first.isdigit() else None


def open_package(ref: str, *, who: str = "") -> PackageSource:
    """The package ``ref`` names: a directory, a ``file://`` URL or an ``http(s)://`` URL of one."""
    parsed = urllib.parse.urlsplit(ref)
    scheme = parsed.scheme.lower() if "://" in ref else ""
    if scheme in ("http", "https"):
        return HttpPackage(ref, ref if ref.endswith("/") else ref + "/", who)
    if scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"package_ref={ref!r} names host {parsed.netloc!r}: a file:// URL is read on this host")
        root = Path(urllib.request.url2pathname(parsed.path))
    elif scheme:
        raise ConfigError(f"package_ref={ref!r} is not a package directory or a file://, http:// or https:// URL of one")
    else:
        root = Path(ref)
    if not root.is_dir():
        raise ConfigError(f"package_ref={ref!r}: {root} is not a directory")
    return LocalPackage(ref, root)


def package_cache(cache_dir: str | os.PathLike[str] | None) -> Path:
    """The cache a stage's config names, or the default one (where stage files are cached too)."""
    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def read_manifest(source: PackageSource) -> tuple[Manifest, str]:
    """The package's manifest as it is now, and its sha256 (``up --package``, which pins it for its
    stages; a stage takes the sha256 from its config: :func:`fetch_manifest`)."""
    raw = _read_small(source, MANIFEST_NAME)
    return Manifest.from_json(raw, source.location(MANIFEST_NAME)), hashlib.sha256(raw).hexdigest()


def fetch_manifest(source: PackageSource, sha256: str, cache_dir: Path) -> Manifest:
    """The manifest whose sha256 is ``sha256``: from the cache, or fetched, checked and cached.

    A manifest that does not hash to ``sha256`` is refused (:class:`ConfigError` naming
    ``manifest_sha256``): nothing it names is fetched."""
    sha256 = sha256.lower()
    path = cache_dir / "package-manifests" / f"{sha256}.json"
    origin = source.location(MANIFEST_NAME)
    with contextlib.suppress(OSError):
        raw = path.read_bytes()
        if hashlib.sha256(raw).hexdigest() == sha256:
            return Manifest.from_json(raw, origin)
    raw = _read_small(source, MANIFEST_NAME)
    got = hashlib.sha256(raw).hexdigest()
    if got != sha256:
        raise ConfigError(f"manifest_sha256={sha256!r} does not match the package: {origin} has sha256 {got}")
    manifest = Manifest.from_json(raw, origin)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(raw)
    os.replace(tmp, path)
    return manifest


def _read_small(source: PackageSource, name: str) -> bytes:
    """A whole small file (the manifest), tried again after a transient failure."""
    for attempt in range(1, FETCH_ATTEMPTS + 1):
        try:
            stream, _ = source.open(name, 0)
            with stream:
                raw = stream.read(MAX_MANIFEST_BYTES + 1)
            if len(raw) > MAX_MANIFEST_BYTES:
                raise ModelFileError(f"package file {source.location(name)} is larger than a manifest "
                                     f"({MAX_MANIFEST_BYTES} bytes)")
            return raw
        except (OSError, http.client.HTTPException) as exc:
            if attempt == FETCH_ATTEMPTS:
                raise ModelFileError(f"cannot fetch {source.location(name)}: {_reason(exc)}") from exc
            time.sleep(_backoff(attempt))
    raise AssertionError("unreachable")


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError):
        return str(exc.reason)
    return f"{type(exc).__name__}: {exc}"


def _backoff(attempt: int) -> float:
    return min(0.1 * 2**attempt, 5.0)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (created if need be) between the processes of this host."""
    with path.open("a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def fetch_part(source: PackageSource, part: Part, cache_dir: Path, *, progress: bool | None = None) -> Path:
    """The part, from the cache or fetched into it, its sha256 checked: the path of its bytes.

    One process of the host fetches a part at a time (a lock file beside it); another one waiting
    for it then finds it in place. A cached part that no longer hashes to its sha256 is fetched again.
    """
    directory = cache_dir / "package-parts"
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / f"{part.sha256}.gguf"
    with _locked(directory / f"{part.sha256}.lock"):
        if final.exists():
            if final.stat().st_size == part.bytes and sha256_file(final) == part.sha256:
                log.debug("package part cached", part=part.path, path=str(final))
                return final
            log.warning("cached package part damaged; fetching it again", part=part.path, path=str(final))
            final.unlink()
        tmp = directory / f"{part.sha256}.gguf.part"
        started = time.perf_counter()
        resumed_from = tmp.stat().st_size if tmp.exists() else 0
        got = _download(source, part, tmp, progress)
        if got != part.sha256:
            tmp.unlink(missing_ok=True)
            raise ModelFileError(f"package part {part.path} ({source.location(part.path)}) has sha256 {got}, but the "
                                 f"manifest says {part.sha256}: refused")
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    log.info("package part fetched", part=part.path, bytes=part.bytes, seconds=round(time.perf_counter() - started, 3),
             resumed_from=resumed_from, source=source.location(part.path))
    return final


def _download(source: PackageSource, part: Part, tmp: Path, progress: bool | None) -> str:
    """Fill ``tmp`` with the part's bytes, resuming from what it holds; the sha256 of the result."""
    h = hashlib.sha256()
    if tmp.exists() and tmp.stat().st_size > part.bytes:
        tmp.unlink()
    tmp.touch()
    with tmp.open("r+b") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        offset = f.tell()
        show = sys.stderr.isatty() if progress is None else progress
        from tqdm import tqdm

        with tqdm(total=part.bytes, initial=offset, unit="B", unit_scale=True, desc=f"fetch {part.path}",
                  disable=not show) as bar:
            fruitless = 0
            while offset < part.bytes:
                before = offset
                try:
                    stream, start = source.open(part.path, offset)
                    if start != offset:  # the source sends the whole file: start over
                        f.truncate(start)
                        h, offset = hashlib.sha256(), start
                        bar.reset(total=part.bytes)
                    f.seek(offset)
                    with stream:
                        while chunk := stream.read(min(_CHUNK, part.bytes - offset + 1)):
                            if offset + len(chunk) > part.bytes:
                                raise ModelFileError(f"package part {part.path} ({source.location(part.path)}) is "
                                                     f"longer than the {part.bytes} bytes the manifest says")
                            f.write(chunk)
                            h.update(chunk)
                            offset += len(chunk)
                            bar.update(len(chunk))
                            if offset == part.bytes:
                                break
                    if offset < part.bytes:
                        raise _Interrupted(f"the transfer ended at byte {offset} of {part.bytes}")
                except (OSError, http.client.HTTPException, _Interrupted) as exc:
                    f.flush()
                    fruitless = 0 if offset > before else fruitless + 1
                    if fruitless >= FETCH_ATTEMPTS:
                        raise ModelFileError(f"cannot fetch package part {part.path} ({source.location(part.path)}): "
                                             f"{FETCH_ATTEMPTS} tries in a row brought no byte; last: {_reason(exc)}"
                                             ) from exc
                    log.warning("package part fetch interrupted; resuming", part=part.path, at_byte=offset,
                                of_bytes=part.bytes, error=_reason(exc))
                    time.sleep(_backoff(max(fruitless, 1)) if fruitless else 0.05)
        f.flush()
    return h.hexdigest()


__all__ = [
    "FETCH_ATTEMPTS",
    "HttpPackage",
    "LocalPackage",
    "PackageSource",
    "fetch_manifest",
    "fetch_part",
    "open_package",
    "package_cache",
    "read_manifest",
]
