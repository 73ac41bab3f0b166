"""The eviction policy fitted to a model from its own routing: the activation-aware score family, with its
constants chosen per cache size by replaying the model's traced requests in the simulator.

Why fit: the fixed constants of `ActivationAwareEviction` (decay 0.7, transition weight 0.85, prior 8
tokens, the layer-distance form) suit one model's routing. How much the next token follows the previous
one, how long a sequence keeps its experts and how much the collection predicts differ from model to
model, and at a large cache the score should rank by the chance of a use within many tokens, not by
the layer distance within one. So the family is

    share[l][e] as in `ActivationAwareEviction` (decay `recency`, transitions `follow`, prior `prior_tokens`),
                read on two time scales with `mix` m > 0: (1 - m) x that + m x the same share of the
                sequence's counts decayed by `slow` (close to 1), its long memory, and with the collection
                prior counting each sequence's first use of an expert `first_use` times more (a large
                value ranks the experts no sequence has used yet by how many requests use them),
    score = share / (ahead + 1)                                     shape 0 (the fixed score's form),
          = share                                                   shape -1 (no distance term),
          = -(ahead + 1 + shape * L * (1 / min(1, k * share) - 1))  shape > 0: minus the expected layer
            visits to the next use, a token using the expert with chance k * share (k = top-k),

and `fit_eviction` picks, per cache fraction, the point of a small grid with the most hits on the traced
requests (coordinate search from the fixed constants, `PASSES` rounds; a tie keeps the earlier point).
`FittedEviction` reads the row of the fraction nearest its cache (`set_capacity`), so the simulator and the
runtime run the same object and the same compiled score (`kernels.select` / `kernels.replay`). Without a
fit it starts from the fixed constants and refits itself online from the accesses it sees (`OnlineFit`).

The fit is saved beside the EAMC (`fit_path`: `X.eviction.json`, written by `moeinf trace`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import kernels
from .base import EvictionContext, PolicyError
from .eviction import ActivationAwareEviction

log = logging.getLogger(__name__)

FORMAT = "moeinf-eviction-fit"
VERSION = 1
FRACTIONS = (0.05, 0.1, 0.2, 0.25, 0.45, 0.6)
"""Cache fractions (of all experts) a fit is made for; a cache takes the nearest (in log scale)."""
GRID: dict[str, tuple[float, ...]] = {
    "follow": (0.0, 0.25, 0.5, 0.7, 0.85, 0.95),
    "recency": (0.5, 0.7, 0.85, 0.95, 0.99),
    "prior_tokens": (0.5, 2.0, 8.0, 32.0, 128.0),
    "shape": (-1.0, 0.0, 0.3, 1.0, 3.0),
    "carry": (0.0, 0.1, 0.3),
    "mix": (0.0, 0.25, 0.5, 0.75),
    "slow": (0.98, 0.995, 1.0),
    "first_use": (0.0, 8.0, 64.0, 4096.0),
}
"""The values the coordinate search tries per constant, in the order it visits the constants."""
PASSES = 2
"""Rounds of the coordinate search over all constants (it stops early when a round changes nothing): a
second round reaches settings the first, visiting the constants in one order, cannot."""
MAX_ACCESSES = 150_000
"""Accesses replayed per candidate by default: the fit's cost per candidate, whatever the trace's size."""


@dataclass(frozen=True)
class Setting:
    """One point of the family (see the module docstring)."""

    recency: float = ActivationAwareEviction.DEFAULT_RECENCY
    follow: float = ActivationAwareEviction.DEFAULT_FOLLOW
    prior_tokens: float = ActivationAwareEviction.DEFAULT_PRIOR_TOKENS
    shape: float = 0.0
    carry: float = 0.0
    mix: float = 0.0
    slow: float = 1.0
    first_use: float = 0.0

    def apply(self, params: np.ndarray, top_k: float) -> None:
        """Write this setting into a policy's kernel parameters."""
        params[kernels.P_RECENCY] = self.recency
        params[kernels.P_FOLLOW] = self.follow
        params[kernels.P_ALPHA] = self.prior_tokens
        params[kernels.P_FIT] = 0.0
        params[kernels.P_DISTANCE] = self.shape == 0.0
        params[kernels.P_SPAN] = max(self.shape, 0.0)
        params[kernels.P_TOPK] = top_k
        params[kernels.P_CARRY] = self.carry
        params[kernels.P_MIX] = self.mix
        params[kernels.P_SLOW] = self.slow
        params[kernels.P_FIRST] = self.first_use


FIXED = Setting()
"""The fixed score's constants: where the search starts, and what a policy without a fit uses."""


@dataclass
class EvictionFit:
    """A fitted table: per cache fraction, the setting with the most hits on the traced requests."""

    num_layers: int
    num_experts: int
    top_k: float
    fractions: list[float]
    settings: list[Setting]
    meta: dict[str, Any] = field(default_factory=dict)

    def setting_for(self, capacity: int) -> Setting:
        """The setting fitted for the fraction nearest (log scale) to `capacity` experts."""
        fraction = max(capacity, 1) / (self.num_layers * self.num_experts)
        gaps = [abs(math.log(fraction / f)) for f in self.fractions]
        return self.settings[int(np.argmin(gaps))]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "num_layers": self.num_layers,
                "num_experts": self.num_experts, "top_k": self.top_k,
                "rows": [{"fraction": f, **asdict(s)}
                         for f, s in zip(self.fractions, self.settings, strict=True)],
                "meta": self.meta}

    @classmethod
    def from_json(cls, record: dict[str, Any]) -> EvictionFit:
        if record.get("format") != FORMAT or record.get("version") != VERSION:
            raise PolicyError(f"not a {FORMAT} v{VERSION} record (format {record.get('format')!r}, version "
                              f"{record.get('version')!r}); re-run `moeinf trace`")
        rows = record["rows"]
        names = set(Setting.__dataclass_fields__)
        return cls(int(record["num_layers"]), int(record["num_experts"]), float(record["top_k"]),
                   [float(row["fraction"]) for row in rows],
                   [Setting(**{k: float(v) for k, v in row.items() if k in names}) for row in rows],
                   dict(record.get("meta", {})))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> EvictionFit:
        """Read a fit file; a file that is not one raises `PolicyError` naming it."""
        try:
            record = json.loads(Path(path).read_text())
            return cls.from_json(record)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise PolicyError(f"{path}: cannot read the fitted eviction policy ({exc}); re-run `moeinf trace`"
                              ) from None


def fit_path(eamc_path: str | Path) -> Path:
    """Where the fitted eviction policy of an EAMC file lives: `X.eviction.json` beside `X.eamc`."""
    path = Path(eamc_path)
    return path.with_name(path.stem + ".eviction.json")


def load_fit_beside(eamc_path: str | Path | None, num_layers: int, num_experts: int) -> EvictionFit | None:
    """The fit `moeinf trace` wrote beside the EAMC file `eamc_path`; None when there is no EAMC or no fit
    beside it (the fitted policy then refits online). A fit of another model's shape is a one-line
    `PolicyError`."""
    if eamc_path is None or not fit_path(eamc_path).is_file():
        return None
    fit = EvictionFit.load(fit_path(eamc_path))
    if (fit.num_layers, fit.num_experts) != (num_layers, num_experts):
        raise PolicyError(f"{fit_path(eamc_path)} is a fit for {fit.num_layers} x {fit.num_experts} experts, "
                          f"the model has {num_layers} x {num_experts}; re-run `moeinf trace` on this model")
    return fit


class FittedEviction(ActivationAwareEviction):
    """Activation-aware eviction with the constants of a fit (`EvictionFit`) for its cache size.

    `set_capacity(slots)` (the cache calls it) picks the fitted row; without a fit, or before a
    capacity is known, the fixed constants apply. With `online=True` the policy logs the accesses it
    sees and refits itself in the background from them (`OnlineFit`), for its own cache size.
    `ctx.cur_eam` is required, as for `ActivationAwareEviction`.
    """

    name = "fitted"

    def __init__(self, num_layers: int, num_experts: int, fit: EvictionFit | None = None, *,
                 eps: float = 1e-4, top_k: float = 1.0, online: bool = False,
                 online_every: int = 16) -> None:
        super().__init__(num_layers, num_experts, eps=eps, layer_weighted=False)
        if fit is not None and (fit.num_layers, fit.num_experts) != (num_layers, num_experts):
            raise PolicyError(f"the eviction fit is for {fit.num_layers} x {fit.num_experts} experts, the "
                              f"model has {num_layers} x {num_experts}; re-run `moeinf trace` on this model")
        # the transitions are learned whatever the setting, so that a refit may turn them on
        self.transition = np.zeros((num_layers * num_experts, num_experts + 1), dtype=np.float64)
        self.fit = fit
        self.top_k = fit.top_k if fit is not None else top_k
        self.capacity: int | None = None
        self.setting = FIXED
        self.setting.apply(self.params, self.top_k)
        self.online = OnlineFit(self, every=online_every) if online and fit is None else None

    def set_capacity(self, capacity: int) -> None:
        """The cache holds `capacity` experts: use the setting fitted for it."""
        self.capacity = capacity
        if self.fit is not None:
            self.use(self.fit.setting_for(capacity))

    def use(self, setting: Setting) -> None:
        self.setting = setting
        setting.apply(self.params, self.top_k)

    def reset(self, counts: np.ndarray | None = None, firsts: np.ndarray | None = None) -> None:
        self.setting.apply(self.params, self.top_k)  # first: the seed's first uses weigh `first_use`
        super().reset(counts, firsts)

    def on_access(self, key: tuple[int, int]) -> None:
        super().on_access(key)
        if self.online is not None:
            self.online.access(self.index(key))

    def _context_arrays(self, ctx: EvictionContext) -> tuple[np.ndarray, np.ndarray]:
        arrays = super()._context_arrays(ctx)
        if self.online is not None:
            self.online.running(float(arrays[0].sum()))
        return arrays


def _policy(num_layers: int, num_experts: int, setting: Setting, top_k: float) -> FittedEviction:
    policy = FittedEviction(num_layers, num_experts, top_k=top_k)
    policy.use(setting)
    return policy


def fit_eviction(traces: Sequence[np.ndarray], *, fractions: Sequence[float] = FRACTIONS,
                 capacities: Sequence[int] | None = None, top_k: float | None = None, seed: int = 0,
                 max_accesses: int = MAX_ACCESSES, grid: dict[str, tuple[float, ...]] | None = None,
                 passes: int = PASSES, workers: int | None = None) -> EvictionFit:
    """Fit the family to `traces` (each [S, L, E] token counts of one traced request, the EAMC side only).

    The requests are split at random (`seed`): up to `max_accesses` accesses' worth of them (at most
    half) are replayed per candidate, the others seed the access counts, as the EAMC side seeds them in
    use. Per fraction (or explicit `capacities`), a coordinate search over `grid` starts from the best
    setting of the previous, smaller fraction (the first from the fixed constants) and keeps a change
    only when it adds hits, for up to `passes` rounds over the constants. `top_k`: the experts a token
    uses per layer (default: the traces' mean per single-token step). `workers`: threads replaying one
    constant's values at once (default: every core; the compiled replay releases the GIL); the result does
    not depend on it.
    """
    from .simulate import Accesses, simulate

    started = time.perf_counter()
    arrays = [np.asarray(trace) for trace in traces]
    if not arrays:
        raise PolicyError("fit_eviction needs at least one traced request")
    _, num_layers, num_experts = arrays[0].shape
    total = num_layers * num_experts
    if top_k is None:
        top_k = mean_top_k(arrays)
    order = np.random.default_rng(seed).permutation(len(arrays))
    sizes = np.array([np.count_nonzero(arrays[i]) for i in order])
    take = max(1, min(len(arrays) // 2, int(np.searchsorted(np.cumsum(sizes), max_accesses)) + 1))
    replayed = [arrays[i] for i in np.sort(order[:take])]
    seeding = [arrays[i] for i in order[take:]]
    counts = access_counts(seeding) if seeding else None
    firsts = request_counts(seeding) if seeding else None
    accesses = Accesses.of(replayed)
    busiest = accesses.busiest
    if capacities is None:
        capacities = [max(busiest, round(f * total)) for f in fractions]
    else:
        fractions = [c / total for c in capacities]
    grid = GRID if grid is None else grid
    settings: list[Setting] = []
    evaluated = 0
    start = FIXED
    with ThreadPoolExecutor(max_workers=max(1, workers or os.cpu_count() or 1)) as pool:
        for capacity in capacities:
            capacity = max(busiest, int(capacity))
            cache: dict[Setting, int] = {}

            def replay(setting: Setting, capacity: int = capacity) -> int:
                policy = _policy(num_layers, num_experts, setting, top_k)
                return simulate(accesses, capacity, policy, counts=counts, firsts=firsts).hits

            def hits(*settings: Setting, cache: dict[Setting, int] = cache) -> list[int]:
                """The hits of each setting; the ones not replayed yet are replayed side by side."""
                new = list(dict.fromkeys(s for s in settings if s not in cache))
                cache.update(zip(new, pool.map(replay, new), strict=True))
                return [cache[s] for s in settings]

            best, best_hits = start, hits(start, FIXED)[0]
            if start != FIXED and cache[FIXED] > best_hits:
                best, best_hits = FIXED, cache[FIXED]
            for _ in range(passes):
                changed = False
                for name, values in grid.items():
                    # one constant's values differ from `best` in that constant only: replayed at once, then
                    # taken in order as one by one (the first with the most hits, if it adds hits)
                    candidates = [Setting(**{**asdict(best), name: value}) for value in values]
                    for candidate, candidate_hits in zip(candidates, hits(*candidates), strict=True):
                        if candidate_hits > best_hits:
                            best, best_hits, changed = candidate, candidate_hits, True
                if not changed:
                    break
            evaluated += len(cache)
            settings.append(best)
            start = best
            log.info("fitted eviction at %d experts: %s (%d hits of %d, %d candidates)", capacity, best,
                     best_hits, accesses.keys.size, len(cache))
    meta = {"requests": len(arrays), "replayed_requests": len(replayed), "accesses": int(accesses.keys.size),
            "candidates": evaluated, "seed": seed, "fit_s": round(time.perf_counter() - started, 2)}
    return EvictionFit(num_layers, num_experts, float(top_k), [float(f) for f in fractions], settings, meta)


def access_counts(traces: Sequence[np.ndarray]) -> np.ndarray:
    """[L, E] how many layer visits of `traces` (each [S, L, E]) accessed each expert: what a policy counts
    when they are replayed (one access per visit, whatever the tokens)."""
    return sum(np.count_nonzero(np.asarray(trace), axis=0) for trace in traces).astype(np.float64)


def request_counts(traces: Sequence[np.ndarray]) -> np.ndarray:
    """[L, E] how many of `traces` (each [S, L, E], one request) used each expert: the first uses a policy
    counts when they are replayed (`Setting.first_use`)."""
    return sum(np.asarray(trace).any(axis=0) for trace in traces).astype(np.float64)


def mean_top_k(traces: Sequence[np.ndarray]) -> float:
    """Experts per layer per token: the mean experts a single-token step's layer uses (all steps when no
    step has one token)."""
    used, visits = 0, 0
    for trace in traces:
        per_visit = np.count_nonzero(trace, axis=2)  # [S, L]
        tokens = trace.sum(axis=2)  # [S, L]
        single = (tokens > 0) & (per_visit == tokens)
        used += int(per_visit[single].sum())
        visits += int(single.sum())
    if visits == 0:
        for trace in traces:
            per_visit = np.count_nonzero(trace, axis=2)
            used += int(per_visit.sum())
            visits += int((per_visit > 0).sum())
    return used / visits if visits else 1.0


class OnlineFit:
    """Refit a `FittedEviction` from the accesses it served, when no traced fit exists.

    The policy logs every access (flat key, in order) and where a new sequence began (its running EAM
    shrank); after every `every` finished sequences, once `every` are logged, a background thread turns
    the last `keep` sequences back into [S, L, E] counts and fits the policy's own cache size on them;
    the new setting is swapped in with one assignment of the parameters (the kernels read them per call).
    """

    def __init__(self, policy: FittedEviction, *, every: int = 16, keep: int = 64) -> None:
        self.policy = policy
        self.every = every
        self.keep = keep
        self._log: list[int] = []
        self._sequences: list[np.ndarray] = []
        self._last_total = -1.0
        self._since = 0
        self._thread: threading.Thread | None = None
        self.refits = 0

    def access(self, index: int) -> None:
        self._log.append(index)

    def running(self, total: float) -> None:
        """The policy was handed a running EAM of `total` tokens; a smaller total than before: a new
        sequence began, so the logged one is closed."""
        if total < self._last_total:
            self.close_sequence()
        self._last_total = total

    def close_sequence(self) -> None:
        if self._log:
            self._sequences.append(self._counts(self._log))
            self._sequences = self._sequences[-self.keep:]
            self._log = []
            self._since += 1
        busy = self._thread is not None and self._thread.is_alive()
        if self._since >= self.every and not busy and self.policy.capacity is not None:
            self._since = 0
            self._thread = threading.Thread(target=self._refit, args=(list(self._sequences),),
                                            name="moeinf-eviction-refit", daemon=True)
            self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def _counts(self, log: list[int]) -> np.ndarray:
        """[S, L, E] one token per access; a step ends where the layer order restarts."""
        num_layers, num_experts = self.policy.num_layers, self.policy.num_experts
        keys = np.asarray(log, dtype=np.int64)
        layers = keys // num_experts
        steps = np.concatenate(([0], np.cumsum(layers[1:] < layers[:-1])))
        counts = np.zeros((int(steps[-1]) + 1, num_layers, num_experts), dtype=np.float32)
        np.add.at(counts, (steps, layers, keys % num_experts), 1.0)
        return np.minimum(counts, 1.0)

    def _refit(self, sequences: list[np.ndarray]) -> None:
        try:
            capacity = self.policy.capacity
            assert capacity is not None
            busiest = max(int(np.count_nonzero(s, axis=2).max()) for s in sequences)
            # the log holds no token counts (a prefill step looks like many experts per token): the
            # model's top-k, which the runtime passed, stays
            fit = fit_eviction(sequences, capacities=[max(capacity, busiest)], seed=self.refits,
                               top_k=self.policy.top_k, passes=1, workers=1)  # one core: serving goes on
            self.policy.use(fit.settings[0])
            self.refits += 1
            log.info("eviction refit online from %d sequences: %s", len(sequences), fit.settings[0])
        except Exception:  # a failed refit leaves the policy as it was; serving goes on
            log.exception("online eviction refit failed")
