"""The Ray executor on a real local two-node Ray cluster: outputs byte-identical to the local executor for
export, convert and reshard (with and without --dtype), tasks on both nodes, a retry after a node dies
mid-run, and cancel. Checkpoints are made here with dcp.save / torch.save."""

from __future__ import annotations

import os
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from converters import ConvertOptions, ReshardOptions, convert, reshard
from converters.config import EngineConfig
from converters.output import MANIFEST
from converters.plan import Execution
from converters.transforms import KeyOptions

from .conftest import ckptctl
from .test_s3 import pin_ids

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.slow
NODE_MEMORY = 100 * 1000 * 1000
RAY = Execution("ray")
SMALL_TASKS = EngineConfig(ray_part_bytes=1)  # one output file per task


@pytest.fixture(scope="session")
def cluster():
    from ray.cluster_utils import Cluster

    # a conversion task asks Ray for --memory-limit bytes of memory: give each node room for a few
    args = {"num_cpus": 2, "object_store_memory": NODE_MEMORY, "resources": {}, "memory": 2 * 1024**3}
    c = Cluster(initialize_head=True, head_node_args=args)
    c.add_node(**args)
    c.wait_for_nodes()
    ray.init(address=c.address, logging_level="WARNING", log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def _state(n: int, rows: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    model = {f"layers.{i}.weight": torch.randn(rows, 64, generator=gen) for i in range(n)}
    model["embed.weight"] = torch.randn(10, 64, generator=gen).to(torch.bfloat16)
    model["steps"] = torch.arange(7, dtype=torch.int64)
    optim = {"state": {name: {"exp_avg": torch.randn(t.shape, generator=gen), "step": torch.tensor(3.0)}
                       for name, t in model.items() if name.endswith("weight")},
             "param_groups": [{"lr": 0.01, "betas": (0.9, 0.95), "params": sorted(model)}]}
    return {"model": model, "optim": optim}


@pytest.fixture(scope="session")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    import torch.distributed.checkpoint as dcp

    root = tmp_path_factory.mktemp("ray-src")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(_state(6, 48), checkpoint_id=str(root / "dcp"))
        dcp.save({"model": _state(16, 4096)["model"]}, checkpoint_id=str(root / "big"))  # 16 MiB of weights
        dcp.save({"model": _state(24, 16384)["model"]}, checkpoint_id=str(root / "huge"))  # 96 MiB
    torch.save(_state(5, 40), root / "full.pt")
    return {"dcp": root / "dcp", "big": root / "big", "huge": root / "huge", "torch": root / "full.pt"}


@pytest.fixture(autouse=True)
def _pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    pin_ids(monkeypatch)  # random ids (DCP save_id, zip serialization_id) come from the driver's plan


def _files(root: Path) -> dict[str, bytes]:
    if root.is_file():
        return {"": root.read_bytes()}
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name != MANIFEST}  # it holds a date


def _same(local: Path, remote: Path) -> None:
    got, want = _files(remote), _files(local)
    assert list(got) == list(want)
    for name in want:
        assert got[name] == want[name], name
    assert not [p for p in remote.parent.iterdir() if ".tmp-" in p.name]


CONVERTS = {
    "export": dict(export=True, keys=KeyOptions(only="model", clean=True), max_shard_size=20_000),
    "export-bf16": dict(export=True, keys=KeyOptions(only="model", clean=True), max_shard_size=20_000,
                        dtype="bfloat16"),
    "convert-torch": dict(to="torch", keys=KeyOptions(only="all", clean=False)),
    "convert-torch-fp16": dict(to="torch", keys=KeyOptions(only="all", clean=False), dtype="float16"),
    "convert-safetensors": dict(keys=KeyOptions(only="all", clean=False), max_shard_size=30_000),
}


@pytest.mark.parametrize("source", ["dcp", "torch"])
@pytest.mark.parametrize("case", list(CONVERTS))
def test_convert_identical(cluster, sources, tmp_path: Path, case: str, source: str) -> None:
    target = "out.pt" if CONVERTS[case].get("to") == "torch" else "out"
    local = convert(str(sources[source]), str(tmp_path / "local" / target), ConvertOptions(**CONVERTS[case]))
    result = convert(str(sources[source]), str(tmp_path / "ray" / target),
                     ConvertOptions(**CONVERTS[case], execution=RAY))
    _same(tmp_path / "local" / target, tmp_path / "ray" / target)
    assert sorted(result.outputs) == sorted(local.outputs)
    assert all(part.node for part in result.parts) and not any(part.node for part in local.parts)
    if target == "out":  # the driver checked each file and wrote its CRC-32 into the manifest
        import json
        import zlib

        files = json.loads((tmp_path / "ray" / target / MANIFEST).read_text())["files"]
        for part in result.parts:
            assert files[part.name]["crc32"] == zlib.crc32((tmp_path / "ray" / target / part.name).read_bytes())


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
@pytest.mark.parametrize("source", ["dcp", "torch"])
def test_reshard_identical(cluster, sources, tmp_path: Path, source: str, dtype: str | None) -> None:
    def options(**kw: object) -> ReshardOptions:
        return ReshardOptions(world_size=3, keys=KeyOptions(only="all", clean=False), dtype=dtype, **kw)

    local = reshard(str(sources[source]), str(tmp_path / "local" / "out"), options())
    result = reshard(str(sources[source]), str(tmp_path / "ray" / "out"), options(execution=RAY))
    _same(tmp_path / "local" / "out", tmp_path / "ray" / "out")
    assert sorted(result.outputs) == sorted(local.outputs)
    assert [p.name for p in result.parts] == ["__0_0.distcp", "__1_0.distcp", "__2_0.distcp"]


def test_cli_export_ray_and_both_nodes(cluster, sources, tmp_path: Path, monkeypatch) -> None:
    """`ckptctl export --ray ADDRESS` from another process; small parts spread over both nodes."""
    monkeypatch.setenv("CKPT_RAY_PART_BYTES", "1")  # one output file per task
    ckptctl("export", sources["big"], tmp_path / "local", "--max-shard-size", "1MiB", "--quiet")
    ckptctl("export", sources["big"], tmp_path / "ray", "--max-shard-size", "1MiB", "--quiet", "--ray", cluster.address)
    _same(tmp_path / "local", tmp_path / "ray")
    result = convert(str(sources["big"]), str(tmp_path / "again"),
                     ConvertOptions(export=True, keys=KeyOptions(only="model", clean=True), max_shard_size=1 << 20,
                                    execution=RAY), config=SMALL_TASKS)
    assert len(result.parts) == 17
    assert {part.node for part in result.parts} == {n["NodeID"] for n in ray.nodes() if n["Alive"]}


def _pin_blockers(cluster) -> list:
    """Hold every CPU of the two session nodes, so that conversion tasks can only run on an extra node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=2)
    class Blocker:
        def ready(self) -> bool:
            return True

    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    blockers = [Blocker.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                for node in nodes]
    ray.get([b.ready.remote() for b in blockers])
    return blockers


def test_retry_after_node_dies(cluster, sources, tmp_path: Path) -> None:
    options = dict(export=True, keys=KeyOptions(only="model", clean=True), max_shard_size=1 << 20)
    convert(str(sources["big"]), str(tmp_path / "local"), ConvertOptions(**options))
    base = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    blockers = _pin_blockers(cluster)
    extra = cluster.add_node(num_cpus=1, object_store_memory=NODE_MEMORY, memory=2 * 1024**3)
    cluster.wait_for_nodes()
    killed: list[str] = []

    def kill_when_writing() -> None:
        """Tasks can only run on the extra node: once the first output file appears, kill that node (its
        raylet and workers, mid-task) and free the CPUs of the others."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if any(p.is_dir() and any(p.iterdir()) for p in tmp_path.glob(".ray.tmp-*")):
                cluster.remove_node(extra, allow_graceful=False)
                killed.extend(p.name for p in next(tmp_path.glob(".ray.tmp-*")).iterdir())
                break
            time.sleep(0.001)
        for blocker in blockers:
            ray.kill(blocker)

    watcher = threading.Thread(target=kill_when_writing)
    watcher.start()
    result = convert(str(sources["big"]), str(tmp_path / "ray"), ConvertOptions(**options, execution=RAY),
                     config=SMALL_TASKS)
    watcher.join()
    assert 0 < len(killed) < len(result.parts)  # killed mid-run
    _same(tmp_path / "local", tmp_path / "ray")
    assert not extra.any_processes_alive()
    nodes = {part.node for part in result.parts}
    assert nodes & base and nodes <= base | {extra.node_id}  # the rest ran (again) on the surviving nodes


class Cancelled(Exception):
    pass


def test_cancel_leaves_nothing(cluster, sources, tmp_path: Path) -> None:
    calls: list[int] = []

    def on_progress(progress) -> None:
        calls.append(progress.done_bytes)
        raise Cancelled

    started = time.monotonic()
    with pytest.raises(Cancelled):  # casting through 1 MiB of memory: seconds of work
        convert(str(sources["huge"]), str(tmp_path / "out"),
                ConvertOptions(export=True, keys=KeyOptions(only="model", clean=True), max_shard_size=1 << 20,
                               dtype="bfloat16", memory_limit=1 << 20, execution=RAY), on_progress,
                config=SMALL_TASKS)
    assert calls and calls[0] < 24 * 16384 * 64 * 4  # cancelled before all source bytes were read
    assert list(tmp_path.iterdir()) == []  # no target, no temporary sibling, no late write from a task
    time.sleep(1.0)
    assert list(tmp_path.iterdir()) == []
    assert time.monotonic() - started < 60


def test_failed_task_fails_the_job_by_name_and_leaves_nothing(cluster, sources, tmp_path: Path) -> None:
    """The source shrinks after the driver planned (another job rewrote it): the task that reads it fails with
    the file's name, is not retried (not an I/O fault), and the temporary target is removed."""
    import shutil

    from converters import storage
    from converters.copier import Copier
    from converters.errors import SourceError
    from converters.formats import load_index
    from converters.output import open_output
    from converters.plan import execute
    from converters.transforms import apply
    from converters.writers.safetensors import plan_safetensors

    src = tmp_path / "src"
    shutil.copytree(sources["dcp"], src)
    reader = storage.RangeReader()
    view = apply(load_index(str(src), reader=reader), KeyOptions(only="model", clean=True), reader).index
    copier = Copier(reader)
    with pytest.raises(SourceError, match=r"__0_0\.distcp: file is shorter"), \
            open_output(str(tmp_path / "out"), False, "safetensors") as out:
        plan = plan_safetensors(view, out, copier, cast_to=None, max_shard_size=20_000)
        os.truncate(src / "__0_0.distcp", 1000)
        execute(plan, out, copier, RAY)
    reader.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_service_job_runs_on_ray(cluster, sources, tmp_path: Path) -> None:
    """The service with CKPT_EXECUTOR=ray: a job's export is written by tasks on both nodes, its progress adds
    up, and the output equals the local executor's."""
    from .service_harness import Tokens, job_spec, make_server

    convert(str(sources["big"]), str(tmp_path / "local"),
            ConvertOptions(export=True, keys=KeyOptions(only="model", clean=True), max_shard_size=1 << 20))
    tokens = Tokens.make()
    server = make_server(tmp_path / "data", read_roots=[sources["big"].parent], write_roots=[tmp_path],
                         tokens=tokens.entries, extra_env={"CKPT_EXECUTOR": "ray", "CKPT_RAY_ADDRESS": cluster.address,
                                                           "CKPT_RAY_PART_BYTES": "1"}).start()
    try:
        with server.client(tokens.write) as client:
            job = client.submit(job_spec("export", sources["big"], tmp_path / "ray", max_shard_size="1MiB"))
            final = client.wait(job["id"], lambda event, data: None, timeout=120)
    finally:
        server.stop()
    assert final["state"] == "succeeded", final["error"]
    progress = final["progress"]
    assert progress["done_bytes"] == progress["total_bytes"] == 16 * 4096 * 64 * 4 + 10 * 64 * 2 + 7 * 8
    _same(tmp_path / "local", tmp_path / "ray")
    import json

    files = json.loads((tmp_path / "ray" / MANIFEST).read_text())["files"]  # CRC-32s that Ray tasks returned
    local = json.loads((tmp_path / "local" / MANIFEST).read_text())["files"]
    shards = [f for name, f in files.items() if name.endswith(".safetensors")]
    assert len(shards) == 17 and all("crc32" in f for f in shards)
    # local outputs record CRC-32s too (their certificate), read back through the page cache: the same values
    assert all(local[name]["crc32"] == f["crc32"] for name, f in files.items())
