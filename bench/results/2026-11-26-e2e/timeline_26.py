"""bench/results/2026-11-25b-e2e/timeline.py with this session's variants: `nowrap` (the default with the
look-ahead maps cut to the pass, `nowrap_maps.py`), `lookahead-nowrap`, `wrap` (the maps that wrap, once
the file beside the EAMC became the cut one) and `nobounce` (`bounce_reads=False`).

    python timeline_26.py --cache 25% --variants resident,none,default,nowrap --raw-gbps 2.55 --out F
"""
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("timeline", HERE.parent / "2026-11-25b-e2e" / "timeline.py")
timeline = importlib.util.module_from_spec(spec)
spec.loader.exec_module(timeline)
NOWRAP = str(timeline.MODEL.with_name(timeline.MODEL.name + ".nowrap.lookahead.safetensors"))
timeline.VARIANTS["nowrap"] = (None, {"eamc": str(timeline.EAMC), "lookahead_predictor": NOWRAP})
timeline.VARIANTS["lookahead-nowrap"] = (None, {"eamc": str(timeline.EAMC), "prefetch": "lookahead",
                                                "lookahead_predictor": NOWRAP})
timeline.VARIANTS["nobounce"] = (None, {"eamc": str(timeline.EAMC), "bounce_reads": False})
WRAP = str(timeline.MODEL.with_name(timeline.MODEL.name + ".wrap.lookahead.safetensors"))
timeline.VARIANTS["wrap"] = (None, {"eamc": str(timeline.EAMC), "lookahead_predictor": WRAP})
if __name__ == "__main__":
    sys.exit(timeline.main())
