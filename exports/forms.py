"""Parsing of export requests, shared by the JSON API and the `request_export` command.

Forms parse types; the scope rules (membership, range, limits) live in `exports.requests.export_request`.
"""
import datetime as dt

from django import forms


class IsoDateField(forms.DateField):
    """A YYYY-MM-DD string. JSON numbers, lists or objects are invalid input, not a crash."""

    def to_python(self, value):
        if value not in self.empty_values and not isinstance(value, (str, dt.date)):
            raise forms.ValidationError(self.error_messages["invalid"], code="invalid")
        return super().to_python(value)


class ExportRequestForm(forms.Form):
    start = IsoDateField(input_formats=["%Y-%m-%d"], error_messages={"invalid": "Use a date as YYYY-MM-DD."})
    end = IsoDateField(input_formats=["%Y-%m-%d"], error_messages={"invalid": "Use a date as YYYY-MM-DD."})
    format = forms.CharField(required=False, max_length=10)
    source = forms.CharField(required=False, max_length=40)
    idempotency_key = forms.CharField(required=False, max_length=200)

    def clean_format(self) -> str:
        return self.cleaned_data["format"] or "csv"

    def clean_source(self) -> str:
        return self.cleaned_data["source"] or "activity"

    def error_text(self) -> str:
        return "; ".join(f"{field}: {' '.join(errors)}" for field, errors in self.errors.items())
