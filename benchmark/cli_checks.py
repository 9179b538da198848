"""Checks every command line of ``benchmark/`` runs on its flags before it loads a model.

A run of the quality grid or the calibration takes 15-35 minutes; a flag that fails after it
(an output folder that is a file, a model that is not a GGUF, a text name that does not
exist) loses that time. Each helper raises :class:`FlagError` (a ``ValueError``) whose
message starts with the flag, says what was expected and what was given (long values cut),
for the command to print as ``error: --flag ...`` and exit 2: argparse's ``parser.error``
or the harness's ``UsageError``.

    check_output_dir("--out-dir", path)   # a folder the run can write (made now if missing)
    check_output_file("--json", path)     # a file the run can write, not a folder
    check_gguf("--model", path)           # a GGUF file whose header and tensor table parse
    given_flags(parser, argv)             # the flags typed (so --quick overrides only the others)
"""

from __future__ import annotations

import argparse
import os
import struct
import tempfile
from pathlib import Path
from typing import Optional, Sequence, Set, Union

# One rule for quoting a value in a message, the serving settings' and the commands' alike.
from rtp_llm.models_py.modules.hybrid.topology_kv.arg_checks import SHOWN_CHARACTERS, shown  # noqa: E402,F401


class FlagError(ValueError):
    """A flag's value the command refuses before it starts; the message starts with the flag."""


def is_file(path: Union[str, os.PathLike]) -> bool:
    """``Path.is_file`` that is False, not an ``OSError``, for a name too long to stat."""
    try:
        return Path(path).is_file()
    except OSError:
        return False


def _stat_error(flag: str, path: Path) -> Optional[str]:
    try:
        os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"{flag}: cannot use {shown(str(path))}: {err.strerror or err}"
    return None


def _nearest_existing(path: Path) -> Path:
    for parent in (path, *path.parents):
        if os.path.lexists(parent):
            return parent
    return Path(path.anchor or ".")


def check_output_dir(flag: str, path: Union[str, os.PathLike]) -> Path:
    """``path`` is a folder the run can write into: made now (with its parents) when missing,
    refused when it is a file or lies under one, or when a file cannot be created in it."""
    path = Path(path)
    problem = _stat_error(flag, path)
    if problem:
        raise FlagError(problem)
    if path.exists() and not path.is_dir():
        raise FlagError(f"{flag}: expected a folder, got {shown(str(path))}, which is a file")
    anchor = _nearest_existing(path)
    if not anchor.is_dir():
        raise FlagError(f"{flag}: expected a folder, got {shown(str(path))}, which lies under the file "
                        f"{shown(str(anchor))}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as err:
        raise FlagError(f"{flag}: cannot write into {shown(str(path))}: {err.strerror or err}") from None
    return path


def check_output_file(flag: str, path: Union[str, os.PathLike]) -> Path:
    """``path`` is a file the run can write: not a folder, its folder writable (made now when
    missing); an existing file is not truncated here."""
    path = Path(path)
    problem = _stat_error(flag, path)
    if problem:
        raise FlagError(problem)
    if path.is_dir():
        raise FlagError(f"{flag}: expected a file path, got {shown(str(path))}, which is a folder")
    parent = path.parent if str(path.parent) else Path(".")
    try:
        check_output_dir(flag, parent)
    except FlagError as err:
        raise FlagError(f"{flag}: cannot write {shown(str(path))}: {str(err)[len(flag) + 2:]}") from None
    if path.exists():
        try:
            with open(path, "r+b"):
                pass
        except OSError as err:
            raise FlagError(f"{flag}: cannot write {shown(str(path))}: {err.strerror or err}") from None
    return path


# GGUF (ggml's file format): magic, version, tensor count, metadata count, then the
# metadata and the tensor table (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md).
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)  # what transformers' GGUF loader reads
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_COUNT = 1 << 24  # tensors or metadata entries: far past any model


class _Truncated(Exception):
    pass


class _Reader:
    def __init__(self, f, size: int) -> None:
        self.f, self.size = f, size

    def read(self, n: int) -> bytes:
        if n < 0 or self.f.tell() + n > self.size:
            raise _Truncated()
        data = self.f.read(n)
        if len(data) != n:
            raise _Truncated()
        return data

    def skip(self, n: int) -> None:
        if n < 0 or self.f.tell() + n > self.size:
            raise _Truncated()
        self.f.seek(n, os.SEEK_CUR)

    def u32(self) -> int:
        return struct.unpack("<I", self.read(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.read(8))[0]

    def string(self) -> bytes:
        return self.read(self.u64())

    def skip_value(self, kind: int, depth: int = 0) -> None:
        if kind in _SCALAR_SIZES:
            self.skip(_SCALAR_SIZES[kind])
        elif kind == _STRING:
            self.skip(self.u64())
        elif kind == _ARRAY and depth < 4:
            inner, count = self.u32(), self.u64()
            if inner in _SCALAR_SIZES:
                self.skip(count * _SCALAR_SIZES[inner])
            else:
                if count > self.size:
                    raise _Truncated()
                for _ in range(count):
                    self.skip_value(inner, depth + 1)
        else:
            raise ValueError(f"unknown metadata value type {kind}")


def check_gguf(flag: str, path: Union[str, os.PathLike]) -> Path:
    """``path`` is a readable GGUF file: the magic ``GGUF``, a version the loader reads, and
    a metadata block and tensor table that parse and lie inside the file (an empty, truncated
    or foreign file fails here, not as the loader's traceback after the imports)."""
    path = Path(path)
    problem = _stat_error(flag, path)
    if problem:
        raise FlagError(problem)
    if not path.is_file():
        raise FlagError(f"{flag}: expected a GGUF file, got {shown(str(path))}, "
                        f"{'a folder' if path.is_dir() else 'which does not exist'}")
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            r = _Reader(f, size)
            try:
                magic = r.read(4)
            except _Truncated:
                raise FlagError(
                    f"{flag}: {shown(str(path))} is not a GGUF file ({size} bytes, no GGUF magic)"
                ) from None
            if magic != GGUF_MAGIC:
                raise FlagError(f"{flag}: {shown(str(path))} is not a GGUF file (starts with {magic!r}, "
                                f"expected {GGUF_MAGIC!r})")
            try:
                version = r.u32()
                if version not in GGUF_VERSIONS:
                    raise FlagError(f"{flag}: {shown(str(path))}: GGUF version {version}, expected one of "
                                    f"{list(GGUF_VERSIONS)}")
                tensors, entries = r.u64(), r.u64()
                if tensors > _MAX_COUNT or entries > _MAX_COUNT:
                    raise FlagError(f"{flag}: {shown(str(path))}: implausible GGUF header ({tensors} tensors, "
                                    f"{entries} metadata entries)")
                alignment = 32
                for _ in range(entries):
                    key = r.string()
                    kind = r.u32()
                    if key == b"general.alignment" and kind == 4:
                        alignment = r.u32() or 32
                    else:
                        r.skip_value(kind)
                ends = []
                for _ in range(tensors):
                    r.string()
                    dims = r.u32()
                    if dims > 8:
                        raise FlagError(f"{flag}: {shown(str(path))}: a tensor of {dims} dimensions in the "
                                        "GGUF tensor table")
                    shape = [r.u64() for _ in range(dims)]
                    kind, offset = r.u32(), r.u64()
                    ends.append((offset, shape, kind))
                data_start = -(-f.tell() // alignment) * alignment
                need = max((offset + _tensor_bytes(shape, kind) for offset, shape, kind in ends), default=0)
                if data_start + need > size:
                    raise _Truncated()
            except _Truncated:
                raise FlagError(f"{flag}: {shown(str(path))}: truncated GGUF file ({size} bytes)") from None
            except ValueError as err:
                if isinstance(err, FlagError):
                    raise
                raise FlagError(f"{flag}: {shown(str(path))}: unreadable GGUF header ({err})") from None
    except OSError as err:
        raise FlagError(f"{flag}: cannot read {shown(str(path))}: {err.strerror or err}") from None
    return path


def _tensor_bytes(shape, kind: int) -> int:
    """Bytes of a tensor of ggml type ``kind`` (0 when the type is unknown here: not checked)."""
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except Exception:  # gguf missing or a type it does not know: the loader will say
        return 0
    n = 1
    for d in shape:
        n *= d
    return n // block * type_size


def given_flags(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]]) -> Set[str]:
    """The ``dest`` of every option typed in ``argv`` (argparse fills a default only for
    attributes its namespace lacks, so a namespace of markers shows which were given)."""
    # An appending option copies the list it finds before appending, so its marker is a list
    # (a typed one then is a new list, not the marker).
    appending = (argparse._AppendAction, argparse._ExtendAction)
    markers = {a.dest: _ListMarker() if isinstance(a, appending) else object()
               for a in parser._actions if a.dest != argparse.SUPPRESS}
    parsed = parser.parse_args(argv, namespace=argparse.Namespace(**markers))
    return {dest for dest, value in vars(parsed).items() if value is not markers.get(dest)}


class _ListMarker(list):
    """The unset marker of an appending option (:func:`given_flags`)."""
