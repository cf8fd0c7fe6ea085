"""Hardware files: one cluster's cost-model figures as JSON, accepted wherever a preset name is.

`python -m embark_torchrec.calibrate` writes them from measurements on the user's own ranks; people may
write them by hand. The format (docs/calibration.md, "The hardware file"):

    {"format": "embark-hardware", "version": 1,
     "hardware": {every Hardware field by name: "name", "hbm_gb", ..., "host_cores"},
     "base"?: the preset the fields not measured came from,
     "sources"?: {field: "measured" | "machine" | "model" | "preset"},
     "measurements"?: {name: {"median", "p25", "p75", "min", "max", "samples", "unit", "what"?}},
     "run"?: {"date", "host", "hosts", "backend", "device", "world_size", "local_world_size", ...}}

Reading is strict, as for spec and plan files (fields.py): unknown keys are refused with a did-you-mean,
every Hardware field is required (but those added since files were first written, OPTIONAL_FIELDS, which default
to the Hardware's default, as the cost model had no such term before), numbers are finite and within their
plannable range (ranges.HARDWARE_RANGES: no bandwidth below 1 MB/s, no memory beyond a petabyte, ...), and every
error names the file and the field.
Pure Python: plan/ imports it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Mapping

from .fields import (
    FieldError,
    boolean,
    choice,
    integer,
    keys,
    mapping,
    number,
    read_document,
    reading,
    shown,
    text,
    texts,
)
from .ranges import HARDWARE_RANGES
from .topology import PRESETS, Hardware, band_refusal, hardware_preset

FORMAT = "embark-hardware"
VERSION = 1
# measured here; read off the machine (memory, cores); counted in the model (dense parameters); from `base`
SOURCES = ("measured", "machine", "model", "preset")

OPTIONAL_FIELDS = (
    "update_ns_per_row",
    "inter_node_paired_ratio",
    "inter_node_solo_ratio",
    "inter_node_one_way_ratio",
    "inter_node_phase_overlap",
    "allreduce_bus_gbps",
    "shared_host_ranks",
    "oversubscribed_collective_us",
    "plan_error",
    "plan_error_below",
    "plan_error_above",
)
_TOP_KEYS = ("format", "version", "hardware", "base", "sources", "measurements", "run")
_STAT_NUMBERS = ("median", "p25", "p75", "min", "max")
_STAT_KEYS = (*_STAT_NUMBERS, "samples", "unit", "what")
_RUN_TEXT = ("date", "dense_date", "host", "backend", "device", "torch", "fbgemm_gpu", "torchrec", "optimizer")
_RUN_COUNTS = ("world_size", "local_world_size")
_RUN_KEYS = (*_RUN_TEXT, *_RUN_COUNTS, "hosts", "quick")


class HardwareError(FieldError):
    """A hardware file (or dict) that cannot be planned with; the message names the file and the field."""


def hardware_fields() -> tuple[str, ...]:
    """The Hardware dataclass's fields, in order: what a file's "hardware" object must hold."""
    return tuple(f.name for f in fields(Hardware))


def _finite(value: Any, field: str) -> float:
    """A finite number of any sign (a measurement's statistic)."""
    try:
        return number(value, field, above=-math.inf)
    except FieldError:
        raise FieldError(f"expected a finite number, got {shown(value)}", field) from None


def _figure(name: str, value: Any, kind: str) -> Any:
    """One Hardware field's value checked by its declared type and its plannable range (ranges.HARDWARE_RANGES):
    name text, host_cores an integer, every other figure a finite number."""
    if kind == "str":
        return text(value, name)
    low, high, low_allowed = HARDWARE_RANGES[name]
    if kind == "int":
        return integer(value, name, minimum=int(low) if low_allowed else int(low) + 1, maximum=int(high))
    return number(value, name, above=low, at_most=high, at_least=low if low_allowed else None)


def hardware_from_dict(d: Any, file: str = "") -> Hardware:
    """A Hardware from a file's "hardware" object: every field required, nothing else allowed."""
    declared = {f.name: str(f.type) for f in fields(Hardware)}
    with reading(HardwareError, parent="hardware", file=file):
        m = mapping(d, "")
        keys(m, "", declared, required=sorted(set(declared) - set(OPTIONAL_FIELDS)))
        values = {name: _figure(name, m[name], kind) for name, kind in declared.items() if name in m}
        if values["hbm_reserve_gb"] >= values["hbm_gb"]:
            limit = values["hbm_gb"]
            raise FieldError(f"the reserve leaves no memory: it must be below hbm_gb ({limit:g})", "hbm_reserve_gb")
        band = (values.get(name, 0.0) for name in ("plan_error", "plan_error_below", "plan_error_above"))
        refusal = band_refusal(*band)
        if refusal is not None:
            raise FieldError(refusal, "plan_error")
    return Hardware(**values)


def hardware_to_dict(hardware: Hardware) -> dict[str, Any]:
    return asdict(hardware)


def _check_measurements(value: Any) -> None:
    for name, stats in mapping(value, "measurements").items():
        where = f"measurements.{name}"
        s = mapping(stats, where)
        keys(s, where, _STAT_KEYS, required=(*_STAT_NUMBERS, "samples", "unit"))
        v = {k: _finite(s[k], f"{where}.{k}") for k in _STAT_NUMBERS}
        if not v["min"] <= v["p25"] <= v["median"] <= v["p75"] <= v["max"]:
            raise FieldError("expected min <= p25 <= median <= p75 <= max", where)
        integer(s["samples"], f"{where}.samples", minimum=1)
        text(s["unit"], f"{where}.unit")
        if "what" in s:
            text(s["what"], f"{where}.what")


def _check_run(value: Any) -> None:
    m = mapping(value, "run")
    keys(m, "run", _RUN_KEYS)
    for key in _RUN_TEXT:
        if key in m:
            text(m[key], f"run.{key}")
    for key in _RUN_COUNTS:
        if key in m:
            integer(m[key], f"run.{key}", minimum=1)
    if "hosts" in m:
        texts(m["hosts"], "run.hosts")
    if "quick" in m:
        boolean(m["quick"], "run.quick")


def check_document(d: Any, file: str = "") -> Hardware:
    """Checks a whole hardware document (every section, strictly) and returns its Hardware."""
    with reading(HardwareError, file=file):
        m = mapping(d, "")
        keys(m, "", _TOP_KEYS, required=("format", "version", "hardware"))
        choice(m["format"], "format", (FORMAT,))
        integer(m["version"], "version", minimum=VERSION, maximum=VERSION)
        if "base" in m:
            text(m["base"], "base")
        if "sources" in m:
            sources = mapping(m["sources"], "sources")
            keys(sources, "sources", hardware_fields())
            for name, source in sources.items():
                choice(source, f"sources.{name}", SOURCES)
        if "measurements" in m:
            _check_measurements(m["measurements"])
        if "run" in m:
            _check_run(m["run"])
    return hardware_from_dict(m["hardware"], file)


def load_hardware(path: str | Path) -> Hardware:
    """The Hardware of a hardware file; any problem is a HardwareError naming the file and the field."""
    return check_document(read_document(path, HardwareError, allow_yaml=False), str(path))


def hardware_sources(value: str | Hardware) -> dict[str, str] | None:
    """Which figures a hardware file's document says were measured ("sources"), for the plan report; None for a
    preset, a Hardware, or a file without sources."""
    if not isinstance(value, str) or not names_a_file(value):
        return None
    document = read_document(value, HardwareError, allow_yaml=False)
    check_document(document, value)
    return dict(document["sources"]) if "sources" in document else None


def save_hardware(path: str | Path, document: Mapping[str, Any]) -> None:
    """Writes a hardware document after checking it as load_hardware would (so that what is written loads)."""
    check_document(document, str(path))
    Path(path).write_text(json.dumps(document, indent=2, allow_nan=False) + "\n")


def names_a_file(value: str) -> bool:
    """Whether a --hardware / hardware= string is a file rather than a preset name: a preset name is
    a preset; otherwise a path ending in .json, holding a directory separator, or naming an existing file."""
    if value in PRESETS:
        return False
    return value.endswith(".json") or os.sep in value or Path(value).is_file()


def resolve_hardware(value: str | Hardware) -> Hardware:
    """A Hardware given as itself, a preset name or a hardware file's path."""
    if isinstance(value, Hardware):
        return value
    if not isinstance(value, str):
        raise TypeError(f"hardware must be a preset name, a hardware file's path or a Hardware, got {value!r}")
    if names_a_file(value):
        return load_hardware(value)
    try:
        return hardware_preset(value)
    except ValueError:
        raise ValueError(
            f"unknown hardware preset {value!r} and no such file; known presets: {sorted(PRESETS)} "
            "(or a hardware file: a path ending in .json, e.g. from python -m embark_torchrec.calibrate)"
        ) from None
