"""The sample model: a tiny transformer-like stack whose tensor shapes do not divide by 2, 3 or 4."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from converters.errors import OptionError

from .. import units

#: Named presets. Every dimension is odd and not a multiple of 3, so no tensor splits evenly at
#: world sizes 2, 3 or 4 (FSDP pads, DCP chunks have unequal sizes).
PRESETS: dict[str, tuple[int, int, int, int]] = {
    # name: (vocab, dim, hidden, layers)
    "tiny": (509, 41, 83, 2),  # ~59k params, ~240 KB fp32
    "small": (1003, 131, 259, 4),  # ~606k params, ~2.4 MB fp32
}



@dataclass(frozen=True)
class SampleConfig:
    vocab: int
    dim: int
    hidden: int
    layers: int
    tie_embeddings: bool = False

    def num_params(self) -> int:
        """Unique parameters (a tied embedding counts once)."""
        d, h = self.dim, self.hidden
        block = 2 * d + (d * d + d) + (d * h + h) + (h * d + d)
        emb = self.vocab * d
        return emb * (1 if self.tie_embeddings else 2) + self.layers * block + 2 * d


class Block(nn.Module):
    def __init__(self, cfg: SampleConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.dim)
        self.attn = nn.Linear(cfg.dim, cfg.dim)
        self.mlp_in = nn.Linear(cfg.dim, cfg.hidden)
        self.mlp_out = nn.Linear(cfg.hidden, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h) + self.mlp_out(F.gelu(self.mlp_in(h)))


class SampleModel(nn.Module):
    def __init__(self, cfg: SampleConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # A persistent buffer: it is in the state dict but not in the optimizer.
        self.register_buffer("pos_scale", torch.linspace(0.5, 1.5, cfg.dim), persistent=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens) * self.pos_scale
        for block in self.layers:
            x = block(x)
        return self.lm_head(self.norm(x))


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy over a [batch, seq] int64 token tensor.

    A free function, not a method: it must call the (possibly FSDP1-wrapped) module itself so that the
    wrapper's forward runs and unshards the parameters.
    """
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _awkward(n: int) -> int:
    """The nearest integer >= max(n, 5) that is odd and not a multiple of 3."""
    n = max(n, 5)
    while n % 2 == 0 or n % 3 == 0:
        n += 1
    return n


def parse_size(size: str) -> int | None:
    """Bytes for strings like ``"1GB"``, ``"500MB"``, ``"2GiB"`` (`units.parse_size`, a unit required); None if
    ``size`` is not one."""
    if not any(c.isalpha() for c in size):
        return None
    try:
        return units.parse_size(size)
    except OptionError:
        return None


def valid_sizes() -> str:
    return ", ".join(repr(k) for k in PRESETS) + ", or a byte size such as '500MB', '1GB', '3GB'"


def config_for_size(size: str, tie_embeddings: bool = False) -> SampleConfig:
    """A :class:`SampleConfig` for a preset name or a target fp32 parameter byte size."""
    if not isinstance(size, str):
        raise ValueError(f"size must be a string: {valid_sizes()}; got {size!r}")
    if size in PRESETS:
        vocab, dim, hidden, layers = PRESETS[size]
        return SampleConfig(vocab, dim, hidden, layers, tie_embeddings)
    target_bytes = parse_size(size)
    if target_bytes is None or target_bytes <= 0:
        raise ValueError(f"unknown size {size!r}: use {valid_sizes()}")
    target = target_bytes / 4  # fp32 parameters
    # More layers for larger models (more, and more realistic, tensors), about 9*dim^2 per layer
    # and an embedding of about 8*dim rows (twice when untied).
    layers = max(2, min(24, round(target ** (1 / 3) / 40)))
    emb_factor = 8 if tie_embeddings else 16
    dim = _awkward(int(math.sqrt(target / (emb_factor + 9 * layers))))
    hidden = _awkward(4 * dim - 1)
    cfg = SampleConfig(1, dim, hidden, layers, tie_embeddings)
    rest = cfg.num_params() - dim * (1 if tie_embeddings else 2)  # all but the embedding rows
    vocab = _awkward(int((target - rest) / (dim * (1 if tie_embeddings else 2))))
    return SampleConfig(vocab, dim, hidden, layers, tie_embeddings)


def build_model(cfg: SampleConfig, seed: int, dtype: torch.dtype = torch.float32) -> SampleModel:
    """The model with deterministic initial values (the same on every rank for the same seed)."""
    torch.manual_seed(seed)
    model = SampleModel(cfg)
    if dtype != torch.float32:
        model = model.to(dtype)
    return model
