"""A SIMULATED vLLM-compatible engine, for tests, benchmarks and sandboxes.

It serves the OpenAI-compatible API that vLLM serves, with vLLM's metric names, usage
fields and pause endpoints, but generates filler text instead of running a model. What
it does simulate faithfully is what sessionfleet depends on: a block-level prefix cache
with a token capacity and LRU eviction (so ``cached_tokens`` grows turn by turn for a
session that stays on one engine and falls to zero elsewhere), a cost model for prefill
and decode time, and export/import of its cache state for checkpoints.

Modules: :mod:`.tokenizer` (deterministic text to tokens and block hashes),
:mod:`.cache` (the prefix cache), :mod:`.cost` (the timing model), :mod:`.server`
(the aiohttp application) and :mod:`.cli` (``sessionfleet sim-engine``).
"""
