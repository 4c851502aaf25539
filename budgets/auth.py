"""Authentication for the JSON API: a bearer token (`Authorization: Bearer fs_…`) or the session.

A token acts for its user in its one account only, while it is neither revoked nor expired and
its user is still active; `last_used_at` records each use."""
from dataclasses import dataclass

from django.middleware.csrf import CsrfViewMiddleware
from django.utils import timezone

from budgets.models import ApiToken, hash_token


class CsrfFailed(Exception):
    """A session request that changes state arrived without a valid CSRF token."""


class _CsrfCheck(CsrfViewMiddleware):
    def _reject(self, request, reason):
        return reason


@dataclass(frozen=True)
class ApiCaller:
    user: object
    # The one account a token acts for; None for a session (the user's memberships decide).
    account_id: int | None = None


def _token_caller(raw: str) -> ApiCaller | None:
    token = ApiToken.objects.select_related("user").filter(key_hash=hash_token(raw)).first()
    if token is None or not token.is_usable or not token.user.is_active:
        return None
    ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
    return ApiCaller(token.user, token.account_id)


def api_caller(request) -> ApiCaller | None:
    """Who a request acts as, or None. Session requests that change state need CSRF
    (raises CsrfFailed without it)."""
    header = request.headers.get("Authorization", "")
    if header[:7].lower() == "bearer ":
        return _token_caller(header[7:].strip())
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return None
    if request.method not in ("GET", "HEAD", "OPTIONS"):
        # The API views are csrf_exempt for token clients; a browser session still needs the token.
        reason = _CsrfCheck(lambda r: None).process_view(request, None, (), {})
        if reason is not None:
            raise CsrfFailed(reason)
    return ApiCaller(user)

