"""Open NVML through pynvml: the system library, or one named by path.

pynvml (nvidia-ml-py 13.x) has no library-path argument. Its
`_LoadNvmlLibrary` calls `CDLL("libnvidia-ml.so.1")` only while the module
global `pynvml.nvmlLib` is None, and every wrapper resolves its entry point
from that object. So to use a library at a given path we dlopen it ourselves
and install it as `pynvml.nvmlLib`, under pynvml's own `libLoadLock`, and drop
pynvml's function-pointer cache so no pointer from another library survives.
pynvml's own `nvmlInit` then initialises that library. (LD_LIBRARY_PATH
cannot do this: the loader reads it once, at process start.)

A process holds one NVML. Swapping libraries while another component still
holds an initialised one would pull it out from under that component, so that
is refused.
"""
from __future__ import annotations

import ctypes

import pynvml


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used. `what` names the failing part: "library" or "init"."""

    def __init__(self, what: str, message: str):
        super().__init__(message)
        self.what = what


def open_nvml(library_path: str | None = None) -> None:
    """nvmlInit against `library_path`, or the system's libnvidia-ml.so.1 when None.

    Raises NvmlUnavailable with a message that says what to do next.
    """
    if library_path is not None:
        _bind_library(library_path)
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        raise NvmlUnavailable("library", "NVML library libnvidia-ml.so.1 not found: install the NVIDIA "
                                         "driver, or run the agent where GPUs are visible") from None
    except pynvml.NVMLError as exc:
        raise NvmlUnavailable("init", f"nvmlInit failed: {exc}; check that the NVIDIA driver is loaded "
                                      "(nvidia-smi should work on this node)") from None


def close_nvml() -> None:
    """Release one nvmlInit; NVML counts them and shuts down at the last."""
    try:
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        pass  # already shut down or never initialised: nothing to release


def _bind_library(path: str) -> None:
    if not all(hasattr(pynvml, name) for name in ("nvmlLib", "libLoadLock", "_nvmlLib_refcount",
                                                     "_nvmlGetFunctionPointer_cache")):
        raise NvmlUnavailable("library", "this pynvml version cannot be pointed at a library path; "
                                         "install nvidia-ml-py 13.x or leave library_path unset")
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        raise NvmlUnavailable("library", f"cannot load NVML library {path!r}: {exc}; "
                                         "fix the path or leave it unset to use the system driver") from None
    with pynvml.libLoadLock:
        current = pynvml.nvmlLib
        if current is not None and current._handle == lib._handle:
            return  # the same library is already installed (dlopen returns the same handle)
        if current is not None and pynvml._nvmlLib_refcount > 0:
            raise NvmlUnavailable("library", f"another NVML library is initialised in this process; "
                                             f"cannot switch to {path!r} until it is shut down")
        pynvml.nvmlLib = lib
        pynvml._nvmlGetFunctionPointer_cache.clear()
