"""Independent float64 references of the optimizer math, in plain torch, for the optim tests."""
import math

import torch

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

    def __init__(self, weights, lr, wd, mu=0.95, nesterov=True, adjust="original", ef_beta=0.0):
        self.w = [w.double().clone() for w in weights]
        self.b = [torch.zeros_like(w) for w in self.w]
        self.e = [None] * len(self.w)
        self.lr, self.wd, self.mu, self.nesterov, self.adjust, self.beta = lr, wd, mu, nesterov, adjust, ef_beta

    def step(self, grads):
        for i, g in enumerate(grads):
            g = g.double()
            self.b[i] = self.mu * self.b[i] + (1 - self.mu) * g
            v = (1 - self.mu) * g + self.mu * self.b[i] if self.nesterov else self.b[i]
            rows, cols = v.shape
            s = math.sqrt(max(1, rows / cols)) if self.adjust == "original" else 0.2 * math.sqrt(max(rows, cols))
            d = -self.lr * self.wd * self.w[i] - self.lr * s * ns5_f64(v)
            self.w[i] = apply_ef(self.w[i], d, self, i)


class AdamWRef:
    def __init__(self, weights, lr, betas=(0.9, 0.999), eps=1e-8, wd=0.01, ef_beta=0.0):
        self.w = [w.double().clone() for w in weights]
        self.m = [torch.zeros_like(w) for w in self.w]
        self.v = [torch.zeros_like(w) for w in self.w]
        self.e = [None] * len(self.w)
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
    float32 weight storage (an ulp of |W| per step) instead of the update arithmetic.
    """
    if ref.beta == 0:
        out = w + d
    else:
        out = w + d if ref.e[i] is None else w + d + ref.beta * (d - ref.e[i])
        ref.e[i] = d
    return out.float().double()
