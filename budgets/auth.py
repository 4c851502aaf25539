"""Authentication for the JSON API: a bearer token (`Authorization: Bearer fs_…`) or the session."""
from django.middleware.csrf import CsrfViewMiddleware
from django.utils import timezone

from budgets.models import ApiToken, hash_token


class CsrfFailed(Exception):
    """A session request that changes state arrived without a valid CSRF token."""


class _CsrfCheck(CsrfViewMiddleware):
    def _reject(self, request, reason):
        return reason


def api_user(request):
    """The user a request acts as, or None. Session requests that change state need CSRF
    (raises CsrfFailed without it)."""
    header = request.headers.get("Authorization", "")
    if header.startswith("Bearer "):
        token = ApiToken.objects.select_related("user").filter(key_hash=hash_token(header[7:].strip())).first()
        if token is None or not token.user.is_active:
            return None
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=timezone.now())
        return token.user
    user = getattr(request, "user", None)
    if user is None or not user.is_authenticated:
        return None
    if request.method not in ("GET", "HEAD", "OPTIONS"):
        # The API views are csrf_exempt for token clients; a browser session still needs the token.
        reason = _CsrfCheck(lambda r: None).process_view(request, None, (), {})
        if reason is not None:
            raise CsrfFailed(reason)
    return user
