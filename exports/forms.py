"""Parsing of export requests, shared by the JSON API and the `request_export` command.

Forms parse types and bounds; the scope rules (membership, range, limits) live in
`exports.requests.export_request`. The JSON body itself is read by `read_json_object`: JSON only,
bounded in size, nesting and number length, unknown fields refused by name.
"""
import datetime as dt
import json

from django import forms

from exports.sources import EARLIEST_DATE, LATEST_DATE

# A request body is a handful of short fields: anything near this is not a real client.
MAX_BODY_BYTES = 16 * 1024
# JSON numbers longer than this are refused before Python converts them (a 5,000-digit integer
# costs quadratic time, and Python refuses 4,300+ digits with an error of its own).
MAX_NUMBER_CHARS = 30


class BadBody(Exception):
    """The body is not an acceptable JSON object; `code` is stable for API clients."""

    def __init__(self, code: str, message: str, status: int = 400):
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


def _bounded(convert):
    def parse(text: str):
        if len(text) > MAX_NUMBER_CHARS:
            raise BadBody("malformed_json", f"JSON numbers may have at most {MAX_NUMBER_CHARS} characters.")
        return convert(text)
    return parse


def _no_constant(name: str):
    raise BadBody("malformed_json", f"{name} is not valid JSON.")


def read_json_object(*, content_type: str, body: bytes, allowed: set[str]) -> dict:
    """The request body as a dict of `allowed` fields, or BadBody (415 for a non-JSON content type)."""
    if content_type != "application/json":
        raise BadBody("unsupported_media_type", "Send the body as JSON with Content-Type: application/json.", 415)
    if len(body) > MAX_BODY_BYTES:
        raise BadBody("body_too_large", f"The body may have at most {MAX_BODY_BYTES} bytes.", 413)
    try:
        data = json.loads(body or b"{}", parse_int=_bounded(int), parse_float=_bounded(float),
                          parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
        raise BadBody("malformed_json", "The body must be a JSON object.") from None
    except RecursionError:  # nested deeper than the parser's stack allows: not a real request
        raise BadBody("malformed_json", "The body is nested too deeply.") from None
    if not isinstance(data, dict):
        raise BadBody("malformed_json", "The body must be a JSON object.")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise BadBody("unknown_fields", f"Unknown field(s): {', '.join(repr(k)[:40] for k in unknown[:5])}; "
                                        f"known: {', '.join(sorted(allowed))}.")
    return data


class IsoDateField(forms.DateField):
    """A YYYY-MM-DD string within [EARLIEST_DATE, LATEST_DATE]. JSON numbers, lists or objects are
    invalid input, not a crash; a date near the calendar's end cannot overflow the day arithmetic."""

    def to_python(self, value):
        if value not in self.empty_values and not isinstance(value, (str, dt.date)):
            raise forms.ValidationError(self.error_messages["invalid"], code="invalid")
        return super().to_python(value)

    def validate(self, value):
        super().validate(value)
        if value is not None and not EARLIEST_DATE <= value <= LATEST_DATE:
            raise forms.ValidationError(f"Use a date from {EARLIEST_DATE} to {LATEST_DATE}.", code="out_of_range")


class TextField(forms.CharField):
    """A JSON string: numbers, lists and objects are invalid input (not quietly stringified)."""

    def to_python(self, value):
        if value not in self.empty_values and not isinstance(value, str):
            raise forms.ValidationError("Use a string.", code="invalid")
        return super().to_python(value)


class ExportRequestForm(forms.Form):
    start = IsoDateField(input_formats=["%Y-%m-%d"], error_messages={"invalid": "Use a date as YYYY-MM-DD."})
    end = IsoDateField(input_formats=["%Y-%m-%d"], error_messages={"invalid": "Use a date as YYYY-MM-DD."})
    format = TextField(required=False, max_length=10)
    source = TextField(required=False, max_length=40)
    idempotency_key = forms.CharField(required=False, max_length=200)

    # What a JSON body may hold (the idempotency key travels in its header).
    BODY_FIELDS = {"start", "end", "format", "source"}

    def clean_format(self) -> str:
        return self.cleaned_data["format"] or "csv"

    def clean_source(self) -> str:
        return self.cleaned_data["source"] or "activity"

    def error_text(self) -> str:
        return "; ".join(f"{field}: {' '.join(errors)}" for field, errors in self.errors.items())
