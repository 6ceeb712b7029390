"""Worker functions for multi-process pipeline tests (importable by spawned ranks)."""
import json
import os

import torch
import torch.nn as nn

from asyncpp_ext.models import GPT, GPTConfig
from asyncpp_ext.pipeline import Pipeline, init_distributed


def make_blocks(seed: int = 0) -> list:
    torch.manual_seed(seed)
    return [nn.Linear(8, 16), nn.Sequential(nn.Tanh(), nn.Linear(16, 16)),
            nn.Sequential(nn.Tanh(), nn.Linear(16, 16)), nn.Sequential(nn.Tanh(), nn.Linear(16, 4))]


def batches(steps: int, m: int, micro_batch: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randn(m * micro_batch, 8, generator=g), torch.randn(m * micro_batch, 4, generator=g)


def optimizer_factory(name: str):
    if name == "sgd":
        return lambda module: torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    if name == "adamw":
        return lambda module: torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1)
    raise ValueError(name)


def reference_losses(schedule: str, m: int, steps: int, optimizer: str) -> list:
    """Single process, written independently of the runtime: the 2bw rule keeps W(t-1) and computes
    the gradient there, then applies it to W(t)."""
    model = nn.Sequential(*make_blocks())
    opt = optimizer_factory(optimizer)(model)
    params = list(model.parameters())
    previous = [p.detach().clone() for p in params]
    losses = []
    for x, y in batches(steps, m):
        current = [p.detach().clone() for p in params]
        if schedule == "2bw":
            with torch.no_grad():
                for p, w in zip(params, previous):
                    p.copy_(w)
        step_losses = []
        for xi, yi in zip(x.chunk(m), y.chunk(m)):
            loss = nn.functional.mse_loss(model(xi), yi)
            step_losses.append(loss.detach())
            (loss / m).backward()
        if schedule == "2bw":
            with torch.no_grad():
                for p, w in zip(params, current):
                    p.copy_(w)
        previous = current
        opt.step()
        opt.zero_grad()
        losses.append(float(sum(l.item() for l in step_losses) / m))
    return losses, [p.detach().clone() for p in params]


def train_worker(schedule: str, m: int, steps: int, optimizer: str, out_dir: str) -> None:
    init_distributed(60)
    torch.set_num_threads(1)  # like the reference in the test process
    pipe = Pipeline(make_blocks(), loss_fn=nn.functional.mse_loss, optimizer=optimizer_factory(optimizer),
                    schedule=schedule, microbatches=m)
    losses = [s.loss for s in pipe.train(batches(steps, m), steps)]
    weights = {f"{i}": t for i, t in zip(pipe.block_indices,
                                         [list(pipe.host.newest_replica()[k].parameters())
                                          for k in range(len(pipe.block_indices))])}
    torch.save({"weights": weights, "trace": pipe.trace, "progress": pipe.progress.snapshot()},
               os.path.join(out_dir, f"stage{pipe.stage}.pt"))
    if pipe.host.is_last:
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump(losses, f)


class FailAt(nn.Module):
    """Identity that raises on its n-th call (an exception inside one stage mid-step)."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.calls = n, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("injected failure in stage forward")
        return x


def failing_worker(fail_stage: int, m: int) -> None:
    init_distributed(60)
    blocks = make_blocks()
    blocks[fail_stage] = nn.Sequential(blocks[fail_stage], FailAt(2 * m + 1))  # during step 2
    pipe = Pipeline(blocks, loss_fn=nn.functional.mse_loss, optimizer=optimizer_factory("sgd"),
                    schedule="2bw", microbatches=m, timeout_s=60)
    for _ in pipe.train(batches(50, m), 50):
        pass


def per_rank_worker(settings_by_rank: list) -> None:
    """Each rank builds its Pipeline with its own settings on top of 2bw, m = 2 (they should all
    be the same): ``split_points`` to split the four blocks elsewhere, ``schedule``, ..."""
    rank, _ = init_distributed(60)
    settings = {"schedule": "2bw", "microbatches": 2, **settings_by_rank[rank]}
    pipe = Pipeline(make_blocks(), loss_fn=nn.functional.mse_loss, optimizer=optimizer_factory("sgd"),
                    timeout_s=60, **settings)
    for _ in pipe.train(batches(2, 2), 2):
        pass


# ---- the product's default path: the GPT under MuonHybrid + EF, as asyncpp-train builds it -----
GPT_CONFIG = GPTConfig(n_layer=2, n_embd=16, n_head=2, seq_len=8)


def gpt_model() -> GPT:
    return GPT(GPT_CONFIG, seed=0)


def gpt_minibatches(steps: int, m: int, micro_batch: int = 2, seed: int = 5) -> list:
    """``steps`` minibatches, each a list of m (tokens, next tokens) microbatches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        blocks = [torch.randint(0, GPT_CONFIG.vocab_size, (micro_batch, GPT_CONFIG.seq_len + 1), generator=g)
                  for _ in range(m)]
        out.append([(b[:, :-1], b[:, 1:]) for b in blocks])
    return out


def cli_muon_factory(module):
    """asyncpp-train --optimizer muon: MuonHybrid with EF 0.5 and the CLI's other defaults."""
    from asyncpp_ext.training.build import optimizer_factory as make_optimizer_factory
    from asyncpp_ext.training.config import RunConfig

    cfg = RunConfig()
    cfg.optim.name = "muon"
    cfg.optim.pin_auto_values()
    return make_optimizer_factory(cfg)(module)


def gpt_train_worker(schedule: str, m: int, steps: int, out_dir: str) -> None:
    init_distributed(60)
    torch.set_num_threads(1)  # the reference runs with one intra-op thread too
    pipe = Pipeline(gpt_model(), loss_fn=GPT.loss, optimizer=cli_muon_factory, schedule=schedule, microbatches=m)
    losses = [s.loss for s in pipe.train(gpt_minibatches(steps, m), steps)]
    state = pipe.state_dict()
    torch.save({"params": state["params"], "stash": state["stash"]}, os.path.join(out_dir, f"stage{pipe.stage}.pt"))
    if pipe.host.is_last:
        with open(os.path.join(out_dir, "losses.json"), "w") as f:
            json.dump(losses, f)


def gather_weights_worker(out_dir: str, dst: int) -> None:
    """llama-tiny (embedding and head tied, on different stages) trained 3 steps of 2bw on two
    stages; each rank saves its state_dict's params, and rank ``dst`` what gather_weights gave."""
    from asyncpp_ext.models import Llama, llama_preset_config
    from asyncpp_ext.optim import build_optimizer

    init_distributed()
    torch.set_num_threads(1)
    cfg = llama_preset_config("llama-tiny")
    g = torch.Generator().manual_seed(3)
    steps = [[(torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g),
               torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=g)) for _ in range(2)]
             for _ in range(3)]
    with Pipeline(Llama(cfg, seed=0), loss_fn=Llama.loss, schedule="2bw", microbatches=2,
                  optimizer=lambda m: build_optimizer(m, "adamw", lr=1e-2)) as pipe:
        for _ in pipe.train(steps, steps=3):
            pass
        rank = torch.distributed.get_rank()
        torch.save(pipe.state_dict()["params"], os.path.join(out_dir, f"params{rank}.pt"))
        gathered = pipe.gather_weights(dst=dst)
        torch.save(gathered, os.path.join(out_dir, f"gathered{rank}.pt"))
