"""One C++ source next to this file, compiled on first use into a cached torch extension.

:class:`CppKernel` wraps :func:`torch.utils.cpp_extension.load` for the package's CPU
kernels: the extension is built once per process into ``$TORCH_EXTENSIONS_DIR`` (default:
the per-user cache ``$XDG_CACHE_HOME/torch_extensions`` or ``~/.cache/torch_extensions``),
in a folder named after a hash of the source, the flags, and the Python and torch
versions, and reused from disk by later processes. :meth:`CppKernel.available` never
raises; a failed build is remembered and reported when the kernel is called anyway.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
from typing import List, Optional, Union

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def _build_directory(name: str) -> str:
    base = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not base:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(cache, "torch_extensions")
    return os.path.join(base, name)


class CppKernel:
    """The extension compiled from ``source`` (a file name in this folder, or an absolute path).

    ``prefix`` names the module and its build folder (the hash is appended); ``cflags`` /
    ``ldflags`` go to the compiler and linker.
    """

    def __init__(self, prefix: str, source: str, cflags: List[str], ldflags: List[str]) -> None:
        self.prefix = prefix
        self.source = os.path.join(_HERE, source)
        self.cflags = list(cflags)
        self.ldflags = list(ldflags)
        self._lock = threading.Lock()
        self._ext = None
        self._error: Optional[BaseException] = None

    def load(self):
        """The compiled extension module (built once per process, cached on disk); raises on failure."""
        if self._ext is not None:
            return self._ext
        with self._lock:
            if self._ext is None and self._error is None:
                try:
                    from torch.utils.cpp_extension import load

                    with open(self.source, "rb") as f:
                        digest = hashlib.sha256(f.read())
                    digest.update(f"{sys.version_info[:2]}-{torch.__version__}-{self.cflags}-{self.ldflags}".encode())
                    name = f"{self.prefix}_{digest.hexdigest()[:16]}"
                    build_dir = _build_directory(name)
                    os.makedirs(build_dir, exist_ok=True)
                    self._ext = load(name=name, sources=[self.source], extra_cflags=self.cflags,
                                     extra_ldflags=self.ldflags, build_directory=build_dir, verbose=False)
                except Exception as exc:  # compiler missing, read-only cache, ...
                    self._error = exc
            if self._ext is None:
                raise RuntimeError(f"{self.prefix}: the C++ extension did not build: {self._error!r}") from self._error
            return self._ext

    def available(self, device: Union[torch.device, str]) -> bool:
        """Whether the kernel can run on ``device`` (CPU, and the build works); never raises.

        Builds the extension on the first CPU query (cached); a failed build returns False
        and its error is kept for :meth:`load`'s message and :meth:`build_error`.
        """
        try:
            if torch.device(device).type != "cpu":
                return False
            self.load()
            return True
        except Exception:
            return False

    def build_error(self) -> Optional[str]:
        """Why the extension did not build (after a failed :meth:`available`), or None."""
        return None if self._error is None else repr(self._error)
