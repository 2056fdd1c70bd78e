"""A Llama-style decoder written the way people write it, for the capacity planner.

RMSNorm that upcasts to fp32, rotary embeddings (``rotate_half``), grouped-query attention whose
K and V are expanded to every head (``repeat_kv``) before ``F.scaled_dot_product_attention``,
SwiGLU MLP, no biases, tied input/output embeddings. The shape defaults to Llama 3.2 3B
(28 layers, hidden 3072, 24 heads, 8 KV heads, MLP 8192, vocabulary 128256: 3.21 B parameters).

Trace it on the CPU and compare with the analytic plan of the same shape::

    raytrain-guard plan --model examples.llama:llama_3b --sample examples.llama:llama_batch \\
        --loss examples.llama:llama_loss --precision bf16-master --strategy fsdp-full \\
        --workers 8 --micro-batch 1 --gpu-mem 80GiB
    raytrain-guard plan --layers 28 --hidden 3072 --heads 24 --kv-heads 8 --ffn-hidden 8192 \\
        --vocab 128256 --seq-len 2048 --gated-mlp --no-bias --tied-embeddings \\
        --precision bf16-master --strategy fsdp-full --workers 8 --micro-batch 1 --gpu-mem 80GiB

``llama_3b_per_op`` is the same model with each block under PyTorch's per-op selective
activation checkpointing (torchtitan's policy), to check ``--recompute per-op``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

#: the sequence length the sample factory uses (the analytic plan's --seq-len)
SEQ_LEN = 2048


@dataclass(frozen=True)
class LlamaConfig:
    layers: int = 28
    hidden: int = 3072
    heads: int = 24
    kv_heads: int = 8
    ffn_hidden: int = 8192
    vocab: int = 128256
    max_seq: int = SEQ_LEN
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(b, kv_heads, s, d) -> (b, kv_heads * n_rep, s, d)."""
    if n_rep == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, n_rep, s, d).reshape(b, kv * n_rep, s, d)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.hidden // cfg.heads
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv_heads
        k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).contiguous().view(b, s, -1)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.hidden, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.input_norm(x), cos, sin)
        return h + self.mlp(self.post_attn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig, per_op_checkpoint: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.lm_head.weight = self.embed.weight          # tied, as in Llama 3.2 1B/3B
        self.per_op_checkpoint = per_op_checkpoint
        head_dim = cfg.hidden // cfg.heads
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(cfg.max_seq).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        x = self.embed(tokens)
        cos, sin = self.cos[:s].to(x.dtype), self.sin[:s].to(x.dtype)
        for block in self.layers:
            if self.per_op_checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False,
                                                      context_fn=per_op_context,
                                                      preserve_rng_state=False)
            else:
                x = block(x, cos, sin)
        return self.lm_head(self.norm(x))


def per_op_context():
    """torchtitan's per-op policy: save every other ``mm`` output and SDPA's, recompute the
    rest (``--recompute per-op``)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    ops = torch.ops.aten
    save = {ops.mm.default, ops._scaled_dot_product_flash_attention.default,
            ops._scaled_dot_product_efficient_attention.default,
            ops._scaled_dot_product_flash_attention_for_cpu.default}
    count: dict[str, int] = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        key = "recompute" if ctx.is_recompute else "forward"
        if func == ops.mm.default:
            count[key] += 1
        keep = func in save and not (func == ops.mm.default and count[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def llama_3b() -> nn.Module:
    """Llama 3.2 3B's shape: 3.21 B parameters."""
    return Llama(LlamaConfig())


def llama_3b_per_op() -> nn.Module:
    """The same model, each block under per-op selective activation checkpointing."""
    return Llama(LlamaConfig(), per_op_checkpoint=True)


def llama_tiny() -> nn.Module:
    """A 2-layer model of the same build, for tests."""
    return Llama(LlamaConfig(layers=2, hidden=64, heads=4, kv_heads=2, ffn_hidden=96,
                             vocab=100, max_seq=32))


def llama_batch(batch_size: int = 1, seq_len: int = SEQ_LEN,
                vocab: int = LlamaConfig.vocab) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, next tokens), each (batch, seq_len) int64."""
    tokens = torch.randint(0, vocab, (batch_size, seq_len + 1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def llama_tiny_batch(batch_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return llama_batch(batch_size, seq_len=32, vocab=100)


def llama_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Next-token cross-entropy on fp32 logits; the 16-bit logits are dropped before backward
    (they are local to this function), as torchtitan's loop does."""
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
