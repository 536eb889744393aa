"""A small JSON-schema checker for the tests of structured output and forced tool calls.

No validator is installed (jsonschema is not a dependency), and the tests need only the
keywords of their own schemas; this covers them, and refuses a schema keyword it does not know,
so a test that grows a new keyword cannot pass by it being ignored. Used by
tests/test_structured_output.py, tests/test_serve_tools.py and tests/test_serve_load.py.
"""

KNOWN = {"type", "enum", "const", "properties", "required", "additionalProperties", "items",
         "minItems", "maxItems", "minLength", "maxLength", "minimum", "maximum", "description",
         "title"}
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def matches(value, schema: dict) -> bool:
    """Whether value follows schema (the keywords in KNOWN; anything else raises ValueError).
    Booleans are not integers or numbers, as in JSON Schema."""
    unknown = set(schema) - KNOWN
    if unknown:
        raise ValueError(f"json_schema_check does not implement {sorted(unknown)}")
    if "enum" in schema and not any(_same(value, e) for e in schema["enum"]):
        return False
    if "const" in schema and not _same(value, schema["const"]):
        return False
    t = schema.get("type")
    if t is None:
        return True
    if t == "integer":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif t == "number":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif t in TYPES:
        ok = isinstance(value, TYPES[t])
    else:
        raise ValueError(f"json_schema_check does not know the type {t!r}")
    if not ok:
        return False
    if t == "object":
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        if not set(schema.get("required", ())) <= set(value):
            return False
        if extra is False and not set(value) <= set(props):
            return False
        return all(matches(v, props[k]) if k in props else
                   (matches(v, extra) if isinstance(extra, dict) else True)
                   for k, v in value.items())
    if t == "array":
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value)):
            return False
        return "items" not in schema or all(matches(x, schema["items"]) for x in value)
    if t == "string":
        return schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value))
    if t in ("integer", "number"):
        return schema.get("minimum", value) <= value <= schema.get("maximum", value)
    return True


def _same(a, b) -> bool:
    """JSON equality: 1 == 1.0, but True is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    return a == b
