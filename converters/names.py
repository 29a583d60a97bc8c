"""One home for the file names and name patterns the engine reads and writes (and the service looks for)."""

from __future__ import annotations

import re

#: HF index files: tensor name -> shard file
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_INDEX = "pytorch_model.bin.index.json"
#: written last into a finished remote output; lists every file with its size and crc32
MANIFEST = "ckpt-manifest.json"
#: written first into a remote output; present without MANIFEST = an upload that never finished
WRITING = ".ckpt-writing"
#: per-rank torch.save files: rank0.pt, model_rank_1.bin, optim_rank2.pth
RANK_FILE = re.compile(r"^(?P<stem>.*?)_?rank_?(?P<rank>\d+)\.(?:pt|pth|bin)$")
#: what a torch.save file may be called
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
#: a local output is written into a hidden sibling `.NAME.tmp-XXXXXXXX`, then renamed into place
TMP_INFIX = ".tmp-"


def tmp_prefix(name: str) -> str:
    """The start of the temporary sibling's name for an output called `name`."""
    return f".{name}{TMP_INFIX}"
