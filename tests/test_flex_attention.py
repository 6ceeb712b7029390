"""``--attention flex`` (models/attention.py, models/document_mask.py): the document mask held as a
FlexAttention BlockMask and attended by flex_attention, block-sparse. On the CPU flex_attention runs
forward only (no backward), unfused: these tests check the mask's rule, the models' outputs against
SDPA's with the boolean mask, compiled blocks taking each microbatch's BlockMask without
recompiling, and the refusals; training with it is CUDA's (the cuda-marked tests)."""
import copy
import json

import pytest
import torch

from asyncpp_ext.models import compile_support
from asyncpp_ext.models.attention import attention_preference, resolve_attention
from asyncpp_ext.models.compile import compile_blocks, uncompile
from asyncpp_ext.models.document_mask import (active_mask, document_mask, flex_block_mask, flex_masks,
                                              within_documents)
from asyncpp_ext.models.registry import build_model, model_config
from asyncpp_ext.training.cli import main as train
from packed_documents import SEP, packed_tokens as _tokens

BlockMask = pytest.importorskip("torch.nn.attention.flex_attention", reason="a torch without FlexAttention").BlockMask


def test_the_block_mask_allows_what_the_boolean_mask_does():
    """Every (query, key) pair of every row: the BlockMask's rule is document_mask's, exactly; and
    its blocks skip what lies wholly in earlier documents (fewer blocks than causal attention's)."""
    x = _tokens(2, 300, 0, boundaries=[(0, 40), (0, 170), (1, 129), (1, 299)])
    block = flex_block_mask(x, SEP)
    dense = document_mask(x, SEP)[:, 0]
    q, k = torch.arange(300)[:, None], torch.arange(300)[None, :]
    for row in range(2):
        assert torch.equal(block.mask_mod(torch.tensor(row), torch.tensor(0), q, k), dense[row])
    causal_blocks = 3 * 4 // 2  # 300 positions in blocks of 128: 3 query blocks, 6 causal key blocks
    assert int(block.kv_num_blocks[0, 0].sum() + block.full_kv_num_blocks[0, 0].sum()) < causal_blocks


@pytest.mark.parametrize("name", ["llama-tiny", "tiny"])
def test_the_models_attend_by_a_block_mask_as_by_the_boolean_one(name):
    """The whole model's output under flex_masks (a BlockMask held, flex_attention run) against
    SDPA with the boolean mask: equal to float rounding; and a document still sees nothing of the
    one before it."""
    model = build_model(model_config(name, seq_len=64), seed=0).eval()
    x = _tokens(2, 48, 0, boundaries=[(0, 10), (1, 10), (1, 30)])
    other = x.clone()
    other[:, :10] = _tokens(2, 10, 1)
    with torch.no_grad():
        with within_documents(x, SEP):
            assert isinstance(active_mask(), torch.Tensor)
            want = model(x)[0]
        with flex_masks():
            with within_documents(x, SEP):
                assert isinstance(active_mask(), BlockMask)
                got = model(x)[0]
            with within_documents(other, SEP):
                got_other = model(other)[0]
        plain = model(x)[0]
    assert torch.allclose(got, want, rtol=0, atol=2e-5)
    assert torch.allclose(got[:, 10:], got_other[:, 10:], rtol=0, atol=1e-6)
    assert (got - plain).abs().max() > 1e-3  # the mask does something


def test_compiled_blocks_take_each_microbatchs_block_mask_without_recompiling():
    """aot_eager under no_grad (the CPU's flex_attention has no backward): a BlockMask read from
    the held slot is a graph input -- its tensors and the closure's document ids --, so four
    microbatches' masks compile nothing after the first and each gives its own output."""
    model = build_model(model_config("llama-tiny", n_layer=2, seq_len=64), seed=0).eval()
    eager = copy.deepcopy(model)
    report = compile_blocks(model, device="cpu", backend="aot_eager")
    outs, after_first = [], None
    with torch.no_grad(), flex_masks():
        for i in range(4):
            x = _tokens(3, 40, 10 + i, boundaries=[(0, 3 + i), (2, 20 - i)])
            with within_documents(x, SEP):
                got, want = model(x)[0], eager(x)[0]
            assert torch.allclose(got, want, rtol=0, atol=1e-5)
            outs.append(got)
            after_first = after_first or dict(report.compiles)
    assert dict(report.compiles) == after_first and not report.fallbacks
    assert not torch.allclose(outs[0], outs[1], atol=1e-3)
    uncompile(model)


def test_the_preference_holds_flex_masks_and_gives_them_back():
    x = _tokens(1, 8, 0, boundaries=[(0, 4)])
    with attention_preference("flex"):
        with within_documents(x, SEP):
            assert isinstance(active_mask(), BlockMask)
    with within_documents(x, SEP):
        assert isinstance(active_mask(), torch.Tensor)
    assert resolve_attention("flex", "cuda") == "flex"
    with pytest.raises(ValueError, match="^--attention flex picks a CUDA attention kernel.*--device cuda"):
        resolve_attention("flex", "cpu")


@pytest.mark.parametrize("train_cfg, model_cfg, message", [
    ({}, {}, "--attention flex runs the document mask's attention block-sparse; add --document-mask"),
    ({"document_mask": 0, "compile": False}, {}, "--attention flex runs fused only in compiled blocks, but --no-compile"),
    ({"document_mask": 0}, {"arch": "hf", "hf_config": {"model_type": "llama"}},
     "--attention flex runs the package's own models' attention"),
])
def test_where_flex_cannot_do_its_job_stage_compute_refuses(monkeypatch, train_cfg, model_cfg, message):
    from asyncpp_ext.training.config import RunConfig
    from asyncpp_ext.training.stage_compute import stage_compute

    monkeypatch.setattr(compile_support, "compile_unavailable_reason", lambda device, **kw: None)
    cfg = RunConfig.from_dict({"train": {"attention": "flex", **train_cfg}})
    for key, value in model_cfg.items():
        setattr(cfg.model, key, value)
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        stage_compute(cfg, "cuda")
    if not train_cfg:  # with the mask and compiled blocks: flex
        cfg.train.document_mask = 0
        assert stage_compute(cfg, "cuda").attention == "flex"


def test_flex_on_the_cpu_is_one_line(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(["--model", "tiny", "--seq-len", "16", "--steps", "2", "--simulate", "--no-progress",
                  "--document-mask", "10", "--attention", "flex", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--attention flex picks a CUDA attention kernel" in err[0], err
    assert not out.exists()


def test_the_pipeline_api_refuses_flex_training_off_cuda():
    """A script holding attention_preference("flex") around a CPU Pipeline with a document mask:
    one line at construction (before anything is built), not flex_attention's error from the
    stage's worker at the first backward; without the mask, without the preference or on CUDA,
    nothing to refuse."""
    from asyncpp_ext.models.document_mask import check_document_mask
    from asyncpp_ext.pipeline import Pipeline

    model = build_model(model_config("tiny"), seed=0)
    with attention_preference("flex"):
        with pytest.raises(ValueError, match=r"^document_mask under attention_preference\('flex'\) trains by "
                                             "flex_attention, which has no backward on cpu"):
            Pipeline(model, loss_fn=type(model).loss, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                     stages=1, document_mask=SEP)
        check_document_mask(None, device="cpu")
        check_document_mask(SEP, device="cuda:0")
    check_document_mask(SEP, device="cpu")


def test_a_hugging_face_layer_refuses_a_block_mask():
    pytest.importorskip("transformers")
    from asyncpp_ext.training.model_source import hf_model_config

    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 256, "max_position_embeddings": 64,
              "tie_word_embeddings": True}
    model = build_model(hf_model_config(config, "test"), seed=0).eval()
    x = _tokens(1, 16, 0, boundaries=[(0, 5)])
    with torch.no_grad(), flex_masks(), within_documents(x, SEP):
        with pytest.raises(ValueError, match="take the document mask as a tensor"):
            model(x)


# ---- CUDA: training by flex_attention ------------------------------------------------------------
def _cuda_flags(data, out):
    return ["--model", "llama-tiny", "--vocab-size", "256", "--data", str(data), "--seq-len", "256",
            "--micro-batch-size", "2", "--microbatches", "2", "--steps", "4", "--eval-every", "2",
            "--eval-batches", "1", "--no-checkpoints", "--no-progress", "--device", "cuda", "--seed", "0",
            "--schedule", "2bw", "--stages", "2", "--document-mask", "10", "--out", str(out)]


@pytest.mark.cuda
def test_on_cuda_flex_trains_as_sdpa_with_the_mask_and_a_pipeline_as_its_simulation(tmp_path):
    """Compiled blocks, bf16, each line of the corpus a document: the flex run's losses follow the
    SDPA-with-mask run's (the same attention by other kernels: bf16 rounding apart), and a 2-stage
    2bw pipeline sharing the GPU equals its simulation within test_cuda_graphs' bound for
    compiled bf16 runs (both hold the preference). The mask's own correctness on the GPU is the
    gradient test's below."""
    from asyncpp_ext.data import builtin_corpus

    data = tmp_path / "corpus.txt"
    data.write_bytes(bytes(builtin_corpus()[:200000]))
    curves = {}
    for name, flags in (("sdpa", ["--simulate"]), ("flex", ["--simulate", "--attention", "flex"]),
                        ("pipe", ["--transport", "gloo", "--attention", "flex", "--timeout", "300"])):
        assert train([*_cuda_flags(data, tmp_path / name), *flags]) == 0
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        curves[name] = [v for r in rows for v in (r["loss"], r.get("eval_loss")) if v is not None]
    assert all(abs(p - f) <= 1e-3 * abs(f) for p, f in zip(curves["pipe"], curves["flex"])), curves
    assert all(abs(f - s) <= 5e-3 * abs(s) for f, s in zip(curves["flex"], curves["sdpa"])), curves
    assert len(curves["flex"]) == len(curves["sdpa"]) == len(curves["pipe"]) == 6  # 4 losses, 2 evaluations


@pytest.mark.cuda
def test_on_cuda_compiled_flex_gradients_match_sdpa_with_the_mask():
    """fp32, one compiled llama block's forward and backward under each kernel: outputs and every
    weight gradient within float32 rounding of each other."""
    torch.manual_seed(0)
    model = build_model(model_config("llama-tiny", n_layer=2, seq_len=256), seed=0).cuda()
    flex_model = copy.deepcopy(model)
    compile_blocks(flex_model, device="cuda")
    x = _tokens(2, 256, 0, boundaries=[(0, 60), (1, 130), (1, 200)]).cuda()
    with within_documents(x, SEP):
        want = model(x)[0]
        want.square().mean().backward()
    with flex_masks(), within_documents(x, SEP):
        got = flex_model(x)[0]
        got.square().mean().backward()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
    for (name, a), b in zip(model.named_parameters(), flex_model.parameters()):
        assert torch.allclose(b.grad, a.grad, rtol=1e-3, atol=1e-5), name
    uncompile(flex_model)
