"""Two exports in a row: the adapter merged into its base, then that model as GGUF or FP8 (`export
--merge-adapter --gguf TYPE`, `--merge-adapter --quantize SCHEME`).

The merged model is written to a staging folder beside the target (same filesystem or bucket, named like every
temporary output, `.NAME.ckpt-tmp-…`), the second export reads it, and the staging folder is removed whatever
happens; the target appears only when the second export commits it.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from . import storage
from .names import tmp_prefix
from .output import remove_output

Result = TypeVar("Result")


def staging_beside(target: str) -> tuple[str, str]:
    """A fresh temporary folder next to `target`, and the merged model's folder in it, named as the target
    without its suffix (what a model's folder name becomes in the second output, e.g. GGUF's general.name)."""
    name = storage.basename(target) or "output"
    root = storage.join(storage.parent(target), f"{tmp_prefix(name)}merged-{uuid.uuid4().hex[:8]}")
    return root, storage.join(root, name.rsplit(".", 1)[0] if "." in name.strip(".") else name)


def through_merged(merge: Callable[[str], Any], then: Callable[[str], Result], target: str) -> Result:
    """`merge(staging)` writes the merged model, `then(staging)` exports it to `target`; the merge's report
    lines lead the result's."""
    root, staging = staging_beside(target)
    try:
        merged = merge(staging)
        result = then(staging)
    finally:
        remove_output(root)
    report = getattr(result, "report", None)
    if isinstance(report, list):
        report[:0] = [f"merged the adapter first ({len(merged.outputs)} file(s), staged beside the target)"]
    return result
