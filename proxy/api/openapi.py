"""``/openapi.json`` as the proxy really answers: the bearer scheme where the token is needed, every error.

Each operation lists the error answers it can send, each with its body schema (``ErrorBody``, or
``ValidationErrorBody`` for 422) and the codes that status carries. What every operation can answer (a fault,
Redis down, a wrong token, a body over the limit, a request that fails the schema) is added here from what
the route takes; what only some send (a stale rollout, an unknown step) is the table ``ROUTE_REFUSALS``,
kept honest by the schema-driven fuzz test (``tests/integration/test_api_fuzz.py``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute

from asyncgrpo.protocol.errors import ERROR_CODES, ErrorBody, ValidationErrorBody

BEARER_SCHEME = "bearerToken"
ROUTE_REFUSALS: dict[tuple[str, str], tuple[str, ...]] = {
    ("POST", "/v1/leases"): ("not_ready", "cancelled"),
    ("POST", "/v1/leases/{lease_id}/renew"): ("lease_lost",),
    ("POST", "/v1/rollouts"): ("bad_request", "stale", "not_holder", "cancelled"),
    ("POST", "/v1/tasks/{task_id}/failure"): (),
    ("GET", "/v1/steps/{step}"): ("not_found",),
    ("POST", "/v1/steps/{step}/start"): ("not_found", "not_claimed"),
    ("POST", "/v1/steps/{step}/failure"): ("bad_request", "not_found", "not_claimed"),
    ("POST", "/v1/versions"): ("bad_request", "conflict"),
    ("GET", "/v1/versions/{version}"): ("not_found",),
    ("POST", "/v1/versions/{version}/corrupt"): ("not_found",),
    ("POST", "/v1/evals/{task_id}/lease"): ("cancelled",),
    ("POST", "/v1/evals/{task_id}/result"): ("cancelled", "not_holder"),
}
"""Refusals particular to a route, by error code (``asyncgrpo.protocol.errors``)."""


def route_errors(route: APIRoute, *, needs_token: bool) -> dict[int, list[str]]:
    """Every error status ``route`` can answer, with the codes sent under it."""
    method = sorted(route.methods)[0]
    by_status: dict[int, list[str]] = {500: ["internal"], 503: ["unavailable"]}
    if needs_token:
        by_status[401] = ["unauthorized"]
    if method not in ("GET", "HEAD"):
        by_status[413] = ["too_large"]
    if route.body_field is not None:
        by_status[400] = ["bad_request"]  # a body that is not JSON, or not UTF-8
    if route.body_field is not None or route.dependant.path_params or route.dependant.query_params:
        by_status[422] = ["bad_request"]
    for code in ROUTE_REFUSALS.get((method, route.path), ()):
        codes = by_status.setdefault(ERROR_CODES[code].status, [])
        if code not in codes:
            codes.append(code)
    return by_status


def _describe(codes: list[str]) -> str:
    return "; ".join(f"`{code}`: {ERROR_CODES[code].meaning}" for code in codes)


def _body_schemas() -> dict[str, Any]:
    """The component schemas of the error bodies (``FieldError`` comes along as a definition)."""
    out: dict[str, Any] = {}
    for model in (ErrorBody, ValidationErrorBody):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


def _error_answer(status: int, codes: list[str]) -> dict[str, Any]:
    model = ValidationErrorBody if status == 422 else ErrorBody
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"description": _describe(codes), "content": {"application/json": {"schema": ref}}}


def install_openapi(app: FastAPI, *, token_required: bool, open_paths: frozenset[str]) -> None:
    """Serve a schema that documents every route's error answers and the bearer scheme."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 body, which we never send
            schemas.pop(unused, None)
        schemas.update(_body_schemas())
        if token_required:
            components["securitySchemes"] = {
                BEARER_SCHEME: {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "ASYNCGRPO_TOKEN, the secret shared by the proxy and its workers.",
                }
            }
        for route in app.routes:
            if not isinstance(route, APIRoute) or not route.include_in_schema:
                continue
            needs_token = token_required and route.path not in open_paths
            for method in route.methods:
                operation = schema["paths"][route.path][method.lower()]
                responses = operation["responses"]
                for status, codes in route_errors(route, needs_token=needs_token).items():
                    responses[str(status)] = _error_answer(status, codes)
                if needs_token:
                    operation["security"] = [{BEARER_SCHEME: []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
