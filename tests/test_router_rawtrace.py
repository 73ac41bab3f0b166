from __future__ import annotations

import numpy as np
import pytest
import torch

from moeinf.trace.rawtrace import RawTrace, load_step_counts, read_raw, step_accesses, write_raw
from moeinf.trace.router import RouterTracer, generated_lengths


def test_raw_trace_roundtrip_gives_the_eams(tiny_model_dir, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("mixtral")).eval()
    ids = torch.tensor([[0, 5, 6, 7], [8, 9, 10, 11]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with RouterTracer(model) as tracer, torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, eos_token_id=None)
        lengths = generated_lengths(out[:, 4:], None)
        eams = tracer.eams(lengths)
        traces = [RawTrace(f"r{b}", "t", tracer.num_layers, tracer.num_experts, tracer.top_k,
                           tracer.sequence_steps(b, lengths[b])) for b in range(2)]
    path = write_raw(tmp_path / "raw.jsonl", traces)
    loaded = list(read_raw(path))
    assert [t.id for t in loaded] == ["r0", "r1"]
    for b, trace in enumerate(loaded):
        np.testing.assert_array_equal(trace.eam(), eams[b])
        first_ids, first_weights = trace.steps[0][0]
        np.testing.assert_array_equal(first_ids, traces[b].steps[0][0][0])
        np.testing.assert_allclose(first_weights, traces[b].steps[0][0][1], atol=1e-6)
    (rid, task, counts), _ = load_step_counts(path)
    assert rid == "r0" and task == "t" and counts.shape == (4, 3, 8)
    assert counts[0].sum() == 3 * 3 * 2 and counts[1].sum() == 3 * 2  # prefill 3 real tokens, then 1 token
    np.testing.assert_array_equal(counts.sum(axis=0), eams[0])


def test_step_accesses_in_compute_order() -> None:
    step = np.zeros((2, 4), dtype=np.float32)
    step[1, 0] = step[0, 3] = step[0, 1] = 2
    assert step_accesses(step) == [(0, 1), (0, 3), (1, 0)]


def test_dropped_tokens_are_not_counted() -> None:
    trace = RawTrace("a", "t", 1, 3, 1, [{0: (np.array([[2], [-1]]), np.array([[0.5], [0.0]]))}])
    assert trace.eam().tolist() == [[0, 0, 1]]
    assert RawTrace.from_json(trace.to_json()).eam().tolist() == [[0, 0, 1]]


def test_rejects_foreign_lines(tmp_path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"format": "other"}\n')
    with pytest.raises(ValueError, match="x.jsonl:1"):
        list(read_raw(path))


def _tiny_traces() -> list[RawTrace]:
    ids = np.array([[0, 2], [1, 2]])
    weights = np.full((2, 2), 0.5, dtype=np.float32)
    return [RawTrace(f"r{i}", "t", 2, 3, 2, [{0: (ids, weights), 1: (ids[:1], weights[:1])}])
            for i in range(3)]


def test_reads_gzip_traces_as_they_come(tmp_path) -> None:
    import gzip

    plain = write_raw(tmp_path / "raw.jsonl", _tiny_traces())
    packed = tmp_path / "raw.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    for path in (plain, packed):
        (rid, task, counts), *rest = load_step_counts(path)
        assert rid == "r0" and len(rest) == 2
        np.testing.assert_array_equal(counts[0], [[1, 1, 2], [1, 0, 1]])
        assert [t.id for t in read_raw(path)] == ["r0", "r1", "r2"]


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize(("bad", "message"), [
    ("{not json", "raw.jsonl.*:3: bad record"),
    ('{"format": "moeinf-rawtrace", "version": 1}', "raw.jsonl.*:3: bad record: missing field 'id'"),
    ('{"format": "moeinf-rawtrace", "version": 1, "id": "x", "task": "t", "num_layers": 2, '
     '"num_experts": 3, "top_k": 1, "steps": [{"layers": [0], "experts": [[[7]]], "weights": [[[1]]]}]}',
     "raw.jsonl.*:3: bad record: step 0: an expert id outside"),
])
def test_a_bad_record_names_the_file_and_line(tmp_path, compress, bad, message) -> None:
    import gzip

    from moeinf.trace.rawtrace import RawTraceError, read_step_counts

    lines = [t.to_json() for t in _tiny_traces()[:2]] + [bad]
    path = tmp_path / ("raw.jsonl.gz" if compress else "raw.jsonl")
    text = "\n".join(lines) + "\n"
    path.write_bytes(gzip.compress(text.encode()) if compress else text.encode())
    with pytest.raises(RawTraceError, match=message):
        list(read_step_counts(path))


def test_a_truncated_gzip_or_missing_file_is_a_clear_error(tmp_path) -> None:
    import gzip

    from moeinf.trace.rawtrace import RawTraceError, read_step_counts

    path = tmp_path / "raw.jsonl.gz"
    path.write_bytes(gzip.compress(("\n".join(t.to_json() for t in _tiny_traces()) + "\n").encode())[:-20])
    with pytest.raises(RawTraceError, match="raw.jsonl.gz:.*cannot read"):
        list(read_step_counts(path))
    with pytest.raises(RawTraceError, match="missing.jsonl: cannot read"):
        list(read_step_counts(tmp_path / "missing.jsonl"))


def test_step_counts_skip_gate_weights_in_any_key_order(tmp_path) -> None:
    """`read_step_counts` cuts the weights before parsing: whatever their place and number format, the
    counts are those of the full record, and the rest of the line is still checked."""
    import json

    from moeinf.trace.rawtrace import RawTraceError, read_step_counts

    record = {"format": "moeinf-rawtrace", "version": 1, "id": "w", "task": "t", "num_layers": 2,
              "num_experts": 3, "top_k": 2,
              "steps": [{"weights": [[[0.5, 5e-01], [1E-3, -0.25]], [[1, 0], [0.125, 2.5e+00]]],
                         "layers": [0, 1], "experts": [[[0, 2], [2, 1]], [[1, 1], [0, 2]]]}]}
    path = tmp_path / "raw.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (_, _, _, counts), = read_step_counts(path)
    np.testing.assert_array_equal(counts, [[[1, 1, 2], [1, 2, 1]]])
    np.testing.assert_array_equal(counts, RawTrace.from_json(path.read_text()).step_counts())
    record["steps"][0]["layers"] = [0, 5]
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(RawTraceError, match="raw.jsonl:1: bad record: step 0: a layer outside"):
        list(read_step_counts(path))


def _mixed_trace(seed: int) -> RawTrace:
    """Steps of every shape a trace holds: a prefill of 3 tokens, decode steps of one token (some grouped
    with one another, one with a layer left out), a ragged step (layers with different token counts) and
    dropped tokens (-1), with gate weights."""
    rng = np.random.default_rng(seed)
    num_layers, num_experts, top_k = 3, 5, 2

    def cell(tokens: int) -> tuple[np.ndarray, np.ndarray]:
        ids = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(tokens)])
        ids[rng.random(tokens) < 0.2, 1] = -1
        return ids, rng.random((tokens, top_k)).astype(np.float32)

    steps = [{layer: cell(3) for layer in range(num_layers)}]
    steps += [{layer: cell(1) for layer in range(num_layers)} for _ in range(4)]
    steps.insert(2, {0: cell(1), 2: cell(1)})
    steps.insert(4, {0: cell(2), 1: cell(1), 2: cell(1)})
    return RawTrace(f"m{seed}", "t", num_layers, num_experts, top_k, steps)


def test_routed_tokens_give_the_counts_of_the_raw_trace(tmp_path) -> None:
    """`read_routed` converts the steps of one shape together: whatever the shapes, its counts (plain, gate
    weighted, top-1) are exactly those of the per-step `RawTrace` (and its `Routed.of`)."""
    from moeinf.bench.cache import top1_counts
    from moeinf.trace.rawtrace import Routed, read_routed, read_step_counts

    traces = [_mixed_trace(seed) for seed in range(3)]
    path = write_raw(tmp_path / "raw.jsonl", traces)
    loaded = list(read_raw(path))
    routed = list(read_routed(path))
    plain = list(read_step_counts(path))
    assert [r.id for r in routed] == [t.id for t in traces] == [p[0] for p in plain]
    for raw, fast, (_, _, top_k, counts) in zip(loaded, routed, plain, strict=True):
        assert top_k == 2 and counts.shape == (len(raw.steps), 3, 5)
        for tokens in (fast, Routed.of(raw)):
            np.testing.assert_array_equal(tokens.step_counts(), raw.step_counts())
            np.testing.assert_array_equal(tokens.step_counts(weighted=True), raw.step_counts(weighted=True))
            for weighted in (False, True):
                np.testing.assert_array_equal(top1_counts(tokens, weighted=weighted),
                                              top1_counts(raw, weighted=weighted))
        np.testing.assert_array_equal(counts, raw.step_counts())
        assert counts[0].sum() > 3 * 3 and counts[2, 1].sum() == 0  # the prefill; the layer left out


def test_a_bad_step_among_steps_of_one_shape_is_named(tmp_path) -> None:
    """A bad step converted with others of its shape is still named: the first bad one."""
    import json

    from moeinf.trace.rawtrace import RawTraceError, read_routed, read_step_counts

    record = json.loads(_mixed_trace(0).to_json())
    record["steps"][5]["experts"][1][0][0] = 9  # a decode step grouped with steps 1, 3 and 6
    record["steps"][4]["weights"][0] = [[0.5, 0.5]]  # the ragged step: 1 token of weights for 2 of experts
    path = tmp_path / "raw.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(RawTraceError, match=r"raw.jsonl:1: bad record: step 5: an expert id outside -1..4"):
        list(read_step_counts(path))
    with pytest.raises(RawTraceError, match=r"raw.jsonl:1: bad record: step 4: the weights do not match"):
        list(read_routed(path))


def test_a_step_without_gate_weights_reads_as_one_over_k(tmp_path) -> None:
    """A trace without weights (as a source that has none): each expert weighs 1/k, so the weighted counts
    are the plain ones and the top-1 proxy keeps the first listed expert."""
    import json

    from moeinf.bench.cache import top1_counts
    from moeinf.trace.rawtrace import read_routed

    record = json.loads(_mixed_trace(1).to_json())
    for step in record["steps"]:
        step["weights"] = []
    path = tmp_path / "raw.jsonl"
    path.write_text(json.dumps(record) + "\n")
    (routed,) = read_routed(path)
    raw = RawTrace.from_json(_mixed_trace(1).to_json())
    np.testing.assert_array_equal(routed.step_counts(weighted=True), raw.step_counts())
    first = np.zeros_like(raw.step_counts())
    for s, step in enumerate(raw.steps):
        for layer, (ids, _) in step.items():
            for expert in ids[:, 0]:
                first[s, layer, expert] += expert >= 0
    np.testing.assert_array_equal(top1_counts(routed), first)
