"""examples/pretrain_smollm.toml, the README's pretraining run: every key a flag of asyncpp-train,
every value one it takes, and the run it describes passing a start's checks (--dry-run) on data
laid out where the file expects it (a small BPE corpus standing in for FineWeb-Edu)."""
import json
from pathlib import Path

from asyncpp_ext.training.cli import main as train
from bpe_tokenizer import train_bpe

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "pretrain_smollm.toml"


def test_the_pretraining_config_passes_a_dry_run(tmp_path, monkeypatch, capsys):
    from asyncpp_ext.data import builtin_corpus
    from asyncpp_ext.data import prepare as prep

    text = bytes(builtin_corpus()[:60000]).decode("utf-8", "ignore")
    train_bpe(tmp_path / "tokenizer.json", text, 300, special_tokens=("<|endoftext|>",))
    (tmp_path / "corpus.txt").write_text(text)
    monkeypatch.chdir(tmp_path)
    assert prep.main(["--tokenizer", "tokenizer.json", "--input", "corpus.txt", "--doc-separator", "\\n\\n",
                      "--val-fraction", "0.1", "--out", "data/fineweb/train.bin"]) == 0
    Path("data/hellaswag_val.jsonl").write_text(json.dumps({"ctx": "The cat sat on the", "endings": ["mat.", "x"],
                                                            "label": 0}) + "\n")
    capsys.readouterr()
    # the file's model and layout, at a sequence length the small corpus holds windows of
    assert train(["--config", str(EXAMPLE), "--seq-len", "64", "--out", "run", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for line in ("schedule: 2bw, 4 stages, on cpu", "optimizer: muon, lr 0.02, wsd schedule, z-loss 0.0001",
                 "attention: within documents, each starting at token 0",
                 "evaluation: every 500 steps, 16 batches, 1 multiple-choice task(s)"):
        assert line in out, line
    cfg = json.loads(out.split("config.json:\n", 1)[1])
    assert cfg["model"]["arch"] == "llama" and cfg["model"]["n_layer"] == 30
    assert cfg["train"]["steps"] == -(-10**10 // (8 * 8 * 64)) and cfg["train"]["log_block_grad_norms"]
    assert cfg["optim"]["decay_shape"] == "1-sqrt" and cfg["optim"]["decay_norms_and_biases"] is False
    assert cfg["data"]["eval_choices"] == ["data/hellaswag_val.jsonl"] and cfg["train"]["document_mask"] == "data"
    assert not Path("run").exists()
