"""Typed fields of the model spec and plan file formats, and of TorchRec's ParameterConstraints.

Every way a value comes in (a file, a dict, a constructor, a TorchRec object) is checked by these
helpers, so a value is refused the same way whatever its source: by type and by value, naming the
field. Integers are ints (not bools, not floats), numbers are finite, booleans are bools, lists are
lists (a string is not a list of names), null is never a value. Pure Python: plan/ imports it.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import reprlib
from functools import lru_cache
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence, TypeVar

from .files import DOCUMENT_MAX_BYTES, read_regular

INT64_MAX = 2**63 - 1  # TorchRec holds sizes and offsets in int64 tensors

# Every attribute of an empty torch.nn.ModuleDict (torch 2.13): TorchRec keeps a collection's tables in
# one, keyed by table name, and Module.add_module refuses a key that is already an attribute (as well
# as '' and names with '.'). Listed here because plan/ does not import torch; test_file_formats.py
# checks the list against torch's.
MODULE_DICT_ATTRIBUTES = frozenset(
    """
    T_destination add_module apply bfloat16 buffers call_super_init children clear compile cpu cuda double
    dump_patches eval extra_repr float forward get_buffer get_extra_state get_parameter get_submodule half ipu
    items keys load_state_dict modules mtia named_buffers named_children named_modules named_parameters
    parameters pop register_backward_hook register_buffer register_forward_hook register_forward_pre_hook
    register_full_backward_hook register_full_backward_pre_hook register_load_state_dict_post_hook
    register_load_state_dict_pre_hook register_module register_parameter register_state_dict_post_hook
    register_state_dict_pre_hook requires_grad_ set_extra_state set_submodule share_memory state_dict to
    to_empty train training type update values xpu zero_grad
    _apply _backward_hooks _backward_pre_hooks _buffers _call_impl _compiled_call_impl _forward_hooks
    _forward_hooks_always_called _forward_hooks_with_kwargs _forward_pre_hooks _forward_pre_hooks_with_kwargs
    _get_backward_hooks _get_backward_pre_hooks _get_name _is_full_backward_hook _load_from_state_dict
    _load_state_dict_post_hooks _load_state_dict_pre_hooks _maybe_warn_non_full_backward_hook _modules
    _named_members _non_persistent_buffers_set _parameters _register_load_state_dict_pre_hook
    _register_state_dict_hook _replicate_for_data_parallel _save_to_state_dict _slow_forward _state_dict_hooks
    _state_dict_pre_hooks _version _wrapped_call_impl
    __annotations__ __call__ __class__ __contains__ __delattr__ __delitem__ __dict__ __dir__ __doc__ __eq__
    __format__ __ge__ __getattr__ __getattribute__ __getitem__ __getstate__ __gt__ __hash__ __init__
    __init_subclass__ __iter__ __le__ __len__ __lt__ __module__ __ne__ __new__ __reduce__ __reduce_ex__
    __repr__ __setattr__ __setitem__ __setstate__ __sizeof__ __str__ __subclasshook__ __weakref__
    """.split()
)

_SHOWN = reprlib.Repr()  # bounded, so a huge or deeply nested value still makes a one-line message
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 3, 6, 6, 4
_SHOWN.maxstring, _SHOWN.maxother = 60, 60


def shown(value: Any) -> str:
    """`value` for an error message: its repr, cut short."""
    return _SHOWN.repr(value)


E = TypeVar("E", bound="FieldError")


class FieldError(ValueError):
    """A refused value, located: the file, the object ("table 't3'"), the field's path in it
    ("shards[0].rows") and the problem; str() is "plan.json: table 't3': field 'shards[0].rows': ...".
    Readers of enclosing objects fill in what the inner check could not know (`wrap`)."""

    def __init__(self, problem: str, field: str = "", where: str = "", file: str = "") -> None:
        self.problem, self.field, self.where, self.file = problem, field, where, file
        parts = (file, where, f"field {field!r}" if field else "", problem)
        super().__init__(": ".join(p for p in parts if p))

    def __reduce__(self) -> tuple[Any, ...]:  # keeps the parts across processes (errors raised on ranks)
        return type(self), (self.problem, self.field, self.where, self.file)

    @classmethod
    def wrap(cls: type[E], error: FieldError, where: str = "", parent: str = "", file: str = "") -> E:
        """`error` as this class, its field under `parent`; `where` and `file` unless it already has them."""
        return cls(error.problem, join(parent, error.field), error.where or where, error.file or file)


class reading:
    """`with reading(SpecError, where="table 't'"):` turns any FieldError raised inside into a SpecError
    located there (a class, not a generator, as hot constructors use it)."""

    __slots__ = ("error", "where", "parent", "file")

    def __init__(self, error: type[FieldError], where: str = "", parent: str = "", file: str = "") -> None:
        self.error, self.where, self.parent, self.file = error, where, parent, file

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if isinstance(value, FieldError):
            raise self.error.wrap(value, self.where, self.parent, self.file) from None


def join(parent: str, field: str) -> str:
    """The path of `field` inside `parent`: "precision" + "forward" -> "precision.forward"."""
    if not parent or not field:
        return parent or field
    return parent + field if field.startswith("[") else f"{parent}.{field}"


def _refuse(expected: str, value: Any, field: str) -> FieldError:
    return FieldError(f"expected {expected}, got {shown(value)}", field)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def integer(value: Any, field: str, minimum: int = 0, maximum: int = INT64_MAX) -> int:
    """An int (not a bool, not a float, even 3.0) in [minimum, maximum]."""
    if not _is_int(value) or not minimum <= value <= maximum:
        bound = f">= {minimum}" if maximum == INT64_MAX else f"in [{minimum}, {maximum}]"
        raise _refuse(f"an integer {bound}", value, field)
    return int(value)


def number(
    value: Any, field: str, above: float = 0.0, at_most: float = math.inf, at_least: float | None = None
) -> float:
    """A finite int or float (not a bool) in (above, at_most], or in [at_least, at_most] when at_least is given."""
    if _is_int(value) or isinstance(value, float):
        try:
            as_float = float(value)
        except OverflowError:  # an int beyond any float
            as_float = math.inf
        low_ok = above < as_float if at_least is None else at_least <= as_float
        if math.isfinite(as_float) and low_ok and as_float <= at_most:
            return as_float
    low, bracket = (above, "(") if at_least is None else (at_least, "[")
    if at_most == math.inf:
        bound = f"{'>' if bracket == '(' else '>='} {low:g}"
    else:
        bound = f"in {bracket}{low:g}, {at_most:g}]"
    raise _refuse(f"a finite number {bound}", value, field)


def boolean(value: Any, field: str) -> bool:
    """true or false: not 1, not "false"."""
    if not isinstance(value, bool):
        raise _refuse("true or false", value, field)
    return value


def text(value: Any, field: str) -> str:
    """A non-empty string."""
    if not isinstance(value, str) or not value:
        raise _refuse("a non-empty string", value, field)
    return value


def choice(value: Any, field: str, options: Sequence[str]) -> str:
    """One of `options`."""
    if not isinstance(value, str) or value not in options:
        raise _refuse(f"one of {list(options)}", value, field)
    return value


def items(value: Any, field: str, expected: str) -> Sequence[Any]:
    """A list (or tuple): not a string, not a mapping; `expected` says of what, for the message."""
    if not isinstance(value, (list, tuple)):
        raise _refuse(expected, value, field)
    return value


def texts(value: Any, field: str, allow_empty: bool = False) -> tuple[str, ...]:
    """A list of non-empty strings (a single string is refused, not read as its letters)."""
    expected = "a list of non-empty strings" if allow_empty else "a non-empty list of non-empty strings"
    out = items(value, field, expected)
    if (not out and not allow_empty) or not all(isinstance(v, str) and v for v in out):
        raise _refuse(expected, value, field)
    return tuple(out)


def integers(value: Any, field: str, length: int | None = None, minimum: int = 0) -> tuple[int, ...]:
    """A non-empty list of ints >= minimum, of exactly `length` when given."""
    count = "a non-empty list" if length is None else f"a list of {length}"
    expected = f"{count} integers >= {minimum}"
    out = items(value, field, expected)
    if not out or (length is not None and len(out) != length):
        raise _refuse(expected, value, field)
    if not all(_is_int(v) and minimum <= v <= INT64_MAX for v in out):
        raise _refuse(expected, value, field)
    return tuple(int(v) for v in out)


def numbers(value: Any, field: str) -> tuple[float, ...]:
    """A non-empty list of finite numbers > 0."""
    expected = "a non-empty list of finite numbers > 0"
    out = items(value, field, expected)
    if not out:
        raise _refuse(expected, value, field)
    try:
        return tuple(number(v, field) for v in out)
    except FieldError:
        raise _refuse(expected, value, field) from None


def mapping(value: Any, field: str) -> Mapping[str, Any]:
    """An object ({...}) whose keys are strings."""
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise _refuse("an object with string keys", value, field)
    return value


def keys(value: Mapping[str, Any], field: str, allowed: Collection[str], required: Collection[str] = ()) -> None:
    """Refuses, naming the key, an unknown key (suggesting the closest known one), a missing
    required key, and null as the value of any key (leave an optional key out instead)."""
    for key in sorted(set(value) - set(allowed)):
        close = difflib.get_close_matches(key, sorted(allowed), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known: {sorted(allowed)}"
        raise FieldError(f"unknown field; {hint}", join(field, key))
    for key in required:
        require(value, key, field)
    for key, v in value.items():
        if v is None:
            raise FieldError("expected a value, got null (leave an optional field out instead)", join(field, key))


def require(value: Mapping[str, Any], key: str, field: str = "") -> Any:
    """value[key], refused naming the key when it is missing."""
    if key not in value:
        raise FieldError("required but missing", join(field, key))
    return value[key]


def table_name(value: Any, field: str) -> str:
    """A name TorchRec can key a table by: a non-empty string that nn.ModuleDict accepts as a key
    (no '.', not one of its attributes, such as 'items' or 'training')."""
    name = text(value, field)
    if "." in name:
        raise FieldError(f"table name {name!r} contains '.', which an nn.ModuleDict key cannot (TorchRec)", field)
    if name in MODULE_DICT_ATTRIBUTES:
        raise FieldError(
            f"table name {name!r} is an attribute of nn.ModuleDict, which TorchRec keeps tables in; rename it",
            field,
        )
    return name


POOLED, SEQUENCE = "pooled", "sequence"
TABLE_KINDS = (POOLED, SEQUENCE)


def table_kind(value: Any, field: str) -> str:
    """A table's kind: "pooled" (an EmbeddingBagCollection's table: one vector per bag) or "sequence"
    (an EmbeddingCollection's: one vector per ID); model specs and plan files both carry it."""
    if not isinstance(value, str) or value not in TABLE_KINDS:
        raise FieldError(f"unknown table kind {shown(value)}; known: {list(TABLE_KINDS)}", field)
    return value


def read_document(path: str | Path, error: type[FieldError], allow_yaml: bool) -> Any:
    """The parsed contents of a JSON file (YAML when allow_yaml and it ends in .yaml/.yml). An
    unreadable file, anything but a regular file (a FIFO would block every rank that opens it), a file over
    DOCUMENT_MAX_BYTES, bytes that are not UTF-8, an empty file, invalid or too deeply nested JSON/YAML
    and a key given twice in one object are all `error`s naming the file."""
    p = Path(path)
    try:
        raw = read_regular(p, DOCUMENT_MAX_BYTES)
    except OSError as e:  # also NotARegularFile and FileTooLarge, whose message says which
        raise error(f"cannot read: {e.strerror or e}", file=str(p)) from None
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"not UTF-8 text (byte {raw[e.start]:#04x} at offset {e.start})", file=str(p)) from None
    if not content.strip():
        raise error("the file is empty", file=str(p))
    is_yaml = allow_yaml and p.suffix in (".yaml", ".yml")
    kind = "YAML" if is_yaml else "JSON"
    try:
        return _load_yaml(content) if is_yaml else json.loads(content, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise error("nested too deeply", file=str(p)) from None
    except _DuplicateKey as e:
        raise error(f"key {shown(e.key)} appears twice in one object", file=str(p)) from None
    except json.JSONDecodeError as e:
        raise error(f"invalid JSON: {e.msg} at line {e.lineno} column {e.colno}", file=str(p)) from None
    except _YamlError as e:
        raise error(" ".join(str(e).split()), file=str(p)) from None
    except ValueError as e:  # e.g. an integer of more digits than Python converts
        raise error(f"invalid {kind}: {' '.join(str(e).split())}", file=str(p)) from None


class _DuplicateKey(Exception):
    def __init__(self, key: Any) -> None:
        super().__init__(key)
        self.key = key


class _YamlError(Exception):
    """A YAML file that cannot be read (its message says why), so that read_document need not import
    yaml for JSON files."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object hook: a key given twice is refused (json.loads would keep the last silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


# YAML scalars as YAML 1.2's JSON schema reads them: an unquoted scalar is a number only if JSON would read it as
# one, true/false (any case YAML 1.2's core schema allows) a boolean, null/~/nothing null, and every other scalar
# the string it is written as. PyYAML's own SafeLoader follows YAML 1.1, which reads `rows: 0100` as 64 (octal),
# `1:30` as 90 (base 60), `0x100` as 256, `1_000` as 1000, `yes`/`no`/`on`/`off` as booleans and `.inf`/`.nan` as
# floats; here they are the strings '0100', '1:30', ..., which a number field refuses by type, naming the file,
# the table and the field, and which a text field (a feature named `on`) keeps as written.
_YAML_INT = r"-?(?:0|[1-9][0-9]*)"
_YAML_FLOAT = r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]*)?(?:[eE][-+]?[0-9]+)?"
_YAML_BOOLS = {"true": True, "True": True, "TRUE": True, "false": False, "False": False, "FALSE": False}
_YAML_NULLS = ("~", "null", "Null", "NULL")  # and an empty value
_YAML_TAG = "tag:yaml.org,2002:"
_WHOLE_INT, _WHOLE_FLOAT = re.compile(_YAML_INT + r"\Z"), re.compile(_YAML_FLOAT + r"\Z")


def _load_yaml(content: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise _YamlError("reading a YAML file needs PyYAML (pip install pyyaml)") from None
    try:
        return yaml.load(content, Loader=_strict_loader())
    except yaml.YAMLError as e:
        raise _YamlError(f"invalid YAML: {e}") from None


@lru_cache(maxsize=1)
def _strict_loader() -> type:
    """PyYAML's safe loader with the scalars above (implicit or tagged: `!!int 0100` is refused too) and only
    the plain data types: a tag for anything else (`!!timestamp`, `!!binary`, `!!set`, `!!python/...`) is an error.
    A key given twice in one mapping is refused (PyYAML keeps the last silently); merged keys (<<) may still be
    overridden."""
    from yaml.composer import Composer
    from yaml.constructor import ConstructorError, SafeConstructor
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.resolver import BaseResolver
    from yaml.scanner import Scanner

    class StrictLoader(Reader, Scanner, Parser, Composer, SafeConstructor, BaseResolver):
        yaml_implicit_resolvers: dict[Any, Any] = {}
        yaml_constructors: dict[Any, Any] = {}

        def __init__(self, stream: str) -> None:
            Reader.__init__(self, stream)
            Scanner.__init__(self)
            Parser.__init__(self)
            Composer.__init__(self)
            SafeConstructor.__init__(self)
            BaseResolver.__init__(self)

        def _scalar(self, node: Any, kind: str, pattern: Any) -> str:
            value = self.construct_scalar(node)
            if not pattern.match(value):
                raise ConstructorError(
                    None, None, f"{value!r} tagged !!{kind} is not a number as JSON writes one", node.start_mark
                )
            return value

        def construct_json_int(self, node: Any) -> int:
            return int(self._scalar(node, "int", _WHOLE_INT))

        def construct_json_float(self, node: Any) -> float:
            return float(self._scalar(node, "float", _WHOLE_FLOAT))

        def construct_json_bool(self, node: Any) -> bool:
            value = self.construct_scalar(node)
            if value not in _YAML_BOOLS:
                raise ConstructorError(None, None, f"!!bool {value!r} is not true or false", node.start_mark)
            return _YAML_BOOLS[value]

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: list[Any] = []
            for key_node, _ in node.value:
                if key_node.tag == _YAML_TAG + "merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise _DuplicateKey(key)
                seen.append(key)
            return super().construct_mapping(node, deep)

    resolvers = (
        ("int", _YAML_INT, "-0123456789"),
        ("float", _YAML_FLOAT, "-0123456789"),
        ("bool", "|".join(_YAML_BOOLS), "tTfF"),
        ("null", "|".join(_YAML_NULLS), "~nN"),
        ("merge", "<<", "<"),
    )
    for kind, pattern, first in resolvers:
        StrictLoader.add_implicit_resolver(_YAML_TAG + kind, re.compile(f"(?:{pattern})\\Z"), list(first))
    StrictLoader.add_implicit_resolver(_YAML_TAG + "null", re.compile(r"\Z"), [""])
    constructors = {
        "int": StrictLoader.construct_json_int,
        "float": StrictLoader.construct_json_float,
        "bool": StrictLoader.construct_json_bool,
        "null": SafeConstructor.construct_yaml_null,
        "str": SafeConstructor.construct_yaml_str,
        "seq": SafeConstructor.construct_yaml_seq,
        "map": SafeConstructor.construct_yaml_map,
    }
    for kind, construct in constructors.items():
        StrictLoader.add_constructor(_YAML_TAG + kind, construct)
    StrictLoader.add_constructor(None, SafeConstructor.construct_undefined)
    return StrictLoader
