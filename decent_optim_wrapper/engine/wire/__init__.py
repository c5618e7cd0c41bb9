"""The wire: what one member's share of a gossip round becomes in bytes, and which groups may compress.

* :mod:`~decent_optim_wrapper.engine.wire.codecs` -- the codec interface and the dense formats (exact,
  bf16, fp16, blockwise int8).
* :mod:`~decent_optim_wrapper.engine.wire.chunk_codec` -- the sparse and low-bit formats (top-k or
  random-k per chunk, values in 2 to 16 bits).
* :mod:`~decent_optim_wrapper.engine.wire.compression` -- :class:`~decent_optim_wrapper.GossipCompression`,
  the formats' names, and which groups of a topology compress.

Imports: torch and :mod:`decent_optim_wrapper.topo` only. Nothing here communicates; the rounds that
send these bytes are the exchange's (:mod:`decent_optim_wrapper.engine.exchange`).
"""
