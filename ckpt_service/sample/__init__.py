"""Real sharded sample checkpoints, made by training a tiny model under FSDP on CPU (gloo).

>>> make_sample("out/ckpt", layout="fsdp2-dcp", world_size=2, size="tiny", reference="out/ref.pt")

See :func:`make_sample` for the options and :data:`LAYOUTS` for the on-disk layouts.

The ranks are started with torch.multiprocessing's "spawn": a script that calls these functions must
guard its top level with ``if __name__ == "__main__":`` (pytest and ``python -c`` need nothing).
Set ``CKPT_SAMPLE_DEBUG=1`` to have every rank print its phases, seconds and memory.
"""

from .build import load_and_step, make_recorded_sample, make_sample, make_samples, recorded_options
from .model import SampleConfig, SampleModel, config_for_size
from .saved_layouts import ENGINE, LAYOUTS, expected_files

__all__ = [
    "ENGINE",
    "LAYOUTS",
    "SampleConfig",
    "SampleModel",
    "config_for_size",
    "expected_files",
    "load_and_step",
    "make_recorded_sample",
    "make_sample",
    "make_samples",
    "recorded_options",
]
