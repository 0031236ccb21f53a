"""onnxruntime's Python-side session module, where scripts import the session and value classes from
(``from onnxruntime.capi.onnxruntime_inference_collection import OrtValue``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from onnxtrain.capi.ortvalue import IOBinding, OrtDevice, OrtValue
from onnxtrain.inference import InferenceSession
from onnxtrain.user_warning import warn

Session = InferenceSession  # onnxruntime's base class of its sessions: isinstance checks hold


def check_and_normalize_provider_args(
    providers: Sequence[Any] | None, provider_options: Sequence[Mapping] | None,
    available_provider_names: Sequence[str],
) -> tuple[list[str], list[dict[str, str]]]:
    """The provider names and their options (keys and values as str) from a ``providers`` argument of names
    or ``(name, options)`` pairs and an optional ``provider_options`` list, as onnxruntime's helper of that
    name gives them: a name listed again is dropped with a warning, a name not in
    ``available_provider_names`` warned about; arguments of the wrong kind are a ValueError."""
    if providers is None:
        return [], []
    if not isinstance(providers, Sequence) or isinstance(providers, str):
        raise ValueError(f"providers must be a list of names or (name, options) pairs, got {providers!r}")
    if provider_options is not None:
        if not isinstance(provider_options, Sequence) or isinstance(provider_options, str):
            raise ValueError(f"provider_options must be a list of dicts, got {provider_options!r}")
        if len(provider_options) != len(providers):
            raise ValueError(f"providers ({len(providers)}) and provider_options ({len(provider_options)}) "
                             "must have the same length")
        if not all(isinstance(p, str) for p in providers):
            raise ValueError("provider_options given with (name, options) pairs in providers: give the "
                             "options one way only")
    names: list[str] = []
    options: list[dict[str, str]] = []
    for k, item in enumerate(providers):
        if isinstance(item, str):
            name, given = item, {} if provider_options is None else provider_options[k]
        elif (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
              and isinstance(item[1], Mapping)):
            name, given = item
        else:
            raise ValueError(f"providers[{k}] must be a name or a (name, options dict) pair, got {item!r}")
        if not isinstance(given, Mapping):
            raise ValueError(f"provider_options[{k}] must be a dict, got {given!r}")
        if name in names:
            warn(f"provider {name!r} is listed more than once: its later listing is ignored")
            continue
        if name not in available_provider_names:
            warn(f"provider {name!r} is not among the available providers "
                 f"({', '.join(available_provider_names)})")
        names.append(name)
        options.append({str(key): str(value) for key, value in given.items()})
    return names, options


__all__ = ["IOBinding", "InferenceSession", "OrtDevice", "OrtValue", "Session",
           "check_and_normalize_provider_args"]
