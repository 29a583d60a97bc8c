"""Reader for Lightning Fabric / Trainer FSDP checkpoints saved with `state_dict_type="sharded"`: a DCP folder
plus `meta.pt`, the torch.save of everything that is not a module or an optimizer (step, loops, callbacks,
hyper-parameters). Those entries are carried as training state (`--only all`), never exported as weights.
A `state_dict_type="full"` checkpoint is one torch.save file, read by the `torch` reader.
"""

from __future__ import annotations

from .. import storage
from ..errors import FormatError
from ..index import CheckpointIndex
from ..torchzip import read_archive
from .dcp import METADATA, DcpReader
from .torchsave import add_entries

META = "meta.pt"


class LightningReader(DcpReader):
    format = "lightning"

    @classmethod
    def sniff_folder(cls, uri: str, names: list[str]) -> bool:
        return METADATA in names and META in names

    def read(self, locate: bool = True) -> CheckpointIndex:
        index = super().read(locate)
        index.format, index.producer = self.format, "Lightning (FSDP, sharded)"
        path = storage.join(self.uri, META)
        if not storage.exists(path):
            raise FormatError(f"{self.uri}: no {META}, so this is not a Lightning sharded checkpoint; "
                              "pass `source_format` dcp to read the DCP part alone", uri=self.uri)
        archive = read_archive(self.reader, path)
        if not isinstance(archive.obj, dict):
            raise FormatError(f"{path}: holds a {type(archive.obj).__name__}, not a dict", uri=path)
        added = add_entries(index, archive)
        index.training_state.update(added)
        index.files.append(META)
        return index

