"""A stage's request that idle CPUs stay quick to wake: the kernel's CPU latency QoS.

A frame that reaches a stage whose CPU sleeps waits for that CPU to wake. On a virtual
machine an idle vCPU halts, and waking it goes through the hypervisor: on this project's
2-vCPU test VMs a one-way send reached a receiver idle for a few ms after 46-66 us, and
after 7-22 us while a process held a latency of 0 (``bench``'s wake floor; the 3-stage hop
latency went from ~215 to ~180 us). Bare metal pays a deep C-state's exit latency the same way.

Linux takes such a request from any process that writes a 32-bit latency in microseconds to
``/dev/cpu_dma_latency`` and keeps the file open (PM QoS): the host's idle states that take
longer to leave are not used until the last such file is closed. It is host-wide (every
process on the host runs under it) and costs idle CPUs their sleep (power; a hypervisor's
time), so it is an operator's choice (``cpu_wake_latency_us``), never a default, and a
stage that is told to hold it and cannot refuses to start.
"""

from __future__ import annotations

import os
import struct

from skippy_stage.errors import ConfigError

DEVICE = "/dev/cpu_dma_latency"
_S32 = struct.Struct("=i")


class WakeLatencyRequest:
    """The request, held from construction until :meth:`close` (or the process ends: the
    kernel drops it with the file)."""

    def __init__(self, microseconds: int, *, stage_id: str, device: str = DEVICE) -> None:
        try:
            self._fd: int | None = os.open(device, os.O_WRONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigError(
                f"stage {stage_id}: cpu_wake_latency_us={microseconds} needs write access to {device} "
                f"({exc.strerror}); run the stage as root or give it the device (a udev rule, or a "
                f"container's --device {DEVICE}), or unset cpu_wake_latency_us") from None
        try:
            os.write(self._fd, _S32.pack(microseconds))
        except OSError as exc:
            self.close()
            raise ConfigError(f"stage {stage_id}: cpu_wake_latency_us={microseconds}: {device} refused the "
                              f"request ({exc.strerror})") from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def may_request(device: str = DEVICE) -> bool:
    """Whether this process may hold a request (it may write the device)."""
    return os.access(device, os.W_OK)


def current_us(device: str = DEVICE) -> int:
    """The latency the host's idle states are held to now: the smallest request held by any
    process (``config.WAKE_LATENCY_MAX_US``, the kernel's default, when none is). Needs read access to the device."""
    fd = os.open(device, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return _S32.unpack(os.read(fd, _S32.size))[0]
    finally:
        os.close(fd)
