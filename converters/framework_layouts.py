"""The folder layout a framework resumes from, kept by `reshard` so that the framework's own resume call works on
the output unchanged at the new world size (`--output-layout auto`, the default):

- **accelerate** (the Hugging Face `Trainer`'s `checkpoint-N/`, `Accelerator.save_state`): `pytorch_model_fsdp_K/`
  and `optimizer_K/` are each a DCP folder, resharded; every other file at the top (`scheduler.pt`,
  `trainer_state.json`, ...) is copied byte for byte. Per-rank RNG states (`rng_state_R.pth` from the Trainer,
  `random_states_R.pkl` from Accelerate): new rank r gets old rank r mod old_world_size's file, so every rank
  restores a generator state the run really had (ranks past the old world size repeat the streams of the
  first ones). The manifest's `layout.per_rank` records which file each one came from.
- **lightning** (a sharded FSDP checkpoint): the DCP folder (model and optimizer) resharded at the top, and
  `meta.pt` (step, loops, callbacks) copied byte for byte beside it, never unpickled.
- **megatron** (a torch_dist dist checkpoint, or a Megatron-LM save folder around one): the `iter_NNNNNNN/`
  folder's DCP resharded (names and layer-stacked tensors as stored), its `metadata.json`, `common.pt` and other
  files copied byte for byte, and `latest_checkpointed_iteration.txt` beside it; Megatron's
  `dist_checkpointing.load` reshards that to its own parallelism. NeMo 2 folders (`weights/` + `context/`) are
  refused.
- **deepspeed**: refused; its tag folders hold ZeRO partitions per data-parallel rank that we do not write at a
  new size. `--output-layout flat` writes one DCP folder (FSDP2's `dcp.load` reads it at any size).
- Anything else, and `--output-layout flat`: one DCP folder, which is the layout DCP-based trainers load.

Side files are read through the confined opener with a size cap and written inside the atomic output.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from . import storage
from .errors import FormatError, OptionError
from .formats.dcp import DcpReader, dcp_subfolders
from .index import CheckpointIndex
from .names import MANIFEST

OUTPUT_LAYOUTS = ("auto", "flat")
SIDE_FILE_CAP = 64 * 1024 * 1024  # a trainer_state.json with a long log history is a few MB
#: per-rank files of an Accelerate folder: the Trainer's RNG states, Accelerate's save_state RNG states
PER_RANK = ("rng_state_{}.pth", "random_states_{}.pkl")
DEEPSPEED = ("DeepSpeed tag folders (global_stepN/ with `latest`) hold ZeRO partitions per data-parallel rank, which "
             "DeepSpeed cannot load at a new size from a reshard")


@dataclass
class FrameworkLayout:
    """What one output holds: DCP folders (output sub-folder -> the entries it holds; '' is the output itself)
    and files copied from the source (output name -> source name)."""

    framework: str
    folders: dict[str, list[str]]
    copies: dict[str, str] = field(default_factory=dict)
    per_rank: dict[str, str] = field(default_factory=dict)  # of `copies`: the per-rank files, for the record

    def about(self) -> dict:
        """The manifest's `layout` record."""
        return {"framework": self.framework, "dcp_folders": sorted(self.folders), "copied": sorted(self.copies),
                "per_rank": dict(sorted(self.per_rank.items())),
                "per_rank_rule": "new rank r takes old rank r mod old world size's file"}

    def report(self) -> list[str]:
        lines = [f"kept the {self.framework} layout: DCP folders " + ", ".join(f"{f or '.'}/" for f in self.folders)
                 + (f"; copied {', '.join(sorted(set(self.copies) - set(self.per_rank)))}" if self.copies else "")]
        if self.per_rank:
            lines.append("per-rank files: " + ", ".join(f"{new} <- {old}" for new, old in
                                                          sorted(self.per_rank.items())))
        return lines


def flat(view: CheckpointIndex) -> FrameworkLayout:
    return FrameworkLayout("dcp", {"": list(view.names())})


def framework_layout(index: CheckpointIndex, view: CheckpointIndex, world_size: int, choice: str,
                     reader: storage.RangeReader) -> FrameworkLayout:
    """The layout to write `view` (selected from `index`) in, or one line saying why the source's cannot be kept."""
    if choice not in OUTPUT_LAYOUTS:
        raise OptionError(f"output_layout {choice}: choose {' or '.join(OUTPUT_LAYOUTS)}", option="output_layout")
    if choice == "flat":
        return flat(view)
    if index.format == "deepspeed":
        raise OptionError(f"{index.uri}: {DEEPSPEED}; pass `output_layout` flat for one DCP folder (FSDP2 loads it "
                          "with dcp.load at any world size)")
    build = {"accelerate": _accelerate, "lightning": _lightning, "megatron": _megatron}.get(index.format)
    if build is None:
        return flat(view)
    if sorted(view.names()) != sorted(index.names()):
        raise OptionError(f"{index.uri}: the {index.format} layout resumes only from the whole training state "
                          "under its stored names; drop `only`/`include`/`exclude`/`rename`/`clean_keys`, or pass "
                          "`output_layout` flat for one DCP folder of the selection")
    return build(index, world_size, reader)


def _lightning(index: CheckpointIndex, world_size: int, reader: storage.RangeReader) -> FrameworkLayout:
    from .formats.lightning import META

    side_file_size(index.uri, META)
    return FrameworkLayout("lightning", {"": [n for n in index.names() if n not in index.training_state]},
                           {META: META})


def _megatron(index: CheckpointIndex, world_size: int, reader: storage.RangeReader) -> FrameworkLayout:
    from .formats.dcp import METADATA
    from .formats.megatron import LATEST, locate

    folder, context, _ = locate(index.uri)
    if context is not None:
        raise OptionError(f"{index.uri}: a NeMo 2 checkpoint (weights/ + context/): its layout is not kept by a "
                          "reshard; pass `output_layout` flat for one DCP folder")
    sub = folder[len(index.uri):].strip("/")
    files = [n for n in storage.listdir(folder) if n not in (METADATA, MANIFEST) and not n.endswith(".distcp")
             and not storage.isdir(storage.join(folder, n))]
    inside = [f"{sub}/{n}" if sub else n for n in files]
    layout = FrameworkLayout("megatron", {sub: [n for n in index.names() if n not in index.training_state]},
                             {n: n for n in inside + ([LATEST] if sub else [])})
    for name in layout.copies:
        side_file_size(index.uri, name)
    return layout


def _accelerate(index: CheckpointIndex, world_size: int, reader: storage.RangeReader) -> FrameworkLayout:
    names = storage.listdir(index.uri)
    folders = {sub: DcpReader(storage.join(index.uri, sub), reader).read(locate=False).names()
               for sub in dcp_subfolders(index.uri, names)}
    held = {name for entries in folders.values() for name in entries}
    if held != set(index.names()):
        odd = sorted(held ^ set(index.names()))[0]
        raise FormatError(f"{index.uri}: entry {odd!r} is not in exactly one of {', '.join(folders)}; the checkpoint "
                          "changed while it was read or is damaged", uri=index.uri, key=odd)
    layout = FrameworkLayout("accelerate", folders)
    files = [n for n in names if n != MANIFEST and n not in folders and not storage.isdir(storage.join(index.uri, n))]
    rank_files: set[str] = set()
    for template in PER_RANK:
        pattern = re.compile(re.escape(template).replace(r"\{\}", r"(\d{1,6})"))
        ranks = {int(m.group(1)): n for n in files if (m := pattern.fullmatch(n))}
        if not ranks and template == PER_RANK[0] and "rng_state.pth" in files and world_size > 1:
            ranks = {0: "rng_state.pth"}  # a one-rank Trainer run's (also copied as it is)
        if ranks and sorted(ranks) != list(range(len(ranks))):
            raise FormatError(f"{index.uri}: per-rank files {', '.join(sorted(ranks.values()))} do not number the "
                              "ranks 0..N-1; the checkpoint is incomplete", uri=index.uri)
        layout.per_rank.update({template.format(r): ranks[r % len(ranks)] for r in range(world_size) if ranks})
        rank_files.update(n for n in ranks.values() if n != "rng_state.pth")
    layout.copies = {n: n for n in files if n not in rank_files} | layout.per_rank
    for name in set(layout.copies.values()):
        side_file_size(index.uri, name)
    return layout


def side_file_size(source: str, name: str) -> int:
    """The size of a file beside the checkpoint's tensors, refused past the cap (before anything is written)."""
    path = storage.member(source, name, source)
    size = storage.size(path)
    if size > SIDE_FILE_CAP:
        raise FormatError(f"{path}: {size} bytes, more than the {SIDE_FILE_CAP >> 20} MiB a side file of a "
                          "framework layout may have; pass `output_layout` flat to write the tensors alone",
                          uri=path)
    return size


def read_side_file(source: str, name: str) -> bytes:
    """A file beside the checkpoint's tensors, as bytes (confined, regular files only, capped)."""
    side_file_size(source, name)
    return storage.read_all(storage.member(source, name, source), SIDE_FILE_CAP)
