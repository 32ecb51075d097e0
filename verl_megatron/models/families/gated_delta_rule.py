"""The gated delta rule and the short causal convolution of gated DeltaNet layers, in torch.

Per value head, with a state S [dk, dv], decay g_t <= 0 (log space), strength beta_t in (0, 1),
l2-normalised key k_t and query q_t (scaled by 1/sqrt(dk)):

    S' = exp(g_t) S;   u_t = beta_t (v_t - S'^T k_t);   S_t = S' + k_t u_t^T;   o_t = S_t^T q_t

:func:`recurrent_gated_delta_rule` runs it token by token (decoding).
:func:`chunk_gated_delta_rule` computes the same numbers chunk by chunk: inside a chunk with
cumulative log decay G_i (from the chunk's start) and entry state S0, the updates u solve the
unit lower-triangular system

    u_i + sum_{j<i} beta_i exp(G_i - G_j) (k_i . k_j) u_j = beta_i (v_i - exp(G_i) S0^T k_i)

so u = W - Y S0 with W, Y from one triangular solve each, and
o_i = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i . k_j) u_j,
S_end = exp(G_C) S0 + sum_j exp(G_C - G_j) k_j u_j^T. Everything runs in float32 and is
differentiable (the training path on CPU). Shapes: q, k [B, T, H, dk]; v [B, T, H, dv];
g, beta [B, T, H]; state [B, H, dk, dv].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension, in float32 (fla's and transformers' l2norm)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """Depthwise causal convolution + SiLU: x [B, C, s] after ``history`` [B, C, K-1] (the inputs
    before x; zeros at a sequence start), weight [C, 1, K] -> [B, C, s]."""
    full = torch.cat([history.to(x.dtype), x], dim=-1)
    return F.silu(F.conv1d(full, weight.to(x.dtype), groups=x.shape[1]))


def _heads_first(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.transpose(1, 2).float() for t in tensors]


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Token by token -> (outputs [B, T, H, dv] float32, final state [B, H, dk, dv])."""
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    q = q * q.shape[-1] ** -0.5
    s = q.new_zeros(*k.shape[:2], k.shape[-1], v.shape[-1]) if state is None else state.float()
    outs = []
    for t in range(q.shape[2]):
        s = s * g[:, :, t, None, None].exp()
        u = (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", s, k[:, :, t])) * beta[:, :, t, None]
        s = s + k[:, :, t, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, :, t]))
    return torch.stack(outs, dim=1), s


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor | None = None, chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Chunk by chunk (see the module docstring) -> (outputs [B, T, H, dv] float32, final state)."""
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    q = q * q.shape[-1] ** -0.5
    length = q.shape[2]
    pad = -length % chunk
    # Padded steps have k = v = 0, beta = 0 and g = 0: they change neither outputs nor the state.
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    q, k, v = (x.reshape(*x.shape[:2], -1, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.reshape(*x.shape[:2], -1, chunk) for x in (g, beta))
    cum = g.cumsum(-1)  # G [B, H, N, C]
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)  # unit diagonal implied
    w = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    y = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    s = q.new_zeros(*k.shape[:2], k.shape[-1], v.shape[-1]) if state is None else state.float()
    outs = []
    for c in range(q.shape[2]):
        u = w[:, :, c] - y[:, :, c] @ s
        outs.append(q_decayed[:, :, c] @ s + scores[:, :, c] @ u)
        s = s * cum[:, :, c, -1, None, None].exp() + k_to_end[:, :, c].transpose(-1, -2) @ u
    out = torch.cat(outs, dim=2)[:, :, :length]
    return out.transpose(1, 2), s
