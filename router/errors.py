"""Errors in the OpenAI schema: {"error": {"message", "type", "param", "code"}} + status."""
from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error answered to the client with `status` and an OpenAI error body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = code
        self.headers = headers or {}

    @property
    def kind(self) -> str:
        """The label of this error in the `pd_request_errors_total` metric."""
        return self.code or self.type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unauthorized() -> APIError:
    return APIError(401, "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
                    type_="authentication_error", code="invalid_api_key")


def model_not_found(model: str) -> APIError:
    return APIError(404, f"The model {model!r} does not exist.", param="model",
                    code="model_not_found")


def too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than {limit} bytes.",
                    code="request_too_large")


def overloaded(retry_after_s: int) -> APIError:
    return APIError(429, "The server has too many requests waiting; retry later.",
                    type_="rate_limit_error", code="queue_full",
                    headers={"Retry-After": str(retry_after_s)})


def timed_out(seconds: float) -> APIError:
    return APIError(504, f"The request did not finish within {seconds:g} s.",
                    type_="timeout_error", code="request_timeout")


def internal(message: str) -> APIError:
    return APIError(500, message, type_="server_error", code="internal_error")
