"""Reader for an Accelerate checkpoint folder (`checkpoint-N/`) holding `pytorch_model_fsdp_0/` and,
optionally, `optimizer_0/`: one index over both DCP folders (their keys are already `model.` /
`optimizer.`-prefixed, so they never collide)."""

from __future__ import annotations

from .. import storage
from ..errors import FormatError
from ..index import CheckpointIndex
from .base import BaseReader
from .dcp import DcpReader, dcp_subfolders


class AccelerateReader(BaseReader):
    format = "accelerate"

    @classmethod
    def sniff_folder(cls, uri: str, names: list[str]) -> bool:
        return len([n for n in dcp_subfolders(uri, names) if n.startswith("pytorch_model_fsdp_")]) == 1

    def read(self, locate: bool = True) -> CheckpointIndex:
        names = storage.listdir(self.uri)
        model = next((n for n in names if n.startswith("pytorch_model_fsdp_")), None)
        if model is None:
            raise FormatError(f"{self.uri}: no pytorch_model_fsdp_N folder, so this is not an Accelerate checkpoint",
                              uri=self.uri)
        index = DcpReader(storage.join(self.uri, model), self.reader).read(locate)
        index.uri, index.format, index.producer = self.uri, self.format, "Accelerate"
        index.files = [f"{model}/{f}" for f in index.files]
        optim = f"optimizer_{model.rsplit('_', 1)[-1]}"
        if optim in names and storage.exists(storage.join(self.uri, optim, ".metadata")):
            opt = DcpReader(storage.join(self.uri, optim), self.reader).read(locate)
            both = sorted(set(index.names()) & set(opt.names()))
            if both:
                raise FormatError(f"{self.uri}: entry {both[0]!r} is both in {model}/ and in {optim}/; the "
                                  "checkpoint is damaged", uri=self.uri, key=both[0])
            index.tensors.update(opt.tensors)
            index.objects.update(opt.objects)
            index.files += [f"{optim}/{f}" for f in opt.files]
        index.notes.append(f"read {model}/" + (f" and {optim}/" if optim in names else ""))
        return index
