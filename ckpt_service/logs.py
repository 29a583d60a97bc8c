"""Structured logs: one JSON object per line on stderr (`ts`, `level`, `event`, then fields such as `job_id`)."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

logger = logging.getLogger("ckpt_service")
_RESERVED = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime", "fields",
                                                                          "color_message"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        line.update(getattr(record, "fields", {}))
        line.update({k: v for k, v in vars(record).items() if k not in _RESERVED and not k.startswith("_")})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def setup(level: str = "info") -> None:
    """Route every logger (uvicorn's included) through one JSON handler on stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


def event(name: str, level: int = logging.INFO, exc_info: bool = False, **fields: Any) -> None:
    """Log one event: `event("job.claimed", job_id=..., attempt=2)`."""
    logger.log(level, name, extra={"fields": fields}, exc_info=exc_info)
