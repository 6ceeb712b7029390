"""A pretraining corpus built from the text already on a machine, for the paper-scale study
(``bench/paper_study.py --scale gpu``) where no network reaches a dataset.

    python bench/study_corpus.py runs/study_corpus            # build (or report) the default corpus
    python bench/study_corpus.py DIR --vocab 16384 --max-mb 300

What it holds: the UTF-8 source and documentation files (``*.py``, ``*.pyi``, ``*.rst``, ``*.md``,
``*.txt``) of the Python installation that runs it, its standard library and site-packages, one
document per file, files of over 1 MB (generated tables) and exact duplicates left out. Documents
are put in a seeded order (by a hash of their content) so the evaluation split, the last
``DataConfig.eval_fraction`` of the tokens, is a sample of every package rather than the last
ones alphabetically. A byte-level BPE (the ``tokenizers`` library, ``vocab`` ids, ``<|endoftext|>``
after each document) is trained on every fourth document, then ``asyncpp-prepare-data``'s
``prepare`` encodes all of them in worker processes.

The folder keeps ``corpus.bin`` (+ its sidecar), ``tokenizer.json`` and ``corpus.json`` (what was
read and how many tokens came out); a later call with the same vocabulary reuses them.
"""
from __future__ import annotations

import hashlib
import json
import os
import site
import sys
import sysconfig
import time
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_command import ArgumentParser  # noqa: E402
from study_runs import StudyError  # noqa: E402

SUFFIXES = (".py", ".pyi", ".rst", ".md", ".txt")
"""Files read as documents."""
MAX_FILE_BYTES = 1 << 20
"""Larger files (generated tables, vendored data) are left out."""
EOT = "<|endoftext|>"
"""The end-of-document token the tokenizer reserves and prepare appends."""
TOKENIZER_SAMPLE = 4
"""The tokenizer trains on every n-th document (the merges settle long before all of it)."""
MIN_VOCAB = 257
"""The byte-level BPE's 256 byte tokens and EOT; a vocabulary below it cannot hold them."""


def default_roots() -> list[Path]:
    """This interpreter's standard library, site-packages and user site-packages folders."""
    roots = {Path(sysconfig.get_paths()["stdlib"]), *map(Path, site.getsitepackages())}
    if site.ENABLE_USER_SITE:
        roots.add(Path(site.getusersitepackages()))
    return sorted(r for r in roots if r.is_dir())


def find_documents(roots: Sequence[Path], max_bytes: int) -> list[Path]:
    """The document files under ``roots``: deduplicated by content, in a seeded content-hash order,
    at most ``max_bytes`` in all."""
    by_hash: dict[str, Path] = {}
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(files):
                path = Path(folder, name)
                if path.suffix not in SUFFIXES or path.is_symlink():
                    continue
                try:
                    if not 0 < path.stat().st_size <= MAX_FILE_BYTES:
                        continue
                    data = path.read_bytes()
                    data.decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                by_hash.setdefault(hashlib.sha1(data).hexdigest(), path)
    chosen, total = [], 0
    for _, path in sorted(by_hash.items()):  # the hash order: packages interleaved, reproducibly
        size = path.stat().st_size
        if total + size > max_bytes:
            break
        chosen.append(path)
        total += size
    return chosen


def _texts(paths: Iterable[Path]) -> Iterator[str]:
    for path in paths:
        yield path.read_text(encoding="utf-8")


def train_tokenizer(paths: Sequence[Path], vocab: int, out: Path) -> None:
    """A byte-level BPE of ``vocab`` ids (``EOT`` among them) trained on every TOKENIZER_SAMPLE-th
    document of ``paths``, saved as a tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_texts(paths[::TOKENIZER_SAMPLE] or paths), trainer)
    tok.save(str(out))


def ensure_corpus(folder: Path, vocab: int, roots: Optional[Sequence[Path]] = None,
                  max_bytes: int = 300 << 20, workers: Optional[int] = None) -> dict:
    """The corpus in ``folder`` (built first if it is missing or has another vocabulary): a dict
    with ``path`` (the .bin), ``tokenizer``, ``vocab``, ``documents``, ``bytes``, ``tokens``,
    ``train_tokens`` (what the study trains on: all but the evaluation tail), ``roots`` and
    ``build_seconds``. StudyError (one line) when it cannot be built."""
    from asyncpp_ext.data.prepare import PrepareError, prepare
    from asyncpp_ext.data.sources import sidecar_path
    from asyncpp_ext.training.config import DataConfig

    folder = Path(folder)
    info_path = folder / "corpus.json"
    if info_path.is_file():
        info = json.loads(info_path.read_text())
        if info.get("vocab") == vocab and Path(info["path"]).is_file():
            return info
    if vocab < MIN_VOCAB:
        raise StudyError(f"a vocabulary of {vocab} ids is below {MIN_VOCAB}, the byte-level BPE's 256 byte tokens "
                         f"and {EOT}; use e.g. 16384")
    if max_bytes <= 0:
        raise StudyError(f"--max-mb {max_bytes >> 20} is not positive; use e.g. 300")
    if importlib_missing("tokenizers"):
        raise StudyError("building the study corpus needs the tokenizers package; pip install tokenizers "
                         "(or pass --data FILE.bin)")
    start = time.perf_counter()
    roots = [Path(r) for r in (roots or default_roots())]
    paths = find_documents(roots, max_bytes)
    if len(paths) < 2:
        raise StudyError(f"found {len(paths)} text file(s) under {', '.join(map(str, roots))}; the study "
                         "corpus needs many (pass --data FILE.bin with a tokenized corpus)")
    made_folder = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder / "documents.jsonl"  # the documents in their order, one record each
    tokenizer = folder / "tokenizer.json"
    out = folder / "corpus.bin"
    built = False
    try:
        for stale in (info_path, out, sidecar_path(out), tokenizer):  # another vocabulary's corpus
            stale.unlink(missing_ok=True)
        with open(staging, "w", encoding="utf-8") as f:
            for text in _texts(paths):
                f.write(json.dumps({"text": text}) + "\n")
        train_tokenizer(paths, vocab, tokenizer)
        result = prepare(str(tokenizer), [str(staging)], str(out), progress=False, doc_boundary="eos",
                         workers=workers)
        tokens = sum(header["num_tokens"] for header in result.values())
        info = {"path": str(out), "tokenizer": str(tokenizer), "vocab": vocab,
                "documents": result.documents, "bytes": sum(p.stat().st_size for p in paths),
                "tokens": tokens, "train_tokens": tokens - int(tokens * DataConfig().eval_fraction),
                "roots": [str(r) for r in roots], "build_seconds": round(time.perf_counter() - start, 1)}
        temp = info_path.with_name(info_path.name + ".tmp")
        temp.write_text(json.dumps(info, indent=1) + "\n")
        os.replace(temp, info_path)  # the corpus counts as built once this lands, whole
        built = True
    except PrepareError as exc:
        raise StudyError(f"building the study corpus failed: {exc}") from None
    finally:  # failed or interrupted: no part of a corpus stays behind
        staging.unlink(missing_ok=True)
        if not built:
            for part in (info_path.with_name(info_path.name + ".tmp"), out, sidecar_path(out), tokenizer):
                part.unlink(missing_ok=True)
            if made_folder and not any(folder.iterdir()):
                folder.rmdir()
    return info


def importlib_missing(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is None


def main(argv=None) -> int:
    """Build (or find) the corpus and print what it holds; 2 with one line on failure."""
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="where the corpus is built (and found again)")
    p.add_argument("--vocab", type=int, default=16384, help="BPE vocabulary size (default 16384)")
    p.add_argument("--max-mb", type=int, default=300, help="most text to read, in MB (default 300)")
    p.add_argument("--root", action="append", type=Path, help="folders to read (default: this Python's "
                   "standard library and site-packages); repeatable")
    a = p.parse_args(argv)
    try:
        info = ensure_corpus(a.folder, a.vocab, a.root, a.max_mb << 20)
    except StudyError as exc:
        print(f"study_corpus: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    from bench_command import run_script

    run_script(main)
