"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``, each saying what to fix."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error answered to the client (never a crash of the server)."""

    def __init__(self, message: str, status_code: int = 400, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


_FIELD_HINTS = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids (integers) "
              "or a list of token-id lists",
    "stop": "stop must be a string or a list of strings",
    "content": "a message's content must be a string or a list of {\"type\": \"text\", \"text\": ...} parts",
    "messages": "messages must be a non-empty list of {\"role\", \"content\"} objects",
}


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "TextPart", "ChatMessage", "StreamOptions"}


def _is_union_tag(part: str) -> bool:
    """pydantic names the member of a union in an error's location (``str``, ``list[int]``...)."""
    return part in _TYPE_TAGS or any(c in part for c in "[]-")


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def validation_error(errors: list[dict], accepted_fields: list[str] | None = None) -> APIError:
    """Turn pydantic/FastAPI validation errors into one 400 that names the field and the fix."""
    if not errors:
        return APIError("invalid request")
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    typ = first.get("type", "")
    if typ == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "")
        return APIError(f"The request body is not valid JSON ({detail}); send a JSON object.", code="invalid_json")
    if not loc:
        if typ == "missing":
            return APIError("The request body is empty; send a JSON object with the request fields.")
        return APIError("The request body must be a JSON object"
                        + (f" with fields such as {', '.join(accepted_fields[:6])}" if accepted_fields else "") + ".")
    # a field path: keep names and indexes, drop pydantic's union-member labels
    path = [str(p) for p in loc if isinstance(p, int) or not _is_union_tag(str(p))]
    param = ".".join(path)
    top = str(loc[0])
    if typ == "extra_forbidden":
        msg = f"Unknown field {param!r}: this server does not support it; remove it."
        if accepted_fields and len(loc) == 1:
            msg += f" Accepted fields: {', '.join(accepted_fields)}."
        return APIError(msg, param=param, code="unknown_field")
    if typ == "missing":
        return APIError(f"Missing required field {param!r}.", param=param, code="missing_field")
    same_field = [e for e in errors if [p for p in e.get("loc", ()) if p != "body"][:1] == [loc[0]]]
    leaf = str(path[-1]) if path else top
    if len(same_field) > 1 and (top in _FIELD_HINTS or leaf in _FIELD_HINTS):
        hint = _FIELD_HINTS.get(leaf) or _FIELD_HINTS[top]
        field = param if leaf in _FIELD_HINTS and leaf != top else top
        return APIError(f"Invalid {field!r}: {hint}.", param=field)
    msg = str(first.get("msg", "invalid value"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    got = f" (got {_short(first['input'])})" if "input" in first and typ != "value_error" else ""
    return APIError(f"Invalid {param!r}: {msg}{got}.", param=param)
