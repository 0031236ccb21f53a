"""What the flat optimizer updates share: the session config entry that turns them off and the size from
which a weight keeps its own arrays (the on-device ``Optimizer``'s and the legacy session's alike)."""

from __future__ import annotations

from typing import Any

from onnxtrain.engine.backends import session_config_entry

CONFIG_KEY = "onnxtrain.flat_update"
# a parameter of this many values or more keeps its own arrays (a single group): gathering its gradient would
# cost about what its own dozen ufunc calls do (0.1 ns a value against 15-20 µs a parameter)
SINGLE_MIN = 1 << 17


def flat_update_enabled(session_options: Any) -> bool:
    """The session options' ``onnxtrain.flat_update`` entry: "1" (the default) or "0" (off)."""
    value = session_config_entry(session_options, CONFIG_KEY) or "1"
    if value not in ("0", "1"):
        raise ValueError(f"session config entry {CONFIG_KEY!r} must be '0' or '1', got {value!r}")
    return value == "1"
