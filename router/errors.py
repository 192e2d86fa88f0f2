"""Errors in the OpenAI schema: {"error": {"message", "type", "param", "code"}} + status."""
from __future__ import annotations

import enum
from typing import Any


class _WireEnum(str, enum.Enum):
    """A str-valued Enum that prints as its value: JSON bodies and metric labels carry it."""

    def __str__(self) -> str:
        return self.value


class ErrorType(_WireEnum):
    """OpenAI's error `type`."""

    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    RATE_LIMIT = "rate_limit_error"
    TIMEOUT = "timeout_error"
    SERVER = "server_error"


class ErrorCode(_WireEnum):
    """OpenAI's error `code`; with the type, what labels `pd_request_errors_total`."""

    INVALID_JSON = "invalid_json"
    INVALID_VALUE = "invalid_value"
    UNSUPPORTED_VALUE = "unsupported_value"       # a field we know but do not implement
    UNKNOWN_PARAMETER = "unknown_parameter"       # a field we do not know
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    INVALID_API_KEY = "invalid_api_key"
    NOT_FOUND = "not_found"
    MODEL_NOT_FOUND = "model_not_found"
    REQUEST_TOO_LARGE = "request_too_large"
    QUEUE_FULL = "queue_full"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"   # a tenant's own limit (router/tenants.py)
    REQUEST_TIMEOUT = "request_timeout"
    INTERNAL_ERROR = "internal_error"
    ENGINE_UNAVAILABLE = "engine_unavailable"
    CLIENT_DISCONNECTED = "client_disconnected"   # a metric label only: nobody is left to tell


class APIError(Exception):
    """An error answered to the client with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str,
                 type_: ErrorType = ErrorType.INVALID_REQUEST, param: str | None = None,
                 code: ErrorCode | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = code
        self.headers = headers or {}

    @property
    def kind(self) -> ErrorCode | ErrorType:
        """The label of this error in the `pd_request_errors_total` metric."""
        return self.code or self.type

    def body(self) -> dict[str, Any]:
        """The JSON error body; text that UTF-8 cannot encode (a client's lone surrogate
        echoed in a message) is escaped, so the body can always be sent."""
        return {"error": {"message": _sendable(self.message), "type": self.type,
                          "param": _sendable(self.param), "code": self.code}}


def _sendable(text: str | None) -> str | None:
    if text is None:
        return None
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bad_request(message: str, param: str | None = None,
                code: ErrorCode | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
    return APIError(401, "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                    type_=ErrorType.AUTHENTICATION, code=ErrorCode.INVALID_API_KEY)


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model {model!r} does not exist.", param="model",
                    code=ErrorCode.MODEL_NOT_FOUND)


def too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than {limit} bytes.",
                    code=ErrorCode.REQUEST_TOO_LARGE)


def overloaded(retry_after_s: int) -> APIError:
    return APIError(429, "The server has too many requests waiting; retry later.",
                    type_=ErrorType.RATE_LIMIT, code=ErrorCode.QUEUE_FULL,
                    headers={"Retry-After": str(retry_after_s)})


def rate_limited(tenant: str, what: str, retry_after_s: int) -> APIError:
    """429: a tenant's own rate limit (router/tenants.py), not the server's load."""
    return APIError(429, f"Rate limit reached for {what} of tenant {tenant!r}; retry after "
                    f"{retry_after_s} s.", type_=ErrorType.RATE_LIMIT,
                    code=ErrorCode.RATE_LIMIT_EXCEEDED,
                    headers={"Retry-After": str(retry_after_s)})


def unavailable(message: str, retry_after_s: int = 5) -> APIError:
    """503: no engine replica can take the request now (starting, restarting, pending)."""
    return APIError(503, message, type_=ErrorType.SERVER, code=ErrorCode.ENGINE_UNAVAILABLE,
                    headers={"Retry-After": str(retry_after_s)})


class EngineUnavailable(RuntimeError):
    """No live engine replica can take (or continue) the request."""


def timed_out(seconds: float) -> APIError:
    return APIError(504, f"The request did not finish within {seconds:g} s.",
                    type_=ErrorType.TIMEOUT, code=ErrorCode.REQUEST_TIMEOUT)


def internal(message: str) -> APIError:
    return APIError(500, message, type_=ErrorType.SERVER, code=ErrorCode.INTERNAL_ERROR)
