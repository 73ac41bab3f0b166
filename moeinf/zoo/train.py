"""Train a small DeepSeek-V3 MoE on the zoo corpus, on the CPU, within a time budget.

Why DeepSeek-V3: its router selects experts by `sigmoid(logits) + e_score_correction_bias`, a buffer that
is part of the checkpoint and of the unmodified transformers forward. Training balances expert load the
aux-loss-free way (DeepSeek-V3, section 2.1.2): after every step each layer's bias moves by
`bias_update_rate` against the sign of that expert's load error, so over-used experts are picked less.
Routing at inference is then decided by the saved weights alone, with nothing to fold away. The routers
get their own (higher) learning rate, so the scores that the bias corrects become confident enough to
give each sequence a small, reused set of experts.

Pipeline: corpus -> tokenizer -> packed sequences -> AdamW with a warm-up and a cosine schedule over the
time budget -> bias calibration on prompts -> `save_pretrained` (safetensors) + tokenizer +
`moeinf-zoo.json` (the recipe and figures).

Bias calibration: training balances the load of packed prompt + answer text, but inference starts with
prompts alone, whose chat-template tokens and question style shift some routers onto a few experts (seen
here: one layer at 10x the mean load over held-out prompts after training, the others about 4x).
`calibrate_biases` continues the same bias balancing, without gradients, on the prompts of training
examples, so the balance holds for the distribution the runtime serves. The weights are not touched.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .corpus import shuffled, training_examples
from .tokenizer import chat_text, train_tokenizer

log = logging.getLogger(__name__)

META_FILE = "moeinf-zoo.json"


@dataclass(frozen=True)
class Recipe:
    """Model size and training schedule of one zoo variant."""

    layers: int
    """MoE layers."""
    experts: int
    top_k: int
    hidden: int
    moe_intermediate: int
    heads: int
    vocab_size: int
    seq_len: int = 256
    batch_size: int = 16
    lr: float = 3e-3
    router_lr_scale: float = 5.0
    weight_decay: float = 0.05
    warmup_steps: int = 50
    bias_update_rate: float = 1e-2
    balance_loss_weight: float = 1e-2
    """Weight of the batch-wise balance loss E * sum_i f_i * P_i (1.0 when balanced), averaged over layers:
    it gives the routers a gradient away from collapse while the biases catch up (DeepSeek-V3 keeps a
    similar, tiny sequence-wise loss next to its bias balancing)."""
    max_minutes: float = 30.0
    """Training time; bias calibration (about a minute on 2 idle cores) comes after it."""
    max_steps: int | None = None
    dense_layers: int = 0
    """Dense decoder layers before the MoE layers (DeepSeek-V3's first_k_dense_replace): the first router
    then sees contextual states rather than token embeddings."""
    max_docs: int | None = None
    """Train on the first `max_docs` examples of the shuffled corpus (None: all of it)."""
    corpus: str = "mixed"
    """Which training files: a key of moeinf.zoo.corpus.CORPORA."""


RECIPES: dict[str, Recipe] = {
    # The shipped model (moeinf/zoo/weights/full): 22 MB in bf16, trained 85 minutes.
    "full": Recipe(layers=8, experts=64, top_k=2, hidden=128, moe_intermediate=48, heads=4,
                   vocab_size=8192, batch_size=8, warmup_steps=20, router_lr_scale=2.0, max_minutes=85.0),
    # The demo model (moeinf/zoo/weights/demo): wider and with fewer experts than `full`, trained longer on
    # the question-answer corpus, so that its answers to held-out questions stay on topic.
    "demo": Recipe(layers=8, experts=32, top_k=2, hidden=176, moe_intermediate=64, heads=4,
                   vocab_size=8192, batch_size=8, warmup_steps=20, router_lr_scale=2.0, max_minutes=78.0,
                   corpus="qa"),
    "quick": Recipe(layers=4, experts=16, top_k=2, hidden=96, moe_intermediate=96, heads=4,
                    vocab_size=4096, batch_size=8, warmup_steps=10, max_minutes=4.0),
    # For tests: seconds, on a slice of the corpus.
    "tiny": Recipe(layers=2, experts=8, top_k=2, hidden=32, moe_intermediate=32, heads=2, vocab_size=512,
                   seq_len=64, batch_size=4, warmup_steps=2, max_minutes=1.0, max_steps=6, max_docs=300),
}


def model_config(recipe: Recipe, tokenizer: Any) -> Any:
    """The transformers DeepSeek-V3 config of a recipe: `dense_layers` dense layers, then `layers` MoE."""
    from transformers import DeepseekV3Config

    head_dim = recipe.hidden // recipe.heads
    return DeepseekV3Config(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden,
        intermediate_size=2 * recipe.hidden,
        moe_intermediate_size=recipe.moe_intermediate,
        num_hidden_layers=recipe.dense_layers + recipe.layers,
        first_k_dense_replace=recipe.dense_layers,
        num_attention_heads=recipe.heads,
        num_key_value_heads=recipe.heads,
        n_routed_experts=recipe.experts,
        n_shared_experts=1,
        num_experts_per_tok=recipe.top_k,
        # One group: selection is a plain top-k over all experts.
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        q_lora_rank=None,
        kv_lora_rank=head_dim * 2,
        qk_rope_head_dim=head_dim // 2,
        qk_nope_head_dim=head_dim // 2,
        v_head_dim=head_dim,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def corpus_texts(recipe: Recipe, seed: int) -> list[str]:
    """The training documents in chat format, shuffled so that packed sequences mix tasks."""
    examples = list(shuffled(training_examples(corpus=recipe.corpus), seed))
    if recipe.max_docs is not None:
        examples = examples[: recipe.max_docs]
    return [chat_text(ex.prompt, ex.answer) for ex in examples]


def pack_tokens(tokenizer: Any, texts: list[str], seq_len: int, batch_size: int) -> torch.Tensor:
    """Tokenize `texts` back to back and cut the stream into rows of `seq_len` tokens: [N, seq_len]."""
    ids = tokenizer(texts, add_special_tokens=False).input_ids
    flat = torch.tensor([t for doc in ids for t in doc], dtype=torch.long)
    rows = flat.numel() // seq_len
    if rows < batch_size:
        raise ValueError(f"corpus gives {rows} sequences of {seq_len} tokens, fewer than one batch; "
                         "raise Recipe.max_docs")
    return flat[: rows * seq_len].view(rows, seq_len)


class LoadMeter:
    """Per MoE layer, the tokens each expert received in the current step and the router scores that chose
    them (hooks on the routers), for bias balancing and the balance loss.

    The hooks are registered on this model instance only and removed by `close`.
    """

    def __init__(self, model: torch.nn.Module, num_experts: int):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.num_experts = num_experts
        self.counts = torch.zeros(len(self.routers), num_experts)
        self.scores: list[torch.Tensor] = []
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]

    def _hook(self, layer: int) -> Any:
        def record(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            router_logits, top_k_index = output[0], output[2]  # [T, E], [T, k]
            self.counts[layer] += torch.bincount(top_k_index.flatten(), minlength=self.num_experts)
            self.scores.append(router_logits.sigmoid())

        return record

    def balance_loss(self) -> torch.Tensor:
        """Mean over layers of E * sum_i f_i * P_i: f = share of routed slots per expert, P = mean normalised
        score per expert; 1.0 when balanced."""
        losses = []
        for counts, scores in zip(self.counts, self.scores, strict=True):
            share = counts / counts.sum().clamp_min(1.0)  # [E]
            probs = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=0)  # [E]
            losses.append(self.num_experts * (share * probs).sum())
        return torch.stack(losses).mean()

    def update_biases(self, rate: float) -> None:
        """Move each expert's selection bias toward balanced load, then start a new count."""
        with torch.no_grad():
            for router, counts in zip(self.routers, self.counts, strict=True):
                router.e_score_correction_bias += rate * torch.sign(counts.mean() - counts)
        self.counts.zero_()
        self.scores.clear()

    def imbalance(self) -> list[float]:
        """Per layer, max/mean expert load in the current count."""
        mean = self.counts.mean(dim=1).clamp_min(1e-9)
        return (self.counts.max(dim=1).values / mean).tolist()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def calibration_texts(recipe: Recipe, seed: int, count: int = 200) -> list[str]:
    """The prompts (chat-formatted, without answers) of `count` training examples, for `calibrate_biases`."""
    examples = list(shuffled(training_examples(corpus=recipe.corpus), seed + 1))
    if recipe.max_docs is not None:
        examples = examples[: recipe.max_docs]
    return [chat_text(ex.prompt) for ex in examples[:count]]


@torch.no_grad()
def calibrate_biases(model: torch.nn.Module, tokenizer: Any, texts: list[str], seq_len: int, *,
                     meter: LoadMeter, target: float = 3.0, iterations: int = 40, rate: float = 0.02,
                     batch_size: int = 16) -> dict[str, Any]:
    """Move each router's `e_score_correction_bias` until no expert of any layer takes more than `target`
    times the mean load of the prompts `texts`.

    Each iteration routes all of `texts` (packed into rows of `seq_len`, no gradients) and moves the bias
    of every expert by `rate * (1 - load / mean load)`, a step that shrinks as the load evens out, with
    `rate` decaying linearly over `iterations` (every layer moves, since a layer's choices change the
    states the next router sees). It stops as soon as every layer is within `target`:
    balancing further would flatten each sequence's routing too, and the sparse, reused expert sets of a
    sequence are what the runtime exploits. Returns the max/mean load per layer before and after (over the
    same tokens) for the model's record. `meter` is closed here.
    """
    data = pack_tokens(tokenizer, texts, seq_len, 1)  # [N, seq_len]
    was_training = model.training
    model.eval()

    def route() -> torch.Tensor:
        meter.counts.zero_()
        meter.scores.clear()
        for start in range(0, len(data), batch_size):
            model(input_ids=data[start : start + batch_size])
            meter.scores.clear()
        return meter.counts.clone()  # [L, E]

    def imbalance(counts: torch.Tensor) -> list[float]:
        return [round(x, 3) for x in (counts.max(dim=1).values / counts.mean(dim=1).clamp_min(1e-9)).tolist()]

    counts = route()
    before = imbalance(counts)
    steps = 0
    while steps < iterations and max(imbalance(counts)) > target:
        step_rate = rate * (1.0 - steps / iterations)
        for router, load in zip(meter.routers, counts, strict=True):
            router.e_score_correction_bias += step_rate * (1.0 - load / load.mean().clamp_min(1e-9))
        counts = route()
        steps += 1
    after = imbalance(counts)
    meter.close()
    model.train(was_training)
    log.info("bias calibration on %d prompt tokens: max/mean load per layer %s -> %s", data.numel(),
             before, after)
    return {"prompts": len(texts), "tokens": int(data.numel()), "iterations": steps, "target": target,
            "max_mean_load_before": before, "max_mean_load_after": after}


def _param_groups(model: torch.nn.Module, recipe: Recipe) -> list[dict[str, Any]]:
    routers, decay, no_decay = [], [], []
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            routers.append(param)
        elif param.ndim >= 2:
            decay.append(param)
        else:
            no_decay.append(param)
    return [
        {"params": decay, "lr": recipe.lr, "weight_decay": recipe.weight_decay},
        {"params": no_decay, "lr": recipe.lr, "weight_decay": 0.0},
        {"params": routers, "lr": recipe.lr * recipe.router_lr_scale, "weight_decay": 0.0},
    ]


def _lr_factor(step: int, progress: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 10% over `progress` in [0, 1] (the share of the budget used)."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def train_model(out_dir: str | Path, variant: str = "full", seed: int = 0, max_minutes: float | None = None,
                *, max_steps: int | None = None, threads: int = 2, progress: bool = True,
                **overrides: Any) -> Path:
    """Train the zoo model `variant` (a key of RECIPES) and save it with its tokenizer to `out_dir`.

    Training stops cleanly when `max_minutes` (default: the recipe's) or `max_steps` is reached; the
    cosine schedule runs over whichever budget is used up first. `overrides` replace Recipe fields.
    `threads`: torch threads; on a machine shared with other busy processes 1 can be several times
    faster than 2, because many small expert matmuls each wait for a descheduled thread.
    """
    from tqdm import tqdm
    from transformers import DeepseekV3ForCausalLM, GenerationConfig

    from ..progress import LogProgress

    if variant not in RECIPES:
        raise ValueError(f"unknown zoo variant {variant!r}; choose one of {sorted(RECIPES)}")
    recipe = replace(RECIPES[variant], **overrides)
    budget_s = 60.0 * (recipe.max_minutes if max_minutes is None else max_minutes)
    max_steps = recipe.max_steps if max_steps is None else max_steps
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(threads)
    torch.manual_seed(seed)

    started = time.monotonic()
    texts = corpus_texts(recipe, seed)
    tokenizer = train_tokenizer(texts, recipe.vocab_size, out)
    data = pack_tokens(tokenizer, texts, recipe.seq_len, recipe.batch_size)
    log.info("corpus: %d sequences of %d tokens (%.1f s)", len(data), recipe.seq_len,
             time.monotonic() - started)

    config = model_config(recipe, tokenizer)
    model = DeepseekV3ForCausalLM(config)
    model.train()
    meter = LoadMeter(model, recipe.experts)
    optimizer = torch.optim.AdamW(_param_groups(model, recipe), betas=(0.9, 0.95))
    base_lrs = [group["lr"] for group in optimizer.param_groups]
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))

    train_start = time.monotonic()
    step, tokens, loss_ema, imbalance = 0, 0, float("nan"), [float("nan")]
    # The bar counts what ends training: steps when they are capped, else seconds of the time budget,
    # so it always has a total and an ETA.
    by_steps = max_steps is not None
    seconds_format = "{l_bar}{bar}| {n:.0f}/{total_fmt} s [{elapsed}<{remaining}{postfix}]"
    if progress and not sys.stderr.isatty():  # a log, not a terminal: a line every few seconds
        bar = LogProgress(max_steps if by_steps else round(budget_s), f"train {variant}",
                          "step" if by_steps else "s")
    else:
        bar = tqdm(total=max_steps if by_steps else round(budget_s), disable=not progress,
                   unit="step" if by_steps else "s", desc=f"train {variant}",
                   bar_format=None if by_steps else seconds_format)
    while True:
        elapsed = time.monotonic() - train_start
        share = elapsed / budget_s
        if max_steps is not None:
            share = max(share, step / max_steps)
        if share >= 1.0:
            break
        batch_rows = order[(step * recipe.batch_size + torch.arange(recipe.batch_size)) % len(data)]
        batch = data[batch_rows]
        factor = _lr_factor(step, share, recipe.warmup_steps)
        for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
            group["lr"] = base * factor
        lm_loss = model(input_ids=batch, labels=batch).loss
        balance = meter.balance_loss()
        loss = lm_loss + recipe.balance_loss_weight * balance
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        imbalance = meter.imbalance()
        meter.update_biases(recipe.bias_update_rate)
        step += 1
        tokens += batch.numel()
        loss_value = lm_loss.item()
        loss_ema = loss_value if math.isnan(loss_ema) else 0.95 * loss_ema + 0.05 * loss_value
        rate = tokens / max(time.monotonic() - train_start, 1e-9)
        bar.update(1 if by_steps else min(time.monotonic() - train_start, budget_s) - bar.n)
        bar.set_postfix(step=step, loss=f"{loss_ema:.3f}", balance=f"{balance.item():.3f}",
                        load=f"{max(imbalance):.2f}", tok_s=f"{rate:.0f}")
        if step % 10 == 0:
            log.info("step %d loss %.3f balance loss %.3f max/mean load per layer %s %.0f tokens/s", step,
                     loss_ema, balance.item(), " ".join(f"{x:.1f}" for x in imbalance), rate)
    bar.close()
    meter.close()
    train_seconds = time.monotonic() - train_start

    model.eval()
    calibration = calibrate_biases(model, tokenizer, calibration_texts(recipe, seed), recipe.seq_len,
                                   meter=LoadMeter(model, recipe.experts))
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=64,
    )
    model.save_pretrained(out)
    meta = {
        "variant": variant, "seed": seed, "recipe": asdict(recipe), "steps": step, "tokens": tokens,
        "epochs": tokens / data.numel(), "train_seconds": round(train_seconds, 1),
        "tokens_per_second": round(tokens / max(train_seconds, 1e-9), 1), "final_loss": round(loss_ema, 4),
        "final_train_max_mean_load": [round(x, 3) for x in imbalance],
        "calibration": calibration,
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    log.info("saved %s after %d steps, %.0f s: %s", out, step, train_seconds, meta)
    return out
