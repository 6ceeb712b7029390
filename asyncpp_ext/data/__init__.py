"""Token data: where tokens come from (``sources``), how batches are cut from them (``batches``;
a weighted mixture of sources: ``mixture``), and
the ``asyncpp-prepare-data`` tokenizer CLI (``prepare``).

The batch names are imported on first use: they need torch, and ``asyncpp-prepare-data`` (which
imports this package) should start without it.
"""
from .shards import TokenShards, resolve_token_paths
from .sources import (BUILTIN, BUILTIN_MAX_BYTES, TOKEN_DTYPES, TOKEN_FORMAT, TOKEN_FORMAT_VERSION,
                      DataError, builtin_corpus, load_shards, load_tokens, scan_max_token_id,
                      sidecar_path, token_dtype_for_vocab, token_file_info)

_BATCH_NAMES = ("BatchStream", "DEFAULT_EVAL_BATCHES", "Microbatch", "eval_batches", "min_tokens_needed",
                "one_pass_batches", "split_tokens", "token_fingerprint")
_MIXTURE_NAMES = ("MixtureStream", "mixture_eval_batches")


def __getattr__(name: str):
    if name in _BATCH_NAMES:
        from . import batches

        return getattr(batches, name)
    if name in _MIXTURE_NAMES:
        from . import mixture

        return getattr(mixture, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BUILTIN", "BUILTIN_MAX_BYTES", "DataError", "TOKEN_DTYPES", "TOKEN_FORMAT",
           "TOKEN_FORMAT_VERSION", "TokenShards", "builtin_corpus", "load_shards", "load_tokens",
           "resolve_token_paths", "scan_max_token_id", "sidecar_path", "token_dtype_for_vocab", "token_file_info", *_BATCH_NAMES,
           *_MIXTURE_NAMES]
