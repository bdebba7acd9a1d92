"""What this host's llama.cpp build offers: CPU features, backend devices, memory.

Read once per process. The loader consults it before it asks llama.cpp for anything that
is known to crash on some hosts (AMX weight repacking), and ``skippy-stage info`` prints it
for bug reports: "it crashed" is only actionable with the CPU flags and the build beside it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import re
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import llama_cpp

from skippy_stage.model import llama_ffi

# llama.cpp issue #20824: with extra buffer types on, weights are repacked into the AMX
# buffer type and ggml_backend_amx_mul_mat segfaults on the first multi-token batch.
AMX_REPACK_CRASH = "llama.cpp issue #20824: ggml_backend_amx_mul_mat segfaults on the first multi-token batch"


@dataclass(frozen=True)
class Device:
    """One ggml backend device, as llama.cpp's registry lists it."""

    name: str
    description: str
    type: str
    memory_free: int
    memory_total: int


@dataclass(frozen=True)
class HostInfo:
    cpu_model: str
    cpu_flags: tuple[str, ...]
    system_info: str  # llama_print_system_info(): the features the loaded ggml build uses
    features: dict[str, str]  # parsed from system_info, e.g. {"AVX2": "1", "AMX_INT8": "1"}
    devices: tuple[Device, ...]
    memory_total: int
    memory_available: int
    skippy_stage_version: str
    llama_cpp_python_version: str
    ggml_libraries: tuple[str, ...]  # ggml's libraries (one libggml-cpu-* per CPU family in a portable build)

    @property
    def amx(self) -> bool:
        """llama.cpp would use AMX here: its build has it and this CPU reports it."""
        return self.features.get("AMX_INT8") == "1" and (not self.cpu_flags or "amx_int8" in self.cpu_flags)

    def device_names(self) -> list[str]:
        return [d.name for d in self.devices]

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["amx"] = self.amx
        return out


def _cpu() -> tuple[str, tuple[str, ...]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), ()
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.MULTILINE)
    return (model.group(1).strip() if model else platform.machine(),
            tuple(sorted(flags.group(1).split())) if flags else ())


def _memory() -> tuple[int, int]:
    """(total, available) bytes; available counts reclaimable cache, as the kernel estimates it."""
    try:
        values = dict(
            (k, int(v.split()[0]) * 1024)
            for k, v in (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
            if v.split()
        )
        return values["MemTotal"], values.get("MemAvailable", values["MemTotal"])
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


def parse_features(system_info: str) -> dict[str, str]:
    """``"CPU : AVX2 = 1 | AMX_INT8 = 1 | "`` -> ``{"AVX2": "1", "AMX_INT8": "1"}``."""
    return {m.group(1): m.group(2) for m in re.finditer(r"([A-Za-z0-9_]+)\s*=\s*([^|\s]+)", system_info)}


def _registry() -> list[tuple[int, str]]:
    """``(ggml_backend_dev_t, name)`` of every device llama.cpp's ggml has registered."""
    llama_ffi.init_backend()
    found = []
    for i in range(llama_ffi.ggml_backend_dev_count()):
        dev = llama_ffi.ggml_backend_dev_get(i)
        found.append((dev, (llama_ffi.ggml_backend_dev_name(dev) or b"").decode()))
    return found


def devices() -> tuple[Device, ...]:
    found = []
    for dev, name in _registry():
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        llama_ffi.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        found.append(Device(
            name=name,
            description=(llama_ffi.ggml_backend_dev_description(dev) or b"").decode(),
            type=llama_ffi.DEVICE_TYPES.get(llama_ffi.ggml_backend_dev_type(dev), "unknown"),
            memory_free=int(free.value),
            memory_total=int(total.value),
        ))
    return tuple(found)


def device_handle(name: str) -> int | None:
    """The ``ggml_backend_dev_t`` of the device called ``name``, or None."""
    return next((dev for dev, found in _registry() if found == name), None)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=1)
def host_info() -> HostInfo:
    llama_ffi.init_backend()
    system_info = llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip()
    cpu_model, flags = _cpu()
    total, available = _memory()
    return HostInfo(
        cpu_model=cpu_model,
        cpu_flags=flags,
        system_info=system_info,
        features=parse_features(system_info),
        devices=devices(),
        memory_total=total,
        memory_available=available,
        skippy_stage_version=_version("skippy-stage"),
        llama_cpp_python_version=getattr(llama_cpp, "__version__", _version("llama-cpp-python")),
        ggml_libraries=tuple(sorted({p.name for d in llama_ffi.backend_dirs() for p in d.glob("libggml*.so")})),
    )


def memory_available() -> int:
    """Bytes available now (not cached: other stages on this host load meanwhile)."""
    return _memory()[1]
