"""The glue of one offloaded model: per-sequence EAMs, prefetch planning and the layer compute loop.

Pipeline of one MoE layer (called by the unmodified HF MoE block through `OffloadedExperts`):

    route (HF router: top_k_index, top_k_weights)
      -> EAM     tokens grouped by expert once; each sequence's EAM row += its token counts
      -> demand  this layer's misses are claimed at MAX priority before anything of this layer's plan is
                 submitted: the I/O threads take their chunks next, and the planning below overlaps them
      -> prefetch  match each sequence's partial EAM in the EAMC (one incremental `Matcher` per
                   sequence), Algorithm 1 plan for later layers, re-submitted with fresh priorities
                   (in-flight keys re-prioritised, dropped ones cancelled), within the prefetch window
      -> wait    block until each of this layer's misses lands (misses that found no slot are claimed
                 as slots free up); before the first block, the block's shared experts compute
                 (`idle`, moeinf/runtime/shared.py)
                 (a layer whose experts are all resident waits for nothing: its look-ahead, planning and
                 prefetch submission run on a planner thread while the experts compute; `settle`)
      -> compute experts in waves as they become resident (one kernel call per wave where exact), each
                 weighted output kept per (token, slot)
      -> combine  HF's own reduction over each token's k slots (order-free, so bit-exact; compute.py)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np
import torch

from ..config import Budget, OffloadConfig
from ..kernels.moe import Dispatch, ExpertKernel, ExpertOutputs
from ..policy import EvictionContext, Key, PrefetchPolicy
from ..policy.lookahead import LookaheadPrefetch, deliverable, layer_distance
from ..store.index import StoreIndex
from ..trace.eamc import EAMC
from ..trace.matcher import Matcher
from ..trace.online import OnlineEAMC
from .cache import ExpertCache
from .lookahead import Lookahead, Pace
from .stats import RuntimeStats

log = logging.getLogger(__name__)


class Remote(Protocol):
    """The experts other processes hold (expert parallelism: `moeinf.parallel.ep.RemoteExperts`)."""

    def owned(self, layer: int, expert: int) -> bool:
        """Whether this process computes (layer, expert)."""

    def send_layer(self, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor, plan: list[tuple[Key, float]] | None, budget: int | None,
                   cur_eam: np.ndarray) -> None:
        """Ship one layer's work to the other processes."""

    def collect(self, layer: int, outputs: ExpertOutputs) -> None:
        """Their rows of `layer`, into `outputs`."""

    def stats(self) -> dict[str, object]: ...

    def reset(self) -> None: ...

    def close(self) -> None: ...

FILL_PRIORITY = 1e-9
"""Below every planned prefetch (priorities in (0, 1]): what `_fill` claims is read when nothing else is."""
GUESS_PRIORITY = 1.0
"""Above every planned prefetch (`moeinf.policy.lookahead.priority` < 1), below a demand read: the next
pass's first-layer experts guessed from the logits are needed before anything else planned."""
GUESS_STEP = 1e-6
"""The guess of the next pass's MoE layer d is read at GUESS_PRIORITY - d x GUESS_STEP: layer by layer, all
above every planned prefetch."""


@dataclass
class Batch:
    """The sequences of the running forward passes: their EAMs and which tokens are padding.

    `token_mask` [B, S] (1 = real token) covers the tokens of the current forward pass when known.
    """

    eams: np.ndarray  # [B, L, E] float32 token counts
    token_mask: torch.Tensor | None = None
    real: np.ndarray | None = None
    """`token_mask != 0` in numpy, made once per forward pass for `_record` at every layer."""
    predicted: list[np.ndarray | None] | None = None
    matchers: list[Matcher] | None = None
    """One per sequence, bound to `matched_against`; rebuilt when the online EAMC swaps."""
    matched_against: EAMC | None = None


class Offloader:
    """Runs the experts of every MoE layer of one model through an `ExpertCache`.

    Not thread-safe by itself: `moeinf.api.MoE` serialises forward passes with a lock.
    """

    def __init__(self, cache: ExpertCache, prefetch: PrefetchPolicy, predictor: OnlineEAMC | None,
                 stats: RuntimeStats, index: StoreIndex, config: OffloadConfig, budget: Budget,
                 lookahead: Lookahead | None = None) -> None:
        """`index`: the store's (the model's MoE layers, experts and top-k); `config` gives the online EAMC's
        and the planning's settings (`SECTIONS["prefetch"]`), `stack_expert_max_bytes`; `budget` the cache's
        size (`Budget.holds_all`)."""
        num_layers, num_experts = index.num_layers, index.num_experts
        self.cache = cache
        self.budget = budget
        self._planner = ThreadPoolExecutor(1, thread_name_prefix="moeinf-plan") \
            if config.prefetch_plan_thread else None
        """Runs a layer's planning beside its expert compute when the layer waits for no read (`plan_thread`):
        the look-ahead, planning and submission are a few ms of CPU per token that would otherwise sit on
        the compute thread, and the expert GEMVs release the GIL."""
        self._pending: Future[None] | None = None
        """The planner thread's task of the latest layer, until `settle` collects it."""
        self.hold_plan = config.prefetch_hold_plan
        """Skip planning at a layer that the latest plan already serves (`prefetch_hold_plan`)."""
        self.stack_max_bytes = config.stack_expert_max_bytes
        """Experts of at most this many bytes are computed stacked (`stack_expert_max_bytes`)."""
        self.lookahead = lookahead
        """Predicts the layers ahead from the current router input (for `lookahead`/`hybrid` prefetch)."""
        self.pace = Pace(config.pace_smoothing)
        self.remote: Remote | None = None
        """The other ranks' experts under expert parallelism (`moeinf.parallel.ep`); None in one process."""
        self.prefetch_policy = prefetch
        self.predictor = predictor
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.stats = stats
        self.top_k = index.top_k
        self.online_capacity = config.eamc_capacity
        self.online_threshold = config.online_threshold
        self.online_rebuild_after = config.online_rebuild_after
        self.batch = Batch(np.zeros((0, num_layers, num_experts), dtype=np.float32))
        self._filled = False
        self._last_plan: list[tuple[Key, float]] = []
        """The latest refresh's plan, which a next-pass guess keeps in flight beside its own reads."""
        self._wanted: list[Key] | None = None
        """The keys the latest plan asked the cache to hold (the head of the plan it had room for)."""
        self._pass_opened = False
        """A next-pass guess already opened the next forward pass (`ExpertCache.new_pass`)."""
        self._row_outputs: dict[int, torch.Tensor] = {}
        """Per MoE layer, the weighted outputs [1, k, H] of its latest resident decoded row (`_resident_row`),
        written again by the next one."""

    def _stackable(self, tensors: list[dict[str, torch.Tensor]]) -> bool:
        """Whether a wave's experts (their `tensors`) are small enough that stacking their weights costs less
        than it saves."""
        if len(tensors) < 2:
            return False
        return sum(t.nbytes for t in tensors[0].values()) <= self.stack_max_bytes

    # --- the planner thread --------------------------------------------------------------------------
    def settle(self) -> None:
        """Wait for the planner thread's task (and raise its error): every entry point that reads or
        changes the batch or the cache calls this first, so only one thread touches them at a time."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Settle and stop the planner thread."""
        try:
            self.settle()
        finally:
            if self._planner is not None:
                self._planner.shutdown(wait=True)
                self._planner = None

    # --- sequences ---------------------------------------------------------------------------------
    def start(self, batch_size: int) -> None:
        """New sequences begin (a `generate` call or a forward pass without a cache)."""
        self.finish()
        self.batch = Batch(np.zeros((batch_size, self.num_layers, self.num_experts), dtype=np.float32),
                           predicted=[None] * batch_size)
        self._wanted = None

    def begin_join(self, batch_size: int) -> Batch:
        """New sequences are prefilled to join the running batch (continuous batching): the prefill
        pass sees a batch of only them; returns the running batch for `end_join`."""
        self.settle()
        running = self.batch
        self.batch = Batch(np.zeros((batch_size, self.num_layers, self.num_experts), dtype=np.float32),
                           predicted=[None] * batch_size)
        return running

    def end_join(self, running: Batch) -> None:
        """Append the prefilled sequences' rows (with their EAMs) after the rows of `running`."""
        self.settle()
        new = self.batch
        predicted = [*(running.predicted or [None] * len(running.eams)),
                     *(new.predicted or [None] * len(new.eams))]
        joined = Batch(np.concatenate([running.eams, new.eams]), predicted=predicted)
        if running.matched_against is new.matched_against and running.matchers and new.matchers:
            joined.matchers, joined.matched_against = running.matchers + new.matchers, new.matched_against
        self.batch = joined

    def keep_rows(self, keep: list[int]) -> None:
        """The batch shrank to rows `keep` (finished sequences dropped by a server): keep their EAMs and
        report the dropped rows' to the online EAMC, as `finish` does."""
        self.settle()
        kept = set(keep)
        dropped = [i for i in range(len(self.batch.eams)) if i not in kept]
        predicted = self.batch.predicted or [None] * len(self.batch.eams)
        self._report([self.batch.eams[i] for i in dropped], [predicted[i] for i in dropped])
        self.batch.eams = self.batch.eams[keep]
        if self.batch.predicted is not None:
            self.batch.predicted = [self.batch.predicted[i] for i in keep]
        if self.batch.matchers is not None:
            self.batch.matchers = [self.batch.matchers[i] for i in keep]

    def set_token_mask(self, mask: torch.Tensor | None) -> None:
        self.settle()
        self.batch.token_mask = mask
        self.batch.real = None if mask is None else mask.detach().cpu().numpy() != 0

    def finish(self) -> None:
        """The running sequences are complete: report them to the online EAMC (or seed one)."""
        self.settle()
        eams, predicted = list(self.batch.eams), self.batch.predicted or [None] * len(self.batch.eams)
        self.batch = Batch(np.zeros((0, self.num_layers, self.num_experts), dtype=np.float32))
        self._report(eams, predicted)

    def _report(self, eams: list[np.ndarray], predicted: list[np.ndarray | None]) -> None:
        """Feed finished sequences' EAMs (and the EAMC entries predicted for them) to the online EAMC."""
        pairs = [(eam, guess) for eam, guess in zip(eams, predicted, strict=True) if eam.sum() > 0]
        done = [eam for eam, _ in pairs]
        if not done:
            return
        if self.predictor is None:
            # No EAMC given: learn from scratch; the first finished sequences seed the collection, which
            # the later ones grow to `online_capacity` entries.
            seed = np.stack(done[:self.online_capacity])
            self.predictor = OnlineEAMC(EAMC(seed), self.online_threshold, self.online_rebuild_after,
                                        capacity=self.online_capacity)
            pairs = pairs[len(seed):]
        for eam, guess in pairs:
            if guess is None:
                self.predictor.add(eam)
            else:
                self.predictor.report(eam, guess)

    # --- one MoE layer -----------------------------------------------------------------------------
    def run_layer(self, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor, kernel: ExpertKernel,
                  idle: Callable[[], None] | None = None) -> torch.Tensor:
        """The experts' output [T, H] for `hidden_states` [T, H] routed by `top_k_index` [T, k]. `idle`: work
        of the block to run once if the layer must wait for a read (its shared experts, `runtime.shared`)."""
        self.settle()
        if top_k_index.shape[0] == 1 and self._steady(layer):
            out = self._resident_row(layer, hidden_states, top_k_index, top_k_weights, kernel)
            if out is not None:
                return out
        dispatch = Dispatch(top_k_index, self.num_experts, stable=kernel.stable)  # expert -> its rows
        self._record(layer, top_k_index, dispatch.ids)
        needed = [(layer, e) for e in dispatch.groups]
        protected = frozenset(needed)
        remote = self.remote
        local = needed if remote is None else [key for key in needed if remote.owned(*key)]
        if layer == 0 and not self._pass_opened:
            self.cache.new_pass()
        self._pass_opened = False
        self.pace.layer_started(layer, self.stats.stall_s, self.stats.bytes_read, bool(self.cache.in_flight))
        # Demand first: this layer's misses are queued at MAX priority before the plan is made and its
        # prefetches submitted, so the I/O threads take their chunks next and planning overlaps the reads.
        cur_eam = self._summed_eam()  # [L, E], the same for every eviction decision of this layer
        demanded = self.cache.demand(local, self._context(layer, protected, cur_eam))
        plan, budget = None, None
        if not self._filled:
            self._fill()
        planning = self.prefetch_policy.should_plan(layer) and not self._all_claimed() \
            and not self._held(local)
        context_for = partial(self._context, layer, cur_eam=cur_eam)
        outputs = kernel.outputs(hidden_states, top_k_index, top_k_weights, dispatch)
        if planning and self._planner is not None and remote is None \
                and all(key in self.cache.resident for key in local):
            # Nothing to wait for: take the experts (resident, so nothing blocks), then plan on the planner
            # thread while they compute. This thread touches no offloader state until `settle`.
            waves = list(self.cache.acquire_waves(local, context_for, demanded))
            self.stats.plans_beside_compute += 1
            self._pending = self._planner.submit(self._plan_and_prefetch, layer, hidden_states, top_k_index,
                                                 needed, self._context(layer, protected, cur_eam))
            for wave in waves:
                self._compute(outputs, wave, kernel)
            return outputs.result()
        if planning:
            ahead = self._ahead(layer, hidden_states, top_k_index)
            plan, budget = self._paced(layer, self._plan(layer, ahead), needed)
        if remote is not None:
            # Expert parallelism: the other ranks compute (and prefetch) their experts meanwhile.
            remote.send_layer(layer, hidden_states, top_k_index, top_k_weights, plan, budget,
                              self.batch.eams.sum(axis=0))
            plan = [(key, p) for key, p in plan if remote.owned(*key)] if plan is not None else None
        if plan is not None:
            self._last_plan = plan
            self._wanted = self.cache.prefetch(plan, self._context(layer, protected, cur_eam), max_new=budget)
        for wave in self.cache.acquire_waves(local, context_for, demanded, idle=idle):
            self._compute(outputs, wave, kernel)
        if remote is not None:
            remote.collect(layer, outputs)
        return outputs.result()

    def _steady(self, layer: int) -> bool:
        """Whether this layer needs no plan, fill or remote call: only its experts, if they are resident."""
        return self.remote is None and self._filled and \
            (self._all_claimed() or not self.prefetch_policy.should_plan(layer))

    def _resident_row(self, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor, kernel: ExpertKernel) -> torch.Tensor | None:
        """`run_layer` of a decoded row routed to distinct experts, all resident, where no plan is to be made
        (`_steady`): what the general path does, without its claims, eviction contexts and waves, and with
        the row's experts in one kernel call where the kernel has one (`ExpertKernel.rows_into`) and no
        grouping (each a few torch ops and ~10-30 us inside a decoded token, at every MoE layer). None
        (nothing counted nor recorded) where the row does not qualify."""
        ids = top_k_index.tolist()[0]  # the row's k experts, in slot order
        if len(set(ids)) != len(ids) or not all(0 <= expert < self.num_experts for expert in ids):
            return None
        slots = sorted(range(len(ids)), key=ids.__getitem__)  # in expert order, as `Dispatch` groups them
        tensors = self.cache.take_resident([(layer, ids[slot]) for slot in slots])
        if tensors is None:
            return None
        self._record(layer, top_k_index, ids)
        if layer == 0 and not self._pass_opened:
            self.cache.new_pass()
        self._pass_opened = False
        self.pace.layer_started(layer, self.stats.stall_s, self.stats.bytes_read, bool(self.cache.in_flight))
        used: list[torch.Tensor] = []

        def buffer(dtype: torch.dtype, width: int) -> torch.Tensor:
            # every slot is written (the k experts are distinct and all computed), and only the sum below
            # leaves this call: the layer's buffer of the latest row serves again when its shape fits
            kept = self._row_outputs.get(layer)
            if kept is None or kept.shape != (1, len(ids), width) or kept.dtype != dtype \
                    or kept.device != hidden_states.device:
                with torch.inference_mode(False):  # written again by later rows, maybe outside inference mode
                    kept = hidden_states.new_empty((1, len(ids), width), dtype=dtype)
                self._row_outputs[layer] = kept
            used.append(kept)
            return kept[0]

        if kernel.rows_into(hidden_states, tensors, slots, top_k_weights.reshape(-1, 1), buffer):
            return used[0].sum(dim=1).to(hidden_states.dtype)  # HF's reduction over the k slots
        dispatch = Dispatch(top_k_index, self.num_experts, stable=kernel.stable)
        outputs = kernel.outputs(hidden_states, top_k_index, top_k_weights, dispatch)
        outputs.compute_many(list(dispatch.groups), kernel, tensors, stack=self._stackable(tensors))
        return outputs.result()

    def _compute(self, outputs: ExpertOutputs, wave: list[tuple[Key, dict[str, torch.Tensor]]],
                 kernel: ExpertKernel) -> None:
        """One wave's experts into `outputs` (stacked in one kernel call where that pays)."""
        outputs.compute_many([key[1] for key, _ in wave], kernel, [tensors for _, tensors in wave],
                             stack=self._stackable([tensors for _, tensors in wave]))

    def _plan_and_prefetch(self, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                           needed: list[Key], context: EvictionContext) -> None:
        """The planning of `run_layer` for a layer whose experts are all resident (on the planner thread)."""
        with torch.inference_mode():  # grad mode is per thread
            self._plan_and_prefetch_now(layer, hidden_states, top_k_index, needed, context)

    def _plan_and_prefetch_now(self, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               needed: list[Key], context: EvictionContext) -> None:
        ahead = self._ahead(layer, hidden_states, top_k_index)
        plan, budget = self._paced(layer, self._plan(layer, ahead), needed)
        self._last_plan = plan
        self._wanted = self.cache.prefetch(plan, context, max_new=budget)

    def takes_guesses(self) -> bool:
        """Whether `guess_next_pass` may read anything: not where every expert is resident or on its way (a
        cache that holds them all) or other ranks own the experts, so the guess need not be made."""
        return self.remote is None and not self._all_claimed()

    def guess_next_pass(self, layers: list[list[int]]) -> None:
        """The next forward pass's first MoE layers will likely use `layers[d]` in layer d (read off this
        pass's logits): read them now, ahead of the rest of the latest plan, which stays in flight. They
        are needed before anything else planned, so they go first (layer by layer) and are not paced; a
        wrong guess is cancelled by the first layer's own plan if its read has not started."""
        self.settle()
        if self.remote is not None or not any(layers) or self._all_claimed():
            return
        self.cache.new_pass()
        self._pass_opened = True
        first = {(layer, e): GUESS_PRIORITY - layer * GUESS_STEP for layer, experts in enumerate(layers)
                 for e in experts}
        plan = [*first.items(), *((key, p) for key, p in self._last_plan if key not in first)]
        self._wanted = self.cache.prefetch(plan, self._context(self.num_layers - 1, frozenset()))

    def _record(self, layer: int, top_k_index: torch.Tensor, ids: list[int] | None = None) -> None:
        """Add this layer's routing to each sequence's EAM (padding tokens excluded when masked); `ids`: the
        expert ids of a lone token as a list (`Dispatch.ids`), when known."""
        if self.lookahead is not None:
            self.lookahead.note(layer, top_k_index)
        eams = self.batch.eams
        batch_size = eams.shape[0]
        tokens = top_k_index.shape[0]
        if batch_size == 0 or tokens % batch_size:
            # Called outside `MoE` (no batch announced) or with an unexpected shape: one pooled sequence.
            self.start(1)
            eams, batch_size = self.batch.eams, 1
        real = self.batch.real
        if ids is not None and batch_size == 1 and (real is None or real.shape[1] == 0 or real[0, -1]):
            # a decoded row of one sequence: its k ids (distinct) counted one by one
            for expert in ids:
                if 0 <= expert < self.num_experts:
                    eams[0, layer, expert] += 1
            return
        # in numpy: a decode step routes a handful of tokens, where each torch op's dispatch costs more
        # than the counting (this ran at every MoE layer: 62 us in torch, a few in numpy)
        index = top_k_index.detach().reshape(batch_size, tokens // batch_size, -1).cpu().numpy()  # [B, S, k]
        valid = (index >= 0) & (index < self.num_experts)
        if real is not None and real.shape[1] >= index.shape[1]:
            valid &= real[:, -index.shape[1]:, None]
        # one bincount over (sequence, expert) ids for the whole batch
        keys = index + (np.arange(batch_size) * self.num_experts)[:, None, None]
        counts = np.bincount(keys[valid], minlength=batch_size * self.num_experts)  # [B*E]
        eams[:, layer] += counts.reshape(batch_size, self.num_experts)

    def _fill(self) -> None:
        """A cache that holds every expert (and a prefetching policy): claim, once, all that is neither
        resident nor in flight, at the lowest priority, so the model's own demand reads go first and
        planning stops once everything is claimed (`_all_claimed`), rather than planning every layer
        for the experts a plan never ranks high enough."""
        self._filled = True
        if self.remote is not None or self.prefetch_policy.name == "none" or not self.budget.holds_all:
            return
        keys = [(layer, expert) for layer in range(self.num_layers) for expert in range(self.num_experts)]
        self.cache.claim_rest(keys, FILL_PRIORITY)

    def _all_claimed(self) -> bool:
        """Every expert of the model is resident or on its way (a cache that holds them all, warmed):
        a prefetch plan could only re-rank what is in flight, so it is not worth planning. Under expert
        parallelism the other ranks still need their plans."""
        cache = self.cache
        return self.remote is None and \
            len(cache.resident) + len(cache.in_flight) >= self.num_layers * self.num_experts

    def _held(self, needed: list[Key]) -> bool:
        """The latest plan still serves this layer (with `hold_plan`): every expert it needs is resident,
        no read is in flight and every key the plan wanted is resident, so the cache is in a steady state
        that a new plan could only re-rank or extend; the look-ahead and planning are skipped (a few ms of
        CPU per token at 96% hits). While reads are in flight the drive is the bottleneck and each layer's
        fresh look-ahead (the deepest layer it predicts is new) still plans: holding then too cut the
        exact store's prefetch recall at 25% (e2e lookahead 1.01x LRU against 1.20x). Counted in
        `stats.plans_held`. Under expert parallelism the other ranks still need a plan at every layer."""
        if not self.hold_plan or self._wanted is None or self.remote is not None:
            return False
        cache = self.cache
        if cache.in_flight or not all(key in cache.resident for key in needed) \
                or not cache.holds(self._wanted):
            return False
        self.stats.plans_held += 1
        return True

    def _ahead(self, layer: int, hidden_states: torch.Tensor, top_k_index: torch.Tensor) -> np.ndarray | None:
        """The look-ahead chances [d, E] of layers layer+1.. for this batch's real tokens (None without),
        from this layer's router input and routing."""
        if self.lookahead is None or not isinstance(self.prefetch_policy, LookaheadPrefetch):
            return None
        mask = self.batch.token_mask
        real = None
        tokens = hidden_states.shape[0]
        if mask is not None and tokens % mask.shape[0] == 0 and mask.shape[1] >= tokens // mask.shape[0]:
            real = mask[:, -(tokens // mask.shape[0]):].reshape(-1) != 0  # [T]
        return self.lookahead.chances(layer, hidden_states, real, top_k_index)

    def _paced(self, layer: int, plan: list[tuple[Key, float]],
               needed: list[Key]) -> tuple[list[tuple[Key, float]], int | None]:
        """Cut `plan` to the reads the drive can start before their layer begins, and cap new reads.

        Until the pace is measured, or for the EAMC-driven policies, a refresh starts at most the reads
        one layer of this batch consumes; a look-ahead plan, once paced, is capped by the cut alone.
        """
        budget = self.top_k * max(self.batch.eams.shape[0], 1)
        reads = self.pace.reads_per_layer(max(map(self.cache.blob_size, needed), default=0))
        if reads is None:
            return plan, budget
        distances = [layer_distance(layer, key[0], self.num_layers) for key, _ in plan]
        kept = deliverable(plan, distances, self.cache.resident.keys(), reads)
        self.stats.paced_out += len(plan) - len(kept)
        return kept, None if isinstance(self.prefetch_policy, LookaheadPrefetch) else budget

    def _plan(self, layer: int, ahead: np.ndarray | None = None) -> list[tuple[Key, float]]:
        """Merge the per-sequence plans (highest priority per key wins), highest first; `ahead` is the
        look-ahead prediction, for the policies that use it."""
        matchers = self._matchers()
        eams = self.batch.eams  # [B, L, E]
        matched: list[np.ndarray | None] = [None] * len(eams)
        if matchers is not None and len(eams):
            # the (row, layer) counts that changed since each matcher last saw them, in one comparison
            stale = (np.stack([matcher.counts for matcher in matchers]) != eams).any(axis=2)  # [B, L]
            for b, row in zip(*np.nonzero(stale), strict=True):
                matchers[b].update(int(row), eams[b, row])
            # the leading layers each sequence has reached (all of them after its first pass)
            observed = eams.sum(axis=2) > 0  # [B, L]
            depths = np.where(observed.all(axis=1), self.num_layers, np.argmin(observed, axis=1))  # [B]
            for b in np.flatnonzero(depths):
                _, matched[b] = matchers[b].match(int(depths[b]))
                self.batch.predicted[b] = matched[b]
        if isinstance(self.prefetch_policy, LookaheadPrefetch):
            return self.prefetch_policy.plan_batch(layer, self.batch.eams, matched, ahead)
        best: dict[Key, float] = {}
        for eam, rows in zip(self.batch.eams, matched, strict=True):
            for key, priority in self.prefetch_policy.plan(layer, eam, rows):
                if priority > best.get(key, -1.0):
                    best[key] = priority
        return sorted(best.items(), key=lambda item: (-item[1], item[0]))

    def _matchers(self) -> list[Matcher] | None:
        """The batch's matchers against the current EAMC (None without one), made or rebuilt as needed."""
        eamc = self.predictor.current if self.predictor is not None else None
        if eamc is None:
            return None
        batch = self.batch
        stale = batch.matchers is None or batch.matched_against is not eamc
        if stale or len(batch.matchers) != len(batch.eams):
            batch.matchers = [Matcher(eamc) for _ in batch.eams]
            batch.matched_against = eamc
        return batch.matchers

    def _summed_eam(self) -> np.ndarray:
        """The batch's EAMs summed [L, E]: one sequence's own, copied (numpy's reduction over one row cost
        30-45 us per layer inside a decoded token, a copy a few)."""
        eams = self.batch.eams
        return eams[0].copy() if len(eams) == 1 else eams.sum(axis=0)

    def _context(self, layer: int, protected: frozenset[Key],
                 cur_eam: np.ndarray | None = None) -> EvictionContext:
        """`cur_eam` is the batch's summed EAM when the caller has it (it changes only in `_record`)."""
        stats = self.stats
        recall = stats.useful_prefetches / stats.accesses if stats.accesses else 0.0
        eam = self._summed_eam() if cur_eam is None else cur_eam
        return EvictionContext(cur_eam=eam, layer=layer, protected=protected, prefetch_recall=recall)
