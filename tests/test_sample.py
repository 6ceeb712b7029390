"""``asyncpp-sample`` and models/generate.py: the text a checkpoint writes after a prompt. Greedy
output equals an independent loop over the model's full forward (bytes and a BPE run, the window
slid past seq_len); a --document-mask run samples within documents; seeded draws repeat and stay
inside top-k / top-p; the end-of-text token ends a sample; bad inputs give one line and exit 2."""
import math

import pytest
import torch

from asyncpp_ext.data.encode import ByteTokenizer
from asyncpp_ext.models import generate as gen
from asyncpp_ext.models.registry import build_model, model_config
from asyncpp_ext.training import sample as sm
from asyncpp_ext.training.checkpoint import checkpoint_named
from asyncpp_ext.training.cli import main as train
from asyncpp_ext.training.export import load_model
from bpe_tokenizer import bpe_llama_run

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
    """The tiny GPT (seq_len 32) trained 3 steps on the built-in corpus (UTF-8 bytes)."""
    out = tmp_path_factory.mktemp("sample") / "run"
    assert train(["--model", "tiny", "--seq-len", "32", "--simulate", "--steps", "3", "--no-progress",
                  "--eval-batches", "0", "--out", str(out)]) == 0
    return out


def _sample(argv, capsys):
    rc = sm.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _greedy(model, ids: list[int], n: int, window: int, allowed: int | None = None) -> list[int]:
    """n greedy ids after ``ids``: the full forward's last logits over the newest ``window`` ids."""
    drawn = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([(ids + drawn)[-window:]]))[0][0, -1]
            if allowed is not None:
                logits = logits[:allowed]
            drawn.append(int(torch.argmax(logits)))
    return drawn


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_the_last_positions_logits_are_the_full_forwards(name):
    model = build_model(model_config(name), seed=3).eval()
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)[0][:, -1]
        last = gen.last_logits(model, ids)
    torch.testing.assert_close(last, full, rtol=1e-5, atol=1e-5)


def test_a_hugging_face_models_last_logits_are_its_full_forwards():
    pytest.importorskip("transformers", reason="transformers is not installed: pip install 'asyncpp_ext[hf]'")
    from asyncpp_ext.models import hf
    model = hf.from_config({"model_type": "qwen2", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
                            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                            "max_position_embeddings": 64, "tie_word_embeddings": True}, seed=1).eval()
    ids = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(ids)[0][:, -1]
        last = gen.last_logits(model, ids)
    torch.testing.assert_close(last, full, rtol=1e-5, atol=1e-5)
    assert not gen.supports_cache(model)  # transformers' layers: the window reruns for each token


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_the_key_value_cache_gives_the_windows_logits_before_and_after_the_window_fills(name):
    """Large weights (every logit depends on the whole window), seq_len 16, 3 rows; llama-tiny's
    keys and values are grouped (4 query heads on 2)."""
    model = build_model(model_config(name, seq_len=16, init_std=0.3), seed=0).eval()
    assert gen.supports_cache(model)
    ids = torch.randint(0, 256, (3, 30), generator=torch.Generator().manual_seed(1))
    cached = gen.CachedLogits(model, window=16)
    with torch.no_grad():
        for n in range(5, 31):  # 5..16 ids in the window, then 17..30: the newest 16 of them
            torch.testing.assert_close(cached(ids[:, :n]), gen.last_logits(model, ids[:, :n][:, -16:]),
                                       rtol=1e-5, atol=1e-5)
            assert cached.held == (n if n <= 16 else 0)
    steps = dict.fromkeys([True, False])
    for use_cache in steps:
        steps[use_cache] = torch.stack(list(gen.generate(model, ids[:, :5], 25, window=16, temperature=0,
                                                         use_cache=use_cache)))
    assert torch.equal(steps[True], steps[False])


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_within_documents_the_cache_gives_the_masked_windows_logits(name):
    """A --document-mask run samples as it trained: every logit is the full forward's under the
    document mask of its window (token 7 the boundary, one in four ids), cached or not, before and
    after the window fills."""
    from asyncpp_ext.models.document_mask import within_documents
    model = build_model(model_config(name, seq_len=16, init_std=0.3), seed=0).eval()
    ids = torch.randint(0, 8, (3, 30), generator=torch.Generator().manual_seed(1))
    assert 7 in ids[:, 1:12]  # boundaries inside the cached part
    cached = gen.CachedLogits(model, window=16, boundary=7)
    with torch.no_grad():
        for n in range(5, 31):
            window = ids[:, :n][:, -16:]
            with within_documents(window, 7):
                want = model(window)[0][:, -1]
            torch.testing.assert_close(cached(ids[:, :n]), want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(gen.window_logits(model, ids[:, :n], 16, 7), want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(gen.window_logits(model, ids, 16), want)  # the mask changes them
    steps = {use_cache: torch.stack(list(gen.generate(model, ids[:, :5], 25, window=16, temperature=0,
                                                      use_cache=use_cache, boundary=7)))
             for use_cache in (True, False)}
    assert torch.equal(steps[True], steps[False])


def test_a_document_reads_nothing_before_its_boundary():
    # llama-tiny (rotary: distances only): what follows the last boundary gives the same logits
    # whatever came before it
    model = build_model(model_config("llama-tiny", seq_len=32, init_std=0.3), seed=0).eval()
    tail = [10, 3, 4, 5]  # a boundary (10), then its document
    with torch.no_grad():
        alone = gen.CachedLogits(model, 32, boundary=10)(torch.tensor([tail]))
        for before in ([1, 2], [9, 8, 7, 6, 5, 4, 3]):
            logits = gen.CachedLogits(model, 32, boundary=10)(torch.tensor([before + tail]))
            torch.testing.assert_close(logits, alone, rtol=1e-5, atol=1e-5)
            assert not torch.allclose(gen.CachedLogits(model, 32)(torch.tensor([before + tail])), alone)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_on_a_gpu_the_cache_gives_the_windows_logits(name):
    """As above on the GPU, where SDPA picks its kernel by shape (one query position against a
    whole prompt): float32 logits within 1e-4."""
    model = build_model(model_config(name, seq_len=16, init_std=0.3), seed=0).eval().cuda()
    ids = torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(1)).cuda()
    cached = gen.CachedLogits(model, window=16)
    with torch.no_grad():
        for n in range(5, 25):
            torch.testing.assert_close(cached(ids[:, :n]), gen.last_logits(model, ids[:, :n][:, -16:]),
                                       rtol=1e-4, atol=1e-4)


def test_a_filled_cache_takes_one_position_at_a_time():
    from asyncpp_ext.models.base import extend_cache
    cache = {}
    k = torch.zeros(1, 2, 3, 4)
    assert extend_cache(cache, k, k)[2] is True and cache["k"].shape[2] == 3
    assert extend_cache(cache, k[:, :, :1], k[:, :, :1])[2] is False and cache["k"].shape[2] == 4
    with pytest.raises(ValueError, match="one new position at a time"):
        extend_cache(cache, k, k)


def test_greedy_text_is_the_full_forwards_argmax_with_the_window_slid_past_seq_len(byte_run, capsys):
    """48 new bytes after a 10-byte prompt: the last 26 draws see a window that no longer holds the
    prompt's start (seq_len 32)."""
    rc, out, err = _sample([byte_run, "--prompt", "def main(x", "--temperature", "0", "--max-new-tokens", "48"],
                           capsys)
    assert rc == 0, err
    _, _, model = load_model(checkpoint_named(str(byte_run), "RUN"))
    expected = _greedy(model, list(b"def main(x"), 48, window=32)
    assert out == (b"def main(x" + bytes(expected)).decode("utf-8", "replace") + "\n"
    assert "48 drawn" in err and "greedy" in err and err.count("\n") == 1


def test_a_document_mask_run_samples_within_documents(tmp_path, capsys):
    """--document-mask 10 (each line a document): asyncpp-sample draws what generate draws within
    documents (whose logits the tests above hold to the masked full forward's), not what the model
    writes reading across lines. Seeded draws at temperature 1: an untrained model's greedy text is
    the same few bytes either way."""
    run = tmp_path / "run"
    assert train(["--model", "llama-tiny", "--seq-len", "32", "--simulate", "--steps", "3", "--no-progress",
                  "--eval-batches", "0", "--document-mask", "10", "--out", str(run)]) == 0
    capsys.readouterr()
    prompt = list(b"import os\nimport sys\ndef f(x")
    rc, out, err = _sample([run, "--prompt", bytes(prompt).decode(), "--temperature", "1", "--top-k", "0",
                            "--seed", "5", "--max-new-tokens", "40"], capsys)
    assert rc == 0, err
    _, _, model = load_model(checkpoint_named(str(run), "RUN"))

    def drawn(boundary):
        steps = gen.generate(model, torch.tensor([prompt]), 40, window=32, temperature=1.0, top_p=1.0,
                             allowed=256, generator=torch.Generator().manual_seed(5), boundary=boundary)
        with torch.no_grad():
            return [int(new) for new in steps]
    assert out == bytes(prompt + drawn(10)).decode("utf-8", "replace") + "\n"
    assert drawn(10) != drawn(None)


@pytest.mark.parametrize("flags, autocast", [([], False), (["--dtype", "fp32"], False), (["--dtype", "bf16"], True)])
def test_dtype_sets_the_forwards_autocast(byte_run, capsys, monkeypatch, flags, autocast):
    """--dtype auto is fp32 on the cpu; bf16 runs every token's forward under bf16 autocast."""
    seen = []
    generate = gen.generate

    def watched(*args, **kwargs):
        for new in generate(*args, **kwargs):
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            yield new

    monkeypatch.setattr(sm, "generate", watched)
    rc, _, err = _sample([byte_run, "--max-new-tokens", "5", *flags], capsys)
    assert rc == 0 and f"tokens/s on cpu, {'bf16' if autocast else 'fp32'})" in err, err
    assert len(seen) == 5 and all(s == (autocast, torch.bfloat16) if autocast else not s[0] for s in seen), seen


def test_generate_slides_the_window_past_seq_len():
    """An untrained model with large weights (its greedy choice depends on the whole window): 30
    new ids after 10, seq_len 16."""
    model = build_model(model_config("tiny", seq_len=16, init_std=0.3), seed=0).eval()
    prompt = list(b"def main(x")
    steps = gen.generate(model, torch.tensor([prompt]), 30, window=16, temperature=0)
    drawn = torch.stack(list(steps))[:, 0].tolist()
    assert drawn == _greedy(model, prompt, 30, window=16)
    assert drawn != _greedy(model, prompt, 30, window=15)  # what the window holds changes the choices


def test_without_a_prompt_a_byte_run_starts_after_a_newline_it_does_not_print(byte_run, capsys):
    rc, out, _ = _sample([byte_run, "--temperature", "0", "--max-new-tokens", "20"], capsys)
    assert rc == 0
    _, _, model = load_model(checkpoint_named(str(byte_run), "RUN"))
    assert out == bytes(_greedy(model, [10], 20, window=32)).decode("utf-8", "replace") + "\n"


def test_the_same_seed_draws_the_same_text_and_another_seed_other_text(byte_run, capsys):
    texts = []
    for seed in (1, 1, 2):
        rc, out, _ = _sample([byte_run, "--prompt", "import ", "--temperature", "1", "--max-new-tokens", "40",
                              "--seed", seed], capsys)
        assert rc == 0
        texts.append(out)
    assert texts[0] == texts[1] and texts[0] != texts[2]
    # top-k 1 leaves one id to draw: greedy whatever the temperature and seed
    rc, greedy, _ = _sample([byte_run, "--prompt", "import ", "--temperature", "0", "--max-new-tokens", "40"], capsys)
    rc_k, top1, _ = _sample([byte_run, "--prompt", "import ", "--temperature", "1", "--top-k", "1",
                             "--max-new-tokens", "40", "--seed", "2"], capsys)
    assert rc == rc_k == 0 and top1 == greedy


def test_several_samples_are_printed_between_separators(byte_run, capsys):
    rc, single, _ = _sample([byte_run, "--prompt", "class ", "--temperature", "0", "--max-new-tokens", "12"], capsys)
    assert rc == 0
    rc, out, err = _sample([byte_run, "--prompt", "class ", "--temperature", "0", "--max-new-tokens", "12",
                            "--samples", "3"], capsys)
    assert rc == 0 and "3 x up to 12 tokens, 36 drawn" in err
    assert out == (sm.SEPARATOR + "\n").join([single] * 3)  # greedy: the batch's rows alike
    rc, out, _ = _sample([byte_run, "--prompt", "class ", "--temperature", "1.5", "--max-new-tokens", "30",
                          "--samples", "3"], capsys)
    blocks = out.split(sm.SEPARATOR + "\n")
    assert rc == 0 and len(blocks) == 3 and len(set(blocks)) == 3 and all(b.startswith("class ") for b in blocks)


def test_top_k_and_top_p_keep_the_ids_they_name():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    kept = lambda **cut: torch.isfinite(gen.filter_logits(logits, **cut))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [False, True, False, True]
    assert kept(top_k=1) == [False, True, False, False]
    assert kept(top_p=0.79) == [False, True, False, True]  # 0.5 + 0.3 reach it
    assert kept(top_p=0.81) == [False, True, True, True]
    assert kept(top_p=0.1) == [False, True, False, False]  # the most likely id always stays
    # after top-k the nucleus is of the renormalised probabilities: 0.5 and 0.3 of 0.95 sum to 0.842
    assert kept(top_k=3, top_p=0.84) == [False, True, False, True]
    assert kept(top_k=3, top_p=0.85) == [False, True, True, True]


def test_draws_follow_the_renormalised_probabilities_inside_top_k():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]])).repeat(20_000, 1)
    ids = gen.choose_next(logits, temperature=1.0, top_k=2, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(ids, minlength=4).double() / len(ids)
    assert counts[0] == 0 and counts[2] == 0
    assert abs(counts[1].item() - 0.5 / 0.8) < 0.015 and abs(counts[3].item() - 0.3 / 0.8) < 0.015
    hot = gen.choose_next(logits[:2000], temperature=0.25, generator=torch.Generator().manual_seed(0))
    # temperature 1/4 raises each probability to the 4th power before normalising
    p = torch.tensor([0.05, 0.5, 0.15, 0.3]) ** 4
    assert abs((hot == 1).double().mean().item() - (p[1] / p.sum()).item()) < 0.03


def test_ids_past_the_tokenizers_vocabulary_are_never_drawn():
    model = build_model(model_config("tiny"), seed=0).eval()
    steps = gen.generate(model, torch.zeros(4, 3, dtype=torch.long), 30, window=64, temperature=5.0,
                         allowed=7, generator=torch.Generator().manual_seed(0))
    drawn = torch.stack(list(steps))
    assert drawn.shape == (30, 4) and int(drawn.max()) < 7 and len(torch.unique(drawn)) > 3


def test_without_a_prompt_a_tokenizer_without_boundary_tokens_starts_after_its_newline(tmp_path):
    """A BPE with no end-of-text token: the first id is its own newline's, not byte 10."""
    from bpe_tokenizer import train_bpe
    from asyncpp_ext.data.encode import load_tokenizer
    tok = train_bpe(tmp_path / "tokenizer.json", "ab\ncd\n" * 50 + "".join(map(chr, range(32, 127))), 270)
    tokenizer = load_tokenizer(str(tmp_path / "tokenizer.json"))
    assert tokenizer.boundary_tokens()[1:] == (None, None)
    ids, hidden = sm.first_ids(tokenizer, "")
    assert ids == tok.encode("\n").ids != [10] and hidden == 1
    assert sm.first_ids(ByteTokenizer(), "") == ([10], 1) and sm.first_ids(tokenizer, "ab") == (tok.encode("ab").ids, 0)


def test_text_is_printed_as_whole_characters_as_their_bytes_arrive():
    import io
    stream = io.StringIO()
    printer = sm.Printer(ByteTokenizer().decode, stream)
    for byte in "aé€".encode():
        printer.add(byte)
        assert "\ufffd" not in stream.getvalue()
    printer.finish()
    assert stream.getvalue() == "aé€\n"


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory):
    """A llama-tiny run on data prepared with a byte-level BPE whose documents end in <|endoftext|>."""
    root = tmp_path_factory.mktemp("sample_bpe")
    # an embedding wider than the tokenizer's 300 ids: the extra ids must never be drawn
    tok = bpe_llama_run(root, 40_000, 300, model_vocab=320)
    return root, tok


def test_a_bpe_run_encodes_and_decodes_with_the_tokenizer_its_data_was_prepared_with(bpe_run, capsys):
    root, tok = bpe_run
    prompt = "def f(self):\n    return"
    rc, out, err = _sample([root / "run", "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "30",
                            "--no-stop-at-eos"], capsys)
    assert rc == 0, err
    cfg, _, model = load_model(checkpoint_named(str(root / "run"), "RUN"))
    ids = tok.encode(prompt).ids
    drawn = _greedy(model, ids, 30, window=cfg.model.seq_len, allowed=300)
    assert out == tok.decode(ids + drawn, skip_special_tokens=False) + "\n"
    rc, out, _ = _sample([root / "run", "--temperature", "0", "--max-new-tokens", "10", "--no-stop-at-eos"], capsys)
    eos = tok.token_to_id("<|endoftext|>")
    assert rc == 0 and out == tok.decode(_greedy(model, [eos], 10, window=cfg.model.seq_len, allowed=300),
                                         skip_special_tokens=False) + "\n"


def test_the_end_of_text_token_ends_a_sample(bpe_run, capsys, monkeypatch):
    root, tok = bpe_run
    eos, a, b = tok.token_to_id("<|endoftext|>"), tok.token_to_id("a"), tok.token_to_id("b")
    rows = [[a, a], [b, eos], [eos, b], [a, b]]  # row 0 ends at step 2, row 1 at step 1

    def scripted(model, prompt, max_new_tokens, **_):
        for step in rows[:max_new_tokens]:
            yield torch.tensor(step)

    monkeypatch.setattr(sm, "generate", scripted)
    rc, out, err = _sample([root / "run", "--prompt", "x", "--samples", "2", "--max-new-tokens", "4"], capsys)
    assert rc == 0 and out == f"xab\n{sm.SEPARATOR}\nxa\n" and "5 drawn" in err
    rc, out, _ = _sample([root / "run", "--prompt", "x", "--samples", "2", "--max-new-tokens", "4",
                          "--no-stop-at-eos"], capsys)
    assert rc == 0 and out.split(f"{sm.SEPARATOR}\n")[0] == tok.decode(
        tok.encode("x").ids + [a, b, eos, a], skip_special_tokens=False) + "\n"


@pytest.mark.parametrize("flags, words", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["--top-k", "-1"], "--top-k must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--samples", "0"], "--samples must be at least 1"),
    (["--tokenizer", "none"], "--tokenizer none: sampling encodes the prompt"),
    (["--tokenizer", "missing.json"], "the run trained on UTF-8 bytes"),
])
def test_bad_inputs_give_one_line_and_exit_2(byte_run, capsys, flags, words):
    rc, out, err = _sample([byte_run, *flags], capsys)
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("asyncpp-sample: error: "), err
    assert words in err


def test_a_run_without_a_checkpoint_and_a_bpe_run_without_its_tokenizer_are_one_line(bpe_run, tmp_path, capsys):
    rc, _, err = _sample([tmp_path, "--prompt", "x"], capsys)
    assert rc == 2 and err.count("\n") == 1 and "checkpoint" in err
    root, _ = bpe_run
    moved = tmp_path / "elsewhere.json"
    (root / "tokenizer.json").rename(moved)
    try:
        rc, out, err = _sample([root / "run", "--prompt", "x"], capsys)
        assert rc == 2 and out == "" and err.count("\n") == 1
        assert "the run's tokenizer is unknown" in err and "--tokenizer FILE" in err
        rc, out, _ = _sample([root / "run", "--prompt", "x", "--tokenizer", moved, "--max-new-tokens", "3"], capsys)
        assert rc == 0 and out.startswith("x")
    finally:
        moved.rename(root / "tokenizer.json")


@pytest.mark.parametrize("failure, rc, line", [
    (KeyboardInterrupt(), 130, "asyncpp-sample: interrupted"),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), 1, "asyncpp-sample: error: out of memory"),
])
def test_a_stop_or_out_of_memory_mid_sample_keeps_the_text_drawn_and_ends_with_a_line(byte_run, capsys, monkeypatch,
                                                                                     failure, rc, line):
    def failing(model, prompt, max_new_tokens, **_):
        yield torch.tensor([ord("a")])
        yield torch.tensor([ord("b")])
        raise failure

    monkeypatch.setattr(sm, "generate", failing)
    code, out, err = _sample([byte_run, "--prompt", "x"], capsys)
    assert code == rc and out == "xab" and err.strip().count("\n") == 0 and err.strip().startswith(line), err


def test_a_reader_that_stops_reading_ends_the_sampling_quietly(byte_run):
    """``asyncpp-sample ... | head -c 10``: exit 141 (128 + SIGPIPE) without a traceback."""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "asyncpp_ext.sample", str(byte_run), "--max-new-tokens", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert len(proc.stdout.read(10)) == 10
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141 and err == b"", err.decode()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_device_cuda_without_a_gpu_is_one_line(byte_run, capsys):
    rc, _, err = _sample([byte_run, "--device", "cuda"], capsys)
    assert rc == 2 and "no CUDA device is visible" in err


def test_temperature_zero_ignores_the_generator():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 2.0]])
    assert gen.choose_next(logits, temperature=0).tolist() == [1, 0]
    assert math.isinf(gen.filter_logits(logits, top_k=1)[0, 0].item())
