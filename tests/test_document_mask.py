"""Attention within documents (``--document-mask``, models/document_mask.py): a position attends
only to the earlier positions of its own document, documents starting at the boundary token; the
same in one process, a pipeline (whose every stage masks, recomputed or not), its evaluation and
asyncpp-eval; compiled blocks read each microbatch's mask without recompiling."""
import copy
import json

import pytest
import torch

from asyncpp_ext.eval import main as evaluate
from asyncpp_ext.models.compile import compile_blocks, uncompile
from asyncpp_ext.models.document_mask import check_document_mask, document_ids, document_mask, within_documents
from asyncpp_ext.models.registry import build_model, model_config
from asyncpp_ext.training.cli import main as train
from bpe_tokenizer import train_bpe
from packed_documents import SEP, packed_tokens as _tokens


def test_the_boundary_token_starts_a_segment():
    x = torch.tensor([[5, 0, 7, 8, 0, 9]])
    assert document_ids(x, 0).tolist() == [[0, 1, 1, 1, 2, 2]]
    allowed = document_mask(x, 0)[0, 0].int().tolist()
    assert allowed == [[1, 0, 0, 0, 0, 0],
                       [0, 1, 0, 0, 0, 0],
                       [0, 1, 1, 0, 0, 0],
                       [0, 1, 1, 1, 0, 0],
                       [0, 0, 0, 0, 1, 0],
                       [0, 0, 0, 0, 1, 1]]
    # no boundary: plain causal
    assert torch.equal(document_mask(torch.tensor([[4, 4, 4]]), 0)[0, 0], torch.ones(3, 3, dtype=torch.bool).tril())


@torch.no_grad()
def _outputs_with_another_first_document(model):
    """(masked, masked with another first document, plain, plain with it) of a window whose first
    document ends at position 10 (and, in row 1, a third starts at 20)."""
    x = _tokens(2, 32, 0, boundaries=[(0, 10), (1, 10), (1, 20)])
    other = x.clone()
    other[:, :10] = _tokens(2, 10, 1)  # another first document
    with within_documents(x, SEP):
        masked = model(x)[0]
    with within_documents(other, SEP):
        masked_other = model(other)[0]
    return masked, masked_other, model(x)[0], model(other)[0]


@pytest.mark.parametrize("name", ["llama-tiny", "tiny"])
def test_a_document_sees_nothing_of_the_one_before(name):
    model = build_model(model_config(name), seed=0).eval()
    masked, masked_other, plain, plain_other = _outputs_with_another_first_document(model)
    assert torch.equal(masked[:, 10:], masked_other[:, 10:])  # bit for bit: masked keys weigh exactly 0
    assert (plain[:, 10:] - plain_other[:, 10:]).abs().max() > 1e-3  # the whole window: they leak
    assert torch.equal(masked[:, :10], plain[:, :10])  # the first document: causal attention as before


HF_CONFIGS = {  # transformers' own layers (models/hf.py): the Llama family, a sliding window, GPT-2
    "hf-llama": {"model_type": "llama", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
                 "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                 "max_position_embeddings": 64, "tie_word_embeddings": True},
    "hf-mistral-window": {"model_type": "mistral", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "max_position_embeddings": 64, "sliding_window": 8},
    "hf-gpt2": {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64},
}


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_a_hugging_face_models_layers_mask_alike(name):
    """The adapter hands the mask to transformers' layers (with a sliding window's, both): the next
    document's outputs do not see the one before, and a window without a boundary is causal
    attention bit for bit."""
    pytest.importorskip("transformers")
    from asyncpp_ext.models.registry import ModelConfig

    model = build_model(ModelConfig(arch="hf", vocab_size=256, seq_len=64, n_layer=2, hf_config=HF_CONFIGS[name]),
                        seed=0).eval()
    masked, masked_other, plain, plain_other = _outputs_with_another_first_document(model)
    with torch.no_grad(), within_documents(_tokens(2, 32, 2), SEP):  # no boundary in the window
        one_document = model(_tokens(2, 32, 0, boundaries=[(0, 10), (1, 10), (1, 20)]))[0]
    assert torch.equal(masked[:, 10:], masked_other[:, 10:])
    assert (plain[:, 10:] - plain_other[:, 10:]).abs().max() > 1e-3
    assert torch.equal(one_document, plain)


def test_with_rotary_positions_a_packed_document_is_the_document_alone():
    model = build_model(model_config("llama-tiny"), seed=0).eval()
    x = _tokens(1, 32, 2, boundaries=[(0, 12)])
    with torch.no_grad():
        with within_documents(x, SEP):
            packed = model(x)[0]
        alone = model(x[:, 12:])[0]
    assert torch.allclose(packed[:, 12:], alone, rtol=0, atol=1e-5)  # rotary attention is relative


def test_compiled_blocks_read_each_microbatchs_mask_without_recompiling():
    """aot_eager: dynamo's guards decide recompilation (test_compile.py says why it stands for
    inductor here). A compiler that baked the first mask in would fail the later comparisons. The
    count is taken after the first microbatch: what this process compiled before for these block
    types (other shapes, no mask) may add compiles to the first one (dynamo's automatic dynamic
    shapes), never to the next."""
    model = build_model(model_config("llama-tiny", n_layer=2), seed=0)
    eager = copy.deepcopy(model)
    report = compile_blocks(model, device="cpu", backend="aot_eager")
    masks = [_tokens(3, 17, 10 + i, boundaries=[(0, 3 + i), (2, 9 - i)]) for i in range(4)]
    outs, after_first = [], None
    for x in masks:
        with within_documents(x, SEP):
            got, want = model(x)[0], eager(x)[0]
            got.sum().backward()
        assert torch.allclose(got, want, rtol=0, atol=1e-5)
        outs.append(got.detach())
        after_first = after_first or dict(report.compiles)
    assert dict(report.compiles) == after_first  # three more masks, nothing compiled
    assert set(after_first) == {"LlamaEmbedding", "LlamaBlock", "LlamaHead"} and not report.fallbacks
    assert not torch.allclose(outs[0], outs[1], atol=1e-3)
    uncompile(model)


# ---- runs ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """A BPE corpus of many documents (the built-in text split at blank lines), <|endoftext|> after
    each, as asyncpp-prepare-data writes it."""
    from asyncpp_ext.data import builtin_corpus
    from asyncpp_ext.data import prepare as prep

    root = tmp_path_factory.mktemp("documents")
    text = bytes(builtin_corpus()[:60000]).decode("utf-8", "ignore")
    train_bpe(root / "tokenizer.json", text, 300, special_tokens=("<|endoftext|>",))
    (root / "corpus.txt").write_text(text)
    assert prep.main(["--tokenizer", str(root / "tokenizer.json"), "--input", str(root / "corpus.txt"),
                      "--doc-separator", "\\n\\n", "--out", str(root / "d.bin")]) == 0
    return root / "d.bin"


def _flags(data):
    return ["--model", "llama-tiny", "--vocab-size", "320", "--data", str(data), "--seq-len", "64",
            "--micro-batch-size", "2", "--microbatches", "3", "--steps", "4", "--eval-every", "2",
            "--eval-batches", "2", "--no-checkpoints", "--no-progress", "--threads", "1"]


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _curve(run):
    return [(r["loss"], r.get("eval_loss")) for r in _rows(run)]


def test_a_pipelines_every_stage_masks_as_its_simulation(tmp_path, documents):
    runs = {}
    for name, flags in (("sim", ["--simulate", "--document-mask"]),
                        ("three", ["--stages", "3", "--timeout", "60", "--document-mask"]),
                        ("recompute", ["--stages", "2", "--timeout", "60", "--recompute", "--document-mask"]),
                        ("none", ["--simulate"])):
        assert train([*_flags(documents), *flags, "--out", str(tmp_path / name)]) == 0
        runs[name] = _curve(tmp_path / name)
    assert runs["three"] == runs["sim"] == runs["recompute"]  # losses and eval losses, list equality
    assert runs["sim"][0][0] != runs["none"][0][0] and runs["sim"][3] != runs["none"][3]
    assert json.loads((tmp_path / "sim" / "config.json").read_text())["train"]["document_mask"] == "data"


def test_data_parallel_replicas_mask_their_own_rows(tmp_path, documents):
    """2 replicas of 1 sequence against one process of 2: each replica masks by its own rows' ids
    (the same sequences; gradients summed in another order, equal to float rounding). A replica
    masking by another row's documents would be off by far more."""
    runs = {}
    for name, extra in (("sim", ["--simulate", "--micro-batch-size", "2"]),
                        ("dp", ["--dp", "2", "--micro-batch-size", "1", "--timeout", "60"])):
        assert train([*_flags(documents), *extra, "--document-mask", "--out", str(tmp_path / name)]) == 0
        runs[name] = _curve(tmp_path / name)
    assert [e is None for _, e in runs["dp"]] == [e is None for _, e in runs["sim"]]
    got = [x for row in runs["dp"] for x in row if x is not None]
    assert got == pytest.approx([x for row in runs["sim"] for x in row if x is not None], rel=1e-5)


def test_a_hugging_face_models_pipeline_masks_as_its_simulation(tmp_path, documents):
    pytest.importorskip("transformers")
    config = tmp_path / "qwen2.json"
    config.write_text(json.dumps({**HF_CONFIGS["hf-llama"], "model_type": "qwen2", "vocab_size": 320}))
    flags = [f for f in _flags(documents) if f not in ("llama-tiny", "--model", "--vocab-size", "320")]
    runs = {}
    for name, extra in (("sim", ["--simulate", "--document-mask"]), ("pipe", ["--stages", "2", "--timeout", "60",
                                                                           "--document-mask"]),
                        ("none", ["--simulate"])):
        assert train(["--hf-config", str(config), *flags, *extra, "--out", str(tmp_path / name)]) == 0
        runs[name] = _curve(tmp_path / name)
    assert runs["pipe"] == runs["sim"] != runs["none"]


def test_asyncpp_eval_masks_as_the_run_did(tmp_path, documents):
    run = tmp_path / "run"
    flags = [f for f in _flags(documents) if f != "--no-checkpoints"]
    assert train([*flags, "--simulate", "--document-mask", "0", "--out", str(run)]) == 0  # <|endoftext|> is id 0
    assert evaluate([str(run), "--json", str(tmp_path / "rows.json")]) == 0
    row, = json.loads((tmp_path / "rows.json").read_text())
    assert row["loss"] == pytest.approx(_rows(run)[-1]["eval_loss"], rel=1e-6)


def test_an_explicit_id_masks_data_without_a_sidecar(tmp_path):
    """The built-in corpus is bytes without boundaries: the newline (10) taken as one."""
    flags = ["--model", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--microbatches", "2", "--steps", "3",
             "--eval-every", "0", "--no-checkpoints", "--no-progress", "--threads", "1", "--simulate"]
    for name, extra in (("lines", ["--document-mask", "10"]), ("none", [])):
        assert train([*flags, *extra, "--out", str(tmp_path / name)]) == 0
    assert _curve(tmp_path / "lines")[0] != _curve(tmp_path / "none")[0]


@pytest.mark.parametrize("extra, message", [
    (["--document-mask"], "records no document boundary token"),  # the built-in corpus: bytes
    (["--document-mask", "300"], "train.document_mask must be 'data' or a token id in [0, 256)"),
    (["--document-mask", "x"], "is not a token id"),
])
def test_bad_document_masks_are_one_line(tmp_path, capsys, extra, message):
    out = tmp_path / "run"
    assert train(["--model", "tiny", "--seq-len", "16", "--steps", "2", "--simulate", "--no-progress", *extra,
                  "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_a_resume_keeps_the_mask_and_refuses_another(tmp_path, capsys, documents):
    run = tmp_path / "run"
    flags = [f for f in _flags(documents) if f != "--no-checkpoints"]
    assert train([*flags, "--simulate", "--document-mask", "--out", str(run)]) == 0
    capsys.readouterr()
    assert train([*flags, "--simulate", "--steps", "6", "--document-mask", "5", "--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "document_mask" in err[0], err
    assert train([*flags, "--simulate", "--steps", "6", "--resume", str(run)]) == 0
    # the id the data records (<|endoftext|>, 0) is the same mask as "data"
    assert train([*flags, "--simulate", "--steps", "8", "--document-mask", "0", "--resume", str(run)]) == 0


def test_the_pipeline_api_checks_its_document_mask():
    from asyncpp_ext.pipeline import Pipeline

    check_document_mask(None, cuda_graphs=True)
    with pytest.raises(ValueError, match="cannot run with cuda_graphs"):
        check_document_mask(0, cuda_graphs=True)
    model = build_model(model_config("tiny"), seed=0)
    for bad in (-1, True, "data"):
        with pytest.raises(ValueError, match="document_mask must be a token id"):
            Pipeline(model, loss_fn=type(model).loss, optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
                     stages=1, document_mask=bad)


@pytest.mark.cuda
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_on_cuda_a_document_sees_nothing_of_the_one_before(compiled):
    """The GPU's attention kernels under the mask (SDPA with a boolean mask: cuDNN's or the
    memory-efficient kernel; compiled: inductor's lowering of it), bf16 autocast: the next
    document's outputs unchanged by the one before, which they see without the mask."""
    model = build_model(model_config("llama-tiny"), seed=0).cuda().eval()
    if compiled:
        compile_blocks(model, device="cuda")
    x = _tokens(2, 32, 0, boundaries=[(0, 10), (1, 10), (1, 20)]).cuda()
    other = x.clone()
    other[:, :10] = _tokens(2, 10, 1).cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        with within_documents(x, SEP):
            masked = model(x)[0].float()
        with within_documents(other, SEP):
            masked_other = model(other)[0].float()
        plain, plain_other = model(x)[0].float(), model(other)[0].float()
    assert torch.allclose(masked[:, 10:], masked_other[:, 10:], rtol=0, atol=1e-6)
    assert (plain[:, 10:] - plain_other[:, 10:]).abs().max() > 1e-3
    if compiled:
        uncompile(model)
