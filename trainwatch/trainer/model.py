"""A small GPT-style decoder over bytes: token + position embeddings, pre-LN blocks
with causal self-attention and an MLP, and an output head tied to the token embedding.

No dropout: a resumed run must reproduce an uninterrupted one bit for bit, and
random masks would make the result depend on RNG history as well as on the step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainwatch.trainer.config import ModelPreset
from trainwatch.trainer.mfu import VOCAB_SIZE  # noqa: F401 - byte-level tokens: every byte is a token, no tokenizer


def _linear_cls(fp8: bool) -> type[nn.Module]:
    if fp8:
        # Imported only on request: transformer-engine is an optional GPU extra.
        import transformer_engine.pytorch as te

        return te.Linear
    return nn.Linear


class CausalSelfAttention(nn.Module):
    def __init__(self, preset: ModelPreset, linear: type[nn.Module]):
        super().__init__()
        self.n_head = preset.n_head
        self.qkv = linear(preset.d_model, 3 * preset.d_model, bias=True)
        self.proj = linear(preset.d_model, preset.d_model, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, preset: ModelPreset, linear: type[nn.Module]):
        super().__init__()
        self.fc = linear(preset.d_model, 4 * preset.d_model, bias=True)
        self.proj = linear(4 * preset.d_model, preset.d_model, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, preset: ModelPreset, linear: type[nn.Module]):
        super().__init__()
        self.ln1 = nn.LayerNorm(preset.d_model)
        self.attn = CausalSelfAttention(preset, linear)
        self.ln2 = nn.LayerNorm(preset.d_model)
        self.mlp = MLP(preset, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only language model; forward(idx, targets) returns (logits, loss)."""

    def __init__(self, preset: ModelPreset, *, fp8: bool = False):
        super().__init__()
        if preset.d_model % preset.n_head:
            raise ValueError(f"d_model {preset.d_model} must be divisible by n_head {preset.n_head}")
        linear = _linear_cls(fp8)
        self.preset = preset
        self.wte = nn.Embedding(VOCAB_SIZE, preset.d_model)
        self.wpe = nn.Embedding(preset.block_size, preset.d_model)
        self.blocks = nn.ModuleList(Block(preset, linear) for _ in range(preset.n_layer))
        self.ln_f = nn.LayerNorm(preset.d_model)
        self.head = nn.Linear(preset.d_model, VOCAB_SIZE, bias=False)
        self.head.weight = self.wte.weight  # tied: the output reuses the input embedding
        self._init_weights(preset.n_layer)

    def _init_weights(self, n_layer: int) -> None:
        for name, p in self.named_parameters():
            if p.dim() < 2:
                if name.endswith("bias"):
                    nn.init.zeros_(p)
                continue  # LayerNorm weights keep their ones
            # GPT-2's scheme: residual projections shrink with depth so the
            # residual stream's variance does not grow with the number of blocks.
            std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
            nn.init.normal_(p, mean=0.0, std=std)

    def num_params(self) -> int:
        """Distinct parameters (the tied head is counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        if t > self.preset.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than the model's block size {self.preset.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, VOCAB_SIZE), targets.reshape(-1))
        return logits, loss
