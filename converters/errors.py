"""One exception tree for the engine. Every message names the file or key and says what to do.

    CkptError
    ├── SourceError          the input is missing, unreadable or not what it claims to be
    │   ├── FormatError      no known layout, or the layout is damaged (bad metadata, truncated data)
    │   └── UnsafePickleError a pickle references a class outside the allow-list
    ├── TargetError          the output cannot be written (exists, disk full, bad name)
    ├── OptionError          a bad option or combination of options
    └── VerifyError          a verification found differences
"""

from __future__ import annotations


class CkptError(Exception):
    """Root of every error the engine raises on purpose."""


class SourceError(CkptError):
    """The input is missing or unreadable."""


class FormatError(SourceError):
    """The input is not a checkpoint of a known layout, or is damaged."""


class UnsafePickleError(FormatError):
    """A pickle asked for a class outside the allow-list; nothing was imported or run."""


class TargetError(CkptError):
    """The output cannot be written."""


class OptionError(CkptError):
    """A bad option or combination of options."""


class VerifyError(CkptError):
    """Two checkpoints differ."""
