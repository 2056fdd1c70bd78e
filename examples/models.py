"""Example model factories and sample-batch factories for the capacity planner.

Each model factory takes no argument and returns an ``nn.Module``; each sample factory returns one
batch (batch first) and may take ``batch_size=``. Pass them as ``"examples.models:mlp"`` and
``"examples.models:mlp_batch"``. They build on whatever device is current, so the planner can
build them under FakeTensorMode or on the meta device.

The models are written the way people write them: a hand-written causal attention, tied input and
output embeddings, a frozen backbone with a trainable head, BatchNorm running-stat buffers.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# -- MLP -------------------------------------------------------------------------------------


def mlp() -> nn.Module:
    """A 3-layer MLP, 1.3 M parameters."""
    return nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512), nn.GELU(),
                         nn.Linear(512, 256))


def mlp_batch(batch_size: int = 32) -> torch.Tensor:
    return torch.randn(batch_size, 512)


# -- CNN with BatchNorm ----------------------------------------------------------------------


class SmallCNN(nn.Module):
    """Conv-BN-ReLU stages and a linear classifier; BatchNorm running stats are buffers."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        chans = [3, 32, 64, 128]
        layers: list[nn.Module] = []
        for cin, cout in zip(chans, chans[1:]):
            layers += [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout),
                       nn.ReLU(), nn.MaxPool2d(2)]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(128 * 4 * 4, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def cnn() -> nn.Module:
    return SmallCNN()


def cnn_batch(batch_size: int = 16) -> torch.Tensor:
    return torch.randn(batch_size, 3, 32, 32)


# -- a GPT-style language model with hand-written attention and tied embeddings -----------------


class CausalSelfAttention(nn.Module):
    """Attention written out (softmax(QK^T / sqrt(d)) V): keeps the seq x seq probabilities."""

    def __init__(self, hidden: int, heads: int, max_seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.register_buffer("mask", torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool)),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(h // self.heads)
        att = att.masked_fill(~self.mask[:s, :s], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, h)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, max_seq: int, sdpa: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(hidden)
        self.attn = SdpaAttention(hidden, heads) if sdpa else \
            CausalSelfAttention(hidden, heads, max_seq)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                 nn.Linear(4 * hidden, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class SdpaAttention(nn.Module):
    """Attention through scaled_dot_product_attention (flash path on CPU with dropout 0)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class TinyGPT(nn.Module):
    """Decoder-only LM; the output head shares the token embedding's weight (tied)."""

    def __init__(self, vocab: int = 1024, hidden: int = 128, heads: int = 4, layers: int = 4,
                 max_seq: int = 128, sdpa: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(max_seq, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, max_seq, sdpa) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt() -> nn.Module:
    """TinyGPT, 4 layers x 128 hidden, hand-written attention, tied embeddings (0.9 M params)."""
    return TinyGPT()


def gpt_batch(batch_size: int = 8) -> torch.Tensor:
    return torch.randint(0, 1024, (batch_size, 128))


def gpt_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy (the loss people actually train with)."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def gpt_1b() -> nn.Module:
    """A 1.2 B-parameter GPT (24 layers x 2048 hidden, 50k vocab, SDPA) for the scale benchmark."""
    return TinyGPT(vocab=50304, hidden=2048, heads=16, layers=24, max_seq=1024, sdpa=True)


def gpt_1b_batch(batch_size: int = 1) -> torch.Tensor:
    return torch.randint(0, 50304, (batch_size, 1024))


# -- frozen-backbone fine-tune with tied weights ---------------------------------------------


class FineTune(nn.Module):
    """A frozen TinyGPT backbone (its tied embedding included) and a trainable classifier head."""

    def __init__(self, num_classes: int = 8) -> None:
        super().__init__()
        self.backbone = TinyGPT(sdpa=True)
        for p in self.backbone.parameters():
            p.requires_grad_(False)
        self.classifier = nn.Sequential(nn.Linear(1024, 256), nn.GELU(),
                                        nn.Linear(256, num_classes))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.backbone(idx).mean(dim=1))


def finetune() -> nn.Module:
    return FineTune()


def finetune_batch(batch_size: int = 8) -> torch.Tensor:
    return torch.randint(0, 1024, (batch_size, 128))


# -- a module with buffers that are not BatchNorm ----------------------------------------------


class WithBuffers(nn.Module):
    """A linear layer that normalizes its input with stored statistics and keeps a lookup table."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(256))
        self.register_buffer("std", torch.ones(256))
        self.register_buffer("table", torch.randn(1000, 256))  # 1 MB of buffer
        self.fc = nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc((x - self.mean) / self.std + self.table[:1].expand_as(x))


def with_buffers() -> nn.Module:
    return WithBuffers()


def with_buffers_batch() -> torch.Tensor:
    """No ``batch_size`` argument: the planner repeats this batch along dim 0."""
    return torch.randn(16, 256)


# -- failing factories, for the error paths ---------------------------------------------------


def broken() -> nn.Module:
    raise RuntimeError("checkpoint file weights.pt not found")


class DataDependent(nn.Module):
    """Branches on a tensor's value (``.item()``): no fake or meta device can run it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.abs().max().item() > 100.0:
            x = x / 100.0
        return self.fc(x)


def data_dependent() -> nn.Module:
    return DataDependent()


def data_dependent_batch(batch_size: int = 4) -> torch.Tensor:
    return torch.randn(batch_size, 16)


class RepeatByCount(nn.Module):
    """Repeats each row by a count held in a tensor: the output shape depends on data, which
    FakeTensorMode refuses (the planner falls back to the meta device)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = torch.ones(x.shape[0], dtype=torch.long, device="cpu")  # host-side counts
        return self.fc(torch.repeat_interleave(x, counts, dim=0))


def repeat_by_count() -> nn.Module:
    return RepeatByCount()
