"""onnxruntime's allocator-sharing names (``OrtMemoryInfo``, ``OrtArenaCfg``,
``create_and_register_allocator`` and their enums), so that a script that shares one CPU arena between its
sessions runs unchanged.

There is nothing to share on onnxtrain's side: the numpy engine pools its own buffers per plan, and the
onnxruntime backend already registers one CPU arena for the graphs of a training step
(:mod:`onnxtrain.engine.ort_plan`). The call checks its arguments as onnxruntime's binding does.
"""

from __future__ import annotations

import enum
import numbers
from typing import Any


class OrtAllocatorType(enum.IntEnum):
    """onnxruntime's allocator kinds, with its values."""

    INVALID = -1
    ORT_DEVICE_ALLOCATOR = 0
    ORT_ARENA_ALLOCATOR = 1


class OrtMemType(enum.IntEnum):
    """onnxruntime's memory kinds, with its values (``CPU`` is ``CPU_OUTPUT``)."""

    CPU_INPUT = -2
    CPU_OUTPUT = -1
    CPU = -1
    DEFAULT = 0


class OrtDeviceMemoryType(enum.IntEnum):
    """onnxruntime's kinds of device memory, with its values."""

    DEFAULT = 0
    HOST_ACCESSIBLE = 5


class OrtMemoryInfoDeviceType(enum.IntEnum):
    """onnxruntime's device kinds for ``OrtMemoryInfo.create_v2``, with its values."""

    CPU = 0
    GPU = 1
    FPGA = 2
    NPU = 3


# the PCI vendor id onnxruntime gives the memory of a device it names so
_VENDOR_IDS = {"cuda": 0x10DE, "cudapinned": 0x10DE}


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    return int(value)


class OrtMemoryInfo:
    """Where an allocator's memory lives: ``OrtMemoryInfo(name, alloc_type, device_id, mem_type)``."""

    def __init__(self, name: str, alloc_type: OrtAllocatorType, device_id: int, mem_type: OrtMemType) -> None:
        if not isinstance(name, str):
            raise TypeError(f"OrtMemoryInfo: the name must be a str, got {type(name).__name__}")
        if not isinstance(alloc_type, OrtAllocatorType):
            raise TypeError(f"OrtMemoryInfo: alloc_type must be an OrtAllocatorType, got {alloc_type!r}")
        if not isinstance(mem_type, OrtMemType):
            raise TypeError(f"OrtMemoryInfo: mem_type must be an OrtMemType, got {mem_type!r}")
        self.name = name
        self.allocator_type = alloc_type
        self.device_id = _int(device_id, "OrtMemoryInfo: device_id")
        self.mem_type = mem_type
        self.device_mem_type = OrtDeviceMemoryType.DEFAULT
        self.device_vendor_id = _VENDOR_IDS.get(name.lower(), 0)

    @staticmethod
    def create_v2(name: str, device_type: OrtMemoryInfoDeviceType, vendor_id: int, device_id: int,
                  device_mem_type: OrtDeviceMemoryType, alignment: int,
                  allocator_type: OrtAllocatorType) -> OrtMemoryInfo:
        """A memory info from a device kind, vendor id and memory kind (onnxruntime's ``create_v2``;
        ``alignment`` is checked, not kept)."""
        if not isinstance(device_type, OrtMemoryInfoDeviceType):
            raise TypeError(f"OrtMemoryInfo.create_v2: device_type must be an OrtMemoryInfoDeviceType, got "
                            f"{device_type!r}")
        if not isinstance(device_mem_type, OrtDeviceMemoryType):
            raise TypeError(f"OrtMemoryInfo.create_v2: device_mem_type must be an OrtDeviceMemoryType, got "
                            f"{device_mem_type!r}")
        _int(alignment, "OrtMemoryInfo.create_v2: alignment")
        info = OrtMemoryInfo(name, allocator_type, device_id, OrtMemType.DEFAULT)
        info.device_mem_type = device_mem_type
        info.device_vendor_id = _int(vendor_id, "OrtMemoryInfo.create_v2: vendor_id")
        return info

    def __repr__(self) -> str:
        return (f"OrtMemoryInfo({self.name!r}, {self.allocator_type.name}, {self.device_id}, "
                f"{self.mem_type.name})")


_ARENA_KEYS = ("max_mem", "arena_extend_strategy", "initial_chunk_size_bytes", "max_dead_bytes_per_chunk",
               "initial_growth_chunk_size_bytes", "max_power_of_two_extend_bytes")


class OrtArenaCfg:
    """An arena's settings: ``OrtArenaCfg(max_mem, arena_extend_strategy, initial_chunk_size_bytes,
    max_dead_bytes_per_chunk)`` or ``OrtArenaCfg({key: value})`` with those keys and
    ``initial_growth_chunk_size_bytes``, ``max_power_of_two_extend_bytes`` (-1 or 0: onnxruntime's
    default)."""

    def __init__(self, *args: Any) -> None:
        values = dict.fromkeys(_ARENA_KEYS, -1)
        values["max_mem"] = 0
        if len(args) == 1 and isinstance(args[0], dict):
            unknown = sorted(set(args[0]) - set(_ARENA_KEYS))
            if unknown:
                raise ValueError(f"OrtArenaCfg: unknown key(s) {unknown}; valid: {list(_ARENA_KEYS)}")
            given = args[0]
        elif len(args) == 4:
            given = dict(zip(_ARENA_KEYS, args))
        else:
            raise TypeError("OrtArenaCfg takes four ints (max_mem, arena_extend_strategy, "
                            "initial_chunk_size_bytes, max_dead_bytes_per_chunk) or one dict")
        for key, value in given.items():
            values[key] = _int(value, f"OrtArenaCfg: {key}")
        for key, value in values.items():
            setattr(self, key, value)


def create_and_register_allocator(mem_info: OrtMemoryInfo, arena_cfg: OrtArenaCfg | None) -> None:
    """Register a shared allocator for sessions with ``session.use_env_allocators`` = "1" (onnxtrain's
    sessions manage their memory themselves: the arguments are checked, nothing else)."""
    if not isinstance(mem_info, OrtMemoryInfo):
        raise TypeError(f"create_and_register_allocator: mem_info must be an OrtMemoryInfo, got "
                        f"{type(mem_info).__name__}")
    if arena_cfg is not None and not isinstance(arena_cfg, OrtArenaCfg):
        raise TypeError(f"create_and_register_allocator: arena_cfg must be an OrtArenaCfg, got "
                        f"{type(arena_cfg).__name__}")
    if mem_info.name.lower() != "cpu":
        raise ValueError(f"create_and_register_allocator: only CPU allocators, got {mem_info.name!r}")


__all__ = ["OrtAllocatorType", "OrtArenaCfg", "OrtDeviceMemoryType", "OrtMemType", "OrtMemoryInfo",
           "OrtMemoryInfoDeviceType", "create_and_register_allocator"]
