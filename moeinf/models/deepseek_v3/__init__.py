"""DeepSeek-V3's fast paths: its router, its absorbed MLA decode, and its decoder layer and body at one
decoded row (`router.py`, `mla_decode.py`, `decode_layer.py` for quantised stores, `decode_exact.py` for
exact ones, `decode_body.py`)."""
