"""What the tuner needs to know about the GPU, with a way to simulate another one.

``INDUCTOR_ATTN_DEVICE`` overrides the description, so that sm_100-only candidates (FA4's CLC
scheduler, split-KV) can be enumerated and pruned on a CPU or Hopper machine, as FA4 does with
``FLASH_ATTENTION_ARCH``. Format: ``"<name>:<major>.<minor>:<sm_count>"``, e.g.
``"NVIDIA B200:10.0:148"``; a short ``"sm_100"`` or ``"sm_90"`` picks a typical part.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch

ENV_VAR = "INDUCTOR_ATTN_DEVICE"

_TYPICAL = {
    "sm_90": ("NVIDIA H100 80GB HBM3", (9, 0), 132),
    "sm_100": ("NVIDIA B200", (10, 0), 148),
}


# Shared memory one block may use (the opt-in maximum), in KiB by compute capability: the CUDA C
# programming guide's table. Unlisted parts get the smallest figure of the family (99 KiB).
_SMEM_KIB = {80: 163, 86: 99, 87: 163, 89: 99, 90: 227, 100: 227}


def smem_per_block(arch: int) -> int:
    """Bytes of shared memory one block may use on ``sm_<arch>``; the CPU (arch 0, Triton's interpreter)
    gets sm_90's figure, so CPU tests see the candidate lists of the GPUs this project measures on.

    >>> smem_per_block(90) // 1024, smem_per_block(86) // 1024, smem_per_block(0) // 1024
    (227, 99, 227)
    """
    return _SMEM_KIB.get(arch or 90, 99) * 1024


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    capability: tuple[int, int]
    sm_count: int
    simulated: bool = False

    @property
    def arch(self) -> int:
        """Compute capability as one number: 90 for sm_90, 100 for sm_100, 0 for the CPU."""
        return self.capability[0] * 10 + self.capability[1]

    def key(self) -> str:
        return f"{self.name}|sm_{self.arch}|{self.sm_count}sm"


def parse_device_override(text: str) -> DeviceInfo:
    """Parse the ``INDUCTOR_ATTN_DEVICE`` format.

    >>> parse_device_override("sm_100").arch
    100
    >>> parse_device_override("NVIDIA H200:9.0:132").sm_count
    132
    """
    if text in _TYPICAL:
        name, cap, sms = _TYPICAL[text]
        return DeviceInfo(name, cap, sms, simulated=True)
    parts = text.split(":")
    try:
        name, cap, sms = parts
        major, minor = (int(x) for x in cap.split("."))
        return DeviceInfo(name, (major, minor), int(sms), simulated=True)
    except ValueError:
        raise ValueError(
            f"{ENV_VAR} must be 'sm_90', 'sm_100' or '<name>:<major>.<minor>:<sm_count>', got {text!r}"
        ) from None


def device_info(device: torch.device | str) -> DeviceInfo:
    """Describe ``device`` (CUDA or CPU), honouring the simulation override for CUDA problems. Called on
    every op call that decides at run time, so every branch is a cache hit after the first."""
    device = torch.device(device)
    override = os.environ.get(ENV_VAR)
    if override:
        return _parsed_override(override)
    if device.type == "cuda":
        return _cuda_info(device.index if device.index is not None else torch.cuda.current_device())
    return _cpu_info()


@functools.cache
def _parsed_override(text: str) -> DeviceInfo:
    return parse_device_override(text)


@functools.cache
def _cpu_info() -> DeviceInfo:
    return DeviceInfo("cpu", (0, 0), os.cpu_count() or 1)


@functools.cache
def _cuda_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    return DeviceInfo(props.name, (props.major, props.minor), props.multi_processor_count)


def on_device_of(t: torch.Tensor) -> contextlib.AbstractContextManager:
    """``t``'s CUDA device made the current one while inside, where it is not: Triton launches, CUDA graphs,
    streams and events take the current device, not their tensors' (a model on ``cuda:1`` with device 0
    current would launch our kernels on the wrong GPU). Nothing for any other tensor, or where it already is."""
    if t.is_cuda and t.get_device() != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()
