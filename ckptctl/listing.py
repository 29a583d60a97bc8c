"""What `ckptctl --help` lists without building a command: every top-level command, the modules that make it,
and its one-line help; and the top-level group (`Listing`) that shows that list.

`ckptctl CMD ...` imports only CMD's modules and builds only CMD (`ckptctl.main`), so start-up pays for the
command that runs: no other command's module, request model or flags. The summary is the first sentence of
the command's help, all that click's one-line help (`make_default_short_help`) ever shows of it, so the
listing reads the same as the built commands' at any width (tests/test_startup.py checks both against the
commands the modules make).
"""

from __future__ import annotations

import copy
from typing import Any, NamedTuple

from typer.core import TyperCommand, TyperGroup


class Entry(NamedTuple):
    #: the `ckptctl` modules whose import makes the command (`checkpoints`: its group, and the commands
    #: `manage` adds to it)
    modules: tuple[str, ...]
    #: the first sentence of its help
    summary: str


OFFLINE = ("offline",)
SERVER = ("server_commands",)
MANAGE = ("manage",)
SERVING = ("serving",)

#: every top-level command, in the order the help lists them (typer's: the modules' commands, then their groups)
COMMANDS: dict[str, Entry] = {
    "inspect": Entry(OFFLINE, "Describe a checkpoint from its metadata alone (no tensor data is read, unless "
                              "stats)."),
    "convert": Entry(OFFLINE, "Convert a checkpoint to one safetensors/torch output (model and optimizer, keys as "
                              "they are)."),
    "export": Entry(OFFLINE, "Export model weights to HF-style sharded safetensors for serving (clean keys, never "
                             "optimizer state)."),
    "reshard": Entry(OFFLINE, "Write a DCP checkpoint laid out for WORLD_SIZE ranks (FSDP2 loads it with "
                              "dcp.load)."),
    "import": Entry(OFFLINE, "Write a Hugging Face model folder as a Megatron-LM torch_dist save (release/), which "
                             "megatron-core's dist_checkpointing.load reads at any TP/PP/EP, to start a Megatron run "
                             "from it; or (into dcp, `--to dcp`) as a DCP folder under the names a FSDP2-wrapped "
                             "transformers model's state_dict has, to start an FSDP2 run."),
    "verify": Entry(OFFLINE, "Compare two checkpoints tensor by tensor (exact unless --atol/--rtol); exit 1 when "
                             "they differ."),
    "scrub": Entry(OFFLINE, "Re-read a stored output and compare it with the CRC-32s its manifest and certificate "
                            "recorded; exit 1 naming each damaged file and byte range."),
    "scan": Entry(OFFLINE, "Read every tensor once for its statistics (NaN, +Inf, -Inf and zero counts, min, max, "
                           "mean, std, L2 norm); exit 1 when a tensor holds NaN or Inf."),
    "diff": Entry(OFFLINE, "Compare two checkpoints of any formats tensor by tensor: identical or not, max |a-b|, "
                           "relative L2 change, by layer; exit 1 when they differ beyond --rtol/--atol."),
    "sample": Entry(OFFLINE, "Train a small model one step with real FSDP on CPU (gloo) and save its checkpoint."),
    "archive": Entry(OFFLINE, "Keep a checkpoint in an archive store: content-addressed chunks, stored once across "
                              "every checkpoint there and losslessly compressed; restore gives it back byte for "
                              "byte."),
    "restore": Entry(OFFLINE, "Write an archived checkpoint back, byte for byte, every chunk's hash checked."),
    "archives": Entry(OFFLINE, "The checkpoints an archive store holds: id, source, files, logical and stored "
                               "bytes."),
    "archive-gc": Entry(OFFLINE, "Delete the chunks no archived checkpoint uses (safe while archives run: it then "
                                 "deletes nothing)."),
    "jobs": Entry(SERVER, "List jobs on the server, newest first."),
    "status": Entry(SERVER, "Show a job; with --follow, wait for it to end (exit 1 unless it succeeds)."),
    "cancel": Entry(SERVER, "Cancel a job: a queued one never starts, a running one is stopped and its partial "
                            "output removed."),
    "aliases": Entry(MANAGE, "List aliases (or one alias's history)."),
    "gc": Entry(MANAGE, "Delete what the retention policies allow (admin), after printing the plan; --dry-run "
                        "prints only."),
    "deletions": Entry(MANAGE, "The deletion log: what GC deleted, by which policy, who ran it, when, and how many "
                               "bytes."),
    "notify": Entry(MANAGE, "Tell the server a checkpoint finished writing (it registers it and fires matching "
                            "rules)."),
    "serve": Entry(SERVING, "Run the REST API and a pool of job slots (jobs in their own processes), with the job "
                            "store under the data dir."),
    "worker": Entry(SERVING, "Run job slots alone against the same store as a `ckptctl serve` (scale workers apart "
                             "from the API)."),
    "submit": Entry(SERVER, "Queue a job on a ckpt-service server, with the offline command's flags."),
    "checkpoints": Entry((*SERVER, *MANAGE), "The checkpoint registry on the server."),
    "runs": Entry(MANAGE, "Training runs and their steps."),
    "policies": Entry(MANAGE, "Retention policies (adding and removing them takes an admin token)."),
    "rules": Entry(MANAGE, "Rules that convert new checkpoints as they land."),
    "token": Entry(SERVING, "Make API tokens."),
    "store": Entry(SERVING, "Check, back up and restore the job store (SQLite under the data dir)."),
}


class Listing(TyperGroup):
    """The top-level group: its help lists every command in `COMMANDS`, those this process did not build by
    their summary (typer's own layout, each row as click shortens the help of a built command)."""

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        shown = copy.copy(self)
        shown.commands = {name: self.commands.get(name) or TyperCommand(name=name, help=entry.summary)
                          for name, entry in COMMANDS.items()} | dict(self.commands)
        TyperGroup.format_commands(shown, ctx, formatter)
