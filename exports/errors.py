"""The JSON API's errors: one shape, `{"error": {"code": …, "message": …}}`, on every /api/ path.

The views answer their own errors in it (`error_response`). `ApiJsonErrorsMiddleware` covers what
no view of ours answers: a path that matches no URL, a method a view does not take (Django's bare
405), an uncaught exception (Django's HTML 500 page), a 4xx/5xx from another middleware. An API
client then never has to parse Django's HTML error pages.
"""
from http import HTTPStatus

from django.http import HttpRequest, HttpResponse, JsonResponse

# Where config/urls.py mounts exports.urls (request.path_info: without a deployment's script prefix).
API_PREFIX = "/api/"
GENERIC_MESSAGES = {
    HTTPStatus.NOT_FOUND: "No such API path: see the API in README.md.",
    HTTPStatus.INTERNAL_SERVER_ERROR: "Something went wrong on our side; it is logged. Try again later.",
}


def error_response(status: int, code: str, message: str, **extra) -> JsonResponse:
    return JsonResponse({"error": {"code": code, "message": message, **extra}}, status=status)


class ApiJsonErrorsMiddleware:
    """Every error answer on an /api/ path is JSON: an HTML or empty one (Django's own 404, 405 and
    500) is replaced by the API's shape, with its status and a code named for it."""

    def __init__(self, get_response):
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        response = self.get_response(request)
        if (response.status_code < 400 or not request.path_info.startswith(API_PREFIX)
                or response.get("Content-Type", "").startswith("application/json")):
            return response
        return json_error_for(request, response)


def json_error_for(request: HttpRequest, response: HttpResponse) -> JsonResponse:
    try:
        status = HTTPStatus(response.status_code)
    except ValueError:  # a status outside the standard's list
        return error_response(response.status_code, "error", f"The request failed ({response.status_code}).")
    if status == HTTPStatus.METHOD_NOT_ALLOWED:
        allowed = response.get("Allow", "")
        answer = error_response(status, "method_not_allowed", f"{request.method} is not allowed here; use {allowed}.")
        answer["Allow"] = allowed
        return answer
    code = status.phrase.lower().replace(" ", "_").replace("-", "_")
    return error_response(status, code, GENERIC_MESSAGES.get(status, f"{status.phrase}."))
