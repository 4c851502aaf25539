"""What redaction costs: `redact()` per message and the logging filter per log line.

Every stored error goes through `scheduling.redaction.redact`, and every log line through
`RedactingFilter` (on every handler). This measures both in this process (no database, no
workers): microseconds per call for typical and worst-case inputs, median of `--repeat` rounds.

    python bench/redaction.py [--repeat 5] [--calls 2000]

Prints a table and writes bench/results/redaction.json.
"""
from __future__ import annotations

import argparse
import io
import logging
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import harness as h  # noqa: E402
from scheduling.redaction import RedactingFilter, redact  # noqa: E402

MESSAGES = {
    "short error (80 B)": "could not connect to postgres://app:pw-1234@db.internal:5432/prod: timeout",
    "S3 error (250 B)": ("An error occurred (InvalidAccessKeyId) when calling the PutObject operation: The AWS "
                         "Access Key Id AKIAIOSFODNN7EXAMPLE you provided does not exist in our records "
                         "(endpoint https://exports:s3cr3t@s3.internal; caller fs_PlantedToken1234567890ab)"),
    "traceback (3 KB)": "Traceback (most recent call last):\n" + '  File "/app/x.py", line 10, in f\n    g()\n' * 60
                        + "ValueError: card 4111111111111111 for bob@example.com",
    "dump (100 KB, cut)": "row 4111111111111111 bob@example.com " * 2800,
}
# The line every run logs as it ends (scheduling.middleware): identifiers and figures, nothing that
# looks like a secret - `redact` returns such texts at the cost of one search.
RUN_EXTRA = {"job": "scheduling.noop", "task_run": 123456, "outcome": "succeeded", "cpu_ms": 3, "wall_ms": 4}


def _cases() -> dict[str, tuple[str, object]]:
    """Per row: the text `redact` is timed on, and the log call that carries it."""
    run_line = ("task finished", lambda logger: logger.info("task finished", extra=RUN_EXTRA))
    return {"a run's line (task finished)": run_line,
            **{name: (text, lambda logger, text=text: logger.error("upstream failed: %s", text))
               for name, text in MESSAGES.items()}}


def _per_call_us(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def _log_line_us(emit, calls: int, *, redacting: bool) -> float:
    """One log line, `emit(logger)`, through a text handler (with the filter, or without)."""
    logger = logging.Logger("bench.redaction")
    handler = logging.StreamHandler(io.StringIO())
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    if redacting:
        handler.addFilter(RedactingFilter())
    logger.addHandler(handler)
    return _per_call_us(lambda: emit(logger), calls)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    rows, results = [], {}
    for name, (text, emit) in _cases().items():
        calls = max(50, args.calls // (20 if len(text) > 10_000 else 1))
        redact_us = h.median([_per_call_us(lambda text=text: redact(text), calls) for _ in range(args.repeat)])
        plain_us = h.median([_log_line_us(emit, calls, redacting=False) for _ in range(args.repeat)])
        filtered_us = h.median([_log_line_us(emit, calls, redacting=True) for _ in range(args.repeat)])
        results[name] = {"bytes": len(text), "redact_us": redact_us, "log_line_us": plain_us,
                         "log_line_redacted_us": filtered_us}
        rows.append([name, h.fmt(redact_us, ".1f"), h.fmt(plain_us, ".1f"), h.fmt(filtered_us, ".1f")])
    print(h.render_table(["message", "redact() µs", "log line µs", "log line + filter µs"], rows, right=[1, 2, 3]))
    h.write_results(h.RESULTS_DIR / "redaction.json", {
        "benchmark": "redaction", "at": h.utc_timestamp(), "repeat": args.repeat, "calls": args.calls,
        "python": platform.python_version(), "results": results,
    })


if __name__ == "__main__":
    main()
