"""Independent float64 references of the optimizer math, in plain torch, for the optim tests."""
import math

import torch
from torch import nn

A, B, C = 3.4445, -4.7750, 2.0315


def run(opt_factory, weights, grads):
    """Step ``opt_factory(params)`` over ``grads`` (one list per step) from copies of ``weights``;
    returns the final weights and the optimizer."""
    params = [w.clone().requires_grad_() for w in weights]
    opt = opt_factory(params)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in params], opt


def ns5_f64(v, eps=1e-7, steps=5):
    x = v.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        a_mat = x @ x.T
        x = A * x + (B * a_mat + C * a_mat @ a_mat) @ x
    return x.T if tall else x


class MuonRef:
    """Muon in float64 (momentum, nesterov, NS5, lr scale, decoupled wd), optional EF."""

    def __init__(self, weights, lr, wd, mu=0.95, nesterov=True, adjust="original", ef_beta=0.0, eps=1e-7):
        self.w = [w.double().clone() for w in weights]
        self.b = [torch.zeros_like(w) for w in self.w]
        self.e = [None] * len(self.w)
        self.d = [None] * len(self.w)
        self.lr, self.wd, self.mu, self.nesterov, self.adjust, self.beta = lr, wd, mu, nesterov, adjust, ef_beta
        self.eps = eps

    def step(self, grads):
        for i, g in enumerate(grads):
            g = g.double()
            self.b[i] = self.mu * self.b[i] + (1 - self.mu) * g
            v = (1 - self.mu) * g + self.mu * self.b[i] if self.nesterov else self.b[i]
            rows, cols = v.shape
            s = math.sqrt(max(1, rows / cols)) if self.adjust == "original" else 0.2 * math.sqrt(max(rows, cols))
            d = -self.lr * self.wd * self.w[i] - self.lr * s * ns5_f64(v, eps=self.eps)
            self.w[i] = apply_ef(self.w[i], d, self, i)


class AdamWRef:
    def __init__(self, weights, lr, betas=(0.9, 0.999), eps=1e-8, wd=0.01, ef_beta=0.0):
        self.w = [w.double().clone() for w in weights]
        self.m = [torch.zeros_like(w) for w in self.w]
        self.v = [torch.zeros_like(w) for w in self.w]
        self.e = [None] * len(self.w)
        self.d = [None] * len(self.w)
        self.t = 0
        self.lr, self.betas, self.eps, self.wd, self.beta = lr, betas, eps, wd, ef_beta

    def step(self, grads):
        self.t += 1
        b1, b2 = self.betas
        for i, g in enumerate(grads):
            g = g.double()
            self.m[i] = b1 * self.m[i] + (1 - b1) * g
            self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
            m_hat = self.m[i] / (1 - b1 ** self.t)
            denom = self.v[i].sqrt() / math.sqrt(1 - b2 ** self.t) + self.eps
            d = -self.lr * self.wd * self.w[i] - self.lr * m_hat / denom
            self.w[i] = apply_ef(self.w[i], d, self, i)


def apply_ef(w, d, ref, i):
    """W + D on the first step or without EF; W + D + beta*(D - E) after; E <- D.

    The new W is rounded to float32 like the optimizer's weights: otherwise the test would measure
    float32 weight storage (an ulp of |W| per step) instead of the update arithmetic. The step's
    D stays readable as ``ref.d[i]`` (for error bounds).
    """
    ref.d[i] = d
    if ref.beta == 0:
        out = w + d
    else:
        out = w + d if ref.e[i] is None else w + d + ref.beta * (d - ref.e[i])
        ref.e[i] = d
    return out.float().double()


HEAD_NAMES = ("lm_head", "head", "output", "output_head", "classifier", "unembed")


def hybrid_routing(model):
    """(muon names, adamw names) by MuonHybrid's documented rule, decided here from module types
    and names: Muon takes a parameter iff it is 2-D, is not an nn.Embedding table and is not the
    output head (an nn.Linear named like a head, or held by a top-level module so named)."""
    embedding_tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    heads = {id(m.weight) for name, m in model.named_modules() if isinstance(m, nn.Linear)
             and (name.split(".")[-1] in HEAD_NAMES or name.split(".")[0] in HEAD_NAMES)}
    muon, adamw = [], []
    for name, p in model.named_parameters():
        hidden_matrix = p.ndim == 2 and id(p) not in embedding_tables and id(p) not in heads
        (muon if hidden_matrix else adamw).append(name)
    return muon, adamw


class MuonHybridRef:
    """MuonHybrid in float64: MuonRef on the hidden matrices, AdamWRef (own lr, betas, eps and
    weight decay) on everything else, EF on both; parameters are addressed by name."""

    def __init__(self, named_weights, muon_names, *, lr, adamw_lr, wd, adamw_wd, ef_beta, mu=0.95,
                 nesterov=True, ns_eps=1e-7, adamw_betas=(0.9, 0.95), adamw_eps=1e-8):
        weights = dict(named_weights)
        self.muon_names = [n for n in weights if n in set(muon_names)]
        self.adamw_names = [n for n in weights if n not in set(muon_names)]
        self.muon = MuonRef([weights[n] for n in self.muon_names], lr=lr, wd=wd, mu=mu, nesterov=nesterov,
                            ef_beta=ef_beta, eps=ns_eps)
        self.adamw = AdamWRef([weights[n] for n in self.adamw_names], lr=adamw_lr, betas=adamw_betas,
                              eps=adamw_eps, wd=adamw_wd, ef_beta=ef_beta)

    def step(self, grads: dict):
        self.muon.step([grads[n] for n in self.muon_names])
        self.adamw.step([grads[n] for n in self.adamw_names])

    def weights(self) -> dict:
        return {**dict(zip(self.muon_names, self.muon.w)), **dict(zip(self.adamw_names, self.adamw.w))}
