"""The text: six Austen novels from Debian's ``r-cran-janeaustenr``, read without R.

Set-up is automatic and cached under ``<data>/janeaustenr/``:

1. ``apt-get download r-cran-janeaustenr`` (1.6 MB; *download*, never ``install``: the
   package depends on all of R);
2. ``dpkg-deb -x`` (or a pure-Python ``ar`` + ``tar`` reader when dpkg is absent);
3. ``data/Rdata.rdb`` + ``Rdata.rdx`` parsed with the pure-Python ``rdata`` package: the
   ``.rdx`` index is a gzip'd serialized R list whose ``variables`` map each name to
   ``(offset, length)`` in the ``.rdb``; each record there is a 4-byte big-endian
   uncompressed length plus a zlib stream holding one serialized character vector
   (~70-character lines of one novel);
4. one ``<novel>.txt`` per novel plus ``manifest.json`` (package file name, sha256).

Later runs read the text files only.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
import random
import shutil
import struct
import subprocess
import tarfile
import warnings
import zlib
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from benchmark.quality.errors import SetupError, UsageError
from benchmark.quality.paths import file_sha256

DEB_PACKAGE = "r-cran-janeaustenr"
NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility")
RDATA_DIR = Path("usr/lib/R/site-library/janeaustenr/data")
_MANIFEST = "manifest.json"


@dataclasses.dataclass(frozen=True)
class AustenCorpus:
    """Reflowed text of each novel plus where it came from.

    texts : novel name -> prose, paragraphs joined by blank lines
    source : package file name, its sha256 and the cache folder (for the run's JSON)
    """

    texts: Dict[str, str]
    source: Dict[str, str]


@dataclasses.dataclass(frozen=True)
class TextWindow:
    """``context`` consecutive tokens of one novel, starting at token ``token_start``."""

    novel: str
    token_start: int
    token_ids: Tuple[int, ...]

    def describe(self) -> Dict[str, object]:
        return {"novel": self.novel, "token_start": self.token_start, "tokens": len(self.token_ids)}


def reflow(lines: Sequence[str]) -> str:
    """Join the package's wrapped lines into paragraphs (blank line = paragraph break)."""
    paragraphs: List[str] = []
    current: List[str] = []
    for line in lines:
        line = line.strip()
        if line:
            current.append(line)
        elif current:
            paragraphs.append(" ".join(current))
            current = []
    if current:
        paragraphs.append(" ".join(current))
    return "\n\n".join(paragraphs)


def read_rdata_character_vectors(rdb: Path, rdx: Path) -> Dict[str, List[str]]:
    """Every variable of an R lazy-load database (``.rdb`` + ``.rdx``) as a list of strings."""
    try:
        import rdata
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SetupError("the Python package 'rdata' is missing: run `pip install rdata`") from exc
    def parse(raw: bytes):
        with warnings.catch_warnings():
            # Records carry no file header; rdata warns "assumed RDS", which is right.
            warnings.simplefilter("ignore", UserWarning)
            return rdata.conversion.convert(rdata.parser.parse_data(raw))

    index = parse(gzip.decompress(rdx.read_bytes()))
    blob = rdb.read_bytes()
    out: Dict[str, List[str]] = {}
    for name, (offset, length) in index["variables"].items():
        record = blob[int(offset) : int(offset) + int(length)]
        (raw_length,) = struct.unpack(">I", record[:4])
        raw = zlib.decompress(record[4:])
        if len(raw) != raw_length:
            raise SetupError(f"{rdb}: record {name!r} decompressed to {len(raw)} bytes, header says {raw_length}")
        value = parse(raw)
        out[str(name)] = [str(s) if s is not None else "" for s in value]
    return out


def _download_deb(cache: Path) -> Path:
    debs = sorted(cache.glob(f"{DEB_PACKAGE}_*.deb"))
    if debs:
        return debs[-1]
    command = f"(cd {cache} && apt-get download {DEB_PACKAGE})"
    if shutil.which("apt-get") is None:
        raise SetupError(
            f"the Austen text needs the Debian package {DEB_PACKAGE}, and apt-get is not available. "
            f"On a Debian/Ubuntu machine run `{command}`, or copy the .deb into {cache}"
        )
    proc = subprocess.run(["apt-get", "download", DEB_PACKAGE], cwd=cache, capture_output=True, text=True)
    debs = sorted(cache.glob(f"{DEB_PACKAGE}_*.deb"))
    if proc.returncode != 0 or not debs:
        raise SetupError(
            f"`apt-get download {DEB_PACKAGE}` failed (exit {proc.returncode}): {proc.stderr.strip()[-400:]}\n"
            f"Run `apt-get update` and then `{command}`, or copy the .deb into {cache}"
        )
    return debs[-1]


def _extract_deb(deb: Path, dest: Path) -> None:
    """``dpkg-deb -x``, or the same by hand: a .deb is an ``ar`` archive holding ``data.tar.*``."""
    dest.mkdir(parents=True, exist_ok=True)
    if shutil.which("dpkg-deb"):
        subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], check=True)
        return
    data = deb.read_bytes()
    if not data.startswith(b"!<arch>\n"):
        raise SetupError(f"{deb}: not a Debian package (no ar magic)")
    pos = 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        body = data[pos + 60 : pos + 60 + size]
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as tar:
                tar.extractall(dest, filter="data")
            return
        pos += 60 + size + (size & 1)
    raise SetupError(f"{deb}: no data.tar member")


def ensure_austen_text(data_dir: Path) -> AustenCorpus:
    """The six novels, downloading and extracting the Debian package on first use."""
    cache = Path(os.path.abspath(data_dir)) / "janeaustenr"
    manifest_path = cache / _MANIFEST
    if manifest_path.exists():
        manifest = json.loads(manifest_path.read_text())
        files = {n: cache / f"{n}.txt" for n in manifest["novels"]}
        if all(p.exists() for p in files.values()):
            texts = {n: p.read_text(encoding="utf-8") for n, p in files.items()}
            return AustenCorpus(texts=texts, source=manifest["source"])
    cache.mkdir(parents=True, exist_ok=True)
    deb = _download_deb(cache)
    extracted = cache / "extracted"
    _extract_deb(deb, extracted)
    rdata_dir = extracted / RDATA_DIR
    vectors = read_rdata_character_vectors(rdata_dir / "Rdata.rdb", rdata_dir / "Rdata.rdx")
    missing = [n for n in NOVELS if n not in vectors]
    if missing:
        raise SetupError(f"{deb}: novels {missing} not found; the package holds {sorted(vectors)}")
    texts = {n: reflow(vectors[n]) for n in NOVELS}
    for name, text in texts.items():
        (cache / f"{name}.txt").write_text(text, encoding="utf-8")
    source = {"package": DEB_PACKAGE, "deb": deb.name, "deb_sha256": file_sha256(deb), "cache": str(cache)}
    manifest_path.write_text(json.dumps({"novels": list(NOVELS), "source": source}, indent=2))
    shutil.rmtree(extracted, ignore_errors=True)
    return AustenCorpus(texts=texts, source=source)


def load_text_file(path: Path) -> Tuple[str, Dict[str, str]]:
    """Any UTF-8 text file as a source of windows: (text, source) with the file's sha256.

    The text is read as is (no reflow): windows are token spans of whatever the file holds.
    A file that is not valid UTF-8 is a :class:`UsageError` naming the first bad byte.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--text: no such file {path}")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"--text: {path} is not UTF-8 (byte {exc.start}: {exc.reason})") from None
    if not text.strip():
        raise UsageError(f"--text: {path} holds no text")
    source = {"file": str(path), "sha256": file_sha256(path), "bytes": str(len(raw))}
    return text, source


def parse_novels(value: str, flag: str = "--novel") -> Tuple[str, ...]:
    """``"emma"`` or a comma list ``"emma,persuasion"`` -> the novels in that order.

    Raises UsageError naming ``flag`` for an empty list, an unknown name or a repeated one."""
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names:
        raise UsageError(f"{flag}: expected a novel or a comma list of them from {list(NOVELS)}, got {value!r}")
    unknown = [n for n in names if n not in NOVELS]
    if unknown:
        raise UsageError(f"{flag}: expected novels from {list(NOVELS)}, got {unknown}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UsageError(f"{flag}: expected each novel once, got {repeated} more than once")
    return names


def sample_windows_from_each(sources: Sequence[Tuple[str, Sequence[int]]], context: int, count: int,
                             seed: int) -> List[TextWindow]:
    """:func:`sample_windows` of each ``(novel, token ids)`` in turn, ``count`` windows from each
    (the same ``seed`` for every one): a calibration over several texts weighs each alike."""
    return [w for name, ids in sources for w in sample_windows(ids, name, context, count, seed)]


def sample_windows(token_ids: Sequence[int], novel: str, context: int, count: int, seed: int) -> List[TextWindow]:
    """``count`` windows of ``context`` tokens, deterministic in ``seed``.

    One window: a start drawn by ``random.Random(seed)`` from ``[0, len - context]`` (the
    harness's original rule, so ``--windows 1`` runs reproduce earlier ones). Several:
    spread over the text and not overlapping when the text is long enough: the slack
    ``len - count * context`` is cut into ``count`` equal strata, one offset ``u_i`` is
    drawn in each, and window ``i`` starts at ``u_i + i * context``. A text too short for
    ``count`` disjoint windows gets one seeded start per stratum of ``[0, len - context]``
    (windows then overlap). Starts are sorted and distinct.
    """
    span = len(token_ids) - context
    if span < 0:
        raise UsageError(f"--context: {novel} has {len(token_ids)} tokens, fewer than the context {context}")
    rng = random.Random(seed)
    if count <= 1:
        starts = sorted(rng.sample(range(span + 1), k=min(count, span + 1)))
    else:
        slack = len(token_ids) - count * context
        if slack >= 0:
            starts = [rng.randint(i * slack // count, (i + 1) * slack // count) + i * context for i in range(count)]
        else:
            starts = [rng.randint(i * span // count, (i + 1) * span // count) for i in range(count)]
        starts = sorted(set(starts))
    return [TextWindow(novel, s, tuple(token_ids[s : s + context])) for s in starts]
