"""A GPT-style decoder: token + learned position embeddings, pre-norm blocks of causal
self-attention and a GELU MLP, a final LayerNorm and an untied LM head; token-level
cross-entropy. ``gpt[layers=12,width=768,heads=12,seq=1024,vocab=50257]`` is GPT-2 small's
shape; the default is small enough to train on a CPU.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from hybridpipe.errors import UserError
from hybridpipe.profiles.zoo.spec import ModelSpec


class Embeddings(nn.Module):
    """Token embedding plus a learned position embedding (inputs are exactly ``seq`` tokens long).

    The GPT spec traces it as one leaf node, so the graph has no bare parameter (get_attr) nodes.
    """

    def __init__(self, vocab: int, width: int, seq: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Parameter(torch.randn(seq, width) * 0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tokens(idx) + self.positions


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; shapes come from constants, so the traced graph carries
    no shape arithmetic between nodes."""

    def __init__(self, width: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads = heads
        self.head_dim = width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k, v = (t.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).flatten(-2))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 4 * width)
        self.gelu = nn.GELU()
        self.out = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.out(self.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, layers: int = 4, width: int = 256, heads: int = 4, seq: int = 128, vocab: int = 2048,
                 dropout: float = 0.0):
        super().__init__()
        self.embed = Embeddings(vocab, width, seq)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*(Block(width, heads, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.embed(idx))
        return self.head(self.ln(self.blocks(x)))


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_spec(spec: str, layers: int = 4, width: int = 256, heads: int = 4, seq: int = 128, vocab: int = 2048,
             dropout: float = 0.0) -> ModelSpec:
    """``gpt[layers=4,width=256,heads=4,seq=128,vocab=2048,dropout=0]``: input (seq,) token ids."""
    if min(layers, width, heads, seq, vocab) < 1 or width % heads:
        raise UserError(f"gpt needs positive sizes and width divisible by heads; got layers={layers} "
                        f"width={width} heads={heads} seq={seq} vocab={vocab}")
    return ModelSpec(name=spec, build=lambda: GPT(layers, width, heads, seq, vocab, dropout), sample_shape=(seq,),
                     input_dtype=torch.int64, loss=token_cross_entropy, target_shape=(seq,), num_classes=vocab,
                     leaf_modules=(Embeddings,))
