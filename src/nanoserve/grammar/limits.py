"""The sizes a constraint may have, checked before anything compiles it, and the check that a
JSON schema has an instance at all (a `$ref` cycle with no way out has none). Every refusal is
a GrammarError naming the request field and the limit. Owns nothing.

The limits bound what the grammar compiler is given, not only what it may take long on: past
them a chain of grammar rules overflows its stack, and an object's optional properties or a list
of choices take seconds to compile or make it panic (README's "Structured outputs and tool
calls" has the sizes measured). Whatever passes them is still compiled in a child process under
a time limit (checker.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_GRAMMAR_CHARS = 256 * 1024  # a schema (as JSON), regex or grammar
MAX_CHOICES = 4096
MAX_SCHEMA_DEPTH = 64  # objects and lists inside each other
MAX_SCHEMA_VALUES = 50_000  # JSON values in all
MAX_PROPERTIES = 1024  # properties of one object
MAX_RULES = 1000  # rules of a Lark or GBNF grammar
MAX_REPEAT = 4096  # the largest count of a repetition: a{n}, a{m,n}, "a"~n


class GrammarError(ValueError):
    """A schema, regex or grammar that cannot be compiled or that is over a limit; `param`
    names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_sizes(kind: str, value: Any, param: str) -> None:
    """Refuse a constraint over one of the limits, naming the first one it passes."""
    where = f"{param}.{kind}"
    if kind == "choice":
        _at_most(len(value), MAX_CHOICES, f"{where}: at most {{}} options (got {{}})", param)
        _at_most(sum(map(len, value)), MAX_GRAMMAR_CHARS,
                 f"{where}: at most {{}} characters in all (got {{}})", param)  # fmt: skip
        return
    if kind == "json":  # its depth first: a deep one is too deep to write out as JSON
        check_schema_sizes(parse_schema(value, where, param), where, param)
    text = value if isinstance(value, str) else json.dumps(value)
    _at_most(len(text), MAX_GRAMMAR_CHARS, f"{where}: at most {{}} characters (got {{}})", param)
    if kind == "regex":
        check_repeats(value, where, param)
    elif kind == "grammar":
        rules = value.count("::=") or len(_LARK_RULE.findall(value))
        _at_most(rules, MAX_RULES, f"{where}: at most {{}} rules (got {{}})", param)
        # An embedded schema's text (`%json {...}`: its descriptions too) is no grammar syntax.
        lines = [line for line in value.splitlines() if "%json" not in line]
        check_repeats("\n".join(lines), where, param)


def parse_schema(value: Any, where: str, param: str) -> Any:
    """A schema given as JSON text, parsed (deep nesting is refused, not a crash)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except RecursionError:
        raise GrammarError(f"{where}: nested at most {MAX_SCHEMA_DEPTH} deep", param) from None
    except ValueError as e:
        raise GrammarError(f"{where}: not valid JSON ({e})", param) from None


def check_schema_sizes(schema: Any, where: str, param: str) -> None:
    """Depth, values and properties per object; `pattern`s' repetition counts. Iterative, so
    that no depth is too deep to measure."""
    stack = [(schema, 1)]
    values = 0
    while stack:
        node, depth = stack.pop()
        values += 1
        _at_most(depth, MAX_SCHEMA_DEPTH, f"{where}: nested at most {{}} deep (got {{}})", param)
        _at_most(values, MAX_SCHEMA_VALUES, f"{where}: at most {{}} values (got more)", param)
        if isinstance(node, dict):
            properties = node.get("properties")
            if isinstance(properties, dict):
                message = f"{where}: at most {{}} properties in one object (got {{}})"
                _at_most(len(properties), MAX_PROPERTIES, message, param)
            if isinstance(node.get("pattern"), str):
                check_repeats(node["pattern"], where, param)
            stack += [(v, depth + 1) for v in node.values()]
        elif isinstance(node, list):
            stack += [(v, depth + 1) for v in node]


_LARK_RULE = re.compile(r"^\s*[?!]?[A-Za-z_]\w*(?:\.-?\d+)?\s*:", re.MULTILINE)
_REPEATS = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}|~\s*(\d+)(?:\s*\.\.\s*(\d+))?")


def check_repeats(text: str, where: str, param: str) -> None:
    for match in _REPEATS.finditer(text):
        count = max(int(n) for n in match.groups() if n)
        _at_most(count, MAX_REPEAT, f"{where}: repetition counts at most {{}} (got {{}})", param)


def _at_most(value: int, limit: int, message: str, param: str) -> None:
    if value > limit:
        raise GrammarError(message.format(limit, value), param)


def has_instance(schema: Any) -> bool:
    """Whether some finite JSON value can match the schema, as far as its `$ref`s decide it: a
    schema that refers to itself (or two that refer to each other) with no branch that ends has
    none. Other keywords are taken as satisfiable (the compiler judges them). A least fixed
    point over the local `$ref` targets: each round marks the targets that have an instance
    given the ones marked so far."""
    targets = _local_refs(schema)
    ending: set[str] = set()
    changed = True
    while changed:
        changed = False
        for ref in targets.keys() - ending:
            if _ends(targets[ref], ending, schema):
                ending.add(ref)
                changed = True
    return _ends(schema, ending, schema)


def _ends(node: Any, ending: set[str], root: Any, depth: int = 0) -> bool:
    if node is False:
        return False
    if not isinstance(node, dict) or depth > MAX_SCHEMA_DEPTH:
        return True
    ref = node.get("$ref")
    local = isinstance(ref, str) and ref.startswith("#") and resolve(root, ref) is not None
    if local and ref not in ending:
        return False

    def ends(child: Any) -> bool:
        return _ends(child, ending, root, depth + 1)

    if isinstance(node.get("allOf"), list) and not all(map(ends, node["allOf"])):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list) and not any(map(ends, node[key])):
            return False
    if node.get("enum") == []:
        return False
    types = node.get("type")
    if isinstance(types, list) and any(t not in ("object", "array") for t in types):
        return True  # a string, number, boolean or null ends it
    properties = _of_type(node.get("properties"), dict)
    required = _of_type(node.get("required"), list)
    if not all(ends(properties[name]) for name in required if name in properties):
        return False
    items = node.get("items")
    min_items = node.get("minItems", 0)
    if isinstance(min_items, int) and min_items > 0:
        prefix = _of_type(node.get("prefixItems"), list)
        if not all(map(ends, prefix[:min_items])):
            return False
        if min_items > len(prefix) and items is not None and not ends(items):
            return False
    return True


def _of_type(value: Any, kind: type) -> Any:
    """`value` if it is a `kind` (a dict or a list), else an empty one."""
    return value if isinstance(value, kind) else kind()


def _local_refs(schema: Any) -> dict[str, Any]:
    """Every local `$ref` in the schema (`#`, `#/$defs/x`, ...) and what it points at."""
    refs: dict[str, Any] = {}
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#") and ref not in refs:
                target = resolve(schema, ref)
                if target is not None:
                    refs[ref] = target
            stack += [v for k, v in node.items() if k not in ("const", "enum", "default")]
        elif isinstance(node, list):
            stack += node
    return refs


def resolve(root: Any, ref: str) -> Any:
    """The value a local JSON pointer (`#/a/b`) names, or None."""
    node = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node
