"""Storage, as one name for the modules that do its jobs (callers write `storage.exists(...)`; the service
reaches storage only through this public module):

- `uris`: locations as text (is_local, local_path, join, basename, parent);
- `confinement`: what this process may read (the engine config's read roots), metadata file names
  (`member`), opening local files safely, the metadata cap;
- `remote`: the fsspec filesystem of a URI and its errors in plain words, told apart by exception type;
- `files`: exists / isdir / listdir / size, capped whole-file reads, listings cached while a source is read;
- `rangeread`: `RangeReader`, byte ranges with their pools and caches;
- `targets`: whether a target may be written, the one completeness check, source/target side of OSErrors.
"""

from __future__ import annotations

from .confinement import check_roots, max_metadata_bytes, member, open_file, read_roots
from .files import exists, isdir, lexists, listdir, read_all, size, static_source
from .rangeread import INDEX_PARALLEL, MIN_REQUEST, READ_CHUNK, REMOTE_PARALLEL, RangeReader
from .remote import filesystem, remote_call, translate_errors
from .targets import check_complete, check_target, io_errors, is_incomplete, names_source, with_io_errors
from .uris import basename, is_local, join, local_path, parent

__all__ = ["INDEX_PARALLEL", "MIN_REQUEST", "READ_CHUNK", "REMOTE_PARALLEL", "RangeReader", "basename",
           "check_complete", "check_roots", "check_target", "exists", "filesystem", "io_errors", "is_incomplete",
           "is_local", "isdir", "join", "lexists", "listdir", "local_path", "max_metadata_bytes", "member",
           "names_source", "open_file", "parent", "read_all", "read_roots", "remote_call", "size", "static_source",
           "translate_errors", "with_io_errors"]
