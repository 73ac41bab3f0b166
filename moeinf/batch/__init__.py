"""Offline batch inference: answer a file of prompts for the most tokens per second, not the lowest latency.

    prompts.jsonl -> jobs (validated, done ids skipped) -> grouping (order by routing, ExpertFlow)
      -> planner (batch size and knobs from a roofline of this machine, MoE-Lightning's HRM)
      -> runner (continuous batching through the offloaded model; each expert is read once per layer per
         step and computed for all its tokens, the next layers' experts streaming in meanwhile)
      -> answers.jsonl (appended, flushed and fsynced per prompt; a rerun resumes)

Modules: `jobs` (input and the resumable output), `runner` (batches and progress), `roofline` (the
machine's measured rates), `planner` (predicted tokens/s of a plan, the search), `kernels` (grouped vs
per-expert products by tokens per expert, a measured table kept as data), `grouping` (route-aware order).
"""
