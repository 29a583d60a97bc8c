"""One error tree under CkptError: every class picklable with its fields, one exit-code table, one HTTP table."""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys

import pytest

from ckpt_service import service_errors as se
from ckpt_service.service_errors import EXIT_CODES, exit_code
from converters import errors as ce
from converters.errors import CkptError

CLASSES = sorted({cls for module in (ce, se) for _, cls in inspect.getmembers(module, inspect.isclass)
                  if issubclass(cls, BaseException) and cls.__module__ == module.__name__}, key=lambda c: c.__name__)


def test_every_error_is_a_ckpt_error() -> None:
    assert {c.__name__ for c in CLASSES} >= {"ServiceError", "InvalidRequest", "Forbidden", "OutsideRoots",
                                             "SettingsError", "ClientError", "SampleJobError", "VerifyError"}
    assert [c.__name__ for c in CLASSES if not issubclass(c, CkptError)] == []
    from ckpt_service.sample.launch import SampleJobError
    from ckpt_service.settings import SettingsError

    assert SampleJobError is se.SampleJobError and SettingsError is se.SettingsError


def instance(cls: type[BaseException]) -> BaseException:
    if cls is se.ClientError:
        return cls(409, "conflict", "target exists")
    if cls in (se.InvalidRequest, se.OutsideRoots):
        return cls("options.x: bad", "options.x")
    if issubclass(cls, se.TooMany):
        return cls("slow down", 7)
    if cls is ce.VerifyError:
        return cls("1 differs", report={"differ": ["w"]}, uri="/a", key="w")
    return cls(f"{cls.__name__} message", uri="s3://b/k", key="layers.0.weight")


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_pickle_round_trip_keeps_type_message_and_fields(cls: type[BaseException]) -> None:
    exc = instance(cls)
    back = pickle.loads(pickle.dumps(exc))
    assert type(back) is cls and str(back) == str(exc) and back.args == exc.args
    assert vars(back) == vars(exc) and vars(exc)  # every class carries fields (uri, key at least)


def test_fields() -> None:
    assert (ce.FormatError("x", uri="/a/.metadata").uri, ce.TargetError("y", key="w").key) == ("/a/.metadata", "w")
    client = se.ClientError(0, "unreachable", "cannot reach")
    assert (str(client), str(se.ClientError(403, "forbidden", "no"))) == ("cannot reach", "no (HTTP 403)")


def test_exit_codes_in_one_table() -> None:
    assert [(cls, code) for cls, code in EXIT_CODES] == [(KeyboardInterrupt, 130), (CkptError, 2)]
    assert [exit_code(e) for e in (ce.VerifyError("d"), se.ClientError(0, "u", "m"), se.SampleJobError("s"),
                                   KeyboardInterrupt(), ValueError("bug"))] == [2, 2, 2, 130, 1]


def test_http_statuses_in_one_table() -> None:
    from api.http_errors import STATUS, status_for

    for i, (earlier, _, _) in enumerate(STATUS):  # subclasses before their bases, or they would never match
        later = [cls for cls, _, _ in STATUS[i + 1:] if issubclass(cls, earlier)]
        assert later == [], (earlier, later)
    assert [status_for(instance(c)) for c in (se.InvalidRequest, se.OutsideRoots, se.QueueFull, se.StoreDamaged,
                                              ce.TargetError, ce.UnsafePickleError)] == [
        (422, "invalid_request"), (403, "outside_storage_roots"), (429, "queue_full"), (503, "store_damaged"),
        (409, "target_error"), (422, "source_error")]
    assert status_for(ValueError()) == (500, "internal")


def test_the_cli_and_service_never_import_the_http_app() -> None:
    code = ("import sys, ckptctl, ckpt_service.service, ckpt_service.worker, ckpt_service.executor; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('api', 'fastapi', 'uvicorn')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout.strip()) == (0, "[]"), proc.stderr
