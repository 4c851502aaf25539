"""One JSON object per log line (production): easy to ship, no customer data by construction —
our log calls pass identifiers and figures as `extra`, never rows or messages from exceptions."""
import json
import logging
import time

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    converter = time.gmtime  # timestamps in UTC, marked Z

    def format(self, record: logging.LogRecord) -> str:
        data = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        data.update({k: v for k, v in vars(record).items() if k not in _STANDARD})
        if record.exc_info:
            data["exc_class"] = record.exc_info[0].__name__
        return json.dumps(data, default=str)
