"""The z-loss (``--z-loss Z``, models/head_loss.z_loss_term): Z * mean(logsumexp(logits)^2) over the
targets in the gradient of the last block's loss, on the plain and the fused (chunked) head, in one
process and in a pipeline; the loss logged stays the cross entropy."""
import json

import pytest
import torch
import torch.nn.functional as F

from asyncpp_ext.models.head_loss import linear_cross_entropy
from asyncpp_ext.models.z_loss import plain_loss, z_loss_term
from asyncpp_ext.training.build import build_data, build_run_model
from asyncpp_ext.training.checkpoint import load_weights
from asyncpp_ext.training.cli import main as train
from asyncpp_ext.training.config import RunConfig

N, C, V, Z = 60, 24, 320, 0.05
FLAGS = ["--model", "tiny", "--seq-len", "16", "--micro-batch-size", "2", "--microbatches", "2", "--steps", "4",
         "--eval-every", "0", "--no-checkpoints", "--no-progress", "--threads", "1"]


def _problem(seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(N, C, generator=gen)
    w = torch.randn(V, C, generator=gen) * 0.3  # logsumexp ~7: 2 Z lse ~0.7, a term no test can miss
    b = torch.randn(V, generator=gen) * 0.1
    t = torch.randint(0, V, (N,), generator=gen)
    t[::7] = -100  # ignored rows: in neither mean
    return [z.requires_grad_() for z in (h, w, b)], t


def _objective(h, w, b, t):
    """Cross entropy + Z * mean lse^2 over the valid rows, by autograd: the definition."""
    logits = F.linear(h, w, b)
    valid = t != -100
    return F.cross_entropy(logits, t) + Z * torch.logsumexp(logits[valid].float(), 1).square().mean()


def _exact_grads(leaves, t):
    exact = [z.detach().double().requires_grad_() for z in leaves]
    _objective(*exact, t).backward()
    return [z.grad for z in exact]


def _grads(fn, leaves, t, dtype=None):
    for z in leaves:
        z.grad = None
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = fn(*leaves, t)
    loss.backward()
    return loss.detach(), [z.grad.clone() for z in leaves]


def _fused(rows, z):
    return lambda h, w, b, t: linear_cross_entropy(h, w, t, bias=b, chunk_rows=rows, z_loss=z)


def _plain(z):
    return lambda h, w, b, t: plain_loss(F.cross_entropy, F.linear(h, w, b), t, z)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("path", ["plain", "fused-1", "fused-7", "fused-whole"])
def test_gradients_are_the_objectives_and_the_value_the_cross_entropy(path):
    leaves, t = _problem()
    fn = {"plain": _plain, "fused-1": lambda z: _fused(1, z), "fused-7": lambda z: _fused(7, z),
          "fused-whole": lambda z: _fused(None, z)}[path]
    value, grads = _grads(fn(Z), leaves, t)
    without, grads_without = _grads(fn(0.0), leaves, t)
    assert torch.equal(value, without)  # the value: the cross entropy, bit for bit
    exact = _exact_grads(leaves, t)
    for g, x, g0 in zip(grads, exact, grads_without):
        assert _rel(g.double(), x) < 2e-6  # fp32 summation order only (measured <= 6e-7)
        assert _rel(g0.double(), x) > 1e-2  # the term is far from negligible here


def test_bf16_fused_and_plain_agree_within_bf16_rounding():
    leaves, t = _problem(1)
    exact = _exact_grads(leaves, t)
    _, plain = _grads(_plain(Z), leaves, t, torch.bfloat16)
    _, fused = _grads(_fused(7, Z), leaves, t, torch.bfloat16)
    for f, p, x in zip(fused, plain, exact):
        # both round the matmuls' inputs and products to bf16 (~5e-3 of the largest entry); the
        # fused kernel's error against float64 is no worse than plain's by more than a quarter
        assert _rel(f.double(), x) <= 1.25 * _rel(p.double(), x) + 1e-4
        assert _rel(f, p) < 2 ** -6


def test_the_term_is_zero_valued_and_absent_without_gradients():
    logits = torch.randn(2, 5, 11, requires_grad=True)
    t = torch.randint(0, 11, (2, 5))
    term = z_loss_term(logits, t, Z)
    assert term.item() == 0.0 and term.requires_grad
    every_ignored = z_loss_term(logits, torch.full_like(t, -100), Z)
    every_ignored.backward()
    assert every_ignored.item() == 0.0 and torch.count_nonzero(logits.grad) == 0  # no 0/0
    with torch.no_grad():  # evaluation: the loss function's value alone
        assert plain_loss(F.cross_entropy, logits.reshape(-1, 11), t.reshape(-1), Z).grad_fn is None
    # a coefficient the runs refuse is refused by the functions too (a negative one pushed the
    # normaliser away from 0 instead)
    for bad in (-5.0, float("nan")):
        with pytest.raises(ValueError, match="z_loss must be a finite number >= 0"):
            z_loss_term(logits, t, bad)
        with pytest.raises(ValueError, match="z_loss must be a finite number >= 0"):
            plain_loss(F.cross_entropy, logits.reshape(-1, 11), t.reshape(-1), bad)


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("head", ["plain", "chunked"])
def test_a_runs_first_gradient_is_the_objectives(tmp_path, head):
    """End to end: --log-grad-norm's first norm is the norm of the objective's gradient at the
    first weights, taken by hand from the run's first minibatch."""
    run = tmp_path / "run"
    assert train([*FLAGS, "--simulate", "--schedule", "sync", "--head-loss", head, "--z-loss", "0.02",
                  "--log-grad-norm", "--out", str(run)]) == 0
    rows = _rows(run)
    cfg = RunConfig.from_dict(json.loads((run / "config.json").read_text()))
    assert cfg.optim.z_loss == 0.02
    model = build_run_model(cfg, True)
    microbatches = build_data(cfg)[0].next()
    ce = 0.0
    for x, y in microbatches:
        logits = model(x)[0]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        lse = torch.logsumexp(logits.float(), -1)
        ((loss + 0.02 * lse.square().mean()) / len(microbatches)).backward()
        ce += loss.item() / len(microbatches)
    norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None))
    assert rows[0]["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    assert rows[0]["loss"] == pytest.approx(ce, rel=1e-6)  # the logged loss: the cross entropy


@pytest.mark.parametrize("head", ["plain", "chunked"])
def test_a_pipeline_is_its_simulation(tmp_path, head):
    runs = {}
    for name, flags in (("sim", ["--simulate", "--z-loss", "0.02"]),
                        ("pipe", ["--stages", "2", "--timeout", "30", "--z-loss", "0.02"]),
                        ("none", ["--simulate"])):
        assert train([*FLAGS, *flags, "--head-loss", head, "--log-grad-norm", "--out", str(tmp_path / name)]) == 0
        runs[name] = _rows(tmp_path / name)
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in runs["pipe"]] == [r[key] for r in runs["sim"]]
    # 2bw: the first two steps run on W(0), so their losses are the run without the term's; the
    # gradients never are, nor the later losses
    assert [r["loss"] for r in runs["sim"][:2]] == [r["loss"] for r in runs["none"][:2]]
    assert all(a["grad_norm"] != b["grad_norm"] for a, b in zip(runs["sim"], runs["none"]))
    assert runs["sim"][3]["loss"] != runs["none"][3]["loss"]


def _mean_lse_squared(run):
    cfg = RunConfig.from_dict(json.loads((run / "config.json").read_text()))
    model = build_run_model(cfg, False)
    load_weights(model, run / f"ckpt-{cfg.train.steps:06d}")
    with torch.no_grad():
        lse = torch.cat([torch.logsumexp(model(x)[0].float(), -1).flatten() for x, _ in build_data(cfg)[0].next()])
    return lse.square().mean().item()


def test_the_z_loss_pulls_the_normaliser_towards_one(tmp_path):
    """What the term is for: trained 40 steps, the model's mean lse^2 on a minibatch is 27.8 without
    it and 13.0 with Z = 0.1 (measured), the cross entropy about the same (2.68, 2.86)."""
    flags = [*FLAGS, "--steps", "40", "--micro-batch-size", "4", "--schedule", "sync", "--simulate", "--lr", "3e-3"]
    flags.remove("--no-checkpoints")
    for z in ("0", "0.1"):
        assert train([*flags, "--z-loss", z, "--out", str(tmp_path / z)]) == 0
    assert _mean_lse_squared(tmp_path / "0.1") < 0.6 * _mean_lse_squared(tmp_path / "0")


@pytest.mark.parametrize("flags, message", [
    (["--z-loss", "-1"], "optim.z_loss must be a non-negative number"),
    (["--z-loss", "inf"], "optim.z_loss must be finite"),
    (["--z-loss", "1e-4", "--head-loss", "liger"], "'liger' does not form the z-loss's gradient"),
    (["--z-loss", "1e-4", "--head-loss", "cce"], "'cce' does not form the z-loss's gradient"),
])
def test_bad_z_loss_is_one_line(tmp_path, capsys, flags, message):
    out = tmp_path / "run"
    assert train([*FLAGS, "--simulate", *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_a_resume_keeps_the_z_loss_and_refuses_another(tmp_path, capsys):
    run = tmp_path / "run"
    flags = [f for f in FLAGS if f != "--no-checkpoints"]
    assert train([*flags, "--simulate", "--z-loss", "1e-3", "--out", str(run)]) == 0
    capsys.readouterr()
    assert train([*flags, "--simulate", "--steps", "6", "--z-loss", "0", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "z_loss" in err[0], err
    assert train([*flags, "--simulate", "--steps", "6", "--resume", str(run)]) == 0  # the run's own, unsaid
    assert RunConfig.from_dict(json.loads((run / "config.json").read_text())).optim.z_loss == 1e-3


def test_the_pipeline_api_checks_its_z_loss():
    from asyncpp_ext.models.registry import build_model, model_config
    from asyncpp_ext.pipeline import Pipeline

    model = build_model(model_config("tiny"), seed=0)
    for kwargs, message in (({"z_loss": -0.5}, "z_loss must be a finite number >= 0"),
                            ({"z_loss": True}, "z_loss must be a finite number >= 0"),
                            ({"z_loss": 1e-4, "head_loss": "fused", "head_loss_kernel": "liger"},
                             "'liger' does not form the z-loss's gradient")):
        with pytest.raises(ValueError, match=message):
            Pipeline(model, loss_fn=type(model).loss, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                     stages=1, **kwargs)


def test_the_compiled_gradient_pass_forms_the_term_as_the_eager_one():
    """On CUDA the chunk passes are compiled (head_loss._ChunkPasses); the z-loss's scaling is part
    of the one elementwise kernel there: the same values as the eager pass, bit for bit, and the
    float64 derivative of CE + Z lse^2 within bf16 rounding."""
    from asyncpp_ext.models import head_loss as hl

    gen = torch.Generator().manual_seed(5)
    passes = hl._ChunkPasses(True)
    logits = torch.randn(6, 300, generator=gen).to(torch.bfloat16) * 4
    t = torch.randint(0, 300, (6, 1), generator=gen)
    lse = passes.stats(logits, t, torch.ones(6, dtype=torch.bool))[0][:, None]
    g = passes.grad(logits, t, lse, torch.bfloat16, Z)
    assert passes.compiled and torch.equal(g, hl._chunk_grad(logits, t, lse, torch.bfloat16, Z))
    x = logits.double().requires_grad_()
    rows_lse = torch.logsumexp(x, 1)
    (rows_lse - x.gather(1, t).squeeze(1) + Z * rows_lse.square()).sum().backward()
    assert torch.allclose(g.double(), x.grad, atol=4e-3, rtol=1e-2)
    assert not torch.allclose(g, passes.grad(logits, t, lse, torch.bfloat16), atol=1e-2)


@pytest.mark.cuda
def test_on_cuda_the_fused_heads_gradient_is_the_objectives():
    """The CUDA path: the chunk passes compiled, 16-bit matmuls writing float32 sums; against the
    float64 objective as accurate as the plain path's bf16 gradients (within a quarter)."""
    leaves, t = _problem()
    leaves = [z.detach().cuda().requires_grad_() for z in leaves]
    t = t.cuda()
    exact = [g.cpu() for g in _exact_grads(leaves, t)]

    def grads(fn):
        for z in leaves:
            z.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            fn(*leaves, t).backward()
        return [z.grad.double().cpu() for z in leaves]
    for f, p, x in zip(grads(_fused(7, Z)), grads(_plain(Z)), exact):
        assert _rel(f, x) <= 1.25 * _rel(p, x) + 1e-4
