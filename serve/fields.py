"""An OpenAI request's fields as the server reads them: `get_field` reads one with its JSON
type, and `APIError` is the error a client sees, OpenAI's `{"error": {...}}` with a status.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered as OpenAI's `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers, self.code = headers or {}, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}

    @classmethod
    def invalid(cls, error: ValueError, chat: bool) -> APIError:
        """A 400 for a value the checks refused, naming the request's field where the error
        names one (`checks.InvalidValue`)."""
        field = getattr(error, "name", None)
        if field is not None:
            field = field.split("[")[0]  # "top_p[1]": one of a list's values
            field = {"logprobs": "top_logprobs" if chat else "logprobs",
                     "stop_ids": "stop_token_ids"}.get(field, field)
        return cls(400, str(error), field)


# The JSON types a field may be (`get_field`).
NUMBER, INT, BOOL, STR, OBJECT = (int, float), (int,), (bool,), (str,), (dict,)


def shown(value: Any, limit: int = 80) -> str:
    """`value`'s repr for an error message, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def get_field(body: dict, name: str, kinds: tuple, default: Any = None) -> Any:
    """`body`'s field `name`, or `default` where it is missing or null; a value that is
    none of `kinds` (`INT`, `BOOL`, ...) is an APIError 400 naming the field."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        wanted = {NUMBER: "a number", INT: "an integer", BOOL: "a boolean",
                  STR: "a string", OBJECT: "an object"}.get(
            kinds, "/".join(k.__name__ for k in kinds))
        raise APIError(400, f"{name}={shown(value)} must be {wanted}", name)
    return value
