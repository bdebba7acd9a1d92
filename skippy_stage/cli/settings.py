"""``--set FIELD=VALUE``: any StageConfig field on the stages ``up``, ``demo`` and ``bench`` start.

The flags of those commands cover what most runs change; every other field (``repack``,
``kv_unified``, cache types, ``session_idle_ttl_s``, a token, certificates, ...) is one ``--set``
away instead of a hand-written config. ``--set stage-1.FIELD=VALUE`` sets it on that stage only;
``--set speculative.k=4`` sets one key of an object field (``speculative`` and ``http_port`` go
to the head alone). A value is read as JSON where it
parses (``true``, ``4``, ``null``, ``{"drafter": "ngram"}``) and as a string otherwise
(``q8_0``, a path). Settings apply after the command's own flags, in the order given, and every
stage's config is then checked by the same rules as ``check`` before anything starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from skippy_stage.config import StageConfig
from skippy_stage.errors import ConfigError

# The chain's wiring, which the command itself writes from --layers / --stages / --host / --base-port.
WIRED = ("stage_id", "stage_index", "layer_start", "layer_end", "upstream", "downstream", "return_to")
# Fields only the head takes: without a stage prefix they go to the head alone.
HEAD_ONLY = ("speculative", "http_port")
_FIELDS = tuple(f.name for f in dataclasses.fields(StageConfig))


@dataclass(frozen=True)
class Setting:
    text: str  # as given, for messages
    stage_id: str | None  # None: every stage
    path: tuple[str, ...]  # field, then keys inside an object field
    value: Any


def parse_setting(text: str, stage_ids: Sequence[str]) -> Setting:
    """One ``[STAGE_ID.]FIELD[.KEY]=VALUE``; a wrong name is refused naming it."""
    name, sep, raw = text.partition("=")
    if not sep or not name.strip():
        raise ConfigError(f"--set {text!r} must be FIELD=VALUE (or STAGE_ID.FIELD=VALUE)")
    parts = name.strip().split(".")
    stage_id = None
    if len(parts) > 1 and parts[0] in stage_ids:
        stage_id, parts = parts[0], parts[1:]
    field_name = parts[0]
    if field_name not in _FIELDS:
        known = f"one of the stages {', '.join(stage_ids)}" if stage_ids else "a stage id"
        raise ConfigError(f"--set {text!r}: {field_name!r} is not a StageConfig field "
                          f"(skippy-stage check prints them all; a prefix before '.' must be {known})")
    if field_name in WIRED:
        raise ConfigError(f"--set {text!r}: {field_name} is wired by the command itself "
                          f"(use --layers, --stages, --host or --base-port)")
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return Setting(text, stage_id, tuple(parts), value)


def apply_settings(configs: list[dict[str, Any]], texts: Sequence[str]) -> list[dict[str, Any]]:
    """``configs`` (one StageConfig dict per stage) with every ``--set`` applied, each stage's
    result checked as ``serve`` would check it; the first wrong setting is refused naming it."""
    stage_ids = [str(cfg["stage_id"]) for cfg in configs]
    settings = [parse_setting(text, stage_ids) for text in texts]
    out = [json.loads(json.dumps(cfg)) for cfg in configs]  # deep copies
    for index, cfg in enumerate(out):
        applied = [s for s in settings if _applies(s, cfg, index)]
        for s in applied:
            _put(cfg, s)
        try:
            StageConfig.from_dict(cfg)
        except ConfigError as exc:
            given = ", ".join(f"--set {s.text}" for s in applied) or "no --set"
            raise ConfigError(f"{exc} (with {given})") from None
    return out


def _applies(s: Setting, cfg: dict[str, Any], index: int) -> bool:
    if s.stage_id is not None:
        return s.stage_id == cfg["stage_id"]
    return index == 0 or s.path[0] not in HEAD_ONLY


def _put(cfg: dict[str, Any], s: Setting) -> None:
    target = cfg
    for key in s.path[:-1]:
        inner = target.get(key)
        if inner is None:
            inner = _object_defaults(key) if target is cfg else {}
        if not isinstance(inner, dict):
            raise ConfigError(f"--set {s.text!r}: {key} is not an object field")
        target[key] = inner = dict(inner)
        target = inner
    target[s.path[-1]] = s.value


def _object_defaults(field_name: str) -> dict[str, Any]:
    """An object field's default as a dict (``speculative``), so one key can be set inside it."""
    spec = next(f for f in dataclasses.fields(StageConfig) if f.name == field_name)
    if spec.default_factory is dataclasses.MISSING:  # type: ignore[misc]
        return {}
    default = spec.default_factory()  # type: ignore[misc]
    return dataclasses.asdict(default) if dataclasses.is_dataclass(default) else {}


def fields_json(text: str) -> dict[str, Any]:
    """An argparse ``type``: stage config fields given as one JSON object (``profile``, ``ab``),
    each name checked as ``--set`` checks it."""
    try:
        fields = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON") from None
    if not isinstance(fields, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object of stage config fields")
    for name in fields:
        if name not in _FIELDS:
            raise argparse.ArgumentTypeError(f"{name!r} is not a StageConfig field (skippy-stage check prints them all)")
        if name in WIRED:
            raise argparse.ArgumentTypeError(f"{name!r} is wired by the command itself")
    return fields
