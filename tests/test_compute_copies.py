"""bf16 compute copies (pipeline/compute_copies.py): which weights are copied, training on them is
bit for bit training under autocast (losses and float32 gradients, over several microbatches), and
the in-process engine runs on them with the same losses as without, delayed schedules included."""
import copy
import importlib.util

import pytest
import torch
import torch.nn as nn

from asyncpp_ext.models.head_loss import head_loss
from asyncpp_ext.models.registry import ModelConfig, build_model
from asyncpp_ext.pipeline.compute_copies import ComputeCopies, copied_parameters, maybe_compute_copies

M = 3


def _llama(tie: bool):
    return ModelConfig(arch="llama", vocab_size=256, seq_len=16, n_layer=2, n_embd=32, n_head=2, n_kv_head=1,
                       intermediate_size=64, tie_embeddings=tie, rope_theta=10000.0, norm_eps=1e-5)


MODELS = {
    "llama-tied-plain": (_llama(True), "plain"),
    "llama-untied-fused": (_llama(False), "fused"),
    "gpt": (ModelConfig(arch="gpt", vocab_size=256, seq_len=16, n_layer=2, n_embd=32, n_head=2), "plain"),
    "hf-qwen2": (ModelConfig(arch="hf", seq_len=16, hf_config=dict(
        model_type="qwen2", vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)),
        "plain"),
}


def _loss(mode):
    def loss(model, x, y):
        *body, head = model.blocks()
        for block in body:
            x = block(x)
        return head_loss(head, x, y, mode)
    return loss


@pytest.mark.parametrize("name", MODELS)
def test_training_on_the_copies_is_bitwise_training_under_autocast(name):
    cfg, mode = MODELS[name]
    if cfg.arch == "hf" and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs pip install 'asyncpp_ext[hf]'")
    reference = build_model(cfg, seed=0)
    model = copy.deepcopy(reference)
    copies = ComputeCopies(model, torch.bfloat16, exclude=[model.blocks()[-1]] if mode == "fused" else [])
    assert len(copies) >= 2 * 4  # at least the blocks' projections
    copies.refresh()
    loss_fn, g = _loss(mode), torch.Generator().manual_seed(1)
    for _ in range(M):
        x, y = (torch.randint(0, 256, (2, 16), generator=g) for _ in range(2))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            want = loss_fn(reference, x, y)
            got = loss_fn(copies.module, x, y)
        (want / M).backward()
        (got / M).backward()
        copies.accumulate()
        assert torch.equal(got, want)
        assert all(c.grad is None for c in copies.copies)
    for (n, a), b in zip(reference.named_parameters(), model.parameters()):
        assert a.grad is not None and torch.equal(a.grad.view(torch.int32), b.grad.view(torch.int32)), n  # bits
        assert b.dtype == torch.float32  # the model keeps its float32 weights
    # and the copies are live: a weight change reaches the compute module only through refresh()
    with torch.no_grad():
        copies.masters[0].add_(1.0)
    assert not torch.equal(copies.copies[0], copies.masters[0].to(torch.bfloat16))
    copies.refresh()
    assert torch.equal(copies.copies[0], copies.masters[0].to(torch.bfloat16))


class _Scaled(nn.Linear):
    """A Linear subclass: its forward may use the weight otherwise, so it is not copied."""


def test_the_first_backward_widens_into_one_new_gradient_buffer():
    """After zero_grad(set_to_none=True) the masters get their copies' gradients widened, -0.0
    kept, as views of one buffer filled by one multi-tensor copy."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    copies = ComputeCopies(model, torch.bfloat16)
    copies.refresh()
    x = torch.randn(5, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        copies.module(x).sum().backward()
    copies.copies[1].grad[0] = -0.0  # a negative zero must come through as one
    wanted = [c.grad.float() for c in copies.copies]
    copies.accumulate()
    storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 1
    for p, w in zip(model.parameters(), wanted):
        assert torch.equal(p.grad.view(torch.int32), w.view(torch.int32))


def _compiled_grads(model, stack: bool, monkeypatch):
    """The masters' float32 gradients after two microbatches through ``model``'s compute module
    compiled block by block (a recording backend: the traced graphs run as traced), and the
    blocks' graphs; ``stack=False`` builds the copies without stacked weights."""
    from asyncpp_ext.models.compile import compile_blocks
    from asyncpp_ext.models.graphs import GRADS_TAKEN

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with monkeypatch.context() as m:
        if not stack:
            m.setattr(ComputeCopies, "_stack", lambda self: [])
        copies = ComputeCopies(model, torch.bfloat16)
    assert getattr(copies.module, GRADS_TAKEN) >= {id(w) for w, _ in copies.stacked}
    copies.refresh()
    torch._dynamo.reset()
    compile_blocks(copies.module, backend=record)
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        x, y = (torch.randint(0, 256, (2, 16), generator=g) for _ in range(2))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _loss("plain")(copies.module, x, y).backward()
        copies.accumulate()
    assert all(c.grad is None for c in copies.copies) and all(w.grad is None for w, _ in copies.stacked)
    ptrs = [p.grad.data_ptr() for p in copies.masters]  # widened into one buffer, in the masters' order
    assert ptrs == sorted(ptrs) and len({p.grad.untyped_storage().data_ptr() for p in copies.masters}) == 1
    return copies, [p.grad.clone() for p in model.parameters()], graphs


def test_compiled_blocks_multiply_by_the_stacked_copies_without_concatenating_them(monkeypatch):
    """A compute module's attention and SwiGLU carry their q/k/v and gate/up copies stacked, as one
    parameter over the copies' own buffer: compiled blocks multiply by it instead of concatenating
    the weights per call, and the masters get the same gradients, bit for bit."""
    import torch._dynamo
    from asyncpp_ext.models.llama import Attention, SwiGLU

    model = build_model(_llama(False), seed=0)
    copies, stacked_grads, graphs = _compiled_grads(copy.deepcopy(model), True, monkeypatch)
    owners = [m for m in copies.module.modules() if isinstance(m, (Attention, SwiGLU))]
    assert len(owners) == 4 and len(copies.stacked) == 4
    for owner in owners:
        w = owner.stacked_weight
        parts = [getattr(owner, n).weight for n in type(owner).stacked_projections]
        assert w.untyped_storage().data_ptr() == copies.flat.untyped_storage().data_ptr()
        assert w.data_ptr() == parts[0].data_ptr() and torch.equal(w, torch.cat(parts))
    cats = sum(n.target is torch.cat for gm in graphs for n in gm.graph.nodes)
    assert cats == 0
    _, cat_grads, cat_graphs = _compiled_grads(copy.deepcopy(model), False, monkeypatch)
    assert sum(n.target is torch.cat for gm in cat_graphs for n in gm.graph.nodes) == 2  # q/k/v, gate/up
    for a, b in zip(stacked_grads, cat_grads):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_only_weights_owned_by_plain_linears_are_copied():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), _Scaled(4, 4), nn.LayerNorm(4),
                          nn.Linear(4, 10, bias=False), nn.Linear(4, 4))
    model[4].weight = model[0].weight  # tied to the embedding table: stays float32
    model[5].weight.requires_grad_(False)  # frozen: nothing to train
    chosen = copied_parameters(model, exclude=[])
    assert [id(p) for p in chosen] == [id(model[1].weight), id(model[1].bias), id(model[5].bias)]
    assert copied_parameters(model, exclude=[model[1]]) == [model[5].bias]
    copies = ComputeCopies(model, torch.bfloat16)
    shared = [m for m in copies.module.modules() if isinstance(m, (nn.Embedding, nn.LayerNorm))]
    assert shared[0].weight is model[0].weight and shared[1].weight is model[3].weight
    assert copies.module[1].weight.dtype == torch.bfloat16 and copies.module[2].weight is model[2].weight
    assert maybe_compute_copies(model, None, True) is None  # float32 runs: nothing to copy
    assert maybe_compute_copies(model, torch.bfloat16, False) is None
    assert maybe_compute_copies(nn.Sequential(nn.LayerNorm(4)), torch.bfloat16, True) is None


def _simulated(schedule, copies_on, steps=3):
    from asyncpp_ext.models.registry import model_config
    from asyncpp_ext.training.build import build_data, build_simulator
    from asyncpp_ext.training.config import RunConfig

    cfg = RunConfig()
    cfg.model = model_config("llama-tiny")
    cfg.pipeline.schedule, cfg.pipeline.microbatches = schedule, 3
    cfg.train.dtype, cfg.train.compute_copies = "bf16", copies_on
    stream, eval_set = build_data(cfg)
    engine = build_simulator(cfg)
    losses = list(engine.train_steps(stream, steps))
    return engine, losses, [p.detach().clone() for p in engine.model.parameters()]


@pytest.mark.parametrize("schedule", ["sync", "2bw"])
def test_the_simulator_on_copies_trains_bitwise_as_with_autocast_casts(schedule):
    engine, losses, weights = _simulated(schedule, True)
    # llama-tiny: 2 blocks x 7 projections, and the head's own Parameter once the simulator untied it
    # from the embedding table (its gradient is summed into the table's after the microbatches)
    assert engine.copies is not None and len(engine.copies) == 2 * 7 + 1
    reference, ref_losses, ref_weights = _simulated(schedule, False)
    assert reference.copies is None
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights))


def test_the_cli_switches_copies_off_by_flag(tmp_path):
    from asyncpp_ext.training.arguments import build_parser, config_from_args

    args = build_parser().parse_args(["--model", "llama-tiny", "--no-compute-copies", "--out", str(tmp_path)])
    assert config_from_args(args).train.compute_copies is False
    args = build_parser().parse_args(["--model", "llama-tiny", "--out", str(tmp_path)])
    assert config_from_args(args).train.compute_copies is True


def _stage_run(copies_on, stage, stages=2):
    """A 2bw stage in one process, 3 steps of M microbatches, bf16 autocast: its losses (last stage)
    and every weight buffer after the steps."""
    from asyncpp_ext.pipeline.stage import StageHost

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
    g = torch.Generator().manual_seed(1)
    batch = ([torch.randn(3, 8, generator=g) for _ in range(M)], [torch.randn(3, 8, generator=g) for _ in range(M)])
    last = stage == stages - 1
    host = StageHost(module, stage=stage, stages=stages, schedule="2bw", microbatches=M,
                     optimizer_factory=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                     loss_fn=nn.functional.mse_loss if last else None, batch_source=lambda step: batch,
                     autocast_dtype=torch.bfloat16, compute_copies=copies_on)
    losses, refreshes = [], []
    host.on_step = lambda step, loss, skipped: losses.append(loss)
    if host.copies:
        for c in host.copies.sets:
            c.refresh = (lambda f: lambda: (refreshes.append(1), f())[1])(c.refresh)
    for step in range(3):
        for mb in range(M):
            host.forward(step, mb, step, batch[0][mb])
            host.backward(step, mb, step, None if last else batch[1][mb])
        host.optimizer_step(step, step + 1)
    return host, losses, [f.clone() for f in host.flat], len(refreshes)


@pytest.mark.parametrize("stage", [0, 1], ids=["first-stage", "last-stage"])
def test_a_2bw_stage_on_copies_trains_bitwise_as_with_autocast_casts(stage):
    host, losses, buffers, refreshes = _stage_run(True, stage)
    assert host.copies is not None and len(host.copies.sets) == 2  # one set per weight version (2bw)
    assert refreshes == 3  # once per version used (W(0), W(1), W(2)), not per microbatch
    assert host.memory_report()["compute_copies"] == 2 * (8 * 16 + 16 + 16 * 8 + 8) * 2
    reference, ref_losses, ref_buffers, _ = _stage_run(False, stage)
    assert reference.copies is None and reference.memory_report()["compute_copies"] == 0
    assert losses == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(buffers, ref_buffers))


@pytest.mark.multiproc
def test_a_bf16_pipeline_on_copies_equals_its_simulation_and_the_run_without(tmp_path):
    """--dtype bf16: real == --simulate == real without copies (the copies change no number).
    --dtype bf16-params: real == --simulate (evaluation included), and a computation of its own."""
    import json

    from asyncpp_ext.training.cli import main

    flags = ["--model", "llama-tiny", "--stages", "2", "--schedule", "2bw", "--microbatches", "2",
             "--micro-batch-size", "2", "--seq-len", "16", "--steps", "4", "--threads", "1",
             "--eval-every", "4", "--ckpt-every", "0", "--no-progress"]
    runs = {"real": ["--dtype", "bf16"], "sim": ["--dtype", "bf16", "--simulate"],
            "real-no-copies": ["--dtype", "bf16", "--no-compute-copies"],
            "params-real": ["--dtype", "bf16-params"], "params-sim": ["--dtype", "bf16-params", "--simulate"]}
    rows = {}
    for name, extra in runs.items():
        assert main(flags + extra + ["--out", str(tmp_path / name)]) == 0
        rows[name] = [json.loads(ln) for ln in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    losses = {name: [(r["loss"], r.get("eval_loss")) for r in rs] for name, rs in rows.items()}
    assert losses["real"] == losses["sim"] == losses["real-no-copies"], losses
    assert losses["params-real"] == losses["params-sim"], losses
    assert losses["params-real"] != losses["real"]  # bf16 activations: another rounding of the same model
    assert abs(losses["params-real"][-1][0] - losses["real"][-1][0]) < 0.01 * losses["real"][-1][0]


def test_bf16_params_computes_every_activation_in_bf16_from_fp32_masters():
    from asyncpp_ext.models.registry import model_config
    from asyncpp_ext.training.build import build_data, build_simulator
    from asyncpp_ext.training.config import RunConfig

    cfg = RunConfig()
    cfg.model = model_config("llama-tiny")
    cfg.pipeline.schedule, cfg.pipeline.microbatches, cfg.train.dtype = "sync", 2, "bf16-params"
    cfg.train.compute_copies = False  # bf16-params copies every parameter whatever this says
    stream, eval_set = build_data(cfg)
    engine = build_simulator(cfg)
    masters = list(engine.model.parameters())
    assert engine.copies is not None and len(engine.copies) == len(masters)  # every parameter
    outputs = []
    hooks = [b.register_forward_hook(lambda m, i, o: outputs.append(o.dtype)) for b in engine.copies.module.blocks()[:-1]]
    losses = list(engine.train_steps(stream, 6))
    for h in hooks:
        h.remove()
    assert set(outputs) == {torch.bfloat16}  # embedding and blocks: the residual stream is bf16
    assert all(p.dtype == torch.float32 for p in engine.model.parameters())
    assert all(c.dtype == torch.bfloat16 for c in engine.copies.copies)
    assert losses[-1] < losses[0]
    # evaluation computes as training does: on the copies, refreshed from the newest weights
    batch = eval_set[:2]
    got = engine.eval_loss(batch)
    with torch.no_grad():
        on_copies = sum(engine.loss_fn(engine.copies.module, x, y).item() for x, y in batch) / len(batch)
        on_masters = sum(engine.loss_fn(engine.model, x, y).item() for x, y in batch) / len(batch)
    assert got == on_copies and got != on_masters


def _lists(device, dtype, sizes=(7, 1 << 15, (1 << 16) + 3, 3 * 577)):
    g = torch.Generator().manual_seed(2)
    dsts = [torch.randn(n, generator=g).to(device) for n in sizes]
    srcs = [(torch.randn(n, generator=g) * 1e-3).to(device=device, dtype=dtype) for n in sizes]
    return dsts, srcs


def _offset_views(tensors, offsets):
    """Each tensor as a view starting ``offset`` elements into a buffer of its own: the CUDA
    kernel's 16-byte loads begin after a peel where dst and src share the offset, and run element
    by element where no common peel exists."""
    views = []
    for t, k in zip(tensors, offsets):
        buf = torch.zeros(t.numel() + 8, dtype=t.dtype, device=t.device)
        views.append(buf[k:k + t.numel()])
        views[-1].copy_(t)
    return views


def _check_fused_accumulate(device):
    from asyncpp_ext.optim import _kernels as K

    for dtype in (torch.bfloat16, torch.float32):
        for dst_at, src_at in ((None, None), ((1, 3, 0, 5), (1, 3, 0, 5)), ((0, 1, 2, 3), (1, 0, 3, 7))):
            dsts, srcs = _lists(device, dtype)
            if dst_at is not None:
                dsts, srcs = _offset_views(dsts, dst_at), _offset_views(srcs, src_at)
            want = [d.clone() for d in dsts]
            torch._foreach_add_(want, srcs)  # torch's mixed add: the reference the copies replace
            K.accumulate(dsts, srcs)
            assert all(torch.equal(a, b) for a, b in zip(dsts, want)), (dtype, dst_at, src_at)


def test_the_fused_accumulate_adds_exactly_as_torch_and_names_a_bad_argument():
    from asyncpp_ext.optim import _kernels as K

    _check_fused_accumulate("cpu")
    dsts, srcs = _lists("cpu", torch.bfloat16)
    for bad_dsts, bad_srcs, words in (
            (dsts, srcs[:-1], "srcs: expected 4 tensors"),
            (dsts, [s.half() for s in srcs], "srcs[0]: expected float32 or bfloat16"),
            (dsts, srcs[:1] + [s.float() for s in srcs[1:]], "srcs[1]"),
            (dsts, [srcs[0][:-1]] + srcs[1:], "srcs[0]"),
            ([d.bfloat16() for d in dsts], srcs, "dsts[0]"),
            ([dsts[0].view(7, 1).expand(7, 2)] + dsts[1:], [srcs[0].view(7, 1).expand(7, 2)] + srcs[1:], "dsts[0]")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            K.accumulate(bad_dsts, bad_srcs)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_copies_add_their_gradients_in_one_fused_call(monkeypatch, compiled):
    # compiled: the blocks' q/k/v and gate/up gradients come from the stacked weights, the others'
    # from their copies -- still one call for all of them
    from asyncpp_ext.models.compile import compile_blocks
    from asyncpp_ext.optim import _kernels as K

    calls = []
    real = K.accumulate
    monkeypatch.setattr(K, "accumulate", lambda dsts, srcs: (calls.append(len(dsts)), real(dsts, srcs))[1])
    cfg, _ = MODELS["llama-tied-plain"]
    model = build_model(cfg, seed=0)
    copies = ComputeCopies(model, torch.bfloat16)
    copies.refresh()
    if compiled:
        import torch._dynamo as dynamo

        dynamo.reset()
        compile_blocks(copies.module, backend=lambda gm, example_inputs: gm.forward)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _loss("plain")(copies.module, x, x).backward()
    if compiled:
        assert all(w.grad is not None for w, _ in copies.stacked) and len(copies.stacked) == 2 * cfg.n_layer
    copies.accumulate()
    assert calls == [len(copies)]


@pytest.mark.cuda
def test_the_fused_accumulate_on_a_gpu_adds_exactly_as_torch():
    _check_fused_accumulate("cuda")


@pytest.mark.slow
def test_compiled_blocks_on_copies_train_bitwise_as_compiled_autocast(tmp_path):
    """Inductor compiles the blocks of the compute module (bf16 weights, no casts) into other
    kernels than those of the autocast blocks (fp32 weights cast inside); the numbers stay the same.
    About a minute on two cores (two compiles)."""
    import json

    from asyncpp_ext.training.cli import main

    flags = ["--model", "llama-tiny", "--dtype", "bf16", "--compile", "--steps", "4", "--microbatches", "2",
             "--eval-every", "0", "--ckpt-every", "0", "--no-progress", "--threads", "1"]
    losses = []
    for name, extra in (("copies", []), ("casts", ["--no-compute-copies"])):
        assert main(flags + extra + ["--out", str(tmp_path / name)]) == 0
        losses.append([json.loads(ln)["loss"] for ln in (tmp_path / name / "metrics.jsonl").read_text().splitlines()])
    assert losses[0] == losses[1]


def test_without_usable_kernels_the_copies_add_through_torch(monkeypatch):
    """A build whose kernels cannot run on the device (a CPU-only build on a GPU machine) still
    trains on the copies: torch adds the gradients, the same sums."""
    from asyncpp_ext.optim import _kernels as K

    monkeypatch.setattr(K, "kernels_usable", lambda t: False)
    monkeypatch.setattr(K, "accumulate", lambda *a: pytest.fail("the kernel was called"))
    _, losses, weights = _simulated("sync", True)
    _, ref_losses, ref_weights = _simulated("sync", False)
    assert losses == ref_losses and all(torch.equal(a, b) for a, b in zip(weights, ref_weights))


def test_in_a_final_backward_the_copies_announce_each_master_as_its_gradient_arrives():
    # data parallelism's hooks (compute_copies.announce_final_grads): a copy's gradient, and a
    # stacked weight's row blocks, go into the masters' .grad as autograd produces them, and each
    # master is announced once; outside a final backward accumulate adds them as before
    from asyncpp_ext.models.llama import fused_linear

    model = build_model(_llama(False), seed=0)
    copies = ComputeCopies(model, torch.bfloat16)
    announced = []
    copies.announce_final_grads(announced.append)
    copies.refresh()
    attn = copies.module.layers[0].attn
    masters = dict(zip(map(id, copies.copies), copies.masters))
    qkv = [masters[id(getattr(attn, n).weight)] for n in ("q_proj", "k_proj", "v_proj")]
    x = torch.randn(3, attn.q_proj.in_features)
    for final in (False, True):
        for p in model.parameters():
            p.grad = None
        copies.start_final_backward(final)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            q, k, v = fused_linear(x, attn.q_proj, attn.k_proj, attn.v_proj, stacked=attn.stacked_weight)
            o = attn.o_proj(q)
        (o.float().sum() + k.float().square().sum() + v.float().sum()).backward()
        if not final:
            assert announced == [] and attn.stacked_weight.grad is not None
            copies.accumulate()
            plain = [p.grad.clone() for p in (*qkv, masters[id(attn.o_proj.weight)])]
        else:
            # o_proj's copy first (its gradient is final first), then the stacked rows in order
            assert [id(p) for p in announced] == [id(masters[id(attn.o_proj.weight)])] + [id(p) for p in qkv]
            assert attn.stacked_weight.grad is None and attn.o_proj.weight.grad is None
            copies.accumulate()  # nothing left to add
            got = [p.grad for p in (*qkv, masters[id(attn.o_proj.weight)])]
            assert all(torch.equal(a, b) for a, b in zip(got, plain))  # the same sums
    # a master reached through its copy and its stacked weight in one final backward: refused
    for p in model.parameters():
        p.grad = None
    copies.start_final_backward(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        both = attn.q_proj(x).float().sum() + fused_linear(x, attn.q_proj, attn.k_proj, attn.v_proj,
                                                           stacked=attn.stacked_weight)[0].float().sum()
    with pytest.raises(RuntimeError, match="grew after it was announced complete to data parallelism, through "
                                           "its compute copy and its stacked product"):
        both.backward()
