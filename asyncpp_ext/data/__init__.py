"""Token data: where tokens come from (``sources``) and how batches are cut from them (``batches``)."""
from .batches import BatchStream, Microbatch, eval_batches, min_tokens_needed, split_tokens
from .sources import BUILTIN, BUILTIN_MAX_BYTES, DataError, builtin_corpus, load_tokens

__all__ = ["BUILTIN", "BUILTIN_MAX_BYTES", "DataError", "builtin_corpus", "load_tokens", "Microbatch",
           "min_tokens_needed", "split_tokens", "BatchStream", "eval_batches"]
