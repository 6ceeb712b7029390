"""``asyncpp-export``: a run's checkpoint as a Hugging Face model directory that transformers loads
and computes the checkpoint's logits with (gpt -> GPT-2, llama -> Llama, a --hf-config model as
itself), merged from a pipeline's shards, in fp32 or bf16, with the tokenizer the run's data was
prepared with; bad inputs give one line, exit 2 and no directory."""
import json
import shutil
import signal
import sys

import pytest
import torch

from asyncpp_ext.models import hf_export
from asyncpp_ext.models.registry import build_model
from asyncpp_ext.training import export as ex
from asyncpp_ext.training.checkpoint import checkpoint_named
from asyncpp_ext.training.cli import main as train
from bpe_tokenizer import bpe_llama_run

transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install 'asyncpp_ext[hf]'")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="safetensors is not installed")

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

QWEN2 = {"model_type": "qwen2", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 64, "tie_word_embeddings": True, "rope_theta": 50000.0}
GPT2 = {"model_type": "gpt2", "vocab_size": 256, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
        "bos_token_id": None, "eos_token_id": None}
RUNS = {
    # a pipeline of two real stages: the tied embedding and head live on different stages
    "llama-2stage-2bw": ["--model", "llama-tiny", "--stages", "2", "--schedule", "2bw", "--optimizer", "muon"],
    "gpt": ["--model", "tiny", "--simulate"],
    "hf-qwen2": ["--hf-config", "qwen2.json", "--seq-len", "32", "--simulate"],
    "hf-gpt2": ["--hf-config", "gpt2.json", "--seq-len", "32", "--simulate"],
}
ARCHITECTURE = {"llama-2stage-2bw": "LlamaForCausalLM", "gpt": "GPT2LMHeadModel", "hf-qwen2": "Qwen2ForCausalLM",
                "hf-gpt2": "GPT2LMHeadModel"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Each RUNS entry trained 4 steps (AdamW unless named), its run directory by name."""
    root = tmp_path_factory.mktemp("export_runs")
    (root / "qwen2.json").write_text(json.dumps(QWEN2))
    (root / "gpt2.json").write_text(json.dumps(GPT2))
    dirs = {}
    for name, flags in RUNS.items():
        flags = [str(root / f) if f.endswith(".json") else f for f in flags]
        dirs[name] = root / name
        assert train([*flags, "--steps", "4", "--no-progress", "--eval-batches", "0",
                      "--out", str(dirs[name])]) == 0
    return dirs


def _export(argv, capsys):
    rc = ex.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err.splitlines()


def _load(directory):
    return transformers.AutoModelForCausalLM.from_pretrained(str(directory)).eval()  # fp32 exports: float32


def _checkpoint_model(run_dir):
    """(run config, the run's model holding its latest checkpoint's newest weights)."""
    cfg, _, model = ex.load_model(checkpoint_named(str(run_dir), "RUN"))
    return cfg, model


@pytest.mark.parametrize("name", list(RUNS))
def test_transformers_computes_the_checkpoints_logits_from_the_export(name, runs, tmp_path, capsys):
    out = tmp_path / "model"
    rc, lines, err = _export([runs[name], "--out", out], capsys)
    assert rc == 0 and err == [], err
    assert lines[0].startswith(f"{runs[name]}/ckpt-000004 (step 4") and ARCHITECTURE[name] in lines[1]
    assert "check: transformers' logits match" in lines[-1]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not list(tmp_path.glob(".tmp-export-*"))
    cfg, ours = _checkpoint_model(runs[name])
    # the weights are the trained ones, not the seed's initialisation
    fresh = build_model(cfg.model.__class__(**{**cfg.model.to_dict(), "hf_model": None}), seed=cfg.train.seed)
    assert any(not torch.equal(a, b) for a, b in zip(ours.parameters(), fresh.parameters()))
    theirs = _load(out)
    assert type(theirs).__name__ == ARCHITECTURE[name]
    ids = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, _ = ours(ids)
        got = theirs(input_ids=ids).logits
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # a tied head is stored once and tied again by transformers
    stored = safetensors_torch.load_file(str(out / "model.safetensors"))
    assert ("lm_head.weight" in stored) == (name == "gpt")
    assert theirs.get_output_embeddings().weight.data_ptr() == theirs.get_input_embeddings().weight.data_ptr() \
        or name == "gpt"


def test_a_document_mask_run_says_transformers_attends_across_documents(runs, tmp_path, capsys):
    run = tmp_path / "masked"
    assert train(["--model", "tiny", "--simulate", "--document-mask", "10", "--steps", "2", "--no-progress",
                  "--eval-batches", "0", "--out", str(run)]) == 0
    capsys.readouterr()
    for source, said in ((run, True), (runs["gpt"], False)):
        rc, lines, err = _export([source, "--out", tmp_path / f"model-{said}", "--no-check"], capsys)
        assert rc == 0 and err == [], err
        note = "  attention: the run trained within documents (--document-mask, token 10); transformers' model " \
               "attends across them: give it one document at a time"
        assert (note in lines) == said, lines


def test_an_exported_hf_run_is_what_hf_model_continues_from(runs, tmp_path, capsys):
    from asyncpp_ext.models import hf

    out = tmp_path / "model"
    assert _export([runs["hf-qwen2"], "--out", out], capsys)[0] == 0
    _, ours = _checkpoint_model(runs["hf-qwen2"])
    again = hf.from_pretrained(out)  # what asyncpp-train --hf-model reads
    want, got = ours.hf_state_dict(), again.hf_state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    # continuing from the exported directory trains as continuing from the checkpoint itself
    common = ["--seq-len", "32", "--simulate", "--steps", "3", "--no-progress", "--eval-batches", "0"]
    assert train(["--hf-model", str(out), *common, "--out", str(tmp_path / "from-export")]) == 0
    assert train(["--init-from", str(runs["hf-qwen2"]), *common, "--out", str(tmp_path / "from-ckpt")]) == 0
    losses = [[json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
              for run in ("from-export", "from-ckpt")]
    assert losses[0] == losses[1]


def test_bf16_export_holds_each_weight_rounded_and_the_logits_of_those(runs, tmp_path, capsys):
    out = tmp_path / "model"
    rc, lines, _ = _export([runs["llama-2stage-2bw"], "--out", out, "--dtype", "bf16"], capsys)
    assert rc == 0 and "bfloat16" in lines[1]
    stored = safetensors_torch.load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    _, ours = _checkpoint_model(runs["llama-2stage-2bw"])
    assert torch.equal(stored["model.embed_tokens.weight"], ours.embed.tok.weight.to(torch.bfloat16))
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.fixture(scope="module")
def tokenized_run(tmp_path_factory):
    """A llama-tiny run on data prepared with a byte-level BPE whose documents end in <|endoftext|>."""
    root = tmp_path_factory.mktemp("tokenized")
    bpe_llama_run(root, 60_000, 400, model_vocab=400)
    return root


def test_the_tokenizer_the_data_was_prepared_with_goes_along(tokenized_run, tmp_path, capsys):
    out = tmp_path / "model"
    rc, lines, _ = _export([tokenized_run / "run", "--out", out], capsys)
    assert rc == 0 and "the one the run's --data was prepared with" in lines[2]
    assert (out / "tokenizer.json").read_bytes() == (tokenized_run / "tokenizer.json").read_bytes()
    config = json.loads((out / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.eos_token == "<|endoftext|>" and config["eos_token_id"] == tokenizer.eos_token_id
    text = "def f(x):\n    return x + 1\n"
    import tokenizers
    assert tokenizer(text)["input_ids"] == tokenizers.Tokenizer.from_file(
        str(tokenized_run / "tokenizer.json")).encode(text).ids
    # none: the weights alone
    rc, lines, _ = _export([tokenized_run / "run", "--out", tmp_path / "bare", "--tokenizer", "none"], capsys)
    assert rc == 0 and sorted(p.name for p in (tmp_path / "bare").iterdir()) == ["config.json", "model.safetensors"]


def _refused(argv, capsys, out):
    rc, lines, err = _export(argv, capsys)
    assert rc == 2 and lines == [] and len(err) == 1 and err[0].startswith("asyncpp-export: error: "), err
    assert not out.exists() or not any(out.iterdir())
    assert not list(out.parent.glob(".tmp-export-*"))
    return err[0]


def test_bad_inputs_give_one_line_and_write_nothing(runs, tokenized_run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "model"
    run = runs["llama-2stage-2bw"]
    assert "is not a directory" in _refused([tmp_path / "nothing", "--out", out], capsys, out)
    assert "no checkpoint" in _refused([tmp_path, "--out", out], capsys, out)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "not an empty directory" in _refused([run, "--out", tmp_path / "full"], capsys, out)
    assert "invalid choice" in _refused([run, "--out", out, "--dtype", "fp16"], capsys, out)
    assert "trained on UTF-8 bytes" in _refused(
        [run, "--out", out, "--tokenizer", tokenized_run / "tokenizer.json"], capsys, out)
    other = tmp_path / "other.json"  # another tokenizer of a vocabulary the model could embed
    text = json.loads((tokenized_run / "tokenizer.json").read_text())
    text["model"]["merges"] = text["model"]["merges"][:-1]
    other.write_text(json.dumps(text))
    assert "is not the tokenizer the run's --data was prepared with" in _refused(
        [tokenized_run / "run", "--out", out, "--tokenizer", other], capsys, out)
    # a damaged shard
    damaged = tmp_path / "damaged"
    shutil.copytree(run, damaged)
    shard = next(damaged.glob("ckpt-*/stage-01.pt"))
    shard.write_bytes(shard.read_bytes()[:-10])
    assert "truncated" in _refused([damaged, "--out", out], capsys, out)
    # missing extras
    monkeypatch.setitem(sys.modules, "transformers", None)  # as where it is not installed
    assert "--no-check" in _refused([run, "--out", out], capsys, out)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    assert "pip install 'asyncpp_ext[hf]'" in _refused([run, "--out", out, "--no-check"], capsys, out)


def test_a_mapping_that_computes_something_else_fails_the_check_and_writes_nothing(runs, tmp_path, capsys,
                                                                                   monkeypatch):
    right = hf_export.EXPORTERS["llama"]

    def swapped(model, cfg):  # key and value projections exchanged: same shapes, other logits
        config, tensors = right(model, cfg)
        for name in [n for n in tensors if ".k_proj." in n]:
            v = name.replace(".k_proj.", ".v_proj.")
            tensors[name], tensors[v] = tensors[v], tensors[name]
        return config, tensors

    monkeypatch.setitem(hf_export.EXPORTERS, "llama", swapped)
    out = tmp_path / "model"
    rc, lines, err = _export([runs["llama-2stage-2bw"], "--out", out], capsys)
    assert rc == 1 and len(err) == 1 and "logits from the written files differ" in err[0], err
    assert not out.exists() and not list(tmp_path.glob(".tmp-export-*"))


def test_a_stop_signal_while_checking_leaves_nothing(runs, tmp_path, capsys, monkeypatch):
    from asyncpp_ext.stop_signals import Stopped

    def stopped(*args):  # SIGTERM lands while transformers loads the written files
        assert list(tmp_path.glob(".tmp-export-*"))  # they are there, under their temporary name
        raise Stopped(signal.SIGTERM)

    monkeypatch.setattr(ex, "check_logits", stopped)
    out = tmp_path / "model"
    rc, lines, err = _export([runs["gpt"], "--out", out], capsys)
    assert rc == 128 + signal.SIGTERM and err[-1] == "asyncpp-export: stopped by SIGTERM; nothing was written"
    assert not out.exists() and not list(tmp_path.glob(".tmp-export-*"))


def test_a_hf_run_without_transformers_is_one_line(runs, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # as where it is not installed
    out = tmp_path / "model"
    assert "pip install 'asyncpp_ext[hf]'" in _refused([runs["hf-qwen2"], "--out", out, "--no-check"], capsys, out)


def test_a_scripts_model_exports_from_its_own_config(tmp_path):
    from asyncpp_ext.models import GPT, preset_config

    cfg = preset_config("tiny")
    model = GPT(cfg, seed=3).eval()
    config, tensors = hf_export.to_transformers(model, cfg)  # a GPTConfig, as a script has it
    (tmp_path / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(_load(tmp_path)(input_ids=ids).logits, model(ids)[0], rtol=0, atol=1e-5)


def test_weights_past_the_shard_size_go_into_indexed_shards_transformers_loads(runs, tmp_path, capsys):
    out = tmp_path / "model"
    rc, lines, _ = _export([runs["gpt"], "--out", out, "--max-shard-size", "30KB"], capsys)
    assert rc == 0 and "check: transformers' logits match" in lines[-1]
    index = json.loads((out / ex.WEIGHTS_INDEX).read_text())
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 2 and f"{len(shards)} shards" in lines[1]
    assert sorted(set(index["weight_map"].values())) == shards
    stored = {}
    for shard in shards:
        part = safetensors_torch.load_file(str(out / shard))
        assert sum(t.numel() * t.element_size() for t in part.values()) <= 30_000 or len(part) == 1
        stored.update(part)
    assert set(stored) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    _, ours = _checkpoint_model(runs["gpt"])
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(_load(out)(input_ids=ids).logits, ours(ids)[0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("text, size", [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("1.5kb", 1500), ("123", 123)])
def test_sizes_read_as_transformers_writes_them(text, size):
    assert ex.parse_size(text, "--max-shard-size") == size
