"""E-mail to files, on either Django line: a test or a benchmark points this process's notices at a
folder to count them (its workers get EMAIL_BACKEND and EMAIL_FILE_PATH in their environment)."""
from pathlib import Path

FILE_BACKEND = "django.core.mail.backends.filebased.EmailBackend"


def mail_to_folder(settings, folder: Path | str) -> None:
    """Send this process's e-mail as files into `folder`. `settings`: django.conf.settings, or
    pytest-django's `settings` fixture (which restores it after the test)."""
    if hasattr(settings, "MAILERS"):  # Django 6.1 (config/settings.py sets MAILERS there)
        settings.MAILERS = {"default": {"BACKEND": FILE_BACKEND, "OPTIONS": {"file_path": str(folder)}}}
    else:  # Django 5.2 LTS
        settings.EMAIL_BACKEND, settings.EMAIL_FILE_PATH = FILE_BACKEND, str(folder)
