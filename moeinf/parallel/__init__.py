"""Expert parallelism across processes: `ep.py` (ranks, the leader's remote experts, the followers' loop)
and `placement.py` (which rank owns which expert)."""
